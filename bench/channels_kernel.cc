// The kernel's own wake-up mechanisms, and the two floors: a bare futex wake (blocking) and a
// store seen by a spinning reader (busy).
#include <fcntl.h>
#include <linux/futex.h>
#include <mqueue.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>

#include "bench_support.h"
#include "channel.h"

namespace bench {
namespace {

// std::atomic_ref would do in C++20, but the word lives in memory the harness owns.
std::atomic<uint32_t>* as_atomic(uint32_t* w) { return reinterpret_cast<std::atomic<uint32_t>*>(w); }

class FutexChannel : public Channel {
 public:
  explicit FutexChannel(uint32_t* w) : w_(as_atomic(w)) {}
  const char* name() const override { return "futex (floor)"; }
  bool supports(bool busy) const override { return !busy; }
  bool setup_waker(std::string*) override { return true; }
  bool signal() override {
    w_->fetch_add(1, std::memory_order_release);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(w_), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    return true;
  }
  int run_waiter(bool, const std::function<void()>& ready,
                 const std::function<bool()>& on_wake) override {
    uint32_t seen = w_->load();
    ready();
    for (;;) {
      uint32_t now;
      while ((now = w_->load(std::memory_order_acquire)) == seen)
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(w_), FUTEX_WAIT, seen, nullptr, nullptr, 0);
      seen = now;
      if (!on_wake()) return 0;
    }
  }

 private:
  std::atomic<uint32_t>* w_;
};

class SpinChannel : public Channel {
 public:
  enum class Kind { kBare, kTimed, kHandshake };
  // `lines`: the word first, then (kTimed, kHandshake) the waker's clock read; kHandshake uses
  // the next cache line too, for the waiter's count of bumps seen.
  SpinChannel(void* lines, Kind kind) : line_(static_cast<Line*>(lines)), kind_(kind) {}
  const char* name() const override {
    switch (kind_) {
      case Kind::kTimed: return "shared-memory spin carrying the waker's clock read";
      case Kind::kHandshake:
        return "shared-memory spin carrying the clock read, after a check that the waiter took the last signal";
      case Kind::kBare: break;
    }
    return "shared-memory spin (floor)";
  }
  bool supports(bool busy) const override { return busy; }
  bool setup_waker(std::string*) override { return true; }
  bool signal() override {
    // As bb_bubble_begin's readiness check: a load of the line the waiter last wrote.
    if (kind_ == Kind::kHandshake) behind_ += line_[1].word.load(std::memory_order_acquire) != last_;
    if (kind_ != Kind::kBare) line_->sent_ns.store(bb_now_ns(), std::memory_order_relaxed);
    last_ = line_->word.fetch_add(1, std::memory_order_release) + 1;
    return true;
  }
  int run_waiter(bool, const std::function<void()>& ready,
                 const std::function<bool()>& on_wake) override {
    uint32_t seen = line_->word.load();
    if (kind_ == Kind::kHandshake) line_[1].word.store(seen, std::memory_order_release);
    ready();
    for (;;) {
      uint32_t now;
      while ((now = line_->word.load(std::memory_order_acquire)) == seen) __builtin_ia32_pause();
      seen = now;
      if (kind_ != Kind::kBare) sent_ns_ = line_->sent_ns.load(std::memory_order_relaxed);
      const bool more = on_wake();
      if (kind_ == Kind::kHandshake) line_[1].word.store(seen, std::memory_order_release);
      if (!more) return 0;
    }
  }

 private:
  struct alignas(64) Line {
    std::atomic<uint32_t> word;
    std::atomic<uint64_t> sent_ns;
  };
  static_assert(sizeof(Line) == 64);
  Line* line_;
  Kind kind_;
  volatile uint64_t sent_ns_ = 0;  // read as a task reads its start's begin time
  uint32_t last_ = 0;              // the word after the waker's last bump
  uint64_t behind_ = 0;            // signals that found the waiter behind (kHandshake)
};

// A descriptor pair: the waker writes 8 bytes to wfd_, the waiter reads them from rfd_.
class FdChannel : public Channel {
 public:
  bool supports(bool) const override { return true; }
  bool setup_waker(std::string*) override {
    close(rfd_);
    return true;
  }
  bool signal() override {
    const uint64_t one = 1;
    return write(wfd_, &one, sizeof one) == ssize_t(sizeof one);
  }
  int run_waiter(bool busy, const std::function<void()>& ready,
                 const std::function<bool()>& on_wake) override {
    if (wfd_ != rfd_) close(wfd_);
    if (busy) fcntl(rfd_, F_SETFL, fcntl(rfd_, F_GETFL) | O_NONBLOCK);
    ready();
    uint64_t v;
    for (;;) {
      const ssize_t n = read(rfd_, &v, sizeof v);
      if (n == ssize_t(sizeof v)) {
        if (!on_wake()) return 0;
      } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        __builtin_ia32_pause();
      } else {
        return 1;
      }
    }
  }
  void cleanup() override {
    close(rfd_);
    if (wfd_ != rfd_) close(wfd_);
  }

 protected:
  int rfd_ = -1, wfd_ = -1;
};

class EventfdChannel : public FdChannel {
 public:
  const char* name() const override { return "eventfd"; }
  bool prepare(bool, std::string* why) override {
    rfd_ = wfd_ = eventfd(0, EFD_CLOEXEC);
    if (rfd_ < 0) *why = std::strerror(errno);
    return rfd_ >= 0;
  }
  bool setup_waker(std::string*) override { return true; }  // one descriptor for both ends
};

class PipeChannel : public FdChannel {
 public:
  const char* name() const override { return "pipe"; }
  bool prepare(bool, std::string* why) override {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
      *why = std::strerror(errno);
      return false;
    }
    rfd_ = p[0];
    wfd_ = p[1];
    return true;
  }
};

class UnixSocketChannel : public FdChannel {
 public:
  const char* name() const override { return "Unix socket (SOCK_SEQPACKET)"; }
  bool prepare(bool, std::string* why) override {
    int s[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, s) != 0) {
      *why = std::strerror(errno);
      return false;
    }
    rfd_ = s[0];
    wfd_ = s[1];
    return true;
  }
};

class MqueueChannel : public Channel {
 public:
  const char* name() const override { return "POSIX message queue"; }
  bool supports(bool) const override { return true; }
  bool prepare(bool busy, std::string* why) override {
    name_ = job_id("mq");
    name_.insert(name_.begin(), '/');
    mq_attr a{};
    a.mq_maxmsg = 8;
    a.mq_msgsize = 8;
    q_ = mq_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | (busy ? O_NONBLOCK : 0),
                 0600, &a);
    if (q_ == mqd_t(-1)) {
      *why = std::string("mq_open: ") + std::strerror(errno);
      return false;
    }
    mq_unlink(name_.c_str());  // the open descriptors keep it alive
    return true;
  }
  void cleanup() override { mq_close(q_); }
  bool setup_waker(std::string*) override { return true; }
  bool signal() override {
    const uint64_t one = 1;
    return mq_send(q_, reinterpret_cast<const char*>(&one), sizeof one, 0) == 0;
  }
  int run_waiter(bool, const std::function<void()>& ready,
                 const std::function<bool()>& on_wake) override {
    ready();
    char buf[8];
    for (;;) {
      const ssize_t n = mq_receive(q_, buf, sizeof buf, nullptr);
      if (n >= 0) {
        if (!on_wake()) return 0;
      } else if (errno == EAGAIN || errno == EINTR) {
        __builtin_ia32_pause();
      } else {
        return 1;
      }
    }
  }

 private:
  std::string name_;
  mqd_t q_ = mqd_t(-1);
};

}  // namespace

std::unique_ptr<Channel> make_futex_channel(uint32_t* w) { return std::make_unique<FutexChannel>(w); }
std::unique_ptr<Channel> make_spin_channel(uint32_t* w) {
  return std::make_unique<SpinChannel>(w, SpinChannel::Kind::kBare);
}
std::unique_ptr<Channel> make_spin_timed_channel(void* line) {
  return std::make_unique<SpinChannel>(line, SpinChannel::Kind::kTimed);
}
std::unique_ptr<Channel> make_spin_handshake_channel(void* lines) {
  return std::make_unique<SpinChannel>(lines, SpinChannel::Kind::kHandshake);
}
std::unique_ptr<Channel> make_eventfd_channel() { return std::make_unique<EventfdChannel>(); }
std::unique_ptr<Channel> make_pipe_channel() { return std::make_unique<PipeChannel>(); }
std::unique_ptr<Channel> make_unix_socket_channel() { return std::make_unique<UnixSocketChannel>(); }
std::unique_ptr<Channel> make_mqueue_channel() { return std::make_unique<MqueueChannel>(); }

}  // namespace bench
