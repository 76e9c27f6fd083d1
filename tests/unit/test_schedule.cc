#include <doctest/doctest.h>

#include "core/schedule.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

using bb::core::closed_form_bubble_fraction;
using bb::core::OpType;
using bb::core::Schedule;
using bb::core::ScheduleKind;
using bb::core::ScheduleParams;
using bb::core::simulate_schedule;

namespace {

ScheduleParams make(ScheduleKind kind, uint32_t p, uint32_t m, uint64_t f, uint64_t b,
                    uint32_t v = 1, uint64_t w = 0, uint64_t comm = 0) {
  ScheduleParams sp;
  sp.kind = kind;
  sp.stages = p;
  sp.microbatches = m;
  sp.chunks = v;
  sp.fwd_ns = f;
  sp.bwd_ns = b;
  sp.wgrad_ns = w;
  sp.comm_ns = comm;
  return sp;
}

Schedule run(const ScheduleParams& sp) {
  Schedule s;
  std::string err;
  const bb_status st = simulate_schedule(sp, &s, &err);
  INFO("simulate_schedule: ", err);
  REQUIRE(st == BB_OK);
  return s;
}

// Invariants every simulated schedule must satisfy, whatever its kind.
void check_consistent(const ScheduleParams& sp, const Schedule& s) {
  const uint32_t ops_per_stage = sp.microbatches * sp.chunks * (sp.kind == ScheduleKind::kZBH1 ? 3 : 2);
  REQUIRE(s.stages.size() == sp.stages);
  for (const auto& st : s.stages) {
    REQUIRE(st.ops.size() == ops_per_stage);
    uint64_t busy = 0, idle = 0, t = 0;
    for (const auto& op : st.ops) {
      CHECK(op.start_ns >= t);  // a stage runs one op at a time, in order
      t = op.end_ns;
      busy += op.end_ns - op.start_ns;
    }
    for (size_t i = 0; i < st.bubbles.size(); ++i) {
      CHECK(st.bubbles[i].duration_ns > 0);
      if (i > 0) CHECK(st.bubbles[i].start_ns >= st.bubbles[i - 1].start_ns + st.bubbles[i - 1].duration_ns);
      idle += st.bubbles[i].duration_ns;
    }
    CHECK(busy == st.busy_ns);
    CHECK(idle == st.idle_ns);
    CHECK(busy + idle == s.iteration_ns);
    CHECK(st.ops.back().held_after == doctest::Approx(0.0));  // every activation is released
  }
}

// The dependencies, checked against the simulated times: every op starts exactly when both its
// stage is free and its input is there (its producer's end, plus the transfer when the producer
// ran on another stage), and each stage runs every (type, micro-batch, chunk) exactly once
// with its op time. Virtual stage k = chunk x p + stage: a forward at k needs the forward at
// k - 1, a backward at k the backward at k + 1 (the last one its own forward), a weight pass
// the backward of its stage.
void check_dependencies(const ScheduleParams& sp, const Schedule& s) {
  const uint32_t p = sp.stages, m = sp.microbatches, v = sp.chunks;
  struct Key {
    OpType type;
    uint32_t mb, chunk, stage;
    bool operator<(const Key& o) const {
      return std::tie(type, mb, chunk, stage) < std::tie(o.type, o.mb, o.chunk, o.stage);
    }
  };
  std::map<Key, const bb::core::ScheduledOp*> at;
  for (uint32_t st = 0; st < p; ++st)
    for (const auto& op : s.stages[st].ops) {
      const Key k{op.type, op.microbatch, op.chunk, st};
      CHECK(at.count(k) == 0);  // once
      at[k] = &op;
    }
  const uint64_t dur[3] = {sp.fwd_ns / v, sp.bwd_ns / v, sp.wgrad_ns};
  auto find = [&](OpType t, uint32_t mb, uint32_t virt) -> const bb::core::ScheduledOp* {
    auto it = at.find(Key{t, mb, virt / p, virt % p});
    REQUIRE(it != at.end());
    return it->second;
  };
  for (uint32_t st = 0; st < p; ++st) {
    uint64_t free_at = 0;
    for (const auto& op : s.stages[st].ops) {
      CAPTURE(st);
      CAPTURE(int(op.type));
      CAPTURE(op.microbatch);
      CAPTURE(op.chunk);
      REQUIRE(op.microbatch < m);
      REQUIRE(op.chunk < v);
      CHECK(op.end_ns - op.start_ns == dur[int(op.type)]);
      const uint32_t virt = op.chunk * p + st;
      uint64_t ready = 0;
      auto input = [&](const bb::core::ScheduledOp* dep, uint32_t dep_virt) {
        ready = dep->end_ns + (dep_virt % p != st ? sp.comm_ns : 0);
      };
      if (op.type == OpType::kForward) {
        if (virt > 0) input(find(OpType::kForward, op.microbatch, virt - 1), virt - 1);
      } else if (op.type == OpType::kBackward) {
        if (virt + 1 < p * v) input(find(OpType::kBackward, op.microbatch, virt + 1), virt + 1);
        else input(find(OpType::kForward, op.microbatch, virt), virt);
      } else {
        input(find(OpType::kBackward, op.microbatch, virt), virt);
      }
      CHECK(op.start_ns == std::max(free_at, ready));
      free_at = op.end_ns;
    }
  }
}

}  // namespace

TEST_CASE("schedule_every_op_starts_when_its_stage_is_free_and_its_input_has_arrived") {
  const ScheduleParams cases[] = {
      make(ScheduleKind::kGPipe, 4, 8, 1000, 2000),
      make(ScheduleKind::kGPipe, 3, 2, 1000, 2000, 1, 0, 150),
      make(ScheduleKind::k1F1B, 4, 8, 1000, 2000),
      make(ScheduleKind::k1F1B, 4, 3, 1000, 2000, 1, 0, 100),
      make(ScheduleKind::k1F1B, 8, 16, 700, 1500, 1, 0, 40),
      make(ScheduleKind::kInterleaved, 4, 8, 1000, 2000, 2),
      make(ScheduleKind::kInterleaved, 2, 4, 900, 1800, 3, 0, 50),
      make(ScheduleKind::kInterleaved, 4, 16, 1200, 2400, 4, 0, 30),
      make(ScheduleKind::kZBH1, 4, 8, 1000, 1000, 1, 1000),
      make(ScheduleKind::kZBH1, 4, 4, 1000, 1500, 1, 0),
      make(ScheduleKind::kZBH1, 6, 12, 1000, 1200, 1, 400, 80),
  };
  for (const auto& sp : cases) {
    CAPTURE(bb::core::schedule_kind_name(sp.kind));
    CAPTURE(sp.stages);
    CAPTURE(sp.microbatches);
    CAPTURE(sp.chunks);
    const Schedule s = run(sp);
    check_consistent(sp, s);
    check_dependencies(sp, s);
  }
}

TEST_CASE("schedule_gpipe_and_1f1b_match_closed_form") {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (uint32_t p = 1; p <= 8; ++p) {
      for (uint32_t m : {1u, 2u, 3u, 4u, 7u, 8u, 16u, 32u}) {
        for (auto fb : {std::pair<uint64_t, uint64_t>{1000, 1000}, {1000, 2000}, {700, 1300}}) {
          CAPTURE(bb::core::schedule_kind_name(kind));
          CAPTURE(p);
          CAPTURE(m);
          CAPTURE(fb.first);
          CAPTURE(fb.second);
          const auto sp = make(kind, p, m, fb.first, fb.second);
          const Schedule s = run(sp);
          check_consistent(sp, s);
          CHECK(s.bubble_fraction() == doctest::Approx(closed_form_bubble_fraction(sp)).epsilon(1e-12));
          CHECK(s.iteration_ns == (m + p - 1) * (fb.first + fb.second));
        }
      }
    }
  }
}

TEST_CASE("schedule_interleaved_matches_closed_form") {
  for (uint32_t p = 2; p <= 8; ++p) {
    for (uint32_t groups : {1u, 2u, 3u, 4u}) {
      for (uint32_t v : {2u, 3u, 4u}) {
        const uint32_t m = p * groups;
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(v);
        const auto sp = make(ScheduleKind::kInterleaved, p, m, 1200, 2400, v);
        const Schedule s = run(sp);
        check_consistent(sp, s);
        CHECK(s.bubble_fraction() == doctest::Approx(closed_form_bubble_fraction(sp)).epsilon(1e-12));
        // Interleaving divides each stage's idle time by v.
        const Schedule plain = run(make(ScheduleKind::k1F1B, p, m, 1200, 2400));
        CHECK(s.stages[0].idle_ns * v == plain.stages[0].idle_ns);
      }
    }
  }
}

TEST_CASE("schedule_zbh1_is_a_third_of_1f1b_when_f_b_w_equal") {
  for (uint32_t p = 2; p <= 8; ++p) {
    for (uint32_t m : {p, p + 1, 2 * p, 4 * p}) {
      CAPTURE(p);
      CAPTURE(m);
      const auto sp = make(ScheduleKind::kZBH1, p, m, 1000, 1000, 1, 1000);
      const Schedule zb = run(sp);
      check_consistent(sp, zb);
      CHECK(zb.bubble_fraction() == doctest::Approx(closed_form_bubble_fraction(sp)).epsilon(1e-12));
      // The same work as 1F1B with the weight gradient inside the backward.
      const Schedule base = run(make(ScheduleKind::k1F1B, p, m, 1000, 2000));
      for (uint32_t s = 0; s < p; ++s) CHECK(zb.stages[s].idle_ns * 3 == base.stages[s].idle_ns);
      CHECK(zb.peak_held == base.peak_held);
    }
  }
}

TEST_CASE("schedule_zbh1_closed_form_exact_for_short_w_and_a_bound_for_long_w") {
  for (uint32_t p : {2u, 4u, 6u}) {
    for (uint32_t m : {p, 3 * p}) {
      for (uint64_t w : {200u, 900u, 1500u, 4000u}) {
        CAPTURE(p);
        CAPTURE(m);
        CAPTURE(w);
        const auto sp = make(ScheduleKind::kZBH1, p, m, 1000, 1200, 1, w);
        const Schedule s = run(sp);
        check_consistent(sp, s);
        const double cf = closed_form_bubble_fraction(sp);
        if (w <= 1000)
          CHECK(s.bubble_fraction() == doctest::Approx(cf).epsilon(1e-12));
        else
          CHECK(s.bubble_fraction() >= cf - 1e-12);
      }
    }
  }
}

TEST_CASE("schedule_1f1b_bubble_kinds_and_memory_trend") {
  const uint32_t p = 4, m = 8;
  const uint64_t f = 1000, b = 2000;
  const Schedule s = run(make(ScheduleKind::k1F1B, p, m, f, b));
  for (uint32_t st = 0; st < p; ++st) {
    CAPTURE(st);
    const auto& tl = s.stages[st];
    // Stage s waits s forwards for its first input, and idles p-1-s backwards at the end.
    if (st == 0) {
      CHECK(tl.bubbles.front().kind != BB_BUBBLE_WARMUP);
    } else {
      CHECK(tl.bubbles.front().kind == BB_BUBBLE_WARMUP);
      CHECK(tl.bubbles.front().start_ns == 0);
      CHECK(tl.bubbles.front().duration_ns == st * f);
    }
    if (st == p - 1 || st == 0) {
      // The last stage's cool-down and the first stage's lack of one.
      if (st == 0) CHECK(tl.bubbles.back().kind != BB_BUBBLE_COOLDOWN);
      if (st == p - 1) {
        CHECK(tl.bubbles.back().kind == BB_BUBBLE_COOLDOWN);
        CHECK(tl.bubbles.back().duration_ns == (p - 1) * b);
      }
    }
    for (const auto& bub : tl.bubbles) {
      if (bub.kind == BB_BUBBLE_WARMUP) CHECK(bub.start_ns == 0);
      if (bub.kind == BB_BUBBLE_COOLDOWN) CHECK(bub.start_ns + bub.duration_ns == s.iteration_ns);
    }
    // 1F1B: stage s holds the activations of p-s micro-batches at its peak.
    CHECK(tl.peak_held == doctest::Approx(p - st));
    CHECK(tl.ops.front().type == OpType::kForward);
    CHECK(tl.ops.back().type == OpType::kBackward);
  }
  CHECK(s.peak_held == doctest::Approx(p));
  CHECK(s.relative_free(0) == doctest::Approx(1.0));
  CHECK(s.relative_free(p) == doctest::Approx(0.0));
  CHECK(s.relative_free(p / 2.0) == doctest::Approx(0.5));
}

TEST_CASE("schedule_gpipe_holds_every_microbatch") {
  const Schedule s = run(make(ScheduleKind::kGPipe, 4, 12, 1000, 2000));
  for (const auto& tl : s.stages) CHECK(tl.peak_held == doctest::Approx(12));
  // The bubble between the forward and backward phases holds everything.
  const auto& last = s.stages[3];
  bool found_full = false;
  for (const auto& bub : s.stages[0].bubbles)
    if (bub.kind == BB_BUBBLE_STEADY && bub.held == doctest::Approx(12)) found_full = true;
  CHECK(found_full);
  CHECK(last.bubbles.front().kind == BB_BUBBLE_WARMUP);
  CHECK(last.bubbles.front().held == 0);
}

TEST_CASE("schedule_comm_time_lengthens_iteration_and_adds_bubbles") {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                    ScheduleKind::kZBH1}) {
    CAPTURE(bb::core::schedule_kind_name(kind));
    const uint32_t v = kind == ScheduleKind::kInterleaved ? 2 : 1;
    const uint64_t w = kind == ScheduleKind::kZBH1 ? 500 : 0;
    const auto base = make(kind, 4, 8, 1000, 1500, v, w);
    auto with_comm = base;
    with_comm.comm_ns = 100;
    const Schedule a = run(base), b = run(with_comm);
    check_consistent(with_comm, b);
    CHECK(b.iteration_ns > a.iteration_ns);
    CHECK(b.bubble_fraction() > a.bubble_fraction());
    // The last stage waits for the first micro-batch to cross p-1 links.
    CHECK(b.stages[3].bubbles.front().duration_ns >= a.stages[3].bubbles.front().duration_ns + 3 * 100);
  }
}

TEST_CASE("schedule_single_stage_has_no_bubbles") {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZBH1}) {
    const Schedule s = run(make(kind, 1, 4, 1000, 2000, 1, kind == ScheduleKind::kZBH1 ? 300 : 0));
    CHECK(s.stages[0].bubbles.empty());
    CHECK(s.bubble_fraction() == 0);
  }
}

TEST_CASE("schedule_bubble_fraction_of_long_iterations_does_not_overflow") {
  // Hour-long ops on 1024 stages: each stage idles ~1e16 ns, their sum is past 64 bits.
  Schedule s;
  s.iteration_ns = 4'000'000'000'000'000'000ull;
  s.stages.resize(1024);
  for (auto& st : s.stages) st.idle_ns = 3'000'000'000'000'000'000ull;
  CHECK(s.bubble_fraction() == doctest::Approx(0.75));
}

TEST_CASE("schedule_rejects_bad_parameters_with_a_message") {
  struct Bad {
    ScheduleParams sp;
    const char* needle;
  };
  const Bad cases[] = {
      {make(ScheduleKind::k1F1B, 0, 4, 1, 1), "stages"},
      {make(ScheduleKind::k1F1B, 2000, 4, 1, 1), "stages"},
      {make(ScheduleKind::k1F1B, 4, 0, 1, 1), "microbatches"},
      {make(ScheduleKind::k1F1B, 4, 4, 0, 1), "positive"},
      {make(ScheduleKind::k1F1B, 4, 4, 1, 0), "positive"},
      {make(ScheduleKind::k1F1B, 4, 4, 1, 1, 2), "chunks"},
      {make(ScheduleKind::kInterleaved, 4, 8, 10, 10, 1), "1f1b"},
      {make(ScheduleKind::kInterleaved, 4, 6, 10, 10, 2), "multiple of stages"},
      {make(ScheduleKind::kInterleaved, 4, 8, 3, 10, 4), "per chunk"},
      {make(ScheduleKind::k1F1B, 4, 8, 10, 10, 1, 5), "zbh1"},
      {make(ScheduleKind::kZBH1, 4, 3, 10, 10, 1, 5), "at least as many microbatches"},
      {make(ScheduleKind::k1F1B, 4, 4, 1, 4000ull * 1000 * 1000 * 1000), "hour"},
      {make(ScheduleKind::k1F1B, 1024, 65536, 1, 1), "too large"},
      // Just past the cap (p x m x v x 3 ops above 2^22): set_schedule runs this on the
      // trainer's thread, so it must stay bounded in memory and time.
      {make(ScheduleKind::kInterleaved, 128, 1024, 16, 16, 11), "too large"},
      {make(ScheduleKind::kInterleaved, 1, 4, 10, 10, 2), "at least 2 stages"},
      {make(static_cast<ScheduleKind>(9), 4, 4, 1, 1), "unknown schedule kind"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.needle);
    Schedule s;
    s.iteration_ns = 12345;
    std::string err;
    CHECK(simulate_schedule(c.sp, &s, &err) == BB_E_INVALID);
    CHECK(err.find(c.needle) != std::string::npos);
    CHECK(s.iteration_ns == 12345);  // untouched on failure
    std::string err2;
    CHECK(closed_form_bubble_fraction(c.sp, &err2) == -1);
    CHECK(err2 == err);
  }
  // A null error pointer is allowed.
  Schedule s;
  CHECK(simulate_schedule(make(ScheduleKind::k1F1B, 0, 4, 1, 1), &s, nullptr) == BB_E_INVALID);
}

TEST_CASE("schedule_kind_names_round_trip") {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                    ScheduleKind::kZBH1}) {
    ScheduleKind parsed{};
    REQUIRE(bb::core::parse_schedule_kind(bb::core::schedule_kind_name(kind), &parsed));
    CHECK(parsed == kind);
  }
  ScheduleKind k{};
  CHECK(bb::core::parse_schedule_kind("ZB-H1", &k));
  CHECK(k == ScheduleKind::kZBH1);
  CHECK_FALSE(bb::core::parse_schedule_kind("2f2b", &k));
  CHECK_FALSE(bb::core::parse_schedule_kind("", &k));
}

// ---- receive waits: how adapters number their bubbles -----------------------------------

namespace {

// What a framework receives per iteration (the adapters' PipelineSchedule.receives_per_iteration):
// activations for every virtual stage but the first, gradients for every one but the last.
size_t receives_per_iteration(const ScheduleParams& sp, uint32_t stage) {
  const size_t virt = size_t{sp.microbatches} * sp.chunks;
  return (virt - (stage == 0 ? sp.microbatches : 0)) +
         (virt - (stage == sp.stages - 1 ? sp.microbatches : 0));
}

std::vector<ScheduleParams> receive_cases() {
  std::vector<ScheduleParams> out;
  for (uint64_t comm : {uint64_t{0}, uint64_t{150}}) {
    out.push_back(make(ScheduleKind::kGPipe, 4, 6, 1000, 2000, 1, 0, comm));
    out.push_back(make(ScheduleKind::k1F1B, 4, 8, 1000, 2000, 1, 0, comm));
    out.push_back(make(ScheduleKind::k1F1B, 4, 2, 1000, 3000, 1, 0, comm));  // m < p
    out.push_back(make(ScheduleKind::k1F1B, 2, 5, 700, 900, 1, 0, comm));
    out.push_back(make(ScheduleKind::kInterleaved, 4, 8, 1200, 2400, 2, 0, comm));
    out.push_back(make(ScheduleKind::kInterleaved, 2, 4, 900, 2700, 3, 0, comm));
    out.push_back(make(ScheduleKind::kZBH1, 4, 8, 1000, 1000, 1, 1000, comm));
    out.push_back(make(ScheduleKind::kZBH1, 3, 5, 1000, 1500, 1, 2500, comm));  // long W
  }
  return out;
}

}  // namespace

TEST_CASE("schedule_receive_waits_count_every_receive_and_add_up_to_the_idle_time") {
  for (const auto& sp : receive_cases()) {
    const Schedule s = run(sp);
    for (uint32_t st = 0; st < sp.stages; ++st) {
      CAPTURE(bb::core::schedule_kind_name(sp.kind));
      CAPTURE(sp.stages);
      CAPTURE(sp.comm_ns);
      CAPTURE(st);
      const auto& tl = s.stages[st];
      const auto waits = bb::core::receive_waits(s, st);
      CHECK(waits.size() == receives_per_iteration(sp, st));
      // Only the cool-down after the stage's last op waits for no receive.
      const uint64_t trailing = s.iteration_ns - tl.ops.back().end_ns;
      uint64_t sum = 0;
      std::vector<std::pair<uint64_t, uint64_t>> nonzero;
      for (const auto& w : waits) {
        sum += w.duration_ns;
        if (w.duration_ns) nonzero.emplace_back(w.start_ns, w.duration_ns);
        CHECK(w.kind == (w.start_ns == 0 && st > 0 ? BB_BUBBLE_WARMUP : BB_BUBBLE_STEADY));
      }
      CHECK(sum == tl.idle_ns - trailing);
      // Each idle interval before an op is exactly one receive wait, and the other waits are 0.
      std::vector<std::pair<uint64_t, uint64_t>> idle;
      for (const auto& b : tl.bubbles)
        if (b.start_ns != tl.ops.back().end_ns) idle.emplace_back(b.start_ns, b.duration_ns);
      CHECK(nonzero == idle);
    }
  }
}

TEST_CASE("schedule_receive_waits_1f1b_middle_stage") {
  const auto sp = make(ScheduleKind::k1F1B, 4, 8, 1000, 2000);
  const Schedule s = run(sp);
  const auto waits = bb::core::receive_waits(s, 2);
  REQUIRE(waits.size() == 16);
  // Stage 2 first waits for two forwards upstream.
  CHECK(waits[0].kind == BB_BUBBLE_WARMUP);
  CHECK(waits[0].duration_ns == 2 * 1000);
  // The first stage receives only gradients, the last only activations; one stage nothing.
  CHECK(bb::core::receive_waits(s, 0).size() == 8);
  CHECK(bb::core::receive_waits(s, 3).size() == 8);
  CHECK(bb::core::receive_waits(s, 4).empty());
  CHECK(bb::core::receive_waits(run(make(ScheduleKind::k1F1B, 1, 4, 1000, 2000)), 0).empty());
}

TEST_CASE("schedule_gaps_between_receive_waits_are_the_stage_compute") {
  for (const auto& sp : receive_cases()) {
    const Schedule s = run(sp);
    for (uint32_t st = 0; st < sp.stages; ++st) {
      CAPTURE(bb::core::schedule_kind_name(sp.kind));
      CAPTURE(st);
      const auto& tl = s.stages[st];
      const auto waits = bb::core::receive_waits(s, st);
      const auto gaps = bb::core::gaps_before(waits, s.iteration_ns);
      REQUIRE(gaps.size() == waits.size());
      // Waits and gaps tile the iteration.
      uint64_t total = 0;
      for (size_t i = 0; i < waits.size(); ++i) total += waits[i].duration_ns + gaps[i];
      CHECK(total == s.iteration_ns);
      // Past the first, a gap is the compute between two receives: no idle time hides in it,
      // which is what lets the library measure a stage's speed from its gaps.
      uint64_t compute = 0;
      for (const auto& op : tl.ops)
        if (op.start_ns >= waits.front().start_ns + waits.front().duration_ns &&
            op.end_ns <= waits.back().start_ns)
          compute += op.end_ns - op.start_ns;
      uint64_t later_gaps = 0;
      for (size_t i = 1; i < gaps.size(); ++i) later_gaps += gaps[i];
      CHECK(later_gaps == compute);
    }
  }
  CHECK(bb::core::gaps_before({}, 1000).empty());
}

TEST_CASE("schedule_unit_times_scale_to_any_proportional_times") {
  // Measured times rely on this: the model at forward F, backward 2F is the unit model times F.
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                    ScheduleKind::kZBH1}) {
    CAPTURE(bb::core::schedule_kind_name(kind));
    const uint32_t v = kind == ScheduleKind::kInterleaved ? 3 : 1;
    const bool zb = kind == ScheduleKind::kZBH1;
    auto base = make(kind, 4, 8, 1, 1, v);
    base.comm_ns = 77;
    const ScheduleParams unit = bb::core::unit_times(base);
    CHECK(unit.comm_ns == 0);
    CHECK(unit.fwd_ns == v);
    CHECK(unit.bwd_ns == (zb ? 1u : 2u) * v);
    CHECK(unit.wgrad_ns == (zb ? 1u : 0u));
    const uint64_t f = 4000 * v;  // real times with the same ratios
    const Schedule u = run(unit), r = run(make(kind, 4, 8, f, zb ? f : 2 * f, v, zb ? f : 0));
    const uint64_t k = f / v;
    CHECK(r.iteration_ns == u.iteration_ns * k);
    for (uint32_t st = 0; st < 4; ++st) {
      const auto wu = bb::core::receive_waits(u, st), wr = bb::core::receive_waits(r, st);
      REQUIRE(wu.size() == wr.size());
      for (size_t i = 0; i < wu.size(); ++i) CHECK(wr[i].duration_ns == wu[i].duration_ns * k);
    }
  }
}

TEST_CASE("schedule_interleaved_holds_megatrons_warmup_plus_one_chunk_per_stage") {
  // Megatron's interleaved 1F1B runs (p - s - 1) * 2 + (v - 1) * p forward chunks before its
  // first backward on stage s (at most m * v; all of them when m == p), then one more forward:
  // that many chunks of activations are in flight at the peak, each a v-th of a micro-batch's.
  for (const auto& [p, m, v] : {std::tuple<uint32_t, uint32_t, uint32_t>{4, 8, 2}, {4, 4, 3},
                                {2, 8, 4}, {8, 16, 2}}) {
    CAPTURE(p);
    CAPTURE(m);
    CAPTURE(v);
    const Schedule s = run(make(ScheduleKind::kInterleaved, p, m, 1000 * v, 2000 * v, v));
    for (uint32_t st = 0; st < p; ++st) {
      CAPTURE(st);
      const uint32_t warmup = m == p ? m * v : std::min((p - st - 1) * 2 + (v - 1) * p, m * v);
      const uint32_t peak = std::min(warmup + 1, m * v);
      CHECK(s.stages[st].peak_held == doctest::Approx(double(peak) / v));
    }
  }
}
