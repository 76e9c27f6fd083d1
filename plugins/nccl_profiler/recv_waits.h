// Turns NCCL's profiler events into "this rank waits for a receive": the bubble signal.
//
// A rank waits while the kernel works on a channel of a receive whose data has not arrived.
// NCCL tells us both ends without any change to the training code:
//   - a KernelCh event of a receive starts when the GPU begins that channel (the proxy thread
//     reads the kernel's counter) and stops when the channel is done;
//   - over the network, a proxy step of that receive leaves RecvWait when the peer's data
//     arrives, which ends the wait before the kernel finishes copying.
// The rank's bubble is open while at least one (receive, channel) pair waits; the sink hears
// the 0 -> 1 and 1 -> 0 transitions only.
//
// NCCL stops a P2p event as soon as it is enqueued, before its kernel-channel and proxy events
// start, and hands the P2p handle to those children as their parent. So P2p records live in a
// fixed pool that outlives every handle: a record is reused only after its channels finished (or,
// when the pool runs out, the oldest stopped one is reclaimed and its late children are
// recognised by a generation and ignored). A parent pointer that is not one of our records is
// ignored rather than dereferenced.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace bb::nccl {

// Receives the rank's wait transitions, under the tracker's lock (so never concurrently).
class WaitSink {
 public:
  virtual ~WaitSink() = default;
  virtual void wait_begins() = 0;
  virtual void wait_ends() = 0;
};

// What a recordEventState call means for a receive, independent of the interface version.
enum class Transition {
  kOther,
  kKernelChannelDone,  // KernelChStop
  kRecvDataArrived,    // ProxyStep RecvFlushWait / RecvGPUWait, ProxyOp RecvReceived (v1-v3)
};

class RecvWaits {
 public:
  static constexpr int kChannels = 64;   // NCCL's MAXCHANNELS
  static constexpr int kPoolSize = 128;  // receives in flight at once, per process

  explicit RecvWaits(WaitSink* sink) : sink_(sink) {}
  RecvWaits(const RecvWaits&) = delete;
  RecvWaits& operator=(const RecvWaits&) = delete;

  // Each returns the handle to give NCCL, or nullptr for an event that cannot affect a wait.
  // nchannels: the channels the receive runs on (0 = not told, as in v3).
  void* p2p_start(bool is_recv, int nchannels);
  void* kernel_channel_start(void* parent, int channel);
  // same_process: the op's pid is ours (under PXN another process's proxy reports it).
  void* proxy_op_start(void* parent, bool same_process, int channel, bool is_send);
  void* proxy_step_start(void* parent);
  void record(void* handle, Transition t);
  void stop(void* handle);

  // Ends an open wait and forgets every record (the last communicator went away).
  void reset();
  // Ends an open wait, forgets every record and reports to sink from now on (nullptr: nowhere).
  // Returns once no call is using the old sink, which may then be destroyed.
  void set_sink(WaitSink* sink);

  // Observability for tests and logs.
  int waiting() const;
  uint64_t waits_begun() const;
  uint64_t records_reclaimed() const;

 private:
  struct P2p;
  enum class Tag : uint32_t { kP2p = 0x50325031, kKernel = 0x4b43484e, kOp = 0x504f5031,
                              kStep = 0x53544550 };
  // A child slot of one (receive, channel): the KernelCh handle and the proxy op/step handles.
  struct Child {
    Tag tag;
    uint32_t channel;
    P2p* owner;
    uint32_t gen;   // the owner's generation when the child started
    bool active;
  };
  struct Channel {
    Child kernel{Tag::kKernel, 0, nullptr, 0, false};
    Child op{Tag::kOp, 0, nullptr, 0, false};
    Child step{Tag::kStep, 0, nullptr, 0, false};  // shared by every step of the op
    bool waiting = false;
    bool arrived = false;
  };
  struct P2p {
    Tag tag = Tag::kP2p;
    uint32_t gen = 0;
    bool in_use = false;
    bool host_stopped = false;
    int nchannels = 0;
    int kernels_done = 0;
    int live_children = 0;
    uint64_t started = 0;  // allocation order, to reclaim the oldest
    std::array<Channel, kChannels> ch;
  };

  P2p* as_p2p(void* p) const;
  Child* as_child(void* p, Tag tag) const;
  bool child_valid(const Child* c) const;
  P2p* allocate();
  void release(P2p* r);
  void maybe_release(P2p* r);
  void set_waiting(P2p* r, int channel, bool on);
  void end_child(Child* c);

  WaitSink* sink_;
  mutable std::mutex mu_;
  std::array<P2p, kPoolSize> pool_{};
  int next_ = 0;
  uint64_t order_ = 0;
  int waiting_ = 0;
  uint64_t waits_begun_ = 0;
  uint64_t reclaimed_ = 0;
};

}  // namespace bb::nccl
