// The pipeline schedule model: where a stage computes and where it idles in one iteration.
//
// A schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1) fixes the order of forward, backward and
// weight-gradient ops on every stage. Simulating that order by its dependencies (an op starts
// when its stage is free and its input from the neighbour stage has arrived) gives each
// stage's ops, its idle intervals (the bubbles side tasks may fill), the iteration length and
// how many micro-batches of activations the stage holds over time. Pure computation: no I/O,
// no clocks, no global state.
#pragma once

#include <bubble/bubble.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace bb::core {

enum class ScheduleKind : uint32_t {
  kGPipe = 0,        // all forwards, then all backwards
  k1F1B = 1,         // PipeDream-flush / Megatron non-interleaved
  kInterleaved = 2,  // Megatron interleaved 1F1B, v model chunks per stage
  kZBH1 = 3,         // zero-bubble H1: backward split into input (B) and weight (W) gradients
};

// "gpipe", "1f1b", "interleaved", "zbh1".
const char* schedule_kind_name(ScheduleKind kind);
// Accepts the names above (case-insensitive; "zb-h1" too). False for anything else.
bool parse_schedule_kind(std::string_view text, ScheduleKind* out);

struct ScheduleParams {
  ScheduleKind kind = ScheduleKind::k1F1B;
  uint32_t stages = 0;        // p
  uint32_t microbatches = 0;  // m
  uint32_t chunks = 1;        // v: model chunks per stage (interleaved only; else 1)
  // Times of one micro-batch through a whole stage. Interleaved splits them evenly among the
  // stage's v chunks. For ZB-H1 bwd_ns is the input-gradient part only and wgrad_ns the
  // weight-gradient part; other schedules take the full backward in bwd_ns and wgrad_ns = 0.
  uint64_t fwd_ns = 0;
  uint64_t bwd_ns = 0;
  uint64_t wgrad_ns = 0;
  uint64_t comm_ns = 0;  // point-to-point transfer between stages, added to every cross-stage edge
};

enum class OpType : uint8_t { kForward = 0, kBackward = 1, kWeight = 2 };

struct ScheduledOp {
  OpType type = OpType::kForward;
  uint32_t microbatch = 0;
  uint32_t chunk = 0;
  uint64_t start_ns = 0;  // from the iteration's start
  uint64_t end_ns = 0;
  double held_after = 0;  // micro-batches of activations the stage holds once the op is done
};

struct ScheduledBubble {
  uint64_t start_ns = 0;  // from the iteration's start
  uint64_t duration_ns = 0;
  bb_bubble_kind kind = BB_BUBBLE_OTHER;
  double held = 0;        // micro-batches of activations held while the stage idles
};

struct StageTimeline {
  std::vector<ScheduledOp> ops;          // in execution order
  std::vector<ScheduledBubble> bubbles;  // in time order; zero-length gaps are omitted
  uint64_t busy_ns = 0;
  uint64_t idle_ns = 0;  // == sum of bubble durations == iteration_ns - busy_ns
  double peak_held = 0;
};

struct Schedule {
  ScheduleParams params;
  // From the first op's start to the last op's end over all stages: the next iteration can
  // only begin once the pipeline has drained.
  uint64_t iteration_ns = 0;
  std::vector<StageTimeline> stages;
  double peak_held = 0;  // the largest peak_held of any stage

  // Idle share of all stages' time in one iteration.
  double bubble_fraction() const;
  double stage_bubble_fraction(uint32_t stage) const;
  // 1 when no activations are held, 0 at the largest activation peak of any stage: the
  // relative trend of free device memory a caller scales its own figure by.
  double relative_free(double held) const;
};

// Simulates one iteration. On bad parameters returns BB_E_INVALID and sets *error (may be
// null) to a sentence naming the parameter and the fix; *out is left untouched then.
bb_status simulate_schedule(const ScheduleParams& params, Schedule* out, std::string* error);

// Unit times for a schedule whose real times are not known yet: a forward of 1 and a backward
// of 2 (the usual ratio), or for ZB-H1 1 each for forward, input and weight gradient (the
// zero-bubble papers' split of that backward); no communication. Interleaved gets those per
// chunk. Scaled by measured compute, the model's lengths are exact when the real times keep
// these ratios.
ScheduleParams unit_times(ScheduleParams params);

// One bubble per receive: for every op of `stage` that needs a tensor from a neighbour (the
// forward of every virtual stage but the first, the backward of every virtual stage but the
// last; ZB-H1's weight passes receive nothing), in execution order, the idle time right before
// that op (0 when its input is already there). This is how a framework that reports its
// receive waits numbers its bubbles. Kind WARMUP before the stage's first op, else STEADY.
// Every idle interval of the stage but the cool-down after its last op comes before a receiving
// op, so the waits add up to the stage's idle time minus that cool-down. Empty when `stage` is
// out of range.
std::vector<ScheduledBubble> receive_waits(const Schedule& schedule, uint32_t stage);

// The time before each bubble since the previous one ended, as a trainer sees it between its
// bubble calls; before the first, since the previous iteration's last bubble ended (so it
// holds whatever idles after that bubble, such as the cool-down, when the bubbles are
// receive waits). Empty for no bubbles.
std::vector<uint64_t> gaps_before(const std::vector<ScheduledBubble>& bubbles,
                                  uint64_t iteration_ns);

// The textbook bubble fraction for these parameters without communication time:
//   GPipe, 1F1B:  (p-1) / (m+p-1)
//   interleaved:  (p-1) / (v*m+p-1)             (the 1F1B bubble divided by about v)
//   ZB-H1:        (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)), a third of 1F1B's when F=B=W
// The first three are exact for any F and B; ZB-H1's is exact when W <= min(F, B) and a lower
// bound otherwise (a long W no longer fits the cool-down gaps it was deferred into).
// Validates like simulate_schedule; returns -1 (and sets *error) on bad parameters.
double closed_form_bubble_fraction(const ScheduleParams& params, std::string* error = nullptr);

}  // namespace bb::core
