// harvest_sim: how much bubble time a side task harvests, and how much of its work spills into
// training time, under four start policies on the same bubbles.
//
// Bubbles come from the schedule model (every stage of GPipe, 1F1B and interleaved pipelines
// over a grid of depths and micro-batch counts). Two views of a task's step length:
//   - per bubble: one task per bubble position, its step a fraction of that bubble;
//   - per stage: one task fills every bubble of its stage, its step a fraction of the stage's
//     duration-weighted mean bubble (the bubble a random idle nanosecond falls in), so short
//     bubbles may not fit a single step.
// Every step's real duration varies by +-noise. A step that is running when the bubble ends
// finishes anyway (no policy can preempt a GPU kernel): that is the spill.
//
//   libbubble  start after the wake latency; a step starts only if the task runtime's
//              estimate (smoothed mean + 2 x smoothed deviation, as core/task.cc) fits before
//              the deadline
//   ideal      no start latency, and an oracle that knows each step's real duration
//   FreeRide   the start is seen at the next 5 ms check; a step starts only if
//              1.2 x the (offline-profiled) median step fits
//   elastic    libbubble, and when a full step no longer fits the task shrinks its last step
//              to the time left (scaled by the same estimate)
//
// Prints one table per view; pure simulation, no clocks.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/schedule.h"

namespace {

using bb::core::ScheduleKind;
using bb::core::ScheduleParams;

struct Config {
  double noise = 0.10;               // step time varies uniformly by +-noise
  // A bubble's true length varies uniformly by +-bubble_noise around the length the policies
  // are given (the trainer's expected length or libbubble's prediction): a deadline is a guess.
  double bubble_noise = 0.03;
  int iterations = 20;               // iterations replayed per stage
  double fwd_ms = 10, bwd_ms = 20, comm_ms = 0.2;
  double wake_us = 5;                // libbubble: bubble begin -> task running (futex wake)
  double freeride_check_ms = 5;      // FreeRide's state polling period
  double freeride_margin = 1.2;
  double elastic_min_us = 50;        // a shrunken step shorter than this is not worth launching
  // The estimate's deviation after the first step, in steps, as in the task runtime
  // (core/task.cc).
  double init_dev = 0.25;
  uint64_t seed = 1;
};

// The oracle knows each step's time and each bubble's true end, and starts a whole step only if
// it ends in the bubble: the most whole steps can harvest (a shrinking policy can harvest more).
enum Policy { kLibbubble = 0, kOracle = 1, kFreeRide = 2, kElastic = 3, kPolicies = 4 };
const char* kPolicyName[kPolicies] = {"libbubble", "oracle", "FreeRide", "elastic"};

// The task runtime's step-time estimate: a smoothed mean and deviation as TCP estimates
// round-trip times, so a step starts only when it is likely to fit.
struct StepEstimate {
  double init_dev = 0.25;
  double mean = 0, dev = 0;
  bool any = false;
  void add(double x) {
    if (!any) {
      mean = x;
      dev = x * init_dev;
      any = true;
      return;
    }
    dev += (std::fabs(x - mean) - dev) / 4;
    mean += (x - mean) / 8;
  }
  double value() const { return any ? mean + 2 * dev : 0; }
  // As core/task.cc: an estimate longer than the room of every recent bubble (its length less
  // how late the task got to it) is lowered a little by each bubble without a step, so one slow
  // step cannot lock the task out for good; a step that spills doubles the bubbles to wait
  // before the next lowering (8 to 1024), one that fits resets that.
  double longest = 0;
  int probe_wait = 0, probe_gap = 0;
  void bubble_begins(double room) { longest = std::max(room, longest - longest / 64); }
  void no_step() {
    if (value() <= longest) return;
    if (probe_wait > 0) {
      --probe_wait;
      return;
    }
    mean -= mean / 16;
    dev -= dev / 4;
  }
  void stepped(bool spilled) {
    if (!spilled) {
      probe_gap = 0;
      return;
    }
    probe_gap = std::min(std::max(2 * probe_gap, 8), 1024);
    probe_wait = probe_gap;
  }
};

struct Tally {
  double bubble = 0, harvested = 0, spilled = 0;
  void operator+=(const Tally& o) {
    bubble += o.bubble;
    harvested += o.harvested;
    spilled += o.spilled;
  }
  double harvest_share() const { return bubble > 0 ? harvested / bubble : 0; }
  // Of the side task's own time, the share that ran past a bubble's end.
  double spill_share() const {
    return harvested + spilled > 0 ? spilled / (harvested + spilled) : 0;
  }
  double spill_of_bubble() const { return bubble > 0 ? spilled / bubble : 0; }
};

// One policy over a sequence of bubbles, replayed for cfg.iterations iterations; the task's
// step estimate carries over from bubble to bubble. Step noise and FreeRide's polling phase come
// from separate generators seeded alike for every policy, so all policies face the same steps.
Tally replay(Policy policy, const std::vector<double>& bubbles, double step, const Config& cfg,
             uint64_t seed) {
  std::mt19937_64 step_rng(seed), phase_rng(seed ^ 0x9e3779b97f4a7c15ull),
      bubble_rng(seed ^ 0xc2b2ae3d27d4eb4full);
  std::uniform_real_distribution<double> noise(1 - cfg.noise, 1 + cfg.noise);
  std::uniform_real_distribution<double> bubble_noise(1 - cfg.bubble_noise, 1 + cfg.bubble_noise);
  std::uniform_real_distribution<double> phase(0, cfg.freeride_check_ms * 1e6);
  StepEstimate est;
  est.init_dev = cfg.init_dev;
  Tally t;
  for (int it = 0; it < cfg.iterations; ++it) {
    for (const double d : bubbles) {
      // d: the length the policies are told; end: when the bubble really ends (the pause).
      const double end = d * bubble_noise(bubble_rng);
      t.bubble += end;
      double now = 0;
      if (policy == kLibbubble || policy == kElastic) now = cfg.wake_us * 1e3;
      if (policy == kFreeRide) now = phase(phase_rng);
      est.bubble_begins(d - now);
      bool stepped = false;
      while (now < std::min(d, end) || (policy == kOracle && now < end)) {
        const double left = d - now;
        double run = step * noise(step_rng);
        bool shrunk = false;
        if (policy == kOracle) {
          if (run > end - now) break;
        } else if (policy == kFreeRide) {
          if (cfg.freeride_margin * step > left) break;
        } else {
          const double e = est.value();
          if (e > left) {
            if (policy != kElastic || left < cfg.elastic_min_us * 1e3) {
              if (!stepped) est.no_step();
              break;
            }
            // Shrink the work so its estimated time matches what is left.
            run *= left / e;
            shrunk = true;
          }
        }
        stepped = true;
        const double in = std::max(0.0, std::min(run, end - now));
        t.harvested += in;
        t.spilled += run - in;
        est.stepped(run > end - now);
        now += run;
        // A shrunken step says nothing about a full step's time.
        if (!shrunk) est.add(run);
      }
    }
  }
  return t;
}

struct Case {
  ScheduleKind kind;
  uint32_t p, m, v;
};

std::vector<Case> grid() {
  std::vector<Case> out;
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved})
    for (uint32_t p : {2u, 4u, 8u, 16u})
      for (uint32_t m : {4u, 8u, 16u, 32u, 64u}) {
        const uint32_t v = kind == ScheduleKind::kInterleaved ? 2 : 1;
        if (kind == ScheduleKind::kInterleaved && m % p != 0) continue;
        out.push_back({kind, p, m, v});
      }
  return out;
}

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr,
               "harvest_sim: %s\nusage: harvest_sim [--noise F] [--iterations N] [--seed S]\n"
               "  --noise F       step-time variation, uniform +-F (default 0.10)\n"
               "  --iterations N  iterations replayed per stage (default 20)\n"
               "  --bubble-noise F  a bubble's true length varies uniformly +-F around the length\n"
               "                  the policies are given (default 0.03)\n"
               "  --init-dev F    the step estimate's deviation after the first step, in steps\n"
               "                  (default 0.25, as the task runtime)\n"
               "  --seed S        random seed (default 1)\n",
               msg.c_str());
  std::exit(2);
}

}  // namespace

struct Row {
  double mean_h[kPolicies] = {}, mean_s[kPolicies] = {};
  double lb_min_h = 1, lb_max_spill_bubble = 0, lb_mean_spill_bubble = 0;
  int worse_than_freeride = 0;
  int configs = 0;
};

// How a task's step length relates to the bubbles it runs in.
enum class Mode {
  kPerBubble,  // one task per bubble position, its step a fraction of that bubble
  kPerStage,   // one task per stage, its step a fraction of the stage's typical bubble
};

Row evaluate(ScheduleKind kind, double fraction, Mode mode, const Config& cfg) {
  Row row;
  for (const Case& c : grid()) {
    if (c.kind != kind) continue;
    ScheduleParams sp;
    sp.kind = c.kind;
    sp.stages = c.p;
    sp.microbatches = c.m;
    sp.chunks = c.v;
    sp.fwd_ns = static_cast<uint64_t>(cfg.fwd_ms * 1e6);
    sp.bwd_ns = static_cast<uint64_t>(cfg.bwd_ms * 1e6);
    sp.comm_ns = static_cast<uint64_t>(cfg.comm_ms * 1e6);
    bb::core::Schedule sched;
    std::string err;
    if (bb::core::simulate_schedule(sp, &sched, &err) != BB_OK) {
      std::fprintf(stderr, "harvest_sim: %s p=%u m=%u: %s\n", bb::core::schedule_kind_name(kind),
                   c.p, c.m, err.c_str());
      std::exit(1);
    }
    Tally per[kPolicies];
    for (uint32_t s = 0; s < c.p; ++s) {
      const auto& bs = sched.stages[s].bubbles;
      const uint64_t seed = cfg.seed * 1000003 + c.p * 7919 + c.m * 131 + s * 17;
      if (mode == Mode::kPerBubble) {
        for (size_t i = 0; i < bs.size(); ++i) {
          const double d = static_cast<double>(bs[i].duration_ns);
          for (int pol = 0; pol < kPolicies; ++pol)
            per[pol] += replay(static_cast<Policy>(pol), {d}, fraction * d, cfg, seed + i * 31);
        }
      } else {
        std::vector<double> ds;
        double sum = 0, sum_sq = 0;
        for (const auto& b : bs) {
          const double d = static_cast<double>(b.duration_ns);
          ds.push_back(d);
          sum += d;
          sum_sq += d * d;
        }
        if (ds.empty()) continue;
        for (int pol = 0; pol < kPolicies; ++pol)
          per[pol] += replay(static_cast<Policy>(pol), ds, fraction * sum_sq / sum, cfg, seed);
      }
    }
    ++row.configs;
    for (int pol = 0; pol < kPolicies; ++pol) {
      row.mean_h[pol] += per[pol].harvest_share();
      row.mean_s[pol] += per[pol].spill_of_bubble();
    }
    row.lb_min_h = std::min(row.lb_min_h, per[kLibbubble].harvest_share());
    row.lb_max_spill_bubble = std::max(row.lb_max_spill_bubble, per[kLibbubble].spill_of_bubble());
    row.lb_mean_spill_bubble += per[kLibbubble].spill_of_bubble();
    // Equal to a rounding error counts as equal.
    if (per[kLibbubble].harvest_share() < per[kFreeRide].harvest_share() - 1e-9)
      ++row.worse_than_freeride;
  }
  for (int pol = 0; pol < kPolicies; ++pol) {
    row.mean_h[pol] /= row.configs;
    row.mean_s[pol] /= row.configs;
  }
  row.lb_mean_spill_bubble /= row.configs;
  return row;
}

int main(int argc, char** argv) {
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") usage_error("prints the harvest table");
    if (i + 1 >= argc) usage_error(a + " needs a value");
    const char* v = argv[++i];
    char* end = nullptr;
    if (a == "--noise") {
      cfg.noise = std::strtod(v, &end);
      if (*end || !(cfg.noise >= 0 && cfg.noise < 1)) usage_error("--noise needs 0 <= F < 1");
    } else if (a == "--iterations") {
      cfg.iterations = static_cast<int>(std::strtol(v, &end, 10));
      if (*end || cfg.iterations < 1 || cfg.iterations > 100000)
        usage_error("--iterations needs 1..100000");
    } else if (a == "--bubble-noise") {
      cfg.bubble_noise = std::strtod(v, &end);
      if (*end || !(cfg.bubble_noise >= 0 && cfg.bubble_noise < 1))
        usage_error("--bubble-noise needs 0 <= F < 1");
    } else if (a == "--init-dev") {
      cfg.init_dev = std::strtod(v, &end);
      if (*end || !(cfg.init_dev >= 0 && cfg.init_dev <= 10)) usage_error("--init-dev needs 0..10");
    } else if (a == "--seed") {
      cfg.seed = std::strtoull(v, &end, 10);
      if (*end) usage_error("--seed needs a whole number");
    } else {
      usage_error("unknown flag '" + a + "'");
    }
  }

  const double fractions[] = {0.01, 0.02, 0.05, 0.10, 0.20, 0.30, 0.50};

  std::printf("harvest_sim: fwd %.1f ms, bwd %.1f ms, p2p %.1f ms per micro-batch and stage; "
              "step noise +-%.0f%%; a bubble's true length +-%.0f%% of the length the policies "
              "are given; %d iterations replayed\n",
              cfg.fwd_ms, cfg.bwd_ms, cfg.comm_ms, cfg.noise * 100, cfg.bubble_noise * 100,
              cfg.iterations);
  std::printf("grid: p in {2,4,8,16} x m in {4,8,16,32,64} (interleaved: v=2, m a multiple of "
              "p), every stage\n");
  std::printf("libbubble: %.0f us wake, step if smoothed mean + 2 x deviation fits; FreeRide: "
              "%.0f ms polling, step if %.1f x median fits\n",
              cfg.wake_us, cfg.freeride_check_ms, cfg.freeride_margin);
  std::printf("harv = share of bubble time harvested, spill = side-task time past a bubble's "
              "end as a share of bubble time (means over configurations, %%); lb min/max: "
              "libbubble's worst configuration; lb<FR: configurations where libbubble harvested "
              "less than FreeRide\n");

  bool ok_targets = true;
  for (Mode mode : {Mode::kPerBubble, Mode::kPerStage}) {
    std::printf("\n== %s ==\n", mode == Mode::kPerBubble
                                    ? "step = a fraction of the bubble it runs in"
                                    : "step = a fraction of the stage's duration-weighted mean "
                                      "bubble (one task fills every bubble of its stage)");
    std::printf("%-12s %4s |", "schedule", "step");
    for (int pol = 0; pol < kPolicies; ++pol) std::printf(" %-13s |", kPolicyName[pol]);
    std::printf(" %-13s | %s\n", "lb min/max", "lb<FR");
    std::printf("%-12s %4s |", "", "");
    for (int pol = 0; pol < kPolicies; ++pol) std::printf(" %5s %7s |", "harv", "spill");
    std::printf(" %5s %7s |\n", "harv", "spill");
    for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved}) {
      for (const double f : fractions) {
        const Row r = evaluate(kind, f, mode, cfg);
        std::printf("%-12s %3.0f%% |", bb::core::schedule_kind_name(kind), f * 100);
        for (int pol = 0; pol < kPolicies; ++pol)
          std::printf(" %5.1f %7.3f |", 100 * r.mean_h[pol], 100 * r.mean_s[pol]);
        std::printf(" %5.1f %7.3f | %d\n", 100 * r.lb_min_h, 100 * r.lb_max_spill_bubble,
                    r.worse_than_freeride);
        // The targets: a step of at most 10% of its bubble harvests >= 90% with < 1% of the
        // bubble spilled; libbubble never harvests less than FreeRide.
        if (r.worse_than_freeride > 0) ok_targets = false;
        if (mode == Mode::kPerBubble && f <= 0.10 + 1e-9 &&
            (r.lb_min_h < 0.90 || r.lb_max_spill_bubble >= 0.01))
          ok_targets = false;
      }
    }
  }
  std::printf("\ntargets (steps <= 10%% of their bubble: >= 90%% harvested, < 1%% of bubble time "
              "spilled, in every configuration; never below FreeRide): %s\n",
              ok_targets ? "met" : "NOT met");
  return 0;
}
