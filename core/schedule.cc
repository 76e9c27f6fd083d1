#include "core/schedule.h"

#include <algorithm>
#include <cctype>
#include <limits>

namespace bb::core {
namespace {

constexpr uint32_t kMaxStages = 1024;
constexpr uint32_t kMaxMicrobatches = 65536;
constexpr uint32_t kMaxChunks = 64;
// Keeps a simulation (made on the caller's thread) to about 250 MB and a second or two: about
// 60 bytes per op while it runs. p = 128, m = 1024, v = 8 is still in.
constexpr uint64_t kMaxOps = 1u << 22;
// An hour per op: long enough for any real model, small enough that an iteration's sum of
// times can never overflow 64 bits with the limits above.
constexpr uint64_t kMaxOpNs = 3600ull * 1000 * 1000 * 1000;
constexpr uint64_t kNotDone = std::numeric_limits<uint64_t>::max();

bool fail(std::string* error, std::string message) {
  if (error) *error = std::move(message);
  return false;
}

bool validate(const ScheduleParams& p, std::string* error) {
  const char* name = schedule_kind_name(p.kind);
  if (name[0] == '?')
    return fail(error, "unknown schedule kind " + std::to_string(static_cast<uint32_t>(p.kind)) +
                           "; use gpipe, 1f1b, interleaved or zbh1");
  if (p.stages == 0 || p.stages > kMaxStages)
    return fail(error, "stages must be 1.." + std::to_string(kMaxStages) + ", got " +
                           std::to_string(p.stages));
  if (p.microbatches == 0 || p.microbatches > kMaxMicrobatches)
    return fail(error, "microbatches must be 1.." + std::to_string(kMaxMicrobatches) + ", got " +
                           std::to_string(p.microbatches));
  if (p.kind == ScheduleKind::kInterleaved) {
    // With one stage every chunk runs on the same device: no transfer, nothing to wait for.
    if (p.stages < 2)
      return fail(error, "interleaved needs at least 2 stages (one stage has no pipeline to "
                         "interleave; use 1f1b)");
    if (p.chunks < 2 || p.chunks > kMaxChunks)
      return fail(error, "interleaved needs 2.." + std::to_string(kMaxChunks) +
                             " chunks per stage, got " + std::to_string(p.chunks) +
                             " (with one chunk use 1f1b)");
    // Megatron's interleaved order walks the micro-batches in groups of p; a partial group
    // has no defined order.
    if (p.microbatches % p.stages != 0)
      return fail(error, "interleaved needs microbatches to be a multiple of stages (" +
                             std::to_string(p.microbatches) + " is not a multiple of " +
                             std::to_string(p.stages) + ")");
  } else if (p.chunks != 1) {
    return fail(error, std::string("chunks must be 1 for ") + name + ", got " +
                           std::to_string(p.chunks) + " (only interleaved splits a stage)");
  }
  // ZB-H1 is defined for m >= p: with fewer micro-batches its deferred weight passes have no
  // steady phase to come from.
  if (p.kind == ScheduleKind::kZBH1 && p.microbatches < p.stages)
    return fail(error, "zbh1 needs at least as many microbatches as stages (" +
                           std::to_string(p.microbatches) + " < " + std::to_string(p.stages) +
                           "); use 1f1b for fewer");
  if (p.fwd_ns == 0 || p.bwd_ns == 0)
    return fail(error, "forward and backward times must be positive");
  if (p.fwd_ns > kMaxOpNs || p.bwd_ns > kMaxOpNs || p.wgrad_ns > kMaxOpNs || p.comm_ns > kMaxOpNs)
    return fail(error, "op and communication times must be at most one hour each");
  if (p.kind == ScheduleKind::kInterleaved && (p.fwd_ns < p.chunks || p.bwd_ns < p.chunks))
    return fail(error, "forward and backward times must be at least one ns per chunk");
  if (p.kind != ScheduleKind::kZBH1 && p.wgrad_ns != 0)
    return fail(error, std::string("a separate weight-gradient time only applies to zbh1; for ") +
                           name + " add it to the backward time");
  const uint64_t ops = uint64_t{p.stages} * p.microbatches * p.chunks * 3;
  if (ops > kMaxOps)
    return fail(error, "stages x microbatches x chunks is too large to simulate (" +
                           std::to_string(ops / 3) + " ops per pass, at most " +
                           std::to_string(kMaxOps / 3) + ")");
  return true;
}

struct OpRef {
  OpType type;
  uint32_t microbatch;
  uint32_t chunk;
};

void order_gpipe(uint32_t m, std::vector<OpRef>* out) {
  for (uint32_t i = 0; i < m; ++i) out->push_back({OpType::kForward, i, 0});
  for (uint32_t i = 0; i < m; ++i) out->push_back({OpType::kBackward, i, 0});
}

void order_1f1b(uint32_t p, uint32_t m, uint32_t s, std::vector<OpRef>* out) {
  const uint32_t warmup = std::min(p - s - 1, m);
  for (uint32_t i = 0; i < warmup; ++i) out->push_back({OpType::kForward, i, 0});
  for (uint32_t i = 0; i < m - warmup; ++i) {
    out->push_back({OpType::kForward, warmup + i, 0});
    out->push_back({OpType::kBackward, i, 0});
  }
  for (uint32_t i = m - warmup; i < m; ++i) out->push_back({OpType::kBackward, i, 0});
}

// Megatron's interleaved order: virtual micro-batch k runs chunk (k mod pv)/p (reversed for
// backwards) of micro-batch (k / pv)*p + k mod p.
void order_interleaved(uint32_t p, uint32_t m, uint32_t v, uint32_t s, std::vector<OpRef>* out) {
  const uint32_t total = m * v;
  auto ref = [&](OpType type, uint32_t k) {
    const uint32_t in_group = k % (p * v);
    uint32_t chunk = in_group / p;
    if (type == OpType::kBackward) chunk = v - 1 - chunk;
    return OpRef{type, (k / (p * v)) * p + in_group % p, chunk};
  };
  uint32_t warmup;
  if (m == p) {
    warmup = total;  // Megatron runs every forward first when m == p
  } else {
    warmup = std::min((p - s - 1) * 2 + (v - 1) * p, total);
  }
  for (uint32_t k = 0; k < warmup; ++k) out->push_back(ref(OpType::kForward, k));
  for (uint32_t k = 0; k < total - warmup; ++k) {
    out->push_back(ref(OpType::kForward, warmup + k));
    out->push_back(ref(OpType::kBackward, k));
  }
  for (uint32_t k = total - warmup; k < total; ++k) out->push_back(ref(OpType::kBackward, k));
}

// ZB-H1 (exact semantics): like 1F1B, but stage s defers its first s weight-gradient passes
// into what would be its cool-down bubble, keeping 1F1B's count of in-flight micro-batches.
void order_zbh1(uint32_t p, uint32_t m, uint32_t s, std::vector<OpRef>* out) {
  uint32_t f = 0, b = 0, w = 0;
  const uint32_t warmup = std::min(p - s - 1, m);
  for (; f < warmup; ++f) out->push_back({OpType::kForward, f, 0});
  for (uint32_t i = 0; i < s && f < m; ++i) {
    out->push_back({OpType::kForward, f++, 0});
    out->push_back({OpType::kBackward, b++, 0});
  }
  while (f < m) {
    out->push_back({OpType::kForward, f++, 0});
    out->push_back({OpType::kBackward, b++, 0});
    out->push_back({OpType::kWeight, w++, 0});
  }
  while (b < m) {
    out->push_back({OpType::kBackward, b++, 0});
    out->push_back({OpType::kWeight, w++, 0});
  }
  while (w < m) out->push_back({OpType::kWeight, w++, 0});
}

// End times of every (stage, chunk, micro-batch) op of one type.
class EndTimes {
 public:
  EndTimes(uint32_t p, uint32_t v, uint32_t m) : v_(v), m_(m), t_(size_t{p} * v * m, kNotDone) {}
  uint64_t& at(uint32_t s, uint32_t c, uint32_t mb) { return t_[(size_t{s} * v_ + c) * m_ + mb]; }

 private:
  uint32_t v_, m_;
  std::vector<uint64_t> t_;
};

}  // namespace

const char* schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kInterleaved: return "interleaved";
    case ScheduleKind::kZBH1: return "zbh1";
  }
  return "?";
}

bool parse_schedule_kind(std::string_view text, ScheduleKind* out) {
  std::string lower(text);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "gpipe") *out = ScheduleKind::kGPipe;
  else if (lower == "1f1b") *out = ScheduleKind::k1F1B;
  else if (lower == "interleaved") *out = ScheduleKind::kInterleaved;
  else if (lower == "zbh1" || lower == "zb-h1") *out = ScheduleKind::kZBH1;
  else return false;
  return true;
}

double Schedule::bubble_fraction() const {
  if (stages.empty() || iteration_ns == 0) return 0;
  // Summed wide: each stage's idle time fits 64 bits, a thousand of them may not.
  unsigned __int128 idle = 0;
  for (const auto& st : stages) idle += st.idle_ns;
  return static_cast<double>(idle) / (static_cast<double>(iteration_ns) * stages.size());
}

double Schedule::stage_bubble_fraction(uint32_t stage) const {
  if (stage >= stages.size() || iteration_ns == 0) return 0;
  return static_cast<double>(stages[stage].idle_ns) / static_cast<double>(iteration_ns);
}

double Schedule::relative_free(double held) const {
  if (peak_held <= 0) return 1;
  return std::clamp(1.0 - held / peak_held, 0.0, 1.0);
}

bb_status simulate_schedule(const ScheduleParams& params, Schedule* out, std::string* error) {
  if (!validate(params, error)) return BB_E_INVALID;
  const uint32_t p = params.stages, m = params.microbatches, v = params.chunks;
  const bool zb = params.kind == ScheduleKind::kZBH1;

  std::vector<std::vector<OpRef>> order(p);
  for (uint32_t s = 0; s < p; ++s) {
    order[s].reserve(size_t{m} * v * (zb ? 3 : 2));
    switch (params.kind) {
      case ScheduleKind::kGPipe: order_gpipe(m, &order[s]); break;
      case ScheduleKind::k1F1B: order_1f1b(p, m, s, &order[s]); break;
      case ScheduleKind::kInterleaved: order_interleaved(p, m, v, s, &order[s]); break;
      case ScheduleKind::kZBH1: order_zbh1(p, m, s, &order[s]); break;
    }
  }

  const uint64_t dur[3] = {params.fwd_ns / v, params.bwd_ns / v, params.wgrad_ns};
  // Activations in micro-batches: a chunk holds 1/v of the stage's. The backward frees them;
  // ZB-H1's deferred weight pass keeps only the weight GEMMs' inputs, small next to the
  // activations, which is why ZB-H1 peaks like 1F1B.
  const double unit = 1.0 / v;
  const double release[3] = {unit, -unit, 0.0};

  EndTimes f_end(p, v, m), b_end(p, v, m);
  Schedule sched;
  sched.params = params;
  sched.stages.resize(p);
  std::vector<size_t> next(p, 0);
  std::vector<uint64_t> free_at(p, 0);
  std::vector<double> held(p, 0);

  // When the input of an op arrives, or kNotDone while its producer has not run yet.
  auto ready_at = [&](uint32_t s, const OpRef& op) -> uint64_t {
    const uint32_t c = op.chunk, mb = op.microbatch;
    auto remote = [&](uint64_t t) { return t == kNotDone ? t : t + params.comm_ns; };
    switch (op.type) {
      case OpType::kForward:
        if (s > 0) return remote(f_end.at(s - 1, c, mb));
        if (c > 0) return p > 1 ? remote(f_end.at(p - 1, c - 1, mb)) : f_end.at(0, c - 1, mb);
        return 0;
      case OpType::kBackward:
        if (s + 1 < p) return remote(b_end.at(s + 1, c, mb));
        if (c + 1 < v) return p > 1 ? remote(b_end.at(0, c + 1, mb)) : b_end.at(0, c + 1, mb);
        return f_end.at(s, c, mb);
      case OpType::kWeight:
        return b_end.at(s, c, mb);
    }
    return kNotDone;
  };

  // Each pass runs every op whose input is ready; an op's start depends only on ops before it,
  // so the visiting order does not change the result.
  size_t remaining = 0;
  for (const auto& o : order) remaining += o.size();
  while (remaining > 0) {
    bool progress = false;
    for (uint32_t s = 0; s < p; ++s) {
      auto& tl = sched.stages[s];
      while (next[s] < order[s].size()) {
        const OpRef& op = order[s][next[s]];
        const uint64_t ready = ready_at(s, op);
        if (ready == kNotDone) break;
        ScheduledOp done;
        done.type = op.type;
        done.microbatch = op.microbatch;
        done.chunk = op.chunk;
        done.start_ns = std::max(free_at[s], ready);
        done.end_ns = done.start_ns + dur[static_cast<int>(op.type)];
        held[s] += release[static_cast<int>(op.type)];
        if (held[s] < 1e-9) held[s] = 0;  // 1/v steps must not drift below zero
        done.held_after = held[s];
        tl.peak_held = std::max(tl.peak_held, held[s]);
        if (op.type == OpType::kForward) f_end.at(s, op.chunk, op.microbatch) = done.end_ns;
        if (op.type == OpType::kBackward) b_end.at(s, op.chunk, op.microbatch) = done.end_ns;
        free_at[s] = done.end_ns;
        tl.busy_ns += done.end_ns - done.start_ns;
        tl.ops.push_back(done);
        ++next[s];
        --remaining;
        progress = true;
      }
    }
    if (!progress) {
      // Only a wrong op order can get here; the orders above are deadlock-free.
      if (error) *error = "internal error: the schedule's op order deadlocks";
      return BB_E_INVALID;
    }
  }

  for (const auto& tl : sched.stages) {
    sched.iteration_ns = std::max(sched.iteration_ns, tl.ops.empty() ? 0 : tl.ops.back().end_ns);
    sched.peak_held = std::max(sched.peak_held, tl.peak_held);
  }
  for (auto& tl : sched.stages) {
    uint64_t t = 0;
    double h = 0;
    for (size_t i = 0; i < tl.ops.size(); ++i) {
      const auto& op = tl.ops[i];
      if (op.start_ns > t)
        tl.bubbles.push_back({t, op.start_ns - t, i == 0 ? BB_BUBBLE_WARMUP : BB_BUBBLE_STEADY, h});
      t = op.end_ns;
      h = op.held_after;
    }
    if (sched.iteration_ns > t)
      tl.bubbles.push_back({t, sched.iteration_ns - t, BB_BUBBLE_COOLDOWN, h});
    tl.idle_ns = sched.iteration_ns - tl.busy_ns;
  }
  *out = std::move(sched);
  return BB_OK;
}

ScheduleParams unit_times(ScheduleParams params) {
  // Interleaved splits each time among the chunks: one unit per chunk keeps the shares whole.
  const uint64_t unit = params.kind == ScheduleKind::kInterleaved ? params.chunks : 1;
  const bool zb = params.kind == ScheduleKind::kZBH1;
  params.fwd_ns = unit;
  params.bwd_ns = zb ? unit : 2 * unit;
  params.wgrad_ns = zb ? unit : 0;
  params.comm_ns = 0;
  return params;
}

std::vector<ScheduledBubble> receive_waits(const Schedule& schedule, uint32_t stage) {
  std::vector<ScheduledBubble> out;
  if (stage >= schedule.stages.size()) return out;
  const uint32_t p = schedule.params.stages, v = schedule.params.chunks;
  const auto& ops = schedule.stages[stage].ops;
  uint64_t t = 0;
  double held = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const ScheduledOp& op = ops[i];
    const uint32_t virt = op.chunk * p + stage;  // the op's place in the whole pipeline
    const bool receives = (op.type == OpType::kForward && virt > 0) ||
                          (op.type == OpType::kBackward && virt + 1 < p * v);
    if (receives)
      out.push_back({t, op.start_ns - t, i == 0 ? BB_BUBBLE_WARMUP : BB_BUBBLE_STEADY, held});
    t = op.end_ns;
    held = op.held_after;
  }
  return out;
}

std::vector<uint64_t> gaps_before(const std::vector<ScheduledBubble>& bubbles,
                                  uint64_t iteration_ns) {
  std::vector<uint64_t> out(bubbles.size());
  for (size_t i = 0; i < bubbles.size(); ++i) {
    const auto& prev = i ? bubbles[i - 1] : bubbles.back();
    const uint64_t prev_end = prev.start_ns + prev.duration_ns;
    out[i] = i ? bubbles[i].start_ns - prev_end : iteration_ns - prev_end + bubbles[0].start_ns;
  }
  return out;
}

double closed_form_bubble_fraction(const ScheduleParams& params, std::string* error) {
  if (!validate(params, error)) return -1;
  const double p = params.stages, m = params.microbatches, v = params.chunks;
  switch (params.kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::k1F1B:
      return (p - 1) / (m + p - 1);
    case ScheduleKind::kInterleaved:
      return (p - 1) / (v * m + p - 1);
    case ScheduleKind::kZBH1: {
      const double f = params.fwd_ns, b = params.bwd_ns, w = params.wgrad_ns;
      const double idle = (p - 1) * std::max(f + b - w, 0.0);
      return idle / (m * (f + b + w) + idle);
    }
  }
  return -1;
}

}  // namespace bb::core
