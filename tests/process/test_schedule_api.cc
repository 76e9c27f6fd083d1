// bb_trainer_set_schedule: a declared schedule seeds the predictor from the first iteration.
#include <bubble/bubble.h>
#include <doctest/doctest.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/observer.h"
#include "core/schedule.h"
#include "tests/helpers/proc.h"
#include "tests/helpers/trainer_fixture.h"

namespace {

// Declares 1F1B, 4 stages, 8 micro-batches, forward 1 ms, backward 2 ms on the hub for
// `stage`, and returns the bubbles the schedule model gives that stage (and, in *gaps, the time
// before each since the previous one ended).
std::vector<bb::core::ScheduledBubble> declare_1f1b(bb_trainer_h t, uint32_t stage,
                                                    std::vector<uint64_t>* gaps = nullptr) {
  bb_schedule_t sc;
  bb_schedule_init(&sc);
  sc.kind = BB_SCHEDULE_1F1B;
  sc.stages = 4;
  sc.microbatches = 8;
  sc.stage = stage;
  sc.fwd_ns = 1'000'000;
  sc.bwd_ns = 2'000'000;
  REQUIRE(bb_trainer_set_schedule(t, &sc) == BB_OK);
  bb::core::ScheduleParams p;
  p.kind = bb::core::ScheduleKind::k1F1B;
  p.stages = 4;
  p.microbatches = 8;
  p.fwd_ns = 1'000'000;
  p.bwd_ns = 2'000'000;
  bb::core::Schedule model;
  std::string err;
  REQUIRE(bb::core::simulate_schedule(p, &model, &err) == BB_OK);
  if (gaps) *gaps = bb::core::gaps_before(model.stages[stage].bubbles, model.iteration_ns);
  return model.stages[stage].bubbles;
}

}  // namespace

TEST_CASE("declared_schedule_predicts_bubbles_from_the_first_iteration") {
  bbtest::RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("sched", 1, nullptr, &t) == BB_OK);
  std::vector<uint64_t> gaps;
  // Stage 0: its iteration ends with compute (the last backward), so the gap before its first
  // bubble is not zero.
  const auto bubbles = declare_1f1b(t, 0, &gaps);
  REQUIRE(bubbles.size() >= 2);
  REQUIRE(gaps.size() == bubbles.size());
  REQUIRE(gaps[0] > 0);
  std::string err;

  std::unique_ptr<bb::core::HubObserver> obs;
  REQUIRE(bb::core::HubObserver::open("", "sched", 1, &obs, &err) == BB_OK);
  bb_trainer_iteration(t);
  for (size_t i = 0; i < bubbles.size(); ++i) {
    // expected_ns = 0: the library predicts; the deadline it publishes is the declared length.
    REQUIRE(bb_bubble_begin(t, 0, BB_MEM_UNKNOWN, bubbles[i].kind) == BB_OK);
    const auto snap = obs->snapshot();
    CHECK(snap.bubble_deadline_ns - snap.bubble_begin_ns == bubbles[i].duration_ns);
    REQUIRE(bb_bubble_end(t) == BB_OK);
  }
  // Marking the next iteration tells waiting tasks when its first bubble comes: after the
  // declared gap before an iteration's first bubble, not the gap that follows a last position.
  REQUIRE(bb_trainer_iteration(t) == BB_OK);
  const auto after = obs->snapshot();
  CHECK(after.next_begin_ns - after.bubble_end_ns == gaps[0]);
  obs.reset();

  // What the schedule model rejects comes back as a clear error.
  bb_schedule_t sc;
  bb_schedule_init(&sc);
  sc.kind = BB_SCHEDULE_1F1B;
  sc.stages = 4;
  sc.microbatches = 8;
  sc.fwd_ns = 1'000'000;
  sc.bwd_ns = 2'000'000;
  sc.stage = 4;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("stage 4 is out of range") != std::string::npos);
  sc.stage = 0;
  sc.fwd_ns = 0;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  sc.fwd_ns = 1;
  sc.kind = BB_SCHEDULE_INTERLEAVED;
  sc.chunks = 2;
  sc.microbatches = 6;  // not a multiple of the 4 stages
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).size() > 10);
  bb_trainer_close(t);
}

namespace {

// What a trainer and a side task saw of one bubble.
struct Seen {
  uint64_t seq = 0, begin = 0, end = 0, announced = 0;  // announced: deadline - begin, 0 if none
};

// One iteration of a 1F1B p=4 m=8 stage-2 trainer reporting one bubble per receive, as the
// framework adapters do: the compute between receives is a sleep of the model's units at
// `unit`, each receive waits its model length. A real side task process (imperative) runs in
// the bubbles; before each bubble the trainer lets it ack the last pause, so it is started in
// every bubble its steps fit. Returns what the hub showed per bubble, and what the task was
// told at each start (by bubble seq).
std::vector<Seen> run_receive_iteration(const char* job, bool declare,
                                        const std::vector<bb::core::ScheduledBubble>& waits,
                                        const std::vector<uint64_t>& gaps,
                                        std::chrono::microseconds unit,
                                        std::map<uint64_t, uint64_t>* task_saw) {
  bbtest::TrainerFixture t(job);
  bbtest::Child task({BB_TEST_TASK, job, "0", "side", "imperative", "--step-us", "50",
                      "--min-step-us", "100"});
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(bbtest::eventually([&] { return t.stats().tasks_attached == 1; }));
  if (declare) {
    bb_schedule_t sc;
    bb_schedule_init(&sc);
    sc.kind = BB_SCHEDULE_1F1B;
    sc.stages = 4;
    sc.microbatches = 8;
    sc.stage = 2;
    sc.bubbles = BB_SCHEDULE_BUBBLES_RECEIVES;  // fwd_ns = bwd_ns = 0: measure them
    REQUIRE(bb_trainer_set_schedule(t.h, &sc) == BB_OK);
  }
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  REQUIRE(bb::core::HubObserver::open("", job, 0, &obs, &err) == BB_OK);
  std::vector<Seen> seen;
  uint64_t bubble_ns = 0;
  REQUIRE(bb_trainer_iteration(t.h) == BB_OK);
  for (size_t i = 0; i < waits.size(); ++i) {
    if (i > 0) std::this_thread::sleep_for(unit * gaps[i]);
    REQUIRE(bbtest::eventually([&] {
      const auto snap = obs->snapshot();
      return snap.tasks.size() == 1 && !snap.tasks[0].started;
    }));
    const auto kind = i == 0 ? BB_BUBBLE_WARMUP : BB_BUBBLE_STEADY;
    REQUIRE(bb_bubble_begin(t.h, 0, BB_MEM_UNKNOWN, kind) == BB_OK);
    const auto open = obs->snapshot();
    Seen s;
    s.seq = open.bubble_seq;
    s.begin = open.bubble_begin_ns;
    s.announced = open.bubble_deadline_ns ? open.bubble_deadline_ns - open.bubble_begin_ns : 0;
    std::this_thread::sleep_for(unit * waits[i].duration_ns);
    // A task the trainer started is let run before the bubble ends, however loaded the
    // machine: a start it woke to after the end would be skipped, and it would print nothing.
    if (open.tasks.size() == 1 && open.tasks[0].started)
      REQUIRE(bbtest::eventually([&] {
        return obs->snapshot().tasks[0].state == bb::core::TaskRunState::kRunning;
      }));
    REQUIRE(bb_bubble_end(t.h) == BB_OK);
    const auto closed = obs->snapshot();
    s.end = s.begin + (closed.bubble_ns - bubble_ns);
    bubble_ns = closed.bubble_ns;
    seen.push_back(s);
  }
  // Once the last pause is acked, every start the task had has been printed.
  REQUIRE(bbtest::eventually([&] { return !obs->snapshot().tasks[0].started; }));
  std::string line;
  while (!(line = task.wait_line("STARTED", 200)).empty()) {
    const auto at = line.find(" len=");  // deadline - begin, 0 without a deadline
    REQUIRE(at != std::string::npos);
    (*task_saw)[std::stoull(line.substr(8))] = std::stoull(line.substr(at + 5));
  }
  return seen;
}

}  // namespace

TEST_CASE("an_iteration_marked_while_a_bubble_is_open_starts_when_that_bubble_ends") {
  bbtest::RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("sched-open", 1, nullptr, &t) == BB_OK);
  std::vector<uint64_t> gaps;
  const auto bubbles = declare_1f1b(t, 0, &gaps);
  REQUIRE(gaps[0] > 0);
  std::string err;
  REQUIRE(bubbles.size() >= 2);
  REQUIRE(bubbles[0].duration_ns != bubbles[1].duration_ns);  // a shift would show

  std::unique_ptr<bb::core::HubObserver> obs;
  REQUIRE(bb::core::HubObserver::open("", "sched-open", 1, &obs, &err) == BB_OK);
  // A bubble of the warm-up before training (no iteration marked yet) is still open when the
  // first iteration is marked: it belongs before the iteration, so its end already publishes
  // the gap before the iteration's first bubble for waiting tasks, and every bubble of the
  // iteration gets its own position's declared length.
  REQUIRE(bb_bubble_begin(t, 0, BB_MEM_UNKNOWN, BB_BUBBLE_OTHER) == BB_OK);
  REQUIRE(bb_trainer_iteration(t) == BB_OK);
  REQUIRE(bb_bubble_end(t) == BB_OK);
  const auto ended = obs->snapshot();
  CHECK(ended.next_begin_ns - ended.bubble_end_ns == gaps[0]);
  for (size_t i = 0; i < bubbles.size(); ++i) {
    CAPTURE(i);
    REQUIRE(bb_bubble_begin(t, 0, BB_MEM_UNKNOWN, bubbles[i].kind) == BB_OK);
    const auto snap = obs->snapshot();
    CHECK(snap.bubble_deadline_ns - snap.bubble_begin_ns == bubbles[i].duration_ns);
    if (i + 1 < bubbles.size()) REQUIRE(bb_bubble_end(t) == BB_OK);
  }
  // The iteration's last bubble is open too when the next iteration is marked, and the next
  // begin closes it: the next iteration's first bubble is predicted at position 0, bounded by
  // its declared length (the lower of that and the one observation there).
  REQUIRE(bb_trainer_iteration(t) == BB_OK);
  REQUIRE(bb_bubble_begin(t, 0, BB_MEM_UNKNOWN, bubbles[0].kind) == BB_OK);
  const auto snap = obs->snapshot();
  CHECK(snap.bubble_deadline_ns - snap.bubble_begin_ns <= bubbles[0].duration_ns);
  REQUIRE(bb_bubble_end(t) == BB_OK);
  obs.reset();
  CHECK(bb_trainer_close(t) == BB_OK);
}

TEST_CASE("published_schedule_with_measured_times_predicts_the_first_iteration") {
  bbtest::RuntimeDir dir;
  // The model an adapter publishes: 1F1B p=4 m=8 stage 2, one bubble per receive, in units.
  bb::core::ScheduleParams p;
  p.kind = bb::core::ScheduleKind::k1F1B;
  p.stages = 4;
  p.microbatches = 8;
  bb::core::Schedule model;
  std::string err;
  REQUIRE(bb::core::simulate_schedule(bb::core::unit_times(p), &model, &err) == BB_OK);
  const auto waits = bb::core::receive_waits(model, 2);
  const auto gaps = bb::core::gaps_before(waits, model.iteration_ns);
  REQUIRE(waits.size() == 16);
  const auto unit = std::chrono::microseconds(400);  // the "real" forward time

  std::map<uint64_t, uint64_t> task_saw;
  const auto seen = run_receive_iteration("msched", true, waits, gaps, unit, &task_saw);
  // Before any compute nothing is known; from the second bubble on each announced length is
  // the model's, scaled by the compute measured so far (the gaps the trainer saw between its
  // own bubble calls), and a receive the model says needs no wait is announced as 1 ns.
  CHECK(seen[0].announced == 0);
  unsigned __int128 observed = 0, units = 0;
  for (size_t i = 1; i < seen.size(); ++i) {
    CAPTURE(i);
    observed += seen[i].begin - seen[i - 1].end;
    units += gaps[i];
    const uint64_t scaled = uint64_t(waits[i].duration_ns * observed / units);
    CHECK(seen[i].announced == (scaled ? scaled : 1));
    // The compute is at least the sleeps, so the scale never undershoots the real forward
    // time: each wait is announced at least at its real length.
    CHECK(seen[i].announced >= waits[i].duration_ns * uint64_t(unit.count()) * 1000);
  }
  // The side task process (steps of at least 100 us) was told the same deadlines, and
  // started where its steps fit: at the warm-up (no deadline yet) and at the two-unit wait for
  // the first gradient, not in the wait the model says is empty.
  for (const auto& s : seen)
    if (task_saw.count(s.seq)) CHECK(task_saw.at(s.seq) == s.announced);
  REQUIRE(waits[1].duration_ns == 0);
  REQUIRE(waits[2].duration_ns == 2);
  CHECK(task_saw.count(seen[0].seq) == 1);
  CHECK(task_saw.count(seen[1].seq) == 0);
  CHECK(task_saw.count(seen[2].seq) == 1);
  CHECK(task_saw[seen[2].seq] >= 2 * uint64_t(unit.count()) * 1000);

  // Without the declaration the first iteration has only the history of each kind: no
  // deadline for the first steady wait (the task runs blind), and the wait for the first
  // gradient is guessed from that empty wait before it.
  std::map<uint64_t, uint64_t> plain_saw;
  const auto plain = run_receive_iteration("mplain", false, waits, gaps, unit, &plain_saw);
  CHECK(plain[0].announced == 0);
  CHECK(plain[1].announced == 0);
  CHECK(plain_saw.count(plain[1].seq) == 1);
  CHECK(plain_saw[plain[1].seq] == 0);
  CHECK(plain[2].announced == plain[1].end - plain[1].begin);
}

TEST_CASE("schedule_with_measured_times_names_what_is_wrong") {
  bbtest::RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("msbad", 0, nullptr, &t) == BB_OK);
  bb_schedule_t sc;
  bb_schedule_init(&sc);
  CHECK(sc.bubbles == BB_SCHEDULE_BUBBLES_IDLE);
  CHECK(sc.size == sizeof(bb_schedule_t));
  sc.stages = 4;
  sc.microbatches = 8;
  sc.stage = 1;
  // Times unknown, both ways of numbering bubbles: fine.
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_OK);
  sc.bubbles = BB_SCHEDULE_BUBBLES_RECEIVES;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_OK);
  // One time without the other.
  sc.fwd_ns = 1000;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("leave both 0") != std::string::npos);
  // A weight-gradient or transfer time cannot be mixed with unknown forward and backward.
  sc.fwd_ns = 0;
  sc.comm_ns = 50;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("comm_ns") != std::string::npos);
  sc.comm_ns = 0;
  sc.bubbles = 7;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("bubbles 7") != std::string::npos);
  // A caller built before `bubbles` existed passes the shorter struct: still accepted.
  sc.bubbles = BB_SCHEDULE_BUBBLES_IDLE;
  sc.size = offsetof(bb_schedule_t, bubbles);
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_OK);
  sc.size = offsetof(bb_schedule_t, comm_ns);
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  // Model chunks belong to the interleaved schedule only: elsewhere they are a mistake to name,
  // not a number to drop.
  bb_schedule_init(&sc);
  sc.stages = 4;
  sc.microbatches = 8;
  sc.stage = 1;
  sc.chunks = 4;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("chunks is 4") != std::string::npos);
  sc.kind = BB_SCHEDULE_INTERLEAVED;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_OK);
  // More receives than the predictor's 1024 positions (two per micro-batch on a middle
  // stage): accepted, the rest falls back.
  bb_schedule_init(&sc);
  sc.stages = 4;
  sc.microbatches = 600;
  sc.stage = 1;
  sc.bubbles = BB_SCHEDULE_BUBBLES_RECEIVES;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_OK);
  // One stage receives nothing: nothing to seed, not an error.
  sc.stages = 1;
  sc.stage = 0;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_OK);
  sc.bubbles = BB_SCHEDULE_BUBBLES_IDLE;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_OK);
  bb_trainer_close(t);
}

namespace {

// A task in this process, started and handed its start info at every bubble it is given.
struct InProcessTask {
  bb_task_h h = nullptr;
  explicit InProcessTask(const char* job) {
    REQUIRE(bb_task_attach(job, 0, "t", nullptr, &h) == BB_OK);
  }
  ~InProcessTask() { bb_task_detach(h); }
  // The start of the bubble just begun; acked at once, so that the next bubble may start it.
  bb_start_info_t start() {
    bb_start_info_t info{sizeof info};
    REQUIRE(bb_task_wait_start(h, 5'000'000'000, &info) == BB_OK);
    REQUIRE(bb_task_ack_pause(h) == BB_OK);
    return info;
  }
};

}  // namespace

TEST_CASE("a_bubble_without_end_is_a_deadline_at_the_end_of_time") {
  // UINT64_MAX is a natural "as long as it takes": the deadline is the end of time, not a sum
  // that wraps into the past and tells the task its bubble ended before it began.
  bbtest::RuntimeDir dir;
  bbtest::TrainerFixture t("forever");
  InProcessTask task("forever");
  REQUIRE(bb_bubble_begin(t.h, UINT64_MAX, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
  const bb_start_info_t info = task.start();
  CHECK(info.deadline_ns == UINT64_MAX);
  REQUIRE(bb_bubble_end(t.h) == BB_OK);
}

TEST_CASE("begins_that_end_the_last_bubble_leave_measured_times_unknown_not_zero") {
  // A trainer that lets each begin end the last bubble has no gap between bubbles. With a
  // schedule declared without times, the gaps are the compute that scales the model: a gap of
  // 0 made every model unit 0 ns and every prediction 1 ns, a deadline no step fits.
  bbtest::RuntimeDir dir;
  bbtest::TrainerFixture t("noend");
  bb_schedule_t sc;
  bb_schedule_init(&sc);
  sc.stages = 4;
  sc.microbatches = 8;
  sc.stage = 3;  // a warm-up and a cool-down per iteration
  REQUIRE(bb_trainer_set_schedule(t.h, &sc) == BB_OK);
  InProcessTask task("noend");
  for (int it = 0; it < 2; ++it) {
    bb_trainer_iteration(t.h);
    for (int b = 0; b < 2; ++b) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the stage computes
      REQUIRE(bb_bubble_begin(t.h, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
      const bb_start_info_t info = task.start();
      CAPTURE(it);
      CAPTURE(b);
      // Unknown (0), or a length observed: never the 1 ns of a scale of 0.
      CHECK((info.deadline_ns == 0 || info.deadline_ns - info.begin_ns > 1000));
    }
  }
  REQUIRE(bb_bubble_end(t.h) == BB_OK);
}
