#include "plugins/nccl_profiler/recv_waits.h"

#include <cstddef>

namespace bb::nccl {

namespace {

// A handle: mark (8 bits) | kind (2) | unused (6) | record (8) | channel (8) | generation (32).
constexpr uint64_t kMark = 0xbbull << 56;
constexpr uint64_t kMarkMask = 0xffull << 56;
// Another mark: resolve() rejects it for every kind.
constexpr uint64_t kGroupHandle = 0xbcull << 56;

}  // namespace

void* RecvWaits::group_handle() { return reinterpret_cast<void*>(uintptr_t(kGroupHandle)); }

void* RecvWaits::handle(Kind kind, const P2p* r, int channel) const {
  const uint64_t index = uint64_t(r - pool_.data());
  const uint64_t v = kMark | uint64_t(kind) << 54 | index << 40 | uint64_t(channel) << 32 | r->gen;
  return reinterpret_cast<void*>(uintptr_t(v));
}

RecvWaits::Ref RecvWaits::resolve(const void* h, Kind kind) const {
  static_assert(kPoolSize <= 256 && kChannels <= 256, "a handle has 8 bits for each");
  static_assert(sizeof(void*) == 8, "handles need 64-bit pointers");
  const uint64_t v = uint64_t(reinterpret_cast<uintptr_t>(h));
  Ref ref;
  if ((v & kMarkMask) != kMark || Kind((v >> 54) & 3) != kind || ((v >> 48) & 0x3f) != 0)
    return ref;
  const uint64_t index = (v >> 40) & 0xff, channel = (v >> 32) & 0xff;
  if (index >= uint64_t(kPoolSize) || channel >= uint64_t(kChannels)) return ref;
  // A P2p handle names no channel.
  if (kind == Kind::kP2p && channel != 0) return ref;
  auto* r = const_cast<P2p*>(&pool_[index]);
  if (!r->in_use || r->gen != uint32_t(v)) return ref;  // reused (or freed) since
  ref.rec = r;
  ref.channel = int(channel);
  return ref;
}

RecvWaits::P2p* RecvWaits::allocate() {
  P2p* pick = nullptr;
  for (int n = 0; n < kPoolSize && !pick; ++n) {
    P2p& r = pool_[size_t((next_ + n) % kPoolSize)];
    if (!r.in_use) pick = &r;
  }
  if (!pick) {
    // Every record is in use: reclaim the oldest one NCCL has stopped. Its late children see a
    // new generation and are ignored; a wait it still held ends here.
    for (P2p& r : pool_)
      if (r.host_stopped && (!pick || r.started < pick->started)) pick = &r;
    if (!pick) return nullptr;
    ++reclaimed_;
    release(pick);
  }
  next_ = int((pick - pool_.data() + 1) % kPoolSize);
  const uint32_t gen = pick->gen;
  *pick = P2p{};
  pick->gen = gen + 1;
  pick->in_use = true;
  pick->started = ++order_;
  return pick;
}

void RecvWaits::release(P2p* r) {
  for (int c = 0; c < kChannels; ++c) set_waiting(r, c, false);
  r->in_use = false;
  ++r->gen;
}

void RecvWaits::maybe_release(P2p* r) {
  // Without a channel count (v3) a record cannot know its last channel; it stays until the pool
  // needs it back.
  if (r->host_stopped && r->live_children == 0 && r->nchannels > 0 &&
      r->kernels_done >= r->nchannels)
    release(r);
}

void RecvWaits::set_waiting(P2p* r, int channel, bool on) {
  Channel& c = r->ch[size_t(channel)];
  if (c.waiting == on) return;
  c.waiting = on;
  if (on) {
    if (waiting_++ == 0) {
      ++waits_begun_;
      if (sink_) sink_->wait_begins();
    }
  } else if (--waiting_ == 0) {
    if (sink_) sink_->wait_ends();
  }
}

void* RecvWaits::p2p_start(bool is_recv, int nchannels) {
  if (!is_recv) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  P2p* r = allocate();
  if (!r) return nullptr;
  r->nchannels = nchannels > kChannels ? kChannels : (nchannels < 0 ? 0 : nchannels);
  return handle(Kind::kP2p, r, 0);
}

void* RecvWaits::kernel_channel_start(void* parent, int channel) {
  if (!parent || channel < 0 || channel >= kChannels) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  P2p* r = resolve(parent, Kind::kP2p).rec;
  if (!r) return nullptr;
  Channel& c = r->ch[size_t(channel)];
  if (!c.kernel) {
    c.kernel = true;
    ++r->live_children;
  }
  // Data the proxy already received before the kernel reached the channel means no wait.
  if (!c.arrived) set_waiting(r, channel, true);
  return handle(Kind::kKernel, r, channel);
}

void* RecvWaits::proxy_op_start(void* parent, bool same_process, int channel, bool is_send) {
  if (!parent || !same_process || is_send || channel < 0 || channel >= kChannels) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  P2p* r = resolve(parent, Kind::kP2p).rec;
  if (!r) return nullptr;
  Channel& c = r->ch[size_t(channel)];
  if (!c.op) {
    c.op = true;
    ++r->live_children;
  }
  return handle(Kind::kOp, r, channel);
}

void* RecvWaits::proxy_step_start(void* parent) {
  if (!parent) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  const Ref op = resolve(parent, Kind::kOp);
  if (!op.rec || !op.rec->ch[size_t(op.channel)].op) return nullptr;
  // Every step of the op gets the same handle: a step only ever tells of its data arriving.
  return handle(Kind::kStep, op.rec, op.channel);
}

void RecvWaits::end_child(P2p* r, int channel, Kind kind) {
  Channel& c = r->ch[size_t(channel)];
  bool& live = kind == Kind::kKernel ? c.kernel : c.op;
  if (!live) return;  // a second stop of the same event changes nothing
  live = false;
  --r->live_children;
  if (kind == Kind::kKernel) {
    set_waiting(r, channel, false);
    ++r->kernels_done;
  }
  maybe_release(r);
}

void RecvWaits::record(void* handle, Transition t) {
  if (!handle || t == Transition::kOther) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (t == Transition::kKernelChannelDone) {
    const Ref k = resolve(handle, Kind::kKernel);
    if (k.rec) end_child(k.rec, k.channel, Kind::kKernel);
    return;
  }
  Ref c = resolve(handle, Kind::kStep);
  if (!c.rec) c = resolve(handle, Kind::kOp);
  if (!c.rec) return;
  c.rec->ch[size_t(c.channel)].arrived = true;
  set_waiting(c.rec, c.channel, false);
}

void RecvWaits::stop(void* handle) {
  if (!handle) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (P2p* r = resolve(handle, Kind::kP2p).rec) {
    r->host_stopped = true;
    maybe_release(r);
    return;
  }
  for (const Kind kind : {Kind::kKernel, Kind::kOp})
    if (const Ref c = resolve(handle, kind); c.rec) return end_child(c.rec, c.channel, kind);
  // A proxy step ends nothing: the channel's wait is the kernel's and the arrival's business.
}

void RecvWaits::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  for (P2p& r : pool_)
    if (r.in_use) release(&r);
  next_ = 0;
}

void RecvWaits::set_sink(WaitSink* sink) {
  std::lock_guard<std::mutex> lock(mu_);  // every use of sink_ holds it
  for (P2p& r : pool_)
    if (r.in_use) release(&r);
  next_ = 0;
  sink_ = sink;
}

int RecvWaits::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_;
}

uint64_t RecvWaits::waits_begun() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waits_begun_;
}

uint64_t RecvWaits::records_reclaimed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reclaimed_;
}

}  // namespace bb::nccl
