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
// when the pool runs out, the oldest stopped one is reclaimed).
//
// The handles given to NCCL are not addresses. Each names what it stands for (a receive record,
// or one of its channel's kernel, proxy-op or proxy-step events), the record's place in the pool
// and the record's generation, with a mark in the top byte, where no user-space address has
// bits. A handle kept past its record's reuse therefore no longer matches (it names an older
// generation), even when the new receive runs on the same channel; an address would have named
// the new receive's event. A value that does not decode to a live event of ours is ignored.
// NCCL never dereferences event handles (they are opaque to it).
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

  // The handle of a group event: not null, because NCCL before 2.28 starts a group's task (P2p)
  // events only under a group handle that is not null, but naming nothing, so its stop (and any
  // child that names it as parent) is ignored.
  static void* group_handle();
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
  enum class Kind : uint32_t { kP2p = 0, kKernel = 1, kOp = 2, kStep = 3 };
  struct Channel {
    bool kernel = false;  // its KernelCh event started and has not stopped
    bool op = false;      // its (receive) proxy op started and has not stopped
    bool waiting = false;
    bool arrived = false;
  };
  struct P2p {
    uint32_t gen = 0;
    bool in_use = false;
    bool host_stopped = false;
    int nchannels = 0;
    int kernels_done = 0;
    int live_children = 0;
    uint64_t started = 0;  // allocation order, to reclaim the oldest
    std::array<Channel, kChannels> ch;
  };
  // What a handle names, once decoded and checked against the pool.
  struct Ref {
    P2p* rec = nullptr;
    int channel = 0;
  };

  void* handle(Kind kind, const P2p* r, int channel) const;
  // The live record (and channel) a handle of that kind names, or rec == nullptr.
  Ref resolve(const void* h, Kind kind) const;
  P2p* allocate();
  void release(P2p* r);
  void maybe_release(P2p* r);
  void set_waiting(P2p* r, int channel, bool on);
  void end_child(P2p* r, int channel, Kind kind);

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
