// Multi-process tests: a trainer (this process, or a bb_test_trainer child) and side tasks in
// child processes, cooperating through a real hub.
#include <bubble/bubble.h>
#include <bubble/bubble_cuda.h>
#include <doctest/doctest.h>
#include <linux/membarrier.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/observer.h"
#include "core/paths.h"
#include "shm/segment.h"
#include "tests/helpers/proc.h"
#include "tests/helpers/trainer_fixture.h"

using bbtest::Child;
using bbtest::RuntimeDir;
using bbtest::eventually;

namespace {

std::string task_bin() { return BB_TEST_TASK; }
std::string trainer_bin() { return BB_TEST_TRAINER; }

using Trainer = bbtest::TrainerFixture;

std::vector<std::string> task_args(const std::string& job, const std::string& name,
                                   const std::string& mode, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {task_bin(), job, "0", name, mode};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

// A signal sent to the trainer's process is the application's: it must reach the application's
// threads, never the hub's service thread, and opening the hub leaves the caller's mask as it was.
TEST_CASE("the_hubs_thread_leaves_the_processs_signals_to_the_application") {
  RuntimeDir dir;
  const auto before = bbtest::thread_ids();
  Trainer t("sig");
  size_t started = 0;
  CHECK(bbtest::misplaced_signal_masks(before, &started) == "");
  CHECK(started == 1);
  CHECK_FALSE(bbtest::thread_blocks(pid_t(syscall(SYS_gettid)), SIGTERM));
}

namespace {

// What a step of the reentrancy test saw when it called back into its own task.
struct Reentry {
  bb_task_h task = nullptr;
  std::vector<bb_status> refused;  // wait, ack pause, ack revoke; then detach and run
  std::string said;
  bool stepped = false;
};

int reenter(void* user, const bb_step_info_t*) {
  auto* r = static_cast<Reentry*>(user);
  if (r->stepped) return BB_STEP_DONE;
  r->stepped = true;
  bb_start_info_t info{sizeof info};
  r->refused = {bb_task_wait_start(r->task, 0, &info)};
  r->said = bb_last_error();
  r->refused.push_back(bb_task_ack_pause(r->task));
  r->refused.push_back(bb_task_ack_revoke(r->task));
  // Only once those were refused: without the guard these would free the handle, or recurse.
  if (r->refused == std::vector<bb_status>(3, BB_E_STATE)) {
    bb_task_callbacks_t cbs;
    bb_task_callbacks_init(&cbs);
    cbs.user = user;
    cbs.step = reenter;
    r->refused.push_back(bb_task_detach(r->task));
    r->refused.push_back(bb_task_run(r->task, &cbs));
  }
  return BB_STEP_DONE;
}

}  // namespace

TEST_CASE("a_runs_callbacks_cannot_wait_ack_run_or_detach_their_own_task") {
  // Each would pull the run's state (its wait, its acks, the handle itself) from under it: they
  // are refused with BB_E_STATE and a sentence, and the run goes on to its end.
  RuntimeDir dir;
  Trainer t("reenter");
  Reentry r;
  REQUIRE(bb_task_attach("reenter", 0, "reenters", nullptr, &r.task) == BB_OK);
  bb_task_callbacks_t cbs;
  bb_task_callbacks_init(&cbs);
  cbs.user = &r;
  cbs.step = reenter;
  bb_status run = BB_E_SYSTEM;
  std::thread runner([&] { run = bb_task_run(r.task, &cbs); });
  t.bubbles_until([&] { return t.stats().steps > 0; });
  runner.join();
  CHECK(run == BB_OK);  // ended by BB_STEP_DONE
  CHECK(r.refused == std::vector<bb_status>(5, BB_E_STATE));
  CHECK(r.said.find("bb_task_wait_start was called from inside bb_task_run") == 0);
  // Outside the run the same calls work again.
  CHECK(bb_task_ack_pause(r.task) == BB_OK);
  CHECK(bb_task_detach(r.task) == BB_OK);
}

TEST_CASE("start_pause_stop_cycle") {
  RuntimeDir dir;
  const auto shm_before = bbtest::dev_shm();
  {
    Trainer t("cycle");
    Child task(task_args("cycle", "worker", "iterative", {"--step-us", "200"}));
    REQUIRE(task.wait_line("ATTACHED") != "");
    REQUIRE(eventually([&] { return t.stats().tasks_attached == 1; }));
    // Started and paused many times, and its steps land inside bubbles.
    REQUIRE(t.bubbles_until([&] {
      auto s = t.stats();
      return s.starts >= 20 && s.steps >= 20;
    }));
    // Steps of 0.2 ms in 2 ms bubbles: the runtime stops starting steps that would not fit and
    // yields, so nearly all of its time is inside bubbles. A task preempted in a step that
    // straddles a bubble's end counts the preemption outside; on a starved machine that can
    // outweigh the first bubbles, so the sums get more bubbles to even out (time-bounded).
    CHECK(t.bubbles_until([&] {
      auto s = t.stats();
      return s.task_ns_in_bubbles > 0 && s.task_ns_outside < s.task_ns_in_bubbles;
    }));
    auto tasks = t.tasks();
    REQUIRE(tasks.size() == 1);
    CHECK(std::string(tasks[0].name) == "worker");
    // The task's own share of the hub's figures: with one task, all of them.
    CHECK(tasks[0].ns_in_bubbles > 0);
    CHECK(tasks[0].pid == task.pid());
    // Stop: the task finishes, reports BB_E_STOPPED and detaches; its slot is freed.
    REQUIRE(bb_trainer_stop_task(t.h, tasks[0].id) == BB_OK);
    const uint64_t starts_at_stop = t.stats().starts;
    CHECK(task.wait_line("RESULT").find("BB_E_STOPPED") != std::string::npos);
    CHECK(task.wait_exit() == 0);
    REQUIRE(t.bubbles_until([&] { return t.stats().tasks_reclaimed == 1; }, 200));
    CHECK(t.stats().starts == starts_at_stop);  // no bubble begun after the stop started it
    CHECK(t.stats().tasks_attached == 0);
    CHECK(t.tasks().empty());
  }
  CHECK(dir.files().empty());
  CHECK(bbtest::dev_shm() == shm_before);
}

// bb_task_callbacks_t.idle: called while the task waits for a bubble, never inside one, and
// able to end the run as finished or failed.
TEST_CASE("the_idle_callback_runs_between_bubbles_and_can_end_the_run") {
  RuntimeDir dir;
  Trainer t("idle");
  {
    // Ten calls in a row (the task counts from its last bubble): about a second without
    // bubbles, far more than the gaps between the bubbles below, so the run cannot end before
    // the task stepped.
    Child task(task_args("idle", "done", "iterative", {"--step-us", "100", "--idle", "10"}));
    REQUIRE(task.wait_line("ATTACHED") != "");
    REQUIRE(eventually([&] { return t.stats().tasks_attached == 1; }));
    REQUIRE(t.bubbles_until([&] { return t.stats().steps >= 3; }));
    // No more bubbles: the task waits, its idle callback runs, and the tenth call ends the run.
    const std::string result = task.wait_line("RESULT", 30000);
    CHECK(result.find("RESULT BB_OK") == 0);
    CHECK(task.wait_exit() == 0);
    std::string last_idle;
    for (const std::string& line : task.lines()) {
      if (line.rfind("IDLE", 0) != 0) continue;
      last_idle = line;
      CHECK_MESSAGE(line.find("in-bubble") == std::string::npos, line);
    }
    CHECK(last_idle == "IDLE 10");
    CHECK(t.bubbles_until([&] { return t.stats().tasks_reclaimed == 1; }, 200));
  }
  {
    Child task(task_args("idle", "fails", "iterative", {"--idle", "2", "--idle-fail"}));
    REQUIRE(task.wait_line("ATTACHED") != "");
    CHECK(task.wait_line("RESULT", 30000).find("RESULT BB_E_CALLBACK") == 0);
    CHECK(task.wait_exit() == 0);
  }
}

// A task waiting for its trainer to come back (BB_ON_TRAINER_EXIT_WAIT) still gets its idle
// calls, so it can end the run meanwhile.
TEST_CASE("the_idle_callback_runs_while_the_task_waits_for_its_trainer_to_come_back") {
  RuntimeDir dir;
  auto t = std::make_unique<Trainer>("idlegone");
  Child task(task_args("idlegone", "w", "iterative", {"--wait", "--idle", "5"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t->stats().tasks_attached == 1; }));
  t.reset();  // the trainer leaves; the task waits up to its reattach timeout (60 s) for another
  CHECK(task.wait_line("RESULT", 30000).find("RESULT BB_OK") == 0);
  CHECK(task.wait_exit() == 0);
}

// A binary built before bb_task_callbacks_t grew idle passes the shorter size: it runs, and
// whatever lies past its struct is never read (here an address that would crash if called).
TEST_CASE("a_callbacks_struct_from_before_idle_still_runs") {
  RuntimeDir dir;
  Trainer t("oldcb");
  Child task(task_args("oldcb", "old", "iterative", {"--step-us", "100", "--old-callbacks"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 1; }));
  REQUIRE(t.bubbles_until([&] { return t.stats().steps >= 3; }));
  // Waiting three idle intervals with no bubble: a library that read idle would call it, and
  // crash, in this time. (What is shown is that nothing happens, so only time can show it.)
  std::this_thread::sleep_for(std::chrono::nanoseconds(3 * BB_TASK_IDLE_NS));
  REQUIRE(bb_trainer_stop_task(t.h, t.task_id("old")) == BB_OK);
  CHECK(task.wait_line("RESULT", 30000).find("RESULT BB_E_STOPPED") == 0);
  CHECK(task.wait_exit() == 0);
}

TEST_CASE("imperative_task_sees_each_start_once") {
  RuntimeDir dir;
  Trainer t("imper");
  Child task(task_args("imper", "loop", "imperative", {"--step-us", "100"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 1; }));
  for (int i = 0; i < 4000 && t.stats().starts < 12; ++i) t.bubble(2000, 500, 777);
  REQUIRE(t.stats().starts >= 12);
  // Every STARTED line names a distinct, increasing bubble, and carries what its begin said.
  std::string line;
  uint64_t last = 0;
  int started = 0;
  t.bubble(2000, 500, 777);
  while (!(line = task.wait_line("STARTED", 50)).empty()) {
    unsigned long long seq = 0, len = 0, free_mem = 0;
    unsigned kind = 99;
    REQUIRE(std::sscanf(line.c_str(), "STARTED %llu kind=%u len=%llu free=%llu", &seq, &kind, &len,
                        &free_mem) == 4);
    CHECK(seq > last);
    CHECK(kind == unsigned(BB_BUBBLE_STEADY));
    CHECK(len == 2'000'000);
    CHECK(free_mem == 777);
    last = seq;
    ++started;
  }
  CHECK(started >= 1);
  CHECK(uint64_t(started) <= t.stats().starts);
  // An imperative task runs until told to pause: every bubble end signals it, and it acks.
  const auto s = t.stats();
  CHECK(s.pauses >= 10);
  CHECK(eventually([&] { return t.stats().pause_latency_p50_ns > 0; }));
}

TEST_CASE("many_tasks_share_bubbles_round_robin") {
  RuntimeDir dir;
  Trainer t("many", 0, 64, 2);
  std::vector<std::unique_ptr<Child>> kids;
  for (int i = 0; i < 6; ++i)
    kids.push_back(std::make_unique<Child>(
        task_args("many", "t" + std::to_string(i), "iterative", {"--step-us", "100"})));
  for (auto& k : kids) REQUIRE(k->wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 6; }));
  // Equal priorities: every task gets bubbles.
  REQUIRE(t.bubbles_until([&] {
    for (auto& ti : t.tasks())
      if (ti.steps == 0) return false;
    return true;
  }));
  CHECK(t.tasks().size() == 6);
}

TEST_CASE("task_killed_mid_step_is_reclaimed_and_trainer_goes_on") {
  RuntimeDir dir;
  const auto shm_before = bbtest::dev_shm();
  Trainer t("kill");
  // Long steps, so the kill lands inside one.
  Child task(task_args("kill", "victim", "iterative", {"--step-us", "20000"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 1; }));
  REQUIRE(bb_bubble_begin(t.h, 100'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
  REQUIRE(eventually([&] { return t.stats().steps >= 1; }));
  task.signal(SIGKILL);
  CHECK(task.wait_exit() != -1);
  CHECK(bb_bubble_end(t.h) == BB_OK);
  REQUIRE(t.bubbles_until([&] { return t.stats().tasks_reclaimed == 1; }, 500));
  CHECK(t.stats().tasks_attached == 0);
  // The freed slot takes a new task.
  Child again(task_args("kill", "next", "iterative", {"--step-us", "100"}));
  REQUIRE(again.wait_line("ATTACHED") != "");
  const uint64_t steps = t.stats().steps;
  REQUIRE(t.bubbles_until([&] { return t.stats().steps > steps + 5; }));
  CHECK(bbtest::dev_shm() == shm_before);
}

namespace {

// A forked child of a task helper (fork-stale modes), killed when the test ends.
struct ForkedTask {
  pid_t pid = -1;
  explicit ForkedTask(Child& task) {
    const std::string forked = task.wait_line("FORKED");
    REQUIRE(forked != "");
    pid = pid_t(std::stol(forked.substr(7)));
  }
  ~ForkedTask() {
    if (pid > 0) kill(pid, SIGKILL);
  }
};

// Once the helper that attached is gone: its slot reclaimed, then given to a task of this
// process, which is started in an open bubble. Returns that task.
bb_task_h reuse_the_slot(Trainer& t, const char* job) {
  REQUIRE(t.bubbles_until([&] { return t.stats().tasks_reclaimed == 1; }, 500));
  bb_task_options_t o;
  bb_task_options_init(&o);
  bb_task_h next = nullptr;
  REQUIRE(bb_task_attach(job, 0, "next", &o, &next) == BB_OK);
  REQUIRE(bb_bubble_begin(t.h, 100'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
  bb_start_info_t info{sizeof info};
  REQUIRE(bb_task_wait_start(next, 5'000'000'000, &info) == BB_OK);
  const auto tasks = t.tasks();
  REQUIRE(tasks.size() == 1);
  CHECK(tasks[0].slot == 0);  // the slot the forked task had (the first)
  return next;
}

void end_the_reuse(Trainer& t, bb_task_h next) {
  CHECK(bb_bubble_end(t.h) == BB_OK);
  bb_task_ack_pause(next);
  bb_task_detach(next);
}

}  // namespace

TEST_CASE("a_task_its_trainer_dropped_takes_no_start_of_the_slots_next_task") {
  // The process that attached exits and leaves the task to a fork: the trainer reclaims the
  // slot and gives it to the next task. The fork, still mapping the hub, must not take the next
  // task's starts for its own: it is told it was dropped.
  RuntimeDir dir;
  Trainer t("stale");
  Child task(task_args("stale", "forked", "fork-stale", {"--wake", "spin"}), true);
  REQUIRE(task.wait_line("ATTACHED") != "");
  ForkedTask forked(task);
  CHECK(task.wait_exit() == 0);
  bb_task_h next = reuse_the_slot(t, "stale");
  REQUIRE(task.write_stdin("go\n"));
  CHECK(task.wait_line("RESULT").rfind("RESULT BB_E_TRAINER_GONE ", 0) == 0);
  end_the_reuse(t, next);
}

TEST_CASE("a_task_its_trainer_dropped_while_it_waited_takes_no_start_of_the_slots_next_task") {
  // The same, with the fork already waiting for a start when its slot is reclaimed and given to
  // the next task: it wakes (at its next liveness look: it sleeps on its old page's wake word,
  // which nothing rings any more) to a doorbell that moved for the next task's start, and must
  // see that the start is not its own. It is stopped meanwhile, so that it is inside its wait
  // when the slot changes hands. It waits asleep, so the test sees it inside its wait (its only
  // sleep after WAITING is the futex).
  RuntimeDir dir;
  Trainer t("stalew");
  Child task(task_args("stalew", "forked", "fork-stale-waiting", {"--wake", "sleep"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  ForkedTask forked(task);
  REQUIRE(task.wait_line("WAITING") != "");
  REQUIRE(eventually([&] { return bbtest::proc_state(forked.pid) == 'S'; }));
  REQUIRE(kill(forked.pid, SIGSTOP) == 0);
  task.signal(SIGKILL);  // the process that attached
  task.wait_exit();
  bb_task_h next = reuse_the_slot(t, "stalew");
  REQUIRE(kill(forked.pid, SIGCONT) == 0);
  CHECK(task.wait_line("RESULT").rfind("RESULT BB_E_TRAINER_GONE ", 0) == 0);
  end_the_reuse(t, next);
}

TEST_CASE("a_dead_tasks_slot_is_freed_while_no_bubble_comes_but_never_under_an_open_one") {
  // A trainer between bubbles for long (an evaluation, a checkpoint) must not hold a dead task's
  // slot until its next bubble: with a table of one slot, the next task could not attach until
  // then. While a bubble is open the slot waits for its end instead: the bubble thread may still
  // pause the task it started there.
  const long mb = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  if (mb < 0 || !(mb & MEMBARRIER_CMD_PRIVATE_EXPEDITED)) {
    MESSAGE("skipped: this kernel (or sandbox) has no private expedited membarrier, and the "
            "trainer leaves dead slots to its next bubble call");
    return;
  }
  RuntimeDir dir;
  Trainer t("idle", 0, /*max_slots=*/1);
  {
    Child a(task_args("idle", "a", "attach-only"));
    REQUIRE(a.wait_line("ATTACHED") != "");
    t.bubble();  // the bubble thread has looked at it
    a.signal(SIGKILL);
    a.wait_exit();
  }
  // No bubble from here on: the slot is freed all the same, and the next task takes it.
  bb_task_h b = nullptr;
  CHECK(eventually([&] { return bb_task_attach("idle", 0, "b", nullptr, &b) == BB_OK; }));
  REQUIRE(b != nullptr);
  CHECK(t.stats().tasks_reclaimed == 1);
  bb_task_detach(b);  // a task that leaves is freed the same way
  REQUIRE(eventually([&] { return t.stats().tasks_reclaimed == 2; }));

  // Started in a bubble and dead while it is open: freed only once the bubble ended.
  Child c(task_args("idle", "c", "imperative"));
  REQUIRE(c.wait_line("ATTACHED") != "");
  REQUIRE(bb_bubble_begin(t.h, 1'000'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
  REQUIRE(c.wait_line("STARTED") != "");
  c.signal(SIGKILL);
  c.wait_exit();
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 0; }));  // it died, seen
  // Three times as long as a dead slot waits for a bubble call when none comes.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(t.stats().tasks_reclaimed == 2);
  REQUIRE(bb_bubble_end(t.h) == BB_OK);
  CHECK(eventually([&] { return t.stats().tasks_reclaimed == 3; }));
}

TEST_CASE("a_task_whose_sleeps_a_signal_keeps_ending_still_notices_its_trainer_died") {
  // A SIGALRM every 20 ms ends each of the task's sleeps (100 ms slices) early. The look at the
  // trainer came only when a slice ran out, so a task with such a timer never noticed.
  RuntimeDir dir;
  Child trainer({trainer_bin(), "sigwait", "0", "--await-tasks", "2"});  // no bubble ever
  REQUIRE(trainer.wait_line("OPEN") != "");
  Child task(task_args("sigwait", "w", "imperative", {"--wake", "sleep", "--itimer-us", "20000"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  trainer.signal(SIGKILL);
  CHECK(trainer.wait_exit() != -1);
  CHECK(task.wait_line("RESULT", 5000).find("BB_E_TRAINER_GONE") != std::string::npos);
  CHECK(task.wait_exit(5000) == 0);
}

TEST_CASE("a_task_at_its_descriptor_limit_is_told_so_when_it_attaches") {
  // The hub and the task's page come as descriptors; the kernel drops the ones a process has no
  // room for. That used to read as "the trainer closed the connection during attach".
  RuntimeDir dir;
  Trainer t("fdroom");
  Child task(task_args("fdroom", "w", "imperative", {"--fd-room", "1"}));  // room for the socket
  const std::string result = task.wait_line("RESULT");
  CAPTURE(result);
  CHECK(result.rfind("RESULT BB_E_SYSTEM ", 0) == 0);
  CHECK(result.find("limit of open descriptors (RLIMIT_NOFILE") != std::string::npos);
  CHECK(task.wait_exit() != -1);
  // The trainer takes its slot back.
  CHECK(eventually([&] { return t.stats().tasks_attached == 0; }));
}

TEST_CASE("a_trainer_at_its_descriptor_limit_refuses_a_connection_with_the_reason") {
  // With no descriptor left, the connection stayed in the backlog, the socket readable, and the
  // hub's thread polling it in a loop; the task heard nothing for 5 s (BB_E_TIMEOUT). With one
  // left, the attach failed as if the task had exited (BB_E_PERMISSION).
  RuntimeDir dir;
  for (const char* room : {"0", "1"}) {
    CAPTURE(room);
    const std::string job = std::string("fdlimit") + room;
    Child trainer({trainer_bin(), job, "0", "--fd-room", room});
    REQUIRE(trainer.wait_line("LIMITED") != "");
    for (int k = 0; k < 2; ++k) {  // and again: nothing of the first is left in the way
      Child task(task_args(job, "w", "imperative"));
      const std::string result = task.wait_line("RESULT", 4000);
      CAPTURE(result);
      CHECK(result.rfind("RESULT BB_E_SYSTEM ", 0) == 0);
      CHECK(result.find("RLIMIT_NOFILE") != std::string::npos);
      CHECK(result.find("exited") == std::string::npos);
      CHECK(task.wait_exit() != -1);
    }
    trainer.signal(SIGTERM);
    CHECK(trainer.wait_line("CLOSED") == "CLOSED BB_OK");
    CHECK(trainer.wait_exit() == 0);
  }
}

TEST_CASE("trainer_killed_task_exits_by_default") {
  RuntimeDir dir;
  Child trainer({trainer_bin(), "tk", "0"});
  REQUIRE(trainer.wait_line("OPEN") != "");
  Child task(task_args("tk", "w", "iterative", {"--step-us", "100"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  trainer.signal(SIGKILL);
  CHECK(trainer.wait_exit() != -1);
  CHECK(task.wait_line("RESULT").find("BB_E_TRAINER_GONE") != std::string::npos);
  CHECK(task.wait_exit() == 0);
}

TEST_CASE("a_waiting_task_whose_new_trainer_never_answers_gives_up_at_its_reattach_timeout") {
  // The trainer dies; what listens on the hub's socket next never takes a connection (a trainer
  // stopped at a breakpoint as it opened the hub). The task waits for its trainer 1 s, as told:
  // the attach attempts that get no answer are tried again within that second, and then the
  // wait ends with BB_E_TRAINER_GONE, not with the first attempt's BB_E_TIMEOUT after 5 s.
  RuntimeDir dir;
  Child trainer({trainer_bin(), "mute", "0", "--await-tasks", "2"});
  REQUIRE(trainer.wait_line("OPEN") != "");
  Child task(task_args("mute", "patient", "imperative", {"--wait", "--reattach-ms", "1000"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  const std::string path = dir.path() + "/mute.0.sock";
  // Listening before the trainer dies, under the same name: the task finds it at once.
  const std::string side = path + ".next";
  bb::shm::Fd mute(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  REQUIRE(mute);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", side.c_str());
  REQUIRE(bind(mute.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(listen(mute.get(), 64) == 0);
  trainer.signal(SIGKILL);
  CHECK(trainer.wait_exit() != -1);
  REQUIRE(rename(side.c_str(), path.c_str()) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string result = task.wait_line("RESULT", 4000);
  const auto took = std::chrono::steady_clock::now() - t0;
  CAPTURE(result);
  CAPTURE(std::chrono::duration_cast<std::chrono::milliseconds>(took).count());
  CHECK(result.rfind("RESULT BB_E_TRAINER_GONE ", 0) == 0);
  CHECK(task.wait_exit(5000) == 0);
}

TEST_CASE("trainer_killed_task_waits_reattaches_to_a_new_trainer_and_gives_up_when_none_comes") {
  RuntimeDir dir;
  auto first = std::make_unique<Child>(std::vector<std::string>{trainer_bin(), "tw", "0"});
  REQUIRE(first->wait_line("OPEN") != "");
  // Waits up to 5 s for a trainer to come back (the second one comes in well under that).
  Child task(task_args("tw", "patient", "iterative",
                       {"--step-us", "100", "--wait", "--reattach-ms", "5000"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  first->signal(SIGKILL);
  CHECK(first->wait_exit() != -1);
  first.reset();
  // The dead trainer left its socket and lock file: the next trainer replaces them.
  CHECK(!dir.files().empty());
  Child second({trainer_bin(), "tw", "0"});
  REQUIRE(second.wait_line("OPEN") != "");
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  REQUIRE(eventually([&] {
    if (!obs && bb::core::HubObserver::open("", "tw", 0, &obs, &err) != BB_OK) return false;
    auto snap = obs->snapshot();
    return snap.tasks.size() == 1 && snap.tasks[0].name == "patient" && snap.tasks[0].steps > 0;
  }));
  obs.reset();
  second.signal(SIGTERM);
  const std::string closed = second.wait_line("CLOSED");
  if (closed.empty()) MESSAGE("no CLOSED after SIGTERM; lines " << second.lines().size() << ", "
                              << second.describe());
  CHECK(closed != "");
  CHECK(second.wait_exit() == 0);
  // No trainer comes back this time: the task gives up at its re-attach timeout, and says so.
  CHECK(task.wait_line("RESULT", 30000).find("RESULT BB_E_TRAINER_GONE") == 0);
  CHECK(task.wait_exit() == 0);
  CHECK(bbtest::eventually([&] { return dir.files().empty(); }));
}

// A task waiting for its trainer to come back finds the new one full (its one slot taken): it
// keeps trying until its timeout rather than giving up at the first refusal, and attaches once
// the slot is free.
TEST_CASE("a_waiting_task_that_finds_the_new_trainer_full_tries_again") {
  RuntimeDir dir;
  bb_trainer_options_t o;
  bb_trainer_options_init(&o);
  o.max_slots = 1;
  bb_trainer_h first = nullptr;
  REQUIRE(bb_trainer_open("full", 0, &o, &first) == BB_OK);
  Child task(task_args("full", "patient", "iterative",
                       {"--step-us", "100", "--wait", "--reattach-ms", "30000"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] {
    bb_trainer_stats_t s{sizeof s};
    bb_trainer_stats(first, &s);
    return s.tasks_attached == 1;
  }));
  REQUIRE(bb_trainer_close(first) == BB_OK);
  // The next trainer, with this process attached in its one slot at once. The waiting task
  // tries every 50 ms: should it take the slot first, the trainer is opened again.
  bb_trainer_h second = nullptr;
  bb_task_h occupant = nullptr;
  for (int attempt = 0; attempt < 5 && !occupant; ++attempt) {
    REQUIRE(bb_trainer_open("full", 0, &o, &second) == BB_OK);
    if (bb_task_attach("full", 0, "occupant", nullptr, &occupant) == BB_OK) break;
    occupant = nullptr;
    bb_trainer_close(second);
    second = nullptr;
  }
  REQUIRE(occupant != nullptr);
  auto attached = [&] {
    bb_trainer_stats_t s{sizeof s};
    bb_trainer_stats(second, &s);
    return s.tasks_attached;
  };
  // Refused for as long as the slot is taken (a second: twenty tries), and still waiting: a
  // task that gave up would have printed its RESULT at once.
  CHECK(task.wait_line("RESULT", 1000) == "");
  CHECK(attached() == 1);
  REQUIRE(bb_task_detach(occupant) == BB_OK);
  int failed = 0;
  CHECK(eventually([&] {
    for (int i = 0; i < 20; ++i) {
      failed += bb_bubble_begin(second, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) != BB_OK;
      failed += bb_bubble_end(second) != BB_OK;
    }
    bb_trainer_stats_t s{sizeof s};
    bb_trainer_stats(second, &s);
    return s.tasks_attached == 1 && s.steps > 0;
  }, 20000));
  CHECK(failed == 0);
  task.signal(SIGKILL);  // it would wait for yet another trainer
  CHECK(task.wait_exit() != -1);
  CHECK(bb_trainer_close(second) == BB_OK);
}

TEST_CASE("second_trainer_for_the_same_hub_is_refused") {
  RuntimeDir dir;
  Trainer t("dup", 3);
  bb_trainer_h other = nullptr;
  CHECK(bb_trainer_open("dup", 3, nullptr, &other) == BB_E_BUSY);
  CHECK(other == nullptr);
  const std::string msg = bb_last_error();
  CHECK(msg.find("already open by trainer pid " + std::to_string(getpid())) != std::string::npos);
  // From another process too.
  Child child({trainer_bin(), "dup", "3"});
  CHECK(child.wait_line("FAILED").find("BB_E_BUSY") != std::string::npos);
  CHECK(child.wait_exit() != -1);
  // A different rank of the same job is a different hub.
  bb_trainer_h rank4 = nullptr;
  CHECK(bb_trainer_open("dup", 4, nullptr, &rank4) == BB_OK);
  bb_trainer_close(rank4);
}

TEST_CASE("invalid_hub_names_are_refused_and_create_nothing") {
  RuntimeDir dir;
  const char* bad[] = {"", "../etc", "a/b", ".hidden", "space name", "x\n",
                       "0123456789012345678901234567890123456789012345678"};
  for (const char* job : bad) {
    bb_trainer_h h = nullptr;
    CHECK_MESSAGE(bb_trainer_open(job, 0, nullptr, &h) == BB_E_INVALID, job);
    CHECK(std::string(bb_last_error()).find("job id") != std::string::npos);
    bb_task_h task = nullptr;
    CHECK(bb_task_attach(job, 0, "t", nullptr, &task) == BB_E_INVALID);
  }
  bb_trainer_h h = nullptr;
  CHECK(bb_trainer_open("ok", 70000, nullptr, &h) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("rank 70000") != std::string::npos);
  CHECK(bb_trainer_open(nullptr, 0, nullptr, &h) == BB_E_INVALID);
  bb_task_h task = nullptr;
  CHECK(bb_task_attach("ok", 0, "bad\x01name", nullptr, &task) == BB_E_INVALID);
  CHECK(dir.files().empty());
}

TEST_CASE("wait_options_over_a_second_are_refused_with_the_option_named") {
  RuntimeDir dir;
  Trainer t("spins", 0, 2);  // a trainer is there: the options are what is refused
  bb_task_options_t o;
  bb_task_options_init(&o);
  o.wake_lead_ns = UINT64_MAX / 2;
  bb_task_h task = nullptr;
  CHECK(bb_task_attach("spins", 0, "t", &o, &task) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("wake_lead_ns") != std::string::npos);
  CHECK(task == nullptr);
  bb_task_options_init(&o);
  o.spin_ns = 2'000'000'000;
  CHECK(bb_task_attach("spins", 0, "t", &o, &task) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("spin_ns") != std::string::npos);
  bb_task_options_init(&o);
  o.wake_lead_ns = 1'000'000'000;  // a second is still allowed
  REQUIRE(bb_task_attach("spins", 0, "t", &o, &task) == BB_OK);
  bb_task_detach(task);
  // A caller built before wake_lead_ns existed passes the shorter struct: what lies past its
  // size is not read (here it would be refused), and the field takes its default.
  bb_task_options_init(&o);
  o.size = offsetof(bb_task_options_t, wake_lead_ns);
  o.wake_lead_ns = UINT64_MAX / 2;
  REQUIRE(bb_task_attach("spins", 0, "t", &o, &task) == BB_OK);
  bb_task_detach(task);
  o.size = 4;
  CHECK(bb_task_attach("spins", 0, "t", &o, &task) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("size is 4") != std::string::npos);
}

namespace {

// Checks one *_init_sized function against its _INIT defaults at a caller size smaller than
// the library's struct (an older header), equal to it, and larger (a newer header).
template <typename T>
void check_init_sized(void (*init_sized)(T*, size_t), const T& defaults) {
  static_assert(std::has_unique_object_representations_v<T>, "compared byte by byte");
  constexpr size_t kGuard = 64;
  alignas(T) unsigned char buf[sizeof(T) + 2 * kGuard];
  auto fresh = [&] { std::memset(buf, 0xab, sizeof buf); };
  auto untouched_from = [&](size_t from) {
    for (size_t k = from; k < sizeof buf; ++k)
      if (buf[k] != 0xab) return false;
    return true;
  };
  T* p = reinterpret_cast<T*>(buf);
  // An older caller's struct: nothing past its size is written, and its size says so.
  fresh();
  init_sized(p, 8);
  CHECK(p->size == 8);
  CHECK(std::memcmp(buf + 4, reinterpret_cast<const unsigned char*>(&defaults) + 4, 4) == 0);
  CHECK(untouched_from(8));
  // The library's own size: exactly the defaults.
  fresh();
  init_sized(p, sizeof(T));
  CHECK(std::memcmp(buf, &defaults, sizeof(T)) == 0);
  CHECK(untouched_from(sizeof(T)));
  // A newer caller's larger struct: the defaults, zeros for the fields the library does not
  // know, its size kept, and nothing past it.
  fresh();
  init_sized(p, sizeof(T) + kGuard);
  CHECK(p->size == sizeof(T) + kGuard);
  CHECK(std::memcmp(buf + 4, reinterpret_cast<const unsigned char*>(&defaults) + 4,
                    sizeof(T) - 4) == 0);
  bool zeros = true;
  for (size_t k = sizeof(T); k < sizeof(T) + kGuard; ++k) zeros &= buf[k] == 0;
  CHECK(zeros);
  CHECK(untouched_from(sizeof(T) + kGuard));
  // No room for the size, or no struct: nothing written.
  fresh();
  init_sized(p, 4);
  CHECK(untouched_from(0));
  init_sized(p, 1 << 20);
  CHECK(untouched_from(0));
  init_sized(nullptr, sizeof(T));
}

}  // namespace

// The initialisers programs built against the first headers call, by their exported names
// (the header now makes those names macros).
extern "C" void first_task_options_init(bb_task_options_t*) __asm__("bb_task_options_init");
extern "C" void first_lend_options_init(bb_lend_options_t*) __asm__("bb_lend_options_init");

extern "C" int bb_test_c_inits_through_void_pointers(void);  // c_header_inits.c

TEST_CASE("option_init_macros_in_c_write_the_defaults_through_a_void_pointer") {
  CHECK(bb_test_c_inits_through_void_pointers() == 1);
}

// A program built against another version's header passes its own struct size to the
// library's init (the *_init macros do): the library never writes past it.
TEST_CASE("option_inits_write_exactly_the_callers_size") {
  check_init_sized(bb_trainer_options_init_sized, bb_trainer_options_t BB_TRAINER_OPTIONS_INIT);
  check_init_sized(bb_schedule_init_sized, bb_schedule_t BB_SCHEDULE_INIT);
  check_init_sized(bb_task_options_init_sized, bb_task_options_t BB_TASK_OPTIONS_INIT);
  check_init_sized(bb_task_callbacks_init_sized, bb_task_callbacks_t BB_TASK_CALLBACKS_INIT);
  check_init_sized(bb_lend_options_init_sized, bb_lend_options_t BB_LEND_OPTIONS_INIT);
  check_init_sized(bb_stream_timing_options_init_sized,
                   bb_stream_timing_options_t BB_STREAM_TIMING_OPTIONS_INIT);
  // A program built against the first header calls the old names: they write the first
  // release's struct, which every caller has, and no more.
  {
    alignas(bb_task_options_t) unsigned char buf[sizeof(bb_task_options_t) + 16];
    std::memset(buf, 0xab, sizeof buf);
    auto* first = reinterpret_cast<bb_task_options_t*>(buf);
    first_task_options_init(first);
    const size_t first_size = offsetof(bb_task_options_t, wake_lead_ns);
    CHECK(first->size == first_size);
    CHECK(first->spin_ns == 20000);
    bool untouched = true;
    for (size_t k = first_size; k < sizeof buf; ++k) untouched &= buf[k] == 0xab;
    CHECK(untouched);
  }
  {
    alignas(bb_lend_options_t) unsigned char buf[sizeof(bb_lend_options_t) + 16];
    std::memset(buf, 0xab, sizeof buf);
    auto* first = reinterpret_cast<bb_lend_options_t*>(buf);
    first_lend_options_init(first);
    CHECK(first->size == offsetof(bb_lend_options_t, clear_grants));
    CHECK(first->auto_grant == 1);
    CHECK(buf[offsetof(bb_lend_options_t, clear_grants)] == 0xab);
  }
  // The macro passes the caller's size.
  bb_task_options_t o;
  std::memset(&o, 0, sizeof o);
  bb_task_options_init(&o);
  CHECK(o.size == sizeof o);
  CHECK(o.wake_lead_ns == 50000);
  // A newer caller's larger struct, so initialised, is taken as it is by the calls that read it.
  RuntimeDir dir;
  Trainer t("newer", 0, 2);
  struct {
    bb_task_options_t o;
    uint64_t newer_field;
  } bigger;
  bb_task_options_init_sized(&bigger.o, sizeof bigger);
  CHECK(bigger.newer_field == 0);
  bb_task_h task = nullptr;
  REQUIRE(bb_task_attach("newer", 0, "t", &bigger.o, &task) == BB_OK);
  bb_task_detach(task);
}

TEST_CASE("sizes_no_version_of_a_struct_has_are_refused_never_followed") {
  RuntimeDir dir;
  Trainer t("sizes", 0, 2);
  // An element size is the stride of bb_trainer_tasks' array: a huge one (a buffer from malloc
  // whose size was never set) would send the next element's read far past the array.
  alignas(8) unsigned char buf[2 * sizeof(bb_task_info_t)] = {};
  for (const uint32_t bad : {0x7fff0000u, 65544u, uint32_t(sizeof(bb_task_info_t) + 4)}) {
    std::memcpy(buf, &bad, sizeof bad);
    std::memcpy(buf + sizeof(bb_task_info_t), &bad, sizeof bad);
    size_t n = 99;
    CHECK(bb_trainer_tasks(t.h, reinterpret_cast<bb_task_info_t*>(buf), 2, &n) == BB_E_INVALID);
    CHECK(std::string(bb_last_error()).find("out[0].size is " + std::to_string(bad)) == 0);
    CHECK(n == 0);
  }
  // An option struct whose size ends inside a field would be copied with half of it (half the
  // address of a callback): refused, saying so.
  bb_task_h task = nullptr;
  bb_task_options_t o;
  bb_task_options_init(&o);
  o.size = offsetof(bb_task_options_t, wake_lead_ns) + 4;
  CHECK(bb_task_attach("sizes", 0, "t", &o, &task) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("ends inside a field") != std::string::npos);
  REQUIRE(bb_task_attach("sizes", 0, "t", nullptr, &task) == BB_OK);
  bb_task_callbacks_t cbs;
  bb_task_callbacks_init(&cbs);
  cbs.idle = [](void*) { return int(BB_STEP_DONE); };
  cbs.size = offsetof(bb_task_callbacks_t, idle) + 4;
  CHECK(bb_task_run(task, &cbs) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("ends inside a field") != std::string::npos);
  bb_task_detach(task);
  // An out-parameter is not left as it was when the call fails.
  uint64_t grant_id = 77;
  CHECK(bb_trainer_grant(nullptr, 1, 0, &grant_id) == BB_E_INVALID);
  CHECK(grant_id == 0);
}

TEST_CASE("attach_without_trainer_says_so") {
  RuntimeDir dir;
  bb_task_h task = nullptr;
  CHECK(bb_task_attach("nobody", 0, "t", nullptr, &task) == BB_E_NOT_FOUND);
  CHECK(std::string(bb_last_error()).find("start the trainer first") != std::string::npos);
}

TEST_CASE("trainer_tasks_takes_the_element_size_as_the_stride") {
  RuntimeDir dir;
  Trainer t("stride");
  Child task(task_args("stride", "older", "attach-only"));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 1; }));
  // A caller built against a header whose bb_task_info_t ended before mem_need.
  constexpr uint32_t kOld = offsetof(bb_task_info_t, mem_need);
  alignas(8) unsigned char buf[3 * kOld + 8];
  std::memset(buf, 0xab, sizeof buf);
  for (uint32_t i = 0; i < 3; ++i) std::memcpy(buf + i * kOld, &kOld, sizeof kOld);
  size_t n = 0;
  REQUIRE(bb_trainer_tasks(t.h, reinterpret_cast<bb_task_info_t*>(buf), 3, &n) == BB_OK);
  CHECK(n == 1);
  bb_task_info_t first;
  std::memcpy(&first, buf, kOld);
  CHECK(first.size == kOld);
  CHECK(first.pid == task.pid());
  CHECK(first.id != 0);
  // Nothing past the fields it knows is written: the next element and the bytes after the
  // array are as they were.
  uint32_t second_size;
  std::memcpy(&second_size, buf + kOld, sizeof second_size);
  CHECK(second_size == kOld);
  bool untouched = true;
  for (size_t b = kOld; b < sizeof buf; ++b)
    if (b % kOld >= sizeof(uint32_t) || b >= 3 * kOld) untouched &= buf[b] == 0xab;
  CHECK(untouched);
  // Elements of different sizes are refused, with the reason.
  const uint32_t other = 16;
  std::memcpy(buf + kOld, &other, sizeof other);
  CHECK(bb_trainer_tasks(t.h, reinterpret_cast<bb_task_info_t*>(buf), 3, &n) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("out[1].size is 16 but out[0].size is 24") !=
        std::string::npos);
}

TEST_CASE("a_task_the_agent_launched_takes_its_priority_and_memory_need_from_its_environment") {
  RuntimeDir dir;
  Trainer t("envopts");
  // What bubbled puts in a task's environment for `bubblectl submit --priority -3 --mem 12345`.
  struct Env {
    Env() {
      setenv("BUBBLE_PRIORITY", "-3", 1);
      setenv("BUBBLE_MEM_NEED", "12345", 1);
    }
    ~Env() {
      unsetenv("BUBBLE_PRIORITY");
      unsetenv("BUBBLE_MEM_NEED");
    }
  } env;
  bb_task_h plain = nullptr, explicit_prio = nullptr;
  REQUIRE(bb_task_attach("envopts", 0, "plain", nullptr, &plain) == BB_OK);
  bb_task_options_t o;
  bb_task_options_init(&o);
  o.priority = 9;  // what the program states itself wins
  REQUIRE(bb_task_attach("envopts", 0, "explicit", &o, &explicit_prio) == BB_OK);
  REQUIRE(eventually([&] { return t.tasks().size() == 2; }));
  for (const auto& info : t.tasks()) {
    CAPTURE(info.name);
    const bool is_plain = std::string(info.name) == "plain";
    CHECK(info.priority == (is_plain ? -3 : 9));
    CHECK(info.mem_need == 12345);
  }
  CHECK(bb_task_detach(plain) == BB_OK);
  CHECK(bb_task_detach(explicit_prio) == BB_OK);
  // Anything but a whole number in range is refused, naming the variable.
  setenv("BUBBLE_MEM_NEED", "2G", 1);
  bb_task_h bad = nullptr;
  CHECK(bb_task_attach("envopts", 0, "bad", nullptr, &bad) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("BUBBLE_MEM_NEED is '2G'") != std::string::npos);
  setenv("BUBBLE_MEM_NEED", "1", 1);
  setenv("BUBBLE_PRIORITY", "3000000000", 1);
  CHECK(bb_task_attach("envopts", 0, "bad", nullptr, &bad) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("BUBBLE_PRIORITY") != std::string::npos);
}

TEST_CASE("full_slot_table_refuses_with_a_clear_error") {
  RuntimeDir dir;
  const auto shm_before = bbtest::dev_shm();
  Trainer t("full", 0, 2);
  Child a(task_args("full", "a", "attach-only"));
  Child b(task_args("full", "b", "attach-only"));
  REQUIRE(a.wait_line("ATTACHED") != "");
  REQUIRE(b.wait_line("ATTACHED") != "");
  Child c(task_args("full", "c", "attach-only"));
  CHECK(c.wait_line("RESULT").find("BB_E_FULL") != std::string::npos);
  CHECK(c.wait_exit() != -1);
  bb_task_h task = nullptr;
  CHECK(bb_task_attach("full", 0, "d", nullptr, &task) == BB_E_FULL);
  CHECK(std::string(bb_last_error()).find("all 2 task slots in use") != std::string::npos);
  CHECK(t.stats().tasks_attached == 2);
  CHECK(bbtest::dev_shm() == shm_before);
}

// One slow step (preempted, say) inflates the task's step estimate past every bubble. The
// runtime then lowers it, bubble by bubble, until a step is tried again, also for a task that
// gets to its bubbles late (here 1 ms into 2 ms bubbles): the estimate must come under the room
// the task is left, not only under the bubbles' length.
TEST_CASE("one_slow_step_does_not_lock_a_late_starting_task_out") {
  RuntimeDir dir;
  Trainer t("slow");
  Child task(task_args("slow", "w", "iterative",
                       {"--step-us", "100", "--resume-us", "1000", "--slow-step", "3:30000"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 1; }));
  const auto steps = [&] { return t.tasks().empty() ? 0 : t.tasks()[0].steps; };
  CHECK(t.bubbles_until([&] { return steps() >= 100; }));
}

// A task whose steps never fit the room it gets (1.5 ms steps, 1 ms into 2 ms bubbles) still
// tries one now and then, as above, but each try that spills doubles the bubbles before the next:
// over 400 bubbles it tries a handful of times, not every few bubbles.
TEST_CASE("a_task_whose_steps_never_fit_its_room_tries_ever_more_rarely") {
  RuntimeDir dir;
  Trainer t("rare");
  Child task(task_args("rare", "w", "iterative", {"--step-us", "1500", "--resume-us", "1000"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 1; }));
  const auto steps = [&] { return t.tasks().empty() ? 0 : t.tasks()[0].steps; };
  REQUIRE(t.bubbles_until([&] { return steps() >= 2; }));  // it does try again
  const uint64_t before = steps();
  t.bubbles_until([] { return false; }, 400);
  const uint64_t tries = steps() - before;
  INFO("steps tried in 400 bubbles: " << tries);
  CHECK(tries <= 8);
}

TEST_CASE("hung_task_never_stalls_the_trainer") {
  RuntimeDir dir;
  Trainer t("hung", 0, 8, 1);
  Child hung(task_args("hung", "hung", "ignore"));
  Child good(task_args("hung", "good", "iterative", {"--step-us", "100"}));
  REQUIRE(hung.wait_line("ATTACHED") != "");
  REQUIRE(good.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 2; }));
  // The hung task is started once, never acks, and is then skipped: the good task keeps
  // getting every bubble, and every begin/end returns at once.
  const bool good_ran = t.bubbles_until([&] {
    for (auto& ti : t.tasks())
      if (std::string(ti.name) == "good" && ti.steps >= 300) return true;
    return false;
  });
  if (!good_ran) {
    std::string seen;
    for (auto& ti : t.tasks())
      seen += std::string(ti.name) + ": steps " + std::to_string(ti.steps) + " running " +
              std::to_string(ti.running) + " bad " + std::to_string(ti.bad) + "; ";
    good.wait_line("\x01", 200);  // collect what it printed so far
    std::string said;
    for (auto& l : good.lines()) said += l + " | ";
    MESSAGE("tasks: " << seen << "starts " << t.stats().starts << ", pauses "
                      << t.stats().pauses << "; the good task said: " << said << "\n"
                      << good.describe());
  }
  REQUIRE(good_ran);
  const auto s = t.stats();
  CHECK(s.starts >= 10);
  // The hung task is still attached, was started, and never acked the pause.
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  REQUIRE(bb::core::HubObserver::open("", "hung", 0, &obs, &err) == BB_OK);
  int seen = 0;
  for (auto& ti : obs->snapshot().tasks) {
    if (ti.name != "hung") continue;
    ++seen;
    CHECK(ti.started);
    CHECK(ti.steps == 0);
    CHECK(ti.pause_requested_ns != 0);
    CHECK(ti.pause_acked_ns == 0);
  }
  CHECK(seen == 1);
}

namespace {

// One long bubble: a task of `task_opts` is running inside it when the trainer is killed. The
// task must end the bubble, see BB_E_TRAINER_GONE at its next wait, and exit 0.
void kill_trainer_mid_bubble(const char* job, std::vector<std::string> task_opts,
                             std::vector<std::string> trainer_opts = {}) {
  RuntimeDir dir;
  std::vector<std::string> targs{trainer_bin(), job, "0", "--bubble-us", "30000000",
                                 "--gap-us", "1000", "--await-tasks", "1"};
  targs.insert(targs.end(), trainer_opts.begin(), trainer_opts.end());
  Child trainer(targs);
  REQUIRE(trainer.wait_line("OPEN") != "");
  Child task(task_args(job, "busy", "imperative", std::move(task_opts)));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(task.wait_line("STARTED", 10000) != "");
  trainer.signal(SIGKILL);
  CHECK(trainer.wait_exit() != -1);
  CHECK(task.wait_line("RESULT", 5000).find("BB_E_TRAINER_GONE") != std::string::npos);
  CHECK(task.wait_exit(5000) == 0);
}

}  // namespace

TEST_CASE("trainer_killed_mid_bubble_running_task_pauses_and_is_told") {
  // Nobody will ever clear the run word: should_pause turns true (the kernel marks the trainer's
  // liveness word; the runtime also notices the dead connection while the task reports its
  // steps), and the next wait says the trainer is gone.
  kill_trainer_mid_bubble("midbubble", {"--step-us", "1000"});
}

TEST_CASE("trainer_killed_mid_bubble_a_task_that_only_polls_should_pause_is_told") {
  // The task calls nothing but should_pause while it runs: no report, no time_left, nothing
  // that would look at its connection. The trainer's death must still end the bubble for it.
  kill_trainer_mid_bubble("midpoll", {"--step-us", "100", "--no-reports"});
}

TEST_CASE("a_hub_service_whose_poll_fails_keeps_the_trainer_alive_to_its_tasks_and_closes") {
  RuntimeDir dir;
  // Once the task is attached the trainer's descriptor limit drops below what its hub service
  // polls: every poll fails (EINVAL). Its tasks must not take it for dead, and its close must
  // still return.
  Child trainer({trainer_bin(), "pollfail", "0", "--bubble-us", "2000", "--gap-us", "1000",
                 "--await-tasks", "1", "--nofile", "3"});
  REQUIRE(trainer.wait_line("OPEN") != "");
  Child task(task_args("pollfail", "busy", "imperative", {"--step-us", "100", "--no-reports"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(trainer.wait_line("LIMITED") != "");
  for (int i = 0; i < 20; ++i) {  // it goes on being started, and never hears "gone"
    const std::string line = task.wait_line("", 5000);
    CAPTURE(line);
    REQUIRE(line.rfind("STARTED", 0) == 0);
  }
  trainer.signal(SIGTERM);
  CHECK(trainer.wait_line("CLOSED", 10000).find("CLOSED BB_OK") == 0);
  CHECK(trainer.wait_exit(5000) == 0);
  CHECK(task.wait_line("RESULT", 5000).find("BB_E_TRAINER_GONE") != std::string::npos);
  CHECK(task.wait_exit(5000) == 0);
}

TEST_CASE("a_trainer_death_the_kernel_does_not_mark_still_reaches_a_task_that_only_polls") {
  // The trainer's threads cannot register robust lists (a sandbox that denies the system
  // call): the hub publishes no liveness word, and should_pause's own look at the connection
  // is what ends the bubble for the task.
  kill_trainer_mid_bubble("midnorobust", {"--step-us", "100", "--no-reports"},
                          {"--no-robust-list"});
}

TEST_CASE("observer_merges_the_bubble_and_service_event_streams") {
  RuntimeDir dir;
  Trainer t("events");
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  REQUIRE(bb::core::HubObserver::open("", "events", 0, &obs, &err) == BB_OK);
  Child task(task_args("events", "logged", "iterative", {"--step-us", "200"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  // Six counted: the service thread logs a step just after counting it, so the fifth step's
  // event is in the log once the sixth is counted.
  REQUIRE(t.bubbles_until([&] { return t.stats().steps >= 6; }));
  const uint64_t bubbles = t.stats().bubbles;

  // Read in small batches, as the agent does: the cursor carries on across calls.
  bb::core::EventCursor cursor;
  std::vector<bb::core::Event> all;
  bb::core::Event buf[7];
  uint64_t lost_total = 0;
  for (;;) {
    uint64_t lost = 0;
    const size_t n = obs->read_events(&cursor, buf, 7, &lost);
    lost_total += lost;
    all.insert(all.end(), buf, buf + n);
    if (n < 7) break;
  }
  CHECK(lost_total == 0);
  using ET = bb::core::EventType;
  size_t begins = 0, ends = 0, attaches = 0, starts = 0, steps = 0;
  bool open = false;
  uint64_t last_bubble_ts = 0;
  for (const auto& e : all) {
    if (e.type == ET::kBubbleBegin || e.type == ET::kBubbleEnd) {
      CHECK(e.ts_ns >= last_bubble_ts);  // one stream, in the order it was logged
      last_bubble_ts = e.ts_ns;
    }
    switch (e.type) {
      case ET::kBubbleBegin: CHECK_FALSE(open); open = true; ++begins; break;
      case ET::kBubbleEnd: CHECK(open); open = false; ++ends; break;
      case ET::kTaskAttach: CHECK(e.a == uint64_t(task.pid())); ++attaches; break;
      case ET::kTaskStart: ++starts; break;
      case ET::kTaskStep: ++steps; break;
      default: break;
    }
  }
  // Every bubble from the bubble thread's stream, the task's life from the service thread's.
  CHECK(begins == bubbles);
  CHECK(ends == bubbles);
  CHECK(attaches == 1);
  CHECK(starts > 0);
  CHECK(steps >= 5);
  // Nothing new: an empty read that leaves the cursor where it was. The hub is quieted first:
  // while the task lives, the service thread logs the reports it still drains; once the task is
  // gone and its slot freed, and no bubble runs, neither thread logs anything.
  task.signal(SIGKILL);
  REQUIRE(t.bubbles_until([&] { return t.stats().tasks_reclaimed == 1; }, 500));
  while (obs->read_events(&cursor, buf, 7) > 0) {
  }
  const bb::core::EventCursor before = cursor;
  CHECK(obs->read_events(&cursor, buf, 7) == 0);
  CHECK(cursor.next[0] == before.next[0]);
  CHECK(cursor.next[1] == before.next[1]);
  obs.reset();
}

TEST_CASE("observer_counts_events_overwritten_before_it_read_them") {
  RuntimeDir dir;
  bb_trainer_options_t o;
  bb_trainer_options_init(&o);
  o.event_capacity = 64;
  bb_trainer_h h = nullptr;
  REQUIRE(bb_trainer_open("lapped", 0, &o, &h) == BB_OK);
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  REQUIRE(bb::core::HubObserver::open("", "lapped", 0, &obs, &err) == BB_OK);
  for (int i = 0; i < 100; ++i) {  // 200 events into a 64-entry stream
    REQUIRE(bb_bubble_begin(h, 1000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
    REQUIRE(bb_bubble_end(h) == BB_OK);
  }
  bb::core::EventCursor cursor;
  std::vector<bb::core::Event> buf(256);
  uint64_t lost = 0;
  const size_t n = obs->read_events(&cursor, buf.data(), buf.size(), &lost);
  CHECK(n == 64);  // the newest lap
  CHECK(lost == 200 - 64);
  CHECK(buf[n - 1].type == bb::core::EventType::kBubbleEnd);
  obs.reset();
  bb_trainer_close(h);
}

TEST_CASE("a_start_seen_after_its_bubble_ended_is_reported_with_its_latency") {
  // A task that wakes only after its bubble ended (a late wake-up on a loaded machine; here the
  // task is stopped meanwhile) does not run, but its start is reported: a STARTED whose latency
  // covers at least the whole bubble, then its PAUSED.
  RuntimeDir dir;
  bb_trainer_h h = nullptr;
  REQUIRE(bb_trainer_open("late", 0, nullptr, &h) == BB_OK);
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  REQUIRE(bb::core::HubObserver::open("", "late", 0, &obs, &err) == BB_OK);
  Child task(task_args("late", "sleepy", "iterative", {"--step-us", "100", "--wake", "sleep"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  using ET = bb::core::EventType;
  bb::core::EventCursor cursor;
  std::vector<bb::core::Event> starts, pauses, begins, ends;
  auto read = [&] {
    bb::core::Event buf[64];
    for (size_t n; (n = obs->read_events(&cursor, buf, 64, nullptr)) > 0;)
      for (size_t k = 0; k < n; ++k) {
        if (buf[k].type == ET::kTaskStart) starts.push_back(buf[k]);
        if (buf[k].type == ET::kTaskPause) pauses.push_back(buf[k]);
        if (buf[k].type == ET::kBubbleBegin) begins.push_back(buf[k]);
        if (buf[k].type == ET::kBubbleEnd) ends.push_back(buf[k]);
      }
  };
  auto starts_made = [&] {
    bb_trainer_stats_t s{sizeof s};
    REQUIRE(bb_trainer_stats(h, &s) == BB_OK);
    return s.starts;
  };
  REQUIRE(eventually([&] {
    bb_trainer_stats_t s{sizeof s};
    return bb_trainer_stats(h, &s) == BB_OK && s.tasks_attached == 1;
  }));
  // One ordinary run. Its PAUSED report is pushed just before the ack itself, so the task is
  // known to be ready again only once it sleeps in its next wait (--wake sleep: a futex).
  REQUIRE(bb_bubble_begin(h, 10'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
  REQUIRE(eventually([&] { return read(), starts.size() == 1; }));
  REQUIRE(bb_bubble_end(h) == BB_OK);
  REQUIRE(eventually([&] { return read(), pauses.size() == 1; }));
  REQUIRE(eventually([&] { return bbtest::proc_state(task.pid()) == 'S'; }));

  task.signal(SIGSTOP);
  REQUIRE(eventually([&] { return bbtest::proc_state(task.pid()) == 'T'; }));
  REQUIRE(bb_bubble_begin(h, 10'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
  REQUIRE(bb_bubble_end(h) == BB_OK);
  CHECK(starts_made() == 2);  // the stopped task was ready, so it was started
  task.signal(SIGCONT);

  REQUIRE(eventually([&] { return read(), starts.size() == 2 && pauses.size() == 2; }));
  REQUIRE(begins.size() == 2);
  REQUIRE(ends.size() == 2);
  CHECK(starts[1].a == pauses[1].a);                         // both name the second run's epoch
  CHECK(starts[1].ts_ns >= ends[1].ts_ns);                   // seen once the task ran again
  CHECK(starts[1].b >= ends[1].ts_ns - begins[1].ts_ns);     // its latency covers the bubble
  obs.reset();
  bb_trainer_close(h);
}

TEST_CASE("a_task_stepping_faster_than_the_hub_drains_loses_no_start_or_pause_report") {
  // Steps of well under a microsecond fill the task's report ring many times over between two
  // drains; the steps are folded together, the starts and pauses all arrive.
  RuntimeDir dir;
  bb_trainer_options_t o;
  bb_trainer_options_init(&o);
  o.event_capacity = 65536;  // room for every event of the run: none may be lapped
  bb_trainer_h h = nullptr;
  REQUIRE(bb_trainer_open("flood", 0, &o, &h) == BB_OK);
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  REQUIRE(bb::core::HubObserver::open("", "flood", 0, &obs, &err) == BB_OK);
  Child task(task_args("flood", "fast", "iterative", {"--step-us", "0"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  auto stats = [&] {
    bb_trainer_stats_t s{sizeof s};
    REQUIRE(bb_trainer_stats(h, &s) == BB_OK);
    return s;
  };
  REQUIRE(eventually([&] { return stats().tasks_attached == 1; }));
  for (int i = 0; i < 2000 && stats().starts < 30; ++i) {
    // Announced longer than it lasts: the task steps until the end pauses it.
    REQUIRE(bb_bubble_begin(h, 10'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    REQUIRE(bb_bubble_end(h) == BB_OK);
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  const uint64_t starts = stats().starts;
  REQUIRE(starts >= 30);
  // Every start is reported once by a STARTED and once by a PAUSED report (its ack).
  using ET = bb::core::EventType;
  bb::core::EventCursor cursor;
  std::vector<bb::core::Event> buf(4096);
  uint64_t started = 0, paused = 0, steps = 0, lost = 0;
  CHECK(eventually([&] {
    for (;;) {
      uint64_t l = 0;
      const size_t n = obs->read_events(&cursor, buf.data(), buf.size(), &l);
      lost += l;
      for (size_t k = 0; k < n; ++k) {
        started += buf[k].type == ET::kTaskStart;
        paused += buf[k].type == ET::kTaskPause;
        steps += buf[k].type == ET::kTaskStep;
      }
      if (n < buf.size()) break;
    }
    return started == starts && paused == starts;
  }));
  CHECK(lost == 0);
  CHECK(started == starts);
  CHECK(paused == starts);
  CHECK(steps > 0);
  const bb_trainer_stats_t s = stats();
  CHECK(s.events_dropped == 0);
  CHECK(s.pause_latency_p50_ns > 0);
  CHECK(s.steps > starts);  // folded reports still count every step
  obs.reset();
  bb_trainer_close(h);
}

namespace {

// A trainer process with one task attached, watched by an observer whose requests wait up to
// timeout_ms, for the tests of what the observer does while the trainer is stopped.
struct ObservedTrainer {
  Child trainer;
  Child task;
  std::unique_ptr<bb::core::HubObserver> obs;
  ObservedTrainer(const char* job, uint32_t timeout_ms)
      : trainer({trainer_bin(), job, "0"}), task(task_once_open(trainer, job)) {
    REQUIRE(task.wait_line("ATTACHED") != "");
    std::string err;
    REQUIRE(bb::core::HubObserver::open("", job, 0, &obs, &err, timeout_ms) == BB_OK);
  }
  static std::vector<std::string> task_once_open(Child& trainer, const char* job) {
    REQUIRE(trainer.wait_line("OPEN") != "");
    return task_args(job, "w", "iterative", {"--step-us", "100"});
  }
  void stop() {
    trainer.signal(SIGSTOP);
    REQUIRE(eventually([&] { return bbtest::all_threads_stopped(trainer.pid()); }));
  }
};

}  // namespace

TEST_CASE("an_answer_the_trainer_gives_late_is_never_taken_for_a_later_requests") {
  RuntimeDir dir;
  ObservedTrainer o("slow", 300);
  auto& [trainer, task, obs] = o;
  std::string err;
  const auto tasks = obs->snapshot().tasks;
  REQUIRE(tasks.size() == 1);
  const uint64_t bogus = tasks[0].id + (uint64_t(1) << 32);  // the slot's next generation
  // Stopped, the trainer answers nothing: the request times out, and so does the next one, at
  // once, while the first answer is still owed.
  o.stop();
  CHECK(obs->stop_task(tasks[0].id, &err) == BB_E_TIMEOUT);
  CHECK(obs->stop_task(bogus, &err) == BB_E_TIMEOUT);
  CHECK(err.find("earlier request") != std::string::npos);  // not sent: the first is owed
  CHECK(obs->alive());
  trainer.signal(SIGCONT);
  // The late answer (BB_OK: the task was asked to stop) is dropped; the request for a task
  // that is not there gets its own answer.
  bb_status st = BB_E_TIMEOUT;
  CHECK(eventually([&] { return (st = obs->stop_task(bogus, &err)) != BB_E_TIMEOUT; }, 10000));
  CHECK(st == BB_E_NOT_FOUND);
  CHECK(task.wait_line("RESULT", 10000).find("BB_E_STOPPED") != std::string::npos);
}

TEST_CASE("an_observer_that_does_not_wait_sends_its_requests_and_takes_the_answers_later") {
  // For an event loop: requests are only sent, and pump() reads the answers when they come. A
  // stopped trainer answers nothing, and no call waits for it (the timeout is 2 s; none may
  // take half of it): a few requests go out, and stops past those are queued, each task's once,
  // and sent as answers come.
  RuntimeDir dir;
  ObservedTrainer o("async", 2000);
  auto& [trainer, task, obs] = o;
  std::string err;
  obs->set_async();
  o.stop();
  const auto t0 = std::chrono::steady_clock::now();
  const auto tasks = obs->snapshot().tasks;  // asks for the task's page
  REQUIRE(tasks.size() == 1);
  CHECK(!tasks[0].started);
  // Ids of tasks not attached: the slot's next generations.
  std::vector<uint64_t> bogus;
  for (uint64_t g = 1; g <= 20; ++g) bogus.push_back(tasks[0].id + (g << 32));
  for (uint64_t id : bogus) CHECK(obs->stop_task(id, &err) == BB_OK);
  CHECK(obs->stop_task(bogus.back(), &err) == BB_OK);  // queued already: not asked twice
  std::vector<bb::core::HubObserver::StopAnswer> stops;
  CHECK(obs->pump(&stops));
  CHECK(stops.empty());
  CHECK(obs->snapshot().tasks.size() == 1);  // asks for no second page meanwhile
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
  CHECK(obs->alive());
  trainer.signal(SIGCONT);
  // Every stop is answered once (the task ids are not attached), in order, and the page came:
  // the task is seen started in the trainer's bubbles, which only its page tells.
  CHECK(eventually([&] { return obs->pump(&stops) && stops.size() >= bogus.size(); }));
  REQUIRE(stops.size() == bogus.size());
  for (size_t i = 0; i < stops.size(); ++i) {
    CHECK(stops[i].task_id == bogus[i]);
    CHECK(stops[i].status == BB_E_NOT_FOUND);
    CHECK(stops[i].error.find("not attached") != std::string::npos);
  }
  CHECK(eventually([&] {
    obs->pump(&stops);
    const auto now = obs->snapshot().tasks;
    return now.size() == 1 && (now[0].started || now[0].state == bb::core::TaskRunState::kRunning);
  }));
  CHECK(stops.size() == bogus.size());  // and no answer more came meanwhile
  // A stop sent now is answered too, and reaches the task.
  REQUIRE(obs->stop_task(tasks[0].id, &err) == BB_OK);
  stops.clear();
  CHECK(eventually([&] { return obs->pump(&stops) && stops.size() == 1; }));
  CHECK(stops[0].status == BB_OK);
  CHECK(task.wait_line("RESULT", 10000).find("BB_E_STOPPED") != std::string::npos);
}

TEST_CASE("an_observer_does_not_hang_on_a_trainer_that_stopped_accepting") {
  RuntimeDir dir;
  Child trainer({trainer_bin(), "frozen", "0"});
  REQUIRE(trainer.wait_line("OPEN") != "");
  std::string path;
  REQUIRE(bb::core::resolve_runtime_dir(nullptr, false, &path) == BB_OK);
  path += "/frozen.0.sock";
  trainer.signal(SIGSTOP);
  REQUIRE(eventually([&] { return bbtest::all_threads_stopped(trainer.pid()); }));
  // Fill the listener's backlog: a further connect would wait for an accept that never comes.
  std::vector<bb::shm::Fd> held;
  for (int i = 0; i < 200; ++i) {
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    REQUIRE(s >= 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    const int rc = connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    held.emplace_back(s);
    if (rc != 0 && errno == EAGAIN) break;  // full
  }
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  CHECK(bb::core::HubObserver::open("", "frozen", 0, &obs, &err, 300) == BB_E_TIMEOUT);
  CHECK(err.find("not accepting") != std::string::npos);
  trainer.signal(SIGCONT);
}

TEST_CASE("an_attach_that_finds_slots_waiting_for_the_next_bubble_is_told_so") {
  // A slot whose task died while a bubble is open is freed once that bubble ended: until then an
  // attach that finds no other slot is told that one is coming free, not that all are in use.
  RuntimeDir dir;
  Trainer t("onefree", 0, 1);
  REQUIRE(bb_bubble_begin(t.h, 1'000'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_OTHER) == BB_OK);
  {
    Child task(task_args("onefree", "gone", "iterative", {"--step-us", "100"}));
    REQUIRE(task.wait_line("ATTACHED") != "");
    task.signal(SIGKILL);
    REQUIRE(task.wait_exit() != -1);
  }
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 0; }));
  bb_task_h h = nullptr;
  CHECK(bb_task_attach("onefree", 0, "next", nullptr, &h) == BB_E_FULL);
  CHECK(std::string(bb_last_error()).find("held tasks that left and are being freed") !=
        std::string::npos);
  REQUIRE(bb_bubble_end(t.h) == BB_OK);
  CHECK(eventually([&] { return bb_task_attach("onefree", 0, "next", nullptr, &h) == BB_OK; }));
  bb_task_detach(h);
}
