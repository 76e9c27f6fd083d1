// A hostile task scribbling over all it can write, beside a well-behaved one.
#include <bubble/bubble.h>
#include <doctest/doctest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "core/observer.h"
#include "core/paths.h"
#include "shm/fd_passing.h"
#include "shm/segment.h"
#include "tests/helpers/proc.h"
#include "tests/helpers/raw_attach.h"

using bbtest::Child;
using bbtest::RuntimeDir;

TEST_CASE("hostile_task_cannot_crash_stall_or_corrupt_the_trainer") {
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  bb_trainer_options_t o;
  bb_trainer_options_init(&o);
  o.max_running = 2;
  REQUIRE(bb_trainer_open("hostile", 0, &o, &t) == BB_OK);
  std::string sock;
  REQUIRE(bb::core::hub_paths(dir.path(), "hostile", 0, &sock, nullptr) == BB_OK);
  Child good({BB_TEST_TASK, "hostile", "0", "good", "iterative", "--step-us", "100"});
  REQUIRE(good.wait_line("ATTACHED") != "");
  // Under a sanitizer the fault must still be a plain SIGSEGV, not a sanitizer report.
  setenv("ASAN_OPTIONS", "handle_segv=0", 1);
  setenv("TSAN_OPTIONS", "handle_segv=0", 1);
  Child evil({BB_HOSTILE_TASK, sock, "1.5"});
  unsetenv("ASAN_OPTIONS");
  unsetenv("TSAN_OPTIONS");
  REQUIRE(evil.wait_line("ATTACHED") != "");

  // The trainer runs bubbles all through the attack. Every call returns at once with BB_OK
  // (counted, not timed), and the bubble count is exact.
  uint64_t calls = 0, failures = 0;
  bool evil_done = false;
  int evil_status = -1;
  for (int i = 0; i < 20000 && !evil_done; ++i) {
    failures += bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) != BB_OK;
    std::this_thread::sleep_for(std::chrono::microseconds(300));  // the GPU computing elsewhere
    failures += bb_bubble_end(t) != BB_OK;
    calls += 2;
    if (i % 50 == 0) {
      evil_status = evil.wait_exit(0);
      evil_done = evil_status != -1;
    }
  }
  REQUIRE(evil_done);
  CHECK(failures == 0);
  bb_trainer_stats_t s{sizeof s};
  REQUIRE(bb_trainer_stats(t, &s) == BB_OK);
  CHECK(s.bubbles == calls / 2);
  // The write into the trainer's pages faulted in the hostile task only.
  CHECK(evil.lines().size() >= 1);
  CHECK(evil.wait_line("SCRIBBLED", 100).find("SCRIBBLED") == 0);
  CHECK(WIFSIGNALED(evil_status));
  CHECK(WTERMSIG(evil_status) == SIGSEGV);
  // It was marked bad while it scribbled, and the good task kept working beside it.
  CHECK(s.tasks_bad >= 1);
  uint64_t good_steps = 0;
  bb_task_info_t info[4];
  for (auto& i : info) i.size = sizeof i;
  size_t n = 0;
  REQUIRE(bb_trainer_tasks(t, info, 4, &n) == BB_OK);
  for (size_t i = 0; i < n && i < 4; ++i)
    if (std::string(info[i].name) == "good") good_steps = info[i].steps;
  CHECK(good_steps > 0);
  // The hub itself still validates for an observer.
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  CHECK(bb::core::HubObserver::open("", "hostile", 0, &obs, &err) == BB_OK);
  obs.reset();
  bb_trainer_close(t);
  CHECK(dir.files().empty());
}

namespace {

std::string hub_socket(const RuntimeDir& dir, const char* job) {
  std::string sock;
  REQUIRE(bb::core::hub_paths(dir.path(), job, 0, &sock, nullptr) == BB_OK);
  return sock;
}

// Sends an attach request as `name` on sock; returns the reply (status, error text).
bb::shm::AttachReplyMsg attach_on(int sock, const char* name) {
  auto m = bb::shm::make_msg<bb::shm::AttachTaskMsg>(bb::shm::MsgType::kAttachTask);
  std::snprintf(m.name, sizeof m.name, "%s", name);
  bb::shm::AttachReplyMsg r{};
  r.status = -1000;
  if (bb::shm::send_msg(sock, &m, sizeof m, nullptr, 0) != 0) return r;
  alignas(8) char buf[bb::shm::kWireMaxMessage];
  int fds[2], nfds = 0;
  const long n = bb::shm::recv_msg(sock, buf, fds, &nfds);
  for (int f = 0; f < nfds; ++f) close(fds[f]);
  if (bb::shm::check_msg(buf, n, bb::shm::MsgType::kAttachReply, sizeof r))
    std::memcpy(&r, buf, sizeof r);
  return r;
}

void run_bubbles(bb_trainer_h t, int n) {
  for (int i = 0; i < n; ++i) {
    REQUIRE(bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
    REQUIRE(bb_bubble_end(t) == BB_OK);
  }
}

}  // namespace

TEST_CASE("a_task_cannot_resize_its_page_under_the_trainer") {
  // The task maps its page writable. Shrunk, the trainer's (and observers') mapping of it would
  // fault with SIGBUS at their next read, killing this process; the page's seals refuse it.
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("resize", 0, nullptr, &t) == BB_OK);
  Child evil({BB_HOSTILE_TASK, hub_socket(dir, "resize"), "30", "--resize"});
  REQUIRE(evil.wait_line("ATTACHED") != "");
  CHECK(evil.wait_line("SHRINK") == "SHRINK Operation not permitted");
  CHECK(evil.wait_line("GROW") == "GROW Operation not permitted");
  run_bubbles(t, 100);  // reads the task's page: started once, then never acked
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  REQUIRE(bb::core::HubObserver::open("", "resize", 0, &obs, &err) == BB_OK);
  CHECK(obs->snapshot().tasks.size() == 1);  // maps the task's page as well
  obs.reset();
  bb_trainer_close(t);
  CHECK(dir.files().empty());
}

TEST_CASE("threads_a_task_parks_on_its_wake_word_cost_a_bubble_one_wake_not_one_each") {
  // A task that parks many threads on its wake word and always looks asleep must not make each
  // begin wake them all (a syscall whose cost grows with the waiters, on the trainer's thread):
  // a task has one waiter, and the bubble thread wakes one. Counted, not timed: the parked
  // threads count their wakes.
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("park", 0, nullptr, &t) == BB_OK);
  Child evil({BB_HOSTILE_TASK, hub_socket(dir, "park"), "60", "--park", "64"}, true);
  REQUIRE(evil.wait_line("ATTACHED") != "");
  REQUIRE(evil.wait_line("PARKED", 30000) != "");
  constexpr int kBubbles = 200;
  for (int i = 0; i < kBubbles; ++i) {
    REQUIRE(bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
    REQUIRE(bb_bubble_end(t) == BB_OK);
    std::this_thread::sleep_for(std::chrono::microseconds(500));  // the woken ones park again
  }
  bb_trainer_stats_t st{sizeof st};
  REQUIRE(bb_trainer_stats(t, &st) == BB_OK);
  REQUIRE(evil.write_stdin("count\n"));
  const std::string line = evil.wait_line("WAKES");
  REQUIRE(line != "");
  const uint64_t wakes = std::stoull(line.substr(6));
  MESSAGE("wakes seen by the 64 parked threads over " << kBubbles << " bubbles: " << wakes
          << " (starts " << st.starts << ")");
  CHECK(st.starts > 0);
  CHECK(wakes > 0);                      // the trainer does wake a sleeping task it starts
  CHECK(wakes <= 2 * uint64_t(kBubbles));  // at most one per begin and one per end
  CHECK(evil.wait_exit() == 0);
  bb_trainer_close(t);
  CHECK(dir.files().empty());
}

TEST_CASE("a_stranger_parked_on_a_tasks_doorbell_takes_none_of_its_wakes") {
  // Every holder of the hub can futex-wait on any word of it, a slot's doorbell too. A task
  // sleeps on a word of its own page instead, which no other task maps: a stranger parked on the
  // victim's doorbell is never woken, and the victim, asleep between bubbles, is woken at every
  // one. Before, the trainer's one wake went to whichever waiter came first, the stranger's
  // threads, and the victim started only at its next liveness look. Counted, not timed.
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("stranger", 0, nullptr, &t) == BB_OK);
  // --die-at never: WAITING before each wait for a start, once the last run is acked.
  Child victim({BB_TEST_TASK, "stranger", "0", "victim", "imperative", "--wake", "sleep",
                "--step-us", "20", "--die-at", "never"});
  REQUIRE(victim.wait_line("ATTACHED") != "");
  bb_task_info_t info[2];
  for (auto& i : info) i.size = sizeof i;
  size_t n = 0;
  REQUIRE(bb_trainer_tasks(t, info, 2, &n) == BB_OK);
  REQUIRE(n == 1);
  const std::string victim_slot = std::to_string(info[0].slot);
  Child stranger({BB_HOSTILE_TASK, hub_socket(dir, "stranger"), "60", "--park-on", victim_slot,
                  "16"},
                 true);
  REQUIRE(stranger.wait_line("ATTACHED") != "");
  REQUIRE(stranger.wait_line("PARKED", 30000) != "");
  // The stranger is stopped, so that every bubble goes to the victim.
  REQUIRE(bb_trainer_tasks(t, info, 2, &n) == BB_OK);
  REQUIRE(n == 2);
  REQUIRE(bb_trainer_stop_task(t, info[std::string(info[0].name) == "victim" ? 1 : 0].id) ==
          BB_OK);
  constexpr int kBubbles = 30;
  int started = 0;
  for (int i = 0; i < kBubbles; ++i) {
    REQUIRE(victim.wait_line("WAITING") != "");
    // Its spin given up, it sleeps (its one blocking call after WAITING is the futex).
    REQUIRE(bbtest::eventually([&] { return bbtest::proc_state(victim.pid()) == 'S'; }));
    REQUIRE(bb_bubble_begin(t, 1'000'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
    started += victim.wait_line("STARTED") != "";
    REQUIRE(bb_bubble_end(t) == BB_OK);
  }
  bb_trainer_stats_t st{sizeof st};
  REQUIRE(bb_trainer_stats(t, &st) == BB_OK);
  REQUIRE(stranger.write_stdin("count\n"));
  const std::string line = stranger.wait_line("WAKES");
  REQUIRE(line != "");
  MESSAGE("wakes: " << st.wakes << " made by the trainer, " << line.substr(6)
          << " taken by the stranger");
  CHECK(started == kBubbles);
  CHECK(st.wakes > 0);            // the victim slept, and the trainer woke it
  CHECK(line == "WAKES 0");       // none of them reached the stranger
  CHECK(stranger.wait_exit() == 0);
  bb_trainer_close(t);
  CHECK(dir.files().empty());
}

TEST_CASE("an_attach_the_trainer_cannot_watch_is_refused") {
  // Peer credentials name the process that called connect(). If it exited before the attach,
  // the trainer could never kill the task nor tell its death: the attach is refused, saying why.
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("ghost", 0, nullptr, &t) == BB_OK);
  const std::string path = hub_socket(dir, "ghost");
  bb::shm::Fd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  REQUIRE(sock);
  timeval tv{5, 0};
  setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const sockaddr_un a = bbtest::hub_address(path);
  // The connect happens in a child that exits at once: its credentials name a dead process.
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0)
    _exit(connect(sock.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0 ? 0 : 1);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  const bb::shm::AttachReplyMsg r = attach_on(sock.get(), "ghost");
  CHECK(r.status == BB_E_PERMISSION);
  CHECK(std::string(r.error).find("cannot watch the process that connected") != std::string::npos);
  size_t n = 99;
  REQUIRE(bb_trainer_tasks(t, nullptr, 0, &n) == BB_OK);
  CHECK(n == 0);
  // The connecting process itself attaches.
  bb::shm::Fd ok(bbtest::connect_hub(path));
  REQUIRE(ok);
  CHECK(attach_on(ok.get(), "alive").status == BB_OK);
  REQUIRE(bb_trainer_tasks(t, nullptr, 0, &n) == BB_OK);
  CHECK(n == 1);
  ok.reset();
  sock.reset();
  bb_trainer_close(t);
  CHECK(dir.files().empty());
}

TEST_CASE("descriptors_sent_to_a_hub_are_refused") {
  // The hub never takes descriptors, and closing one it was sent can block (a TCP socket that
  // lingers with unsent data): the kernel refuses them at the sender (SO_PASSRIGHTS, 6.16+).
  {
    bb::shm::Fd probe(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!bb::shm::refuse_passed_fds(probe.get())) {
      MESSAGE("skipped: this kernel has no SO_PASSRIGHTS (Linux 6.16+), nothing to check here");
      return;
    }
  }
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("passfd", 0, nullptr, &t) == BB_OK);
  bb::shm::Fd sock(bbtest::connect_hub(hub_socket(dir, "passfd")));
  REQUIRE(sock);
  int p[2];
  REQUIRE(pipe2(p, O_CLOEXEC) == 0);
  bb::shm::Fd r(p[0]), w(p[1]);
  auto m = bb::shm::make_msg<bb::shm::AttachTaskMsg>(bb::shm::MsgType::kAttachTask);
  std::snprintf(m.name, sizeof m.name, "%s", "passfd");
  const int fd = r.get();
  CHECK(bb::shm::send_with_fds(sock.get(), &m, sizeof m, &fd, 1, 0) == EPERM);
  // Without the descriptor the same connection attaches, and the trainer goes on.
  CHECK(attach_on(sock.get(), "passfd").status == BB_OK);
  CHECK(bb::shm::send_with_fds(sock.get(), &m, sizeof m, &fd, 1, 0) == EPERM);
  run_bubbles(t, 10);
  sock.reset();
  bb_trainer_close(t);
  CHECK(dir.files().empty());
}

// A task attached at the wire level that pushes reports of its choosing into its page, each
// weighed by the trainer's service thread before push() returns.
namespace {
struct ReportingTask {
  bb_trainer_h t = nullptr;
  bbtest::RawAttach raw;
  bbtest::RawViews v;
  uint64_t cached_head = 0;
  ReportingTask(const RuntimeDir& dir, const char* job, bb_trainer_h trainer) : t(trainer) {
    std::string sock, err;
    REQUIRE(bb::core::hub_paths(dir.path(), job, 0, &sock, nullptr) == BB_OK);
    REQUIRE(bbtest::raw_attach(sock, "reporter", &raw));
    REQUIRE_MESSAGE(bbtest::map_raw(raw, &v, &err), err);
  }
  void push(bb::shm::ReportType type, uint32_t epoch, uint64_t ts_ns, uint64_t a) {
    const bb::shm::Report r{uint16_t(type), 1, epoch, ts_ns, a, 0};
    REQUIRE(bb::shm::ring_push(v.task->reports, v.ctl->report_head, cached_head, r) ==
            bb::shm::RingStatus::kOk);
    const uint64_t tail = v.task->reports.tail.load();
    REQUIRE(bbtest::eventually([&] { return v.ctl->report_head.load() == tail; }));  // drained
    // The head moves before the report is weighed: a request through the service thread
    // returns only after the drain that popped it is done (no task 0: BB_E_NOT_FOUND).
    bb_grant_info_t barrier{sizeof barrier};
    CHECK(bb_trainer_task_grant(t, 0, &barrier) == BB_E_NOT_FOUND);
  }
};
}  // namespace

// A report's every field is the task's: a step that claims to have begun before the clock's
// zero (its duration longer than its end time) is dropped, not counted or logged with a
// time that wrapped around. A plausible one beside it is counted.
TEST_CASE("a_step_report_that_began_before_time_began_is_dropped") {
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("steps", 0, nullptr, &t) == BB_OK);
  {
    ReportingTask liar(dir, "steps", t);
    // "ended 1 us after the clock's zero, after a 5 us step"
    liar.push(bb::shm::ReportType::kStep, 0, 1000, 5000);
    CHECK(liar.v.ctl->steps.load() == 0);
    liar.push(bb::shm::ReportType::kStep, 0, bb_now_ns(), 5000);
    CHECK(liar.v.ctl->steps.load() == 1);
    CHECK(liar.v.ctl->step_ns.load() == 5000);
  }
  bb_trainer_close(t);
}

TEST_CASE("a_tasks_reports_cannot_claim_more_step_time_than_passed_nor_starts_it_was_not_given") {
  // A task's reports feed the hub's totals and latency figures (the agent's harvest and
  // metrics): step time is believed only within the wall time since the attach, each report
  // after the last, and a start or pause latency once per run epoch the trainer gave.
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("claims", 0, nullptr, &t) == BB_OK);
  {
    const uint64_t attached = bb_now_ns();
    ReportingTask boaster(dir, "claims", t);
    const bb::shm::SlotCtl* ctl = boaster.v.ctl;
    constexpr uint64_t kHour = 3'500'000'000'000ull;  // just inside the 1 h sanity bound
    // A step cannot have begun before the clock's zero (a machine up for less than an hour has
    // its monotonic clock below kHour): claim half the time since then, still far more than
    // passed since the attach.
    const uint64_t claim = std::min(kHour, bb_now_ns() / 2);
    for (int k = 0; k < 20; ++k) boaster.push(bb::shm::ReportType::kStep, 0, bb_now_ns(), claim);
    const uint64_t claimed_by = bb_now_ns();
    CHECK(ctl->steps.load() == 20);
    CHECK(ctl->step_ns.load() > 0);
    CHECK(ctl->step_ns.load() <= claimed_by - attached);  // not 20 hours
    bb_trainer_stats_t st{sizeof st};
    REQUIRE(bb_trainer_stats(t, &st) == BB_OK);
    CHECK(st.task_ns_in_bubbles <= claimed_by - attached);
    // Two reports stamped alike (a coarse clock): the second gets no time, but its step counts.
    const uint64_t same = bb_now_ns();
    boaster.push(bb::shm::ReportType::kStep, 0, same, 1000);
    const uint64_t ns_before = ctl->step_ns.load();
    boaster.push(bb::shm::ReportType::kStep, 0, same, 1000);
    CHECK(ctl->steps.load() == 22);
    CHECK(ctl->step_ns.load() == ns_before);

    // Start latencies: none for epochs never given, one for the start that was.
    for (uint32_t e = 1; e <= 50; ++e)
      boaster.push(bb::shm::ReportType::kStarted, e, bb_now_ns(), claim);
    REQUIRE(bb_trainer_stats(t, &st) == BB_OK);
    CHECK(st.start_latency_p99_ns == 0);
    REQUIRE(bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
    REQUIRE(ctl->given_epoch.load() == 1);
    boaster.push(bb::shm::ReportType::kStarted, 1, bb_now_ns(), 7000);
    boaster.push(bb::shm::ReportType::kStarted, 1, bb_now_ns(), claim);  // the same start again
    REQUIRE(bb_trainer_stats(t, &st) == BB_OK);
    CHECK(st.start_latency_p99_ns > 0);
    CHECK(st.start_latency_p99_ns < 1'000'000);  // the one real sample, not the claim
    REQUIRE(bb_bubble_end(t) == BB_OK);
  }
  bb_trainer_close(t);
}
