#include "plugins/nccl_profiler/recv_waits.h"

#include <cstddef>

namespace bb::nccl {

RecvWaits::P2p* RecvWaits::as_p2p(void* p) const {
  const auto* base = reinterpret_cast<const char*>(pool_.data());
  const auto* q = static_cast<const char*>(p);
  if (q < base || q >= base + sizeof pool_) return nullptr;
  const size_t off = size_t(q - base);
  if (off % sizeof(P2p) != 0) return nullptr;
  auto* r = const_cast<P2p*>(&pool_[off / sizeof(P2p)]);
  return (r->tag == Tag::kP2p && r->in_use) ? r : nullptr;
}

// A child pointer is accepted only if it is exactly one of the child slots of a record: NCCL
// hands back what we gave it, but a stale or foreign pointer must not be written through.
RecvWaits::Child* RecvWaits::as_child(void* p, Tag tag) const {
  const auto* base = reinterpret_cast<const char*>(pool_.data());
  const auto* q = static_cast<const char*>(p);
  if (q < base || q >= base + sizeof pool_) return nullptr;
  const size_t i = size_t(q - base) / sizeof(P2p);
  const size_t off = size_t(q - base) % sizeof(P2p);
  if (off < offsetof(P2p, ch)) return nullptr;
  const size_t k = (off - offsetof(P2p, ch)) / sizeof(Channel);
  if (k >= size_t(kChannels)) return nullptr;
  auto& c = const_cast<Channel&>(pool_[i].ch[k]);
  Child* slot = tag == Tag::kKernel ? &c.kernel : tag == Tag::kOp ? &c.op : &c.step;
  return (static_cast<const void*>(slot) == p && slot->tag == tag) ? slot : nullptr;
}

bool RecvWaits::child_valid(const Child* c) const {
  return c && c->active && c->owner && c->owner->in_use && c->gen == c->owner->gen;
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
  for (int c = 0; c < kChannels; ++c) {
    pick->ch[size_t(c)].kernel.channel = uint32_t(c);
    pick->ch[size_t(c)].op.channel = uint32_t(c);
    pick->ch[size_t(c)].step.channel = uint32_t(c);
  }
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
  if (r) r->nchannels = nchannels > kChannels ? kChannels : (nchannels < 0 ? 0 : nchannels);
  return r;
}

void* RecvWaits::kernel_channel_start(void* parent, int channel) {
  if (!parent || channel < 0 || channel >= kChannels) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  P2p* r = as_p2p(parent);
  if (!r) return nullptr;
  Child& k = r->ch[size_t(channel)].kernel;
  if (!k.active) {
    k.active = true;
    k.owner = r;
    k.gen = r->gen;
    ++r->live_children;
  }
  // Data the proxy already received before the kernel reached the channel means no wait.
  if (!r->ch[size_t(channel)].arrived) set_waiting(r, channel, true);
  return &k;
}

void* RecvWaits::proxy_op_start(void* parent, bool same_process, int channel, bool is_send) {
  if (!parent || !same_process || is_send || channel < 0 || channel >= kChannels) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  P2p* r = as_p2p(parent);
  if (!r) return nullptr;
  Child& op = r->ch[size_t(channel)].op;
  if (!op.active) {
    op.active = true;
    op.owner = r;
    op.gen = r->gen;
    ++r->live_children;
  }
  return &op;
}

void* RecvWaits::proxy_step_start(void* parent) {
  if (!parent) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  Child* op = as_child(parent, Tag::kOp);
  if (!child_valid(op)) return nullptr;
  Child& step = op->owner->ch[op->channel].step;
  step.active = true;
  step.owner = op->owner;
  step.gen = op->gen;
  return &step;
}

void RecvWaits::end_child(Child* c) {
  P2p* r = c->owner;
  c->active = false;
  --r->live_children;
  if (c->tag == Tag::kKernel) {
    set_waiting(r, int(c->channel), false);
    ++r->kernels_done;
  }
  maybe_release(r);
}

void RecvWaits::record(void* handle, Transition t) {
  if (!handle || t == Transition::kOther) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (t == Transition::kKernelChannelDone) {
    Child* k = as_child(handle, Tag::kKernel);
    if (child_valid(k)) end_child(k);
    return;
  }
  Child* c = as_child(handle, Tag::kStep);
  if (!c) c = as_child(handle, Tag::kOp);
  if (!child_valid(c)) return;
  c->owner->ch[c->channel].arrived = true;
  set_waiting(c->owner, int(c->channel), false);
}

void RecvWaits::stop(void* handle) {
  if (!handle) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (P2p* r = as_p2p(handle)) {
    r->host_stopped = true;
    maybe_release(r);
    return;
  }
  if (Child* k = as_child(handle, Tag::kKernel)) {
    if (child_valid(k)) end_child(k);
    return;
  }
  if (Child* op = as_child(handle, Tag::kOp)) {
    if (child_valid(op)) end_child(op);
    return;
  }
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
