// iceoryx (the C binding): a publisher in the waker, a subscriber in the waiter, which blocks in
// a WaitSet on "has data" or polls iox_sub_take_chunk. RouDi, the broker every iceoryx process
// registers with, is started by signal_latency itself (see its RouDi start-up in signal_latency.cc).
#include "channel.h"

#ifdef BENCH_HAVE_ICEORYX

#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "bench_support.h"

extern "C" {
#include <iceoryx_binding_c/log.h>
#include <iceoryx_binding_c/publisher.h>
#include <iceoryx_binding_c/runtime.h>
#include <iceoryx_binding_c/subscriber.h>
#include <iceoryx_binding_c/wait_set.h>
}

namespace bench {
namespace {

class IceoryxChannel : public Channel {
 public:
  const char* name() const override { return "iceoryx 2.0 (C binding)"; }
  bool supports(bool) const override { return true; }
  bool exit_cleanly() const override { return true; }
  bool prepare(bool, std::string*) override {
    instance_ = job_id("iox") + "-" + std::to_string(++round_);
    return true;
  }
  // Each runtime leaves its IPC socket and lock file in /tmp, named after the runtime.
  void cleanup() override {
    for (const char* side : {"-pub", "-sub"})
      for (const char* ext : {"", ".lock"}) unlink(("/tmp/" + instance_ + side + ext).c_str());
  }

  bool setup_waker(std::string*) override {
    iox_set_loglevel(Iceoryx_LogLevel_Off);
    iox_runtime_init((instance_ + "-pub").c_str());
    iox_pub_options_t o;
    iox_pub_options_init(&o);
    o.historyCapacity = 0;
    o.subscriberTooSlowPolicy = ConsumerTooSlowPolicy_DISCARD_OLDEST_DATA;
    pub_ = iox_pub_init(&pub_storage_, "bench", instance_.c_str(), "wake", &o);
    return pub_ != nullptr;
  }
  // The chunk is borrowed from the pool before the stamp: only the publish is the wake-up.
  bool prepare_signal() override {
    if (chunk_) return true;
    if (iox_pub_loan_chunk(pub_, &chunk_, sizeof(uint64_t)) != AllocationResult_SUCCESS) return false;
    *static_cast<uint64_t*>(chunk_) = 1;
    return true;
  }
  bool signal() override {
    if (!chunk_ && !prepare_signal()) return false;
    iox_pub_publish_chunk(pub_, chunk_);
    chunk_ = nullptr;
    return true;
  }

  int run_waiter(bool busy, const std::function<void()>& ready,
                 const std::function<bool()>& on_wake) override {
    iox_set_loglevel(Iceoryx_LogLevel_Off);
    iox_runtime_init((instance_ + "-sub").c_str());
    iox_sub_options_t o;
    iox_sub_options_init(&o);
    o.queueCapacity = 16;
    o.historyRequest = 0;
    o.queueFullPolicy = QueueFullPolicy_DISCARD_OLDEST_DATA;
    iox_sub_storage_t storage;
    iox_sub_t sub = iox_sub_init(&storage, "bench", instance_.c_str(), "wake", &o);
    // Signals count only once RouDi has connected us to the publisher.
    if (!wait_for([&] { return iox_sub_get_subscription_state(sub) == SubscribeState_SUBSCRIBED; },
                  10'000'000'000ull)) {
      std::fprintf(stderr, "iceoryx: the subscriber never got connected\n");
      return 1;
    }
    iox_ws_storage_t ws_storage;
    iox_ws_t ws = nullptr;
    if (!busy) {
      ws = iox_ws_init(&ws_storage);
      if (iox_ws_attach_subscriber_state(ws, sub, SubscriberState_HAS_DATA, 0, nullptr) !=
          WaitSetResult_SUCCESS)
        return 1;
    }
    ready();
    int rc = 0;
    for (bool more = true; more;) {
      if (!busy) {
        iox_notification_info_t info[4];
        uint64_t missed = 0;
        iox_ws_wait(ws, info, 4, &missed);
      }
      const void* chunk = nullptr;
      const iox_ChunkReceiveResult r = iox_sub_take_chunk(sub, &chunk);
      if (r == ChunkReceiveResult_SUCCESS) {
        more = on_wake();
        iox_sub_release_chunk(sub, chunk);
      } else if (r != ChunkReceiveResult_NO_CHUNK_AVAILABLE) {
        rc = 1;
        break;
      } else {
        __builtin_ia32_pause();
      }
    }
    if (ws) iox_ws_deinit(ws);
    iox_sub_deinit(sub);
    return rc;
  }

 private:
  std::string instance_;
  int round_ = 0;
  iox_pub_storage_t pub_storage_;
  iox_pub_t pub_ = nullptr;
  void* chunk_ = nullptr;  // loaned ahead of the next signal
};

}  // namespace

std::unique_ptr<Channel> make_iceoryx_channel(const std::string&) {
  return std::make_unique<IceoryxChannel>();
}

}  // namespace bench

#else  // !BENCH_HAVE_ICEORYX

namespace bench {
namespace {

class MissingIceoryx : public Channel {
 public:
  const char* name() const override { return "iceoryx"; }
  bool supports(bool) const override { return true; }
  bool prepare(bool, std::string* why) override {
    *why = "not built: CMake found no iceoryx_binding_c (Debian: libiceoryx-binding-c-dev)";
    return false;
  }
  bool setup_waker(std::string*) override { return false; }
  bool signal() override { return false; }
  int run_waiter(bool, const std::function<void()>&, const std::function<bool()>&) override {
    return 1;
  }
};

}  // namespace

std::unique_ptr<Channel> make_iceoryx_channel(const std::string&) {
  return std::make_unique<MissingIceoryx>();
}

}  // namespace bench

#endif
