// Memory grants end to end: the trainer (this process) lends memory through the C ABI, side
// tasks in child processes map their grants and write into them, and revocation runs as a
// protocol (ack, or kill at the deadline). The CUDA backends run over the fake driver of
// tests/cuda_double, loaded through BUBBLE_CUDA_DRIVER exactly as libcuda.so.1 would be.
#include <bubble/bubble.h>
#include <dirent.h>
#include <dlfcn.h>
#include <doctest/doctest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/paths.h"
#include "shm/layout.h"
#include "shm/segment.h"
#include "shm/wire.h"
#include "tests/cuda_double/cuda_double.h"
#include "tests/helpers/proc.h"
#include "tests/helpers/trainer_fixture.h"
#include "tests/helpers/raw_attach.h"

using bbtest::Child;
using bbtest::RuntimeDir;
using bbtest::eventually;

namespace {

constexpr uint64_t kKiB = 1024, kMiB = 1024 * 1024;

std::string task_bin() { return BB_TEST_TASK; }
std::string trainer_bin() { return BB_TEST_TRAINER; }

// The fake driver sits next to the test programs in the build tree unless the build says where.
std::string double_path() {
#ifdef BUBBLE_CUDA_DOUBLE_PATH
  return BUBBLE_CUDA_DOUBLE_PATH;
#else
  const std::string t = BB_TEST_TASK;
  return t.substr(0, t.rfind('/')) + "/cuda_double/libbubble_cuda_double.so";
#endif
}

int count_fds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n - 1;  // the directory's own descriptor
}

// No descriptor is left open: the count comes back to what it was. The hub hands the sockets of
// the task connections it is done with to its closer thread (core/closer.h), which closes them a
// moment later, so this waits for that; a leak never comes back.
bool fds_back_to(int before) {
  return eventually([&] { return count_fds() == before; });
}

uint32_t pattern_word(uint32_t seed, uint64_t i) { return seed ^ uint32_t(i * 2654435761u); }

bool pattern_ok(uint64_t addr, uint64_t bytes, uint32_t seed) {
  const auto* w = reinterpret_cast<const volatile uint32_t*>(addr);
  for (uint64_t i = 0; i < bytes / 4; ++i)
    if (w[i] != pattern_word(seed, i)) return false;
  return true;
}

// A variable set for children spawned in this scope (and this process), then restored.
struct ScopedEnv {
  std::string name, old;
  bool had;
  ScopedEnv(const char* n, const std::string& value) : name(n) {
    const char* o = getenv(n);
    had = o != nullptr;
    if (had) old = o;
    setenv(n, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had)
      setenv(name.c_str(), old.c_str(), 1);
    else
      unsetenv(name.c_str());
  }
};

struct Trainer : bbtest::TrainerFixture {
  explicit Trainer(const char* job, uint32_t max_running = 1)
      : TrainerFixture(job, 0, 64, max_running) {}
  // clear: -1 leaves the default; struct_size: 0 = the current struct.
  void lend(bb_grant_backend backend, uint64_t bytes, int clear = -1, uint32_t struct_size = 0,
            bool auto_grant = true) {
    bb_lend_options_t lo;
    bb_lend_options_init(&lo);
    lo.backend = backend;
    lo.bytes = bytes;
    lo.auto_grant = auto_grant ? 1 : 0;
    if (clear >= 0) lo.clear_grants = uint32_t(clear);
    if (struct_size) lo.size = struct_size;
    const bb_status st = bb_trainer_lend(h, &lo);
    INFO(bb_last_error());
    REQUIRE(st == BB_OK);
  }
  bb_grant_stats_t grants() const {
    bb_grant_stats_t s{sizeof s};
    REQUIRE(bb_trainer_grant_stats(h, &s) == BB_OK);
    return s;
  }
  bb_grant_info_t grant_of(uint64_t task_id) const {
    bb_grant_info_t g{sizeof g};
    const bb_status st = bb_trainer_task_grant(h, task_id, &g);
    INFO(bb_last_error());
    REQUIRE(st == BB_OK);
    return g;
  }
  // Waits for the task's attach, then runs bubbles until it wrote its grant; the grant's id.
  uint64_t attached_and_granted(Child& task) {
    REQUIRE(task.wait_line("ATTACHED") != "");
    const uint64_t gid = until_granted(task);
    REQUIRE(gid != 0);
    return gid;
  }
  // Runs bubbles until the task prints its GRANT line; returns the grant id it names (0: none).
  uint64_t until_granted(Child& task) {
    std::string line;
    bubbles_until([&] { return !(line = task.wait_line("GRANT", 5)).empty(); });
    return line.empty() ? 0 : std::stoull(line.substr(6));
  }
};

std::vector<std::string> task_args(const std::string& job, const std::string& name,
                                   const std::string& mode, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {task_bin(), job, "0", name, mode};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

bool killed_by_sigkill(int status) {
  return status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

// Nothing left of any grant in the lender.
void check_lender_empty(const bb_grant_stats_t& g) {
  CHECK(g.active == 0);
  CHECK(g.revoking == 0);
  CHECK(g.quarantined == 0);
  CHECK(g.granted_bytes == 0);
  CHECK(g.requested_bytes == 0);
  CHECK(g.free_bytes == g.capacity);
}

}  // namespace

TEST_CASE("host_grant_written_by_task_is_read_by_trainer_then_revoked_and_acked") {
  RuntimeDir dir;
  const auto shm_before = bbtest::dev_shm();
  const int fds_before = count_fds();
  {
    Trainer t("gh");
    t.lend(BB_GRANT_HOST, 4 * kMiB);
    Child task(task_args("gh", "w", "iterative",
                         {"--mem", std::to_string(64 * kKiB), "--grant-seed", "7"}));
    const uint64_t gid = t.attached_and_granted(task);
    const int fds_granted = count_fds();
    const uint64_t id = t.task_id("w");
    bb_grant_info_t g = t.grant_of(id);
    CHECK(g.id == gid);
    CHECK(g.state == BB_GRANT_STATE_ACTIVE);
    CHECK(g.backend == BB_GRANT_HOST);
    CHECK(g.bytes == 64 * kKiB);
    CHECK(g.mapped == 1);
    REQUIRE(g.address != 0);
    // What the task wrote into its grant, the trainer reads at its own address of it.
    CHECK(pattern_ok(g.address, g.bytes, 7));
    // A process the trainer forks without an exec (a data loader's worker) does not get the
    // lent range: it could read the task's data, and would keep the pages past their release.
    const pid_t worker = fork();
    REQUIRE(worker >= 0);
    if (worker == 0) {
      const bool mapped = msync(reinterpret_cast<void*>(g.address), 4096, MS_ASYNC) == 0;
      _exit(mapped ? 3 : 0);
    }
    int wst = 0;
    REQUIRE(waitpid(worker, &wst, 0) == worker);
    CHECK_MESSAGE((WIFEXITED(wst) && WEXITSTATUS(wst) == 0), "a forked child maps the grant");
    bb_grant_stats_t s = t.grants();
    CHECK(s.backend == BB_GRANT_HOST);
    CHECK(s.capacity == 4 * kMiB);
    CHECK(s.active == 1);
    CHECK(s.granted_bytes == 64 * kKiB);
    CHECK(s.requested_bytes == 64 * kKiB);
    CHECK(s.free_bytes == 4 * kMiB - 64 * kKiB);
    CHECK(s.grants_made == 1);

    // Revoke: the idle task unmaps and acks, and the memory is released long before the deadline.
    REQUIRE(bb_trainer_revoke(t.h, id, bb_now_ns() + 30'000'000'000ull) == BB_OK);
    CHECK(bb_trainer_revoke(t.h, id, 0) != BB_OK);  // already revoking, or already released
    REQUIRE(eventually([&] { return t.grants().revokes_acked == 1; }));
    s = t.grants();
    CHECK(s.revokes == 1);
    CHECK(s.tasks_killed == 0);
    check_lender_empty(s);
    CHECK(t.grant_of(id).state == BB_GRANT_STATE_NONE);
    // The grant's memfd went to the task; the trainer kept none while the grant lived (a
    // worker it forks would inherit it, and hold the memory past its release), so the release
    // closed nothing.
    CHECK(count_fds() == fds_granted);
    // A task that needs memory and holds none is not started; nor is it granted again unasked.
    const uint64_t starts = t.stats().starts;
    for (int i = 0; i < 20; ++i) t.bubble();
    CHECK(t.stats().starts == starts);
    CHECK(t.grants().grants_made == 1);

    // Granted again on request: a new grant, written afresh.
    uint64_t again = 0;
    REQUIRE(bb_trainer_grant(t.h, id, 0, &again) == BB_OK);
    CHECK(again > gid);
    CHECK(t.until_granted(task) == again);
    g = t.grant_of(id);
    CHECK(pattern_ok(g.address, g.bytes, 7));
    CHECK(bb_trainer_grant(t.h, id, 0, nullptr) == BB_E_BUSY);  // one grant per task

    // Stopping the task: it gives the grant back as it detaches.
    REQUIRE(bb_trainer_stop_task(t.h, id) == BB_OK);
    CHECK(task.wait_line("RESULT").find("BB_E_STOPPED") != std::string::npos);
    CHECK(task.wait_exit() == 0);
    REQUIRE(eventually([&] { return t.grants().active == 0; }));
    s = t.grants();
    check_lender_empty(s);
    CHECK(s.tasks_killed == 0);
    CHECK(s.released_dead == 0);
  }
  CHECK(fds_back_to(fds_before));
  CHECK(bbtest::dev_shm() == shm_before);
  CHECK(dir.files().empty());
}

TEST_CASE("revoke_pauses_a_running_imperative_task_which_acks_in_the_bubble") {
  RuntimeDir dir;
  Trainer t("gi");
  t.lend(BB_GRANT_HOST, 1 * kMiB);
  Child task(task_args("gi", "imp", "imperative",
                       {"--mem", "8192", "--grant-seed", "3", "--step-us", "100"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  const uint64_t id = t.task_id("imp");
  REQUIRE(eventually([&] { return t.grant_of(id).state == BB_GRANT_STATE_ACTIVE; }));
  // One long bubble, open all through the revoke: should_pause turns 1 for the grant alone.
  REQUIRE(bb_bubble_begin(t.h, 60'000'000'000ull, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
  REQUIRE(task.wait_line("GRANT") != "");
  CHECK(pattern_ok(t.grant_of(id).address, 8192, 3));
  REQUIRE(bb_trainer_revoke(t.h, id, bb_now_ns() + 30'000'000'000ull) == BB_OK);
  CHECK(eventually([&] { return t.grants().revokes_acked == 1; }));
  CHECK(bb_bubble_end(t.h) == BB_OK);
  check_lender_empty(t.grants());
  CHECK(t.grants().tasks_killed == 0);
}

TEST_CASE("task_ignoring_revoke_is_killed_at_the_deadline_and_its_grant_reclaimed") {
  RuntimeDir dir;
  const auto shm_before = bbtest::dev_shm();
  const int fds_before = count_fds();
  {
    Trainer t("gk");
    t.lend(BB_GRANT_HOST, 1 * kMiB);
    Child task(task_args("gk", "deaf", "grant-hang", {"--mem", "65536", "--grant-seed", "9"}));
    REQUIRE(task.wait_line("ATTACHED") != "");
    REQUIRE(t.until_granted(task) != 0);
    const uint64_t id = t.task_id("deaf");
    REQUIRE(bb_trainer_revoke(t.h, id, bb_now_ns() + 300'000'000ull) == BB_OK);
    // Until the task is gone the range stays allocated: nobody else can be given it.
    bb_grant_info_t g = t.grant_of(id);
    CHECK(g.state == BB_GRANT_STATE_REVOKING);
    CHECK(g.deadline_ns != 0);
    CHECK(t.grants().granted_bytes == 65536);
    CHECK(killed_by_sigkill(task.wait_exit(10000)));
    REQUIRE(eventually([&] { return t.grants().released_dead == 1; }));
    const bb_grant_stats_t s = t.grants();
    CHECK(s.tasks_killed == 1);
    CHECK(s.revokes == 1);
    CHECK(s.revokes_acked == 0);
    check_lender_empty(s);
    REQUIRE(eventually([&] { return t.stats().tasks_attached == 0; }));
  }
  CHECK(fds_back_to(fds_before));
  CHECK(bbtest::dev_shm() == shm_before);
}

TEST_CASE("killed_task_grant_is_reclaimed") {
  RuntimeDir dir;
  const int fds_before = count_fds();
  {
    Trainer t("gd");
    t.lend(BB_GRANT_HOST, 1 * kMiB);
    Child task(task_args("gd", "victim", "iterative", {"--mem", "100000", "--grant-seed", "5"}));
    REQUIRE(task.wait_line("ATTACHED") != "");
    REQUIRE(t.until_granted(task) != 0);
    CHECK(t.grants().granted_bytes == 102400);  // page-rounded
    // The trainer reads the results its task writes through this address; the task may die
    // (or leave) at any moment meanwhile.
    const bb_grant_info_t g = t.grant_of(t.task_id("victim"));
    REQUIRE(g.address != 0);
    // The safe way to read them: a copy the release waits for.
    std::vector<uint32_t> copy(g.bytes / 4);
    REQUIRE(bb_trainer_read_grant(t.h, g.id, 0, copy.data(), g.bytes) == BB_OK);
    CHECK(pattern_ok(reinterpret_cast<uint64_t>(copy.data()), g.bytes, 5));
    REQUIRE(bb_trainer_read_grant(t.h, g.id, 400, copy.data(), 8) == BB_OK);
    CHECK(copy[0] == pattern_word(5, 100));
    CHECK(copy[1] == pattern_word(5, 101));
    // Only the grant's own bytes: not past them (100000 of the 102400 page-rounded), nor a
    // range whose end wraps.
    CHECK(bb_trainer_read_grant(t.h, g.id, g.bytes - 4, copy.data(), 8) == BB_E_INVALID);
    CHECK(std::string(bb_last_error()).find("outside grant") != std::string::npos);
    CHECK(bb_trainer_read_grant(t.h, g.id, UINT64_MAX, copy.data(), 2) == BB_E_INVALID);
    CHECK(bb_trainer_read_grant(t.h, g.id, g.bytes, copy.data(), 0) == BB_OK);
    task.signal(SIGKILL);
    CHECK(task.wait_exit() != -1);
    REQUIRE(eventually([&] { return t.grants().released_dead == 1; }));
    const bb_grant_stats_t s = t.grants();
    CHECK(s.tasks_killed == 0);
    check_lender_empty(s);
    // A read of the released grant does not fault the trainer (before, this test died of
    // SIGSEGV here): it sees zeros, the task's data having gone with its memfd.
    const auto* p = reinterpret_cast<const volatile unsigned char*>(g.address);
    unsigned sum = 0;
    for (uint64_t i = 0; i < g.bytes; i += 4096) sum += p[i];
    CHECK(sum == 0);
    CHECK(bb_trainer_read_grant(t.h, g.id, 0, copy.data(), 4) == BB_E_NOT_FOUND);
  }
  CHECK(fds_back_to(fds_before));
}

TEST_CASE("task_leaving_its_slot_still_mapping_a_grant_is_killed") {
  RuntimeDir dir;
  Trainer t("gl");
  t.lend(BB_GRANT_HOST, 1 * kMiB);
  Child task(task_args("gl", "sly", "grant-leave", {"--mem", "4096", "--grant-seed", "1"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(t.until_granted(task) != 0);
  REQUIRE(task.wait_line("LEAVING") != "");
  // Its connection closed but its process lives on with the memory mapped: killed, then the
  // grant goes back once the kernel reports the process gone.
  CHECK(killed_by_sigkill(task.wait_exit(10000)));
  REQUIRE(eventually([&] { return t.grants().released_dead == 1; }));
  CHECK(t.grants().tasks_killed == 1);
  check_lender_empty(t.grants());
}

// Whether the process maps a host grant (a memfd the lender named bubble-grant).
bool maps_host_grant(int pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find("bubble-grant") != std::string::npos) return true;
  return false;
}

TEST_CASE("close_returns_once_a_task_gave_its_grant_back") {
  RuntimeDir dir;
  const auto shm_before = bbtest::dev_shm();
  Trainer t("gc");
  t.lend(BB_GRANT_HOST, 1 * kMiB);
  // It outlives its trainer (waiting for another to open the hub), so a task taken for one that
  // kept its grant would be killed, not merely exit.
  Child task(task_args("gc", "polite", "iterative",
                       {"--mem", "65536", "--grant-seed", "3", "--wait", "--reattach-ms", "60000"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(t.until_granted(task) != 0);
  REQUIRE(maps_host_grant(task.pid()));
  // The task hears the trainer is closing, unmaps its grant and says so; close waits for that
  // rather than free the memory under it, and does not kill a task that let go.
  bb_trainer_close(t.h);
  t.h = nullptr;
  CHECK_FALSE(maps_host_grant(task.pid()));
  CHECK(task.wait_exit(0) == -1);  // alive, waiting for a trainer
  CHECK(dir.files().empty());
  CHECK(bbtest::dev_shm() == shm_before);
}

TEST_CASE("close_kills_a_task_that_keeps_its_grant_before_the_memory_goes") {
  RuntimeDir dir;
  Trainer t("gq");
  t.lend(BB_GRANT_HOST, 1 * kMiB);
  Child task(task_args("gq", "clingy", "grant-hang", {"--mem", "65536", "--grant-seed", "4"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(t.until_granted(task) != 0);
  // It never calls libbubble again: close revokes the grant, kills it at the deadline and
  // returns once the kernel reports it dead.
  bb_trainer_close(t.h);
  t.h = nullptr;
  CHECK(killed_by_sigkill(task.wait_exit(0)));
}

// bb_trainer_unlend: every grant comes back, the memory goes, and a new lend (here another size)
// grants the same tasks again.
TEST_CASE("unlend_takes_every_grant_back_and_a_new_lend_grants_again") {
  RuntimeDir dir;
  const auto shm_before = bbtest::dev_shm();
  const int fds_before = count_fds();
  {
    Trainer t("gu");
    t.lend(BB_GRANT_HOST, 1 * kMiB);
    Child a(task_args("gu", "a", "iterative", {"--mem", std::to_string(64 * kKiB),
                                              "--grant-seed", "11", "--step-us", "100"}));
    Child b(task_args("gu", "b", "iterative", {"--mem", std::to_string(128 * kKiB),
                                              "--grant-seed", "12", "--step-us", "100"}));
    REQUIRE(a.wait_line("ATTACHED") != "");
    REQUIRE(b.wait_line("ATTACHED") != "");
    const uint64_t ga = t.until_granted(a), gb = t.until_granted(b);
    REQUIRE(ga != 0);
    REQUIRE(gb != 0);
    REQUIRE(maps_host_grant(a.pid()));
    REQUIRE(maps_host_grant(b.pid()));

    // Both give their grants back when asked; nobody is killed, and the memory is gone.
    const bb_status st = bb_trainer_unlend(t.h, bb_now_ns() + 30'000'000'000ull);
    INFO(bb_last_error());
    REQUIRE(st == BB_OK);
    CHECK_FALSE(maps_host_grant(a.pid()));
    CHECK_FALSE(maps_host_grant(b.pid()));
    bb_grant_stats_t s = t.grants();
    CHECK(s.backend == 0);
    CHECK(s.capacity == 0);
    CHECK(s.revokes == 2);
    CHECK(s.revokes_acked == 2);
    CHECK(s.tasks_killed == 0);
    CHECK(bb_trainer_grant(t.h, t.task_id("a"), 0, nullptr) == BB_E_STATE);
    CHECK(bb_trainer_unlend(t.h, 0) == BB_E_STATE);  // nothing lent any more

    // As before the first lend, the tasks are started without grants.
    const uint64_t starts = t.stats().starts;
    CHECK(t.bubbles_until([&] { return t.stats().starts >= starts + 4; }));

    // Lent again, four times the size: each task is granted again, unasked, a new grant that it
    // fills, and the trainer reads it there.
    t.lend(BB_GRANT_HOST, 4 * kMiB);
    const uint64_t ga2 = t.until_granted(a), gb2 = t.until_granted(b);
    CHECK(ga2 > std::max(ga, gb));
    CHECK(gb2 > std::max(ga, gb));
    s = t.grants();
    CHECK(s.backend == BB_GRANT_HOST);
    CHECK(s.capacity == 4 * kMiB);
    CHECK(s.active == 2);
    CHECK(s.granted_bytes == 192 * kKiB);
    const bb_grant_info_t g = t.grant_of(t.task_id("b"));
    CHECK(g.bytes == 128 * kKiB);
    CHECK(pattern_ok(g.address, g.bytes, 12));
  }
  CHECK(fds_back_to(fds_before));
  CHECK(bbtest::dev_shm() == shm_before);
  CHECK(dir.files().empty());
}

// A holder that ignores the request is killed at the deadline; unlend returns once the kernel
// reports it dead, and meanwhile no grant is made (asked from another thread while unlend waits,
// which also reads the grant statistics throughout).
TEST_CASE("unlend_kills_a_holder_that_keeps_its_grant_and_makes_no_grant_meanwhile") {
  RuntimeDir dir;
  const auto shm_before = bbtest::dev_shm();
  {
    Trainer t("gv");
    t.lend(BB_GRANT_HOST, 1 * kMiB);
    Child deaf(task_args("gv", "deaf", "grant-hang", {"--mem", "65536", "--grant-seed", "9"}));
    Child plain(task_args("gv", "plain", "attach-only"));
    REQUIRE(deaf.wait_line("ATTACHED") != "");
    REQUIRE(plain.wait_line("ATTACHED") != "");
    REQUIRE(t.until_granted(deaf) != 0);
    const uint64_t plain_id = t.task_id("plain");
    bb_status unlent = BB_E_SYSTEM;
    std::atomic<bool> unlender_done{false};
    // A deadline of 3 s leaves the refused grant below time to land inside it on a slow machine.
    std::thread unlender([&] {
      unlent = bb_trainer_unlend(t.h, bb_now_ns() + 3'000'000'000ull);
      unlender_done = true;
    });
    const bool revoking = eventually([&] { return t.grants().revoking == 1; });
    const bb_status granted = bb_trainer_grant(t.h, plain_id, 4096, nullptr);
    const std::string why = bb_last_error();
    // Statistics read all through the call, the lender's free included: the lent range or
    // nothing, never garbage.
    bool whole = true;
    while (!unlender_done) {
      const bb_grant_stats_t s = t.grants();
      whole &= s.capacity == 0 || s.capacity == 1 * kMiB;
    }
    CHECK(whole);
    unlender.join();
    CHECK(revoking);
    CHECK(granted == BB_E_STATE);
    CHECK(why.find("being taken back") != std::string::npos);
    CHECK(unlent == BB_OK);
    CHECK(killed_by_sigkill(deaf.wait_exit(0)));  // already dead when unlend returned
    const bb_grant_stats_t s = t.grants();
    CHECK(s.backend == 0);
    CHECK(s.tasks_killed == 1);
  }
  CHECK(bbtest::dev_shm() == shm_before);
}

// A grant already being revoked with a far deadline is taken back by unlend's: its holder is
// killed then, not a minute later, and unlend returns BB_OK.
TEST_CASE("unlend_brings_an_earlier_revokes_deadline_forward") {
  RuntimeDir dir;
  Trainer t("gw");
  t.lend(BB_GRANT_HOST, 1 * kMiB);
  Child deaf(task_args("gw", "deaf", "grant-hang", {"--mem", "65536", "--grant-seed", "2"}));
  REQUIRE(deaf.wait_line("ATTACHED") != "");
  REQUIRE(t.until_granted(deaf) != 0);
  const uint64_t id = t.task_id("deaf");
  const uint64_t far = bb_now_ns() + 60'000'000'000ull;
  REQUIRE(bb_trainer_revoke(t.h, id, far) == BB_OK);
  const uint64_t soon = bb_now_ns() + 300'000'000ull;
  const bb_status st = bb_trainer_unlend(t.h, soon);
  INFO(bb_last_error());
  CHECK(st == BB_OK);
  CHECK(killed_by_sigkill(deaf.wait_exit(0)));  // dead when unlend returned, long before `far`
  CHECK(t.grants().tasks_killed == 1);
  CHECK(t.grants().backend == 0);
}

namespace {

// One counter of a bb_test_trainer "STATS key=value ..." line (UINT64_MAX if it is missing).
uint64_t stat_of(const std::string& line, const std::string& key) {
  const size_t at = line.find(" " + key + "=");
  return at == std::string::npos ? UINT64_MAX
                                 : std::strtoull(line.c_str() + at + key.size() + 2, nullptr, 10);
}

}  // namespace

// A holder the kill cannot reach (the trainer runs as another user, the task as root): unlend
// gives up past its deadline with BB_E_TIMEOUT and the memory stays lent to it, while a task
// that gave its grant back is granted again; once the holder is gone, unlend frees it all.
TEST_CASE("unlend_times_out_on_a_holder_it_cannot_kill_and_keeps_the_memory_lent") {
  if (geteuid() != 0) {
    MESSAGE("skipped: needs root, to run the trainer as another user than its task");
    return;
  }
  constexpr uid_t kNobody = 65534;
  RuntimeDir dir;
  REQUIRE(chown(dir.path().c_str(), kNobody, kNobody) == 0);
  const auto shm_before = bbtest::dev_shm();
  Child trainer({trainer_bin(), "gx", "0", "--uid", std::to_string(kNobody), "--lend",
                 "host:1048576", "--commands", "--bubble-us", "1000", "--gap-us", "1000"},
                true);
  REQUIRE(trainer.wait_line("LENT") != "");
  const std::string as_nobody = std::to_string(kNobody);
  Child deaf(task_args("gx", "deaf", "grant-hang",
                       {"--mem", "65536", "--grant-seed", "5", "--attach-uid", as_nobody}));
  Child coop(task_args("gx", "coop", "iterative", {"--mem", "65536", "--grant-seed", "6",
                                                   "--step-us", "100", "--attach-uid", as_nobody}));
  REQUIRE(deaf.wait_line("GRANT") != "");
  REQUIRE(coop.wait_line("GRANT") != "");

  REQUIRE(trainer.write_stdin("U 300\n"));
  const std::string timed_out = trainer.wait_line("UNLENT", 30000);
  INFO(timed_out);
  CHECK(timed_out.rfind("UNLENT BB_E_TIMEOUT", 0) == 0);
  CHECK(timed_out.find("1 grant(s) were not given back") != std::string::npos);
  CHECK(timed_out.find("stays lent") != std::string::npos);
  // The holder lives on and still maps its grant; the memory under it was not freed.
  CHECK(kill(deaf.pid(), 0) == 0);
  CHECK(maps_host_grant(deaf.pid()));
  // The other task gave its grant back, and is granted again (a new id, filled anew).
  CHECK(coop.wait_line("GRANT") != "");
  REQUIRE(trainer.write_stdin("S\n"));
  const std::string lent = trainer.wait_line("STATS");
  INFO(lent);
  CHECK(stat_of(lent, "capacity") == 1 * kMiB);
  CHECK(stat_of(lent, "killed") == 0);  // the kill was refused
  CHECK(stat_of(lent, "active") + stat_of(lent, "revoking") == 2);

  // Once the holder is gone its grant comes back, and unlend frees the memory.
  REQUIRE(kill(deaf.pid(), SIGKILL) == 0);
  CHECK(killed_by_sigkill(deaf.wait_exit(10000)));
  REQUIRE(trainer.write_stdin("U 5000\n"));
  const std::string unlent = trainer.wait_line("UNLENT", 30000);
  CHECK(unlent == "UNLENT BB_OK");
  REQUIRE(trainer.write_stdin("S\n"));
  const std::string after = trainer.wait_line("STATS");
  INFO(after);
  CHECK(stat_of(after, "capacity") == 0);
  CHECK(stat_of(after, "active") == 0);
  REQUIRE(trainer.write_stdin("Q\n"));
  CHECK(trainer.wait_line("CLOSED") == "CLOSED BB_OK");
  CHECK(trainer.wait_exit() == 0);
  CHECK(coop.wait_line("RESULT").find("BB_E_TRAINER_GONE") != std::string::npos);
  CHECK(bbtest::dev_shm() == shm_before);
}

TEST_CASE("grants_never_overlap_and_freed_ranges_coalesce_for_a_waiting_task") {
  RuntimeDir dir;
  Trainer t("go", 4);
  t.lend(BB_GRANT_HOST, 1 * kMiB);
  std::vector<std::unique_ptr<Child>> kids;
  const char* names[] = {"a", "b", "c"};
  for (int i = 0; i < 3; ++i) {
    kids.push_back(std::make_unique<Child>(task_args(
        "go", names[i], "iterative",
        {"--mem", std::to_string(256 * kKiB), "--grant-seed", std::to_string(100 + i)})));
    REQUIRE(kids.back()->wait_line("ATTACHED") != "");
  }
  for (auto& k : kids) REQUIRE(t.until_granted(*k) != 0);
  // A fourth wants more than is left: it waits, unstarted.
  Child big(task_args("go", "big", "iterative",
                      {"--mem", std::to_string(512 * kKiB), "--grant-seed", "200"}));
  REQUIRE(big.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.grants().grants_failed >= 1; }));
  for (int i = 0; i < 20; ++i) t.bubble();
  CHECK(big.wait_line("GRANT", 5) == "");
  CHECK(t.grant_of(t.task_id("big")).state == BB_GRANT_STATE_NONE);

  bb_grant_stats_t s = t.grants();
  CHECK(s.active == 3);
  CHECK(s.granted_bytes == 768 * kKiB);
  CHECK(s.free_bytes == 256 * kKiB);
  std::vector<bb_grant_info_t> gs;
  for (const char* n : names) gs.push_back(t.grant_of(t.task_id(n)));
  for (size_t i = 0; i < gs.size(); ++i) {
    CHECK(gs[i].offset + gs[i].bytes <= 1 * kMiB);
    CHECK(pattern_ok(gs[i].address, gs[i].bytes, uint32_t(100 + i)));
    for (size_t j = i + 1; j < gs.size(); ++j)
      CHECK((gs[i].offset + gs[i].bytes <= gs[j].offset ||
             gs[j].offset + gs[j].bytes <= gs[i].offset));
  }
  // Free the grant that borders the free tail: the two coalesce into room for the big task.
  size_t last = 0;
  for (size_t i = 1; i < gs.size(); ++i)
    if (gs[i].offset > gs[last].offset) last = i;
  REQUIRE(gs[last].offset + gs[last].bytes == 768 * kKiB);
  kids[last]->signal(SIGKILL);
  CHECK(kids[last]->wait_exit() != -1);
  REQUIRE(t.until_granted(big) != 0);
  const bb_grant_info_t bg = t.grant_of(t.task_id("big"));
  CHECK(bg.offset == gs[last].offset);
  CHECK(bg.bytes == 512 * kKiB);
  CHECK(pattern_ok(bg.address, bg.bytes, 200));
  for (size_t i = 0; i < gs.size(); ++i)
    if (i != last) CHECK(pattern_ok(gs[i].address, gs[i].bytes, uint32_t(100 + i)));
  s = t.grants();
  CHECK(s.active == 3);
  CHECK(s.granted_bytes == 1 * kMiB);
  CHECK(s.free_bytes == 0);
  CHECK(s.released_dead == 1);
}

TEST_CASE("lend_and_grant_calls_reject_bad_input_with_a_clear_error") {
  RuntimeDir dir;
  Trainer t("ge");
  CHECK(bb_trainer_lend(t.h, nullptr) == BB_E_INVALID);
  bb_lend_options_t lo;
  bb_lend_options_init(&lo);
  CHECK(bb_trainer_lend(t.h, &lo) == BB_E_INVALID);  // no bytes
  CHECK(std::string(bb_last_error()).find("bytes") != std::string::npos);
  lo.bytes = kMiB;
  lo.backend = 9;
  CHECK(bb_trainer_lend(t.h, &lo) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("bb_grant_backend") != std::string::npos);
  lo.backend = BB_GRANT_HOST;
  lo.size = 4;
  CHECK(bb_trainer_lend(t.h, &lo) == BB_E_INVALID);
  lo.size = sizeof lo;
  lo.device_ptr = 0x1000;  // existing memory is for cuda-ipc only
  CHECK(bb_trainer_lend(t.h, &lo) == BB_E_INVALID);
  lo.device_ptr = 0;
  lo.clear_grants = 2;
  CHECK(bb_trainer_lend(t.h, &lo) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("clear_grants is 2") != std::string::npos);
  // A caller built before clear_grants existed passes the shorter struct; the field is not read.
  lo.size = offsetof(bb_lend_options_t, clear_grants);
  // Nothing lent yet: no grants, and stats say so.
  bb_grant_stats_t s{sizeof s};
  REQUIRE(bb_trainer_grant_stats(t.h, &s) == BB_OK);
  CHECK(s.backend == 0);
  CHECK(s.capacity == 0);
  CHECK(bb_trainer_revoke(t.h, 12345, 0) == BB_E_NOT_FOUND);
  char buf[16];
  CHECK(bb_trainer_read_grant(t.h, 1, 0, buf, sizeof buf) == BB_E_STATE);
  CHECK(std::string(bb_last_error()).find("no memory is lent") != std::string::npos);
  CHECK(bb_trainer_read_grant(nullptr, 1, 0, buf, sizeof buf) == BB_E_INVALID);
  CHECK(bb_trainer_read_grant(t.h, 1, 0, nullptr, sizeof buf) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("dst is NULL") != std::string::npos);
  CHECK(bb_trainer_unlend(nullptr, 0) == BB_E_INVALID);
  CHECK(bb_trainer_unlend(t.h, 0) == BB_E_STATE);
  CHECK(std::string(bb_last_error()).find("no memory is lent") != std::string::npos);
  REQUIRE(bb_trainer_lend(t.h, &lo) == BB_OK);
  CHECK(bb_trainer_lend(t.h, &lo) == BB_E_BUSY);
  CHECK(std::string(bb_last_error()).find("bb_trainer_unlend") != std::string::npos);
  CHECK(bb_trainer_grant(t.h, 77, 4096, nullptr) == BB_E_NOT_FOUND);
  bb_grant_info_t g{sizeof g};
  CHECK(bb_trainer_task_grant(t.h, 77, &g) == BB_E_NOT_FOUND);
  CHECK(bb_trainer_read_grant(t.h, 77, 0, buf, sizeof buf) == BB_E_NOT_FOUND);
  CHECK(std::string(bb_last_error()).find("grant 77 is not live") != std::string::npos);
  // A task without mem_need is not granted unasked, and grant(0) needs a size.
  Child task(task_args("ge", "plain", "attach-only"));
  REQUIRE(task.wait_line("ATTACHED") != "");
  const uint64_t id = t.task_id("plain");
  CHECK(t.grant_of(id).state == BB_GRANT_STATE_NONE);
  CHECK(bb_trainer_revoke(t.h, id, 0) == BB_E_NOT_FOUND);
  CHECK(bb_trainer_grant(t.h, id, 0, nullptr) == BB_E_INVALID);
  // More than all the lent memory (1 MiB): no release would make room, so it is not "no room".
  CHECK(bb_trainer_grant(t.h, id, 2 * kMiB, nullptr) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("larger than all the lent memory (1048576 bytes)") !=
        std::string::npos);
  CHECK(bb_task_grant(nullptr, nullptr) == BB_E_INVALID);
}

TEST_CASE("cuda_lend_without_a_driver_is_unsupported_with_the_reason") {
  RuntimeDir dir;
  ScopedEnv env("BUBBLE_CUDA_DRIVER", "/nonexistent/libcuda.so.1");
  for (const char* backend : {"cuda-vmm", "cuda-ipc"}) {
    Child trainer({trainer_bin(), "gu", "0", "--lend", std::string(backend) + ":8388608"});
    const std::string line = trainer.wait_line("LEND_FAILED");
    CHECK(line.find("BB_E_UNSUPPORTED") != std::string::npos);
    CHECK(line.find("needs the CUDA driver") != std::string::npos);
    CHECK(line.find("BUBBLE_CUDA_DRIVER") != std::string::npos);
    const int status = trainer.wait_exit();
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 3));
  }
  // The host backend needs no driver; the trainer lends, runs bubbles and closes cleanly when
  // told to on its stdin.
  Child trainer({trainer_bin(), "gu", "0", "--lend", "host:1048576", "--commands"}, true);
  CHECK(trainer.wait_line("LENT") != "");
  REQUIRE(trainer.write_stdin("Q\n"));
  const std::string closed = trainer.wait_line("CLOSED");
  if (closed.empty()) MESSAGE("no CLOSED after Q; " << trainer.describe());
  CHECK(closed == "CLOSED BB_OK");
  CHECK(trainer.wait_exit() == 0);
}

namespace {

// The double's bookkeeping in this process (the trainer's side), through the loaded library.
bool double_counts(bbdouble_counts* c, std::string* violations) {
  void* h = dlopen(double_path().c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!h) return false;
  auto outstanding = reinterpret_cast<void (*)(bbdouble_counts*)>(dlsym(h, "bbdouble_outstanding"));
  auto viol = reinterpret_cast<size_t (*)(char*, size_t)>(dlsym(h, "bbdouble_violations"));
  if (outstanding) outstanding(c);
  char buf[2048] = {0};
  if (viol) viol(buf, sizeof buf);
  *violations = buf;
  dlclose(h);
  return outstanding != nullptr;
}

// The double's call log in this process since its last reset; reset it after reading.
std::string double_log(bool reset) {
  void* h = dlopen(double_path().c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!h) return "";
  auto log = reinterpret_cast<size_t (*)(char*, size_t)>(dlsym(h, "bbdouble_log"));
  auto rst = reinterpret_cast<void (*)()>(dlsym(h, "bbdouble_reset"));
  std::string s;
  if (log) {
    s.resize(log(nullptr, 0) + 1);
    s.resize(log(s.data(), s.size()));
  }
  if (reset && rst) rst();
  dlclose(h);
  return s;
}

// key=value of a log line, "" without it.
std::string arg_of(const std::string& line, const std::string& key) {
  const size_t k = line.find(" " + key + "=");
  if (k == std::string::npos) return "";
  const size_t v = k + key.size() + 2;
  return line.substr(v, line.find(' ', v) - v);
}

std::vector<std::string> log_lines(const std::string& log, const std::string& name) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < log.size()) {
    const size_t nl = log.find('\n', pos);
    std::string line = log.substr(pos, nl - pos);
    pos = nl == std::string::npos ? log.size() : nl + 1;
    if (line.compare(0, name.size() + 1, name + " ") == 0) out.push_back(line);
  }
  return out;
}

// clear: what the trainer lends with (-1: the default); old_struct: it passes the struct of a
// caller built before clear_grants existed.
void cuda_end_to_end(bb_grant_backend backend, const char* job, int clear = -1,
                     bool old_struct = false) {
  RuntimeDir dir;
  ScopedEnv env("BUBBLE_CUDA_DRIVER", double_path());
  const int fds_before = count_fds();
  const bool cleared = clear != 0;
  {
    Trainer t(job);
    t.lend(backend, 16 * kMiB, clear,
           old_struct ? uint32_t(offsetof(bb_lend_options_t, clear_grants)) : 0);
    double_log(true);
    Child task(task_args(job, "gpu", "iterative", {"--mem", std::to_string(kMiB),
                                                   "--grant-seed", "42"}));
    REQUIRE(task.wait_line("ATTACHED") != "");
    const uint64_t gid = t.until_granted(task);
    REQUIRE(gid != 0);
    const uint64_t id = t.task_id("gpu");
    const bb_grant_info_t g = t.grant_of(id);
    CHECK(g.backend == uint32_t(backend));
    CHECK(g.bytes == kMiB);
    CHECK(g.mapped == 1);
    // The double's device memory is host memory: the trainer's device pointer reads it.
    CHECK(pattern_ok(g.address, g.bytes, 42));
    // The hub's service thread zeroed exactly the grant, on a stream of its own, and waited for
    // that stream before the task was told of the grant (it wrote its pattern after).
    const std::string log = double_log(false);
    const auto memsets = log_lines(log, "cuMemsetD8Async");
    const auto syncs = log_lines(log, "cuStreamSynchronize");
    INFO(log);
    if (cleared) {
      REQUIRE(memsets.size() == 1);
      REQUIRE(syncs.size() == 1);
      CHECK(arg_of(memsets[0], "ptr") == std::to_string(g.address));
      CHECK(arg_of(memsets[0], "size") ==
            std::to_string(backend == BB_GRANT_CUDA_VMM ? 2 * kMiB : kMiB));
      CHECK(arg_of(memsets[0], "value") == "0");
      CHECK(arg_of(memsets[0], "stream") != "0");
      CHECK(arg_of(syncs[0], "stream") == arg_of(memsets[0], "stream"));
      CHECK(log.find("cuMemsetD8Async") < log.find("cuStreamSynchronize"));
      CHECK(syncs[0].find("-> CUDA_SUCCESS") != std::string::npos);
    } else {
      CHECK(memsets.empty());
      CHECK(syncs.empty());
      CHECK(log_lines(log, "cuStreamCreate").empty());
    }
    // bb_trainer_read_grant copies the task's bytes out on the lender's own stream (the one
    // that clears grants), which it waits for.
    double_log(true);
    std::vector<uint32_t> copy(g.bytes / 4);
    REQUIRE(bb_trainer_read_grant(t.h, g.id, 0, copy.data(), g.bytes) == BB_OK);
    CHECK(pattern_ok(reinterpret_cast<uint64_t>(copy.data()), g.bytes, 42));
    {
      const std::string rlog = double_log(false);
      INFO(rlog);
      const auto copies = log_lines(rlog, "cuMemcpyAsync");
      const auto waits = log_lines(rlog, "cuStreamSynchronize");
      REQUIRE(copies.size() == 1);
      REQUIRE(waits.size() == 1);
      CHECK(arg_of(copies[0], "src") == std::to_string(g.address));
      CHECK(arg_of(copies[0], "dst") == std::to_string(reinterpret_cast<uint64_t>(copy.data())));
      CHECK(arg_of(copies[0], "stream") != "0");
      CHECK(arg_of(waits[0], "stream") == arg_of(copies[0], "stream"));
      if (cleared) CHECK(arg_of(copies[0], "stream") == arg_of(memsets[0], "stream"));
    }
    const bb_grant_stats_t s = t.grants();
    CHECK(s.capacity == 16 * kMiB);
    CHECK(s.active == 1);
    // cuda-vmm rounds a grant up to the allocation granularity (the double's: 2 MiB).
    CHECK(s.granted_bytes == (backend == BB_GRANT_CUDA_VMM ? 2 * kMiB : kMiB));
    REQUIRE(bb_trainer_revoke(t.h, id, bb_now_ns() + 30'000'000'000ull) == BB_OK);
    REQUIRE(eventually([&] { return t.grants().revokes_acked == 1; }));
    // Given back: its bytes went with it, and reading them is refused, not a fault.
    CHECK(bb_trainer_read_grant(t.h, g.id, 0, copy.data(), 4) == BB_E_NOT_FOUND);
    CHECK(std::string(bb_last_error()).find("is not live") != std::string::npos);
    check_lender_empty(t.grants());
    REQUIRE(bb_trainer_stop_task(t.h, id) == BB_OK);
    CHECK(task.wait_line("RESULT").find("BB_E_STOPPED") != std::string::npos);
    CHECK(task.wait_exit() == 0);
  }
  // Closing the hub gave every driver object back.
  bbdouble_counts c{};
  std::string violations;
  REQUIRE(double_counts(&c, &violations));
  CHECK(c.physical == 0);
  CHECK(c.mappings == 0);
  CHECK(c.reservations == 0);
  CHECK(c.device_allocs == 0);
  CHECK(c.ctx_retains == 0);
  CHECK(c.streams == 0);
  CHECK_MESSAGE(c.violations == 0, violations);
  CHECK(fds_back_to(fds_before));
}

}  // namespace

TEST_CASE("cuda_vmm_grant_end_to_end_through_the_driver_double") {
  cuda_end_to_end(BB_GRANT_CUDA_VMM, "gv");
}

TEST_CASE("cuda_ipc_grant_end_to_end_through_the_driver_double") {
  cuda_end_to_end(BB_GRANT_CUDA_IPC, "gp");
}

TEST_CASE("cuda_grants_of_a_caller_built_before_clear_grants_are_cleared") {
  cuda_end_to_end(BB_GRANT_CUDA_VMM, "go", -1, true);
}

TEST_CASE("cuda_grants_lent_with_clear_grants_0_skip_the_memset") {
  cuda_end_to_end(BB_GRANT_CUDA_VMM, "gz", 0);
  cuda_end_to_end(BB_GRANT_CUDA_IPC, "gy", 0);
}

TEST_CASE("a_long_read_of_a_grant_lets_the_hub_service_in_between_its_pieces") {
  // bb_trainer_read_grant copies 4 MiB at a time under the lender's lock. Between two pieces it
  // unlocked and locked again at once, which let no waiting thread in: the hub's service thread
  // (here answering bb_trainer_task_grant) waited for the whole copy.
  RuntimeDir dir;
  Trainer t("gread");
  t.lend(BB_GRANT_HOST, 256 * kMiB);
  Child task(task_args("gread", "w", "imperative",
                       {"--mem", std::to_string(128 * kMiB), "--grant-seed", "3"}));
  const uint64_t gid = t.attached_and_granted(task);
  const uint64_t id = t.task_id("w");
  std::atomic<bool> stop{false}, reading{false};
  std::atomic<uint64_t> reads{0};
  std::vector<char> buf(128 * kMiB);
  std::thread reader([&] {
    while (!stop.load()) {
      reading = true;
      CHECK(bb_trainer_read_grant(t.h, gid, 0, buf.data(), buf.size()) == BB_OK);
      reads.fetch_add(1);
    }
  });
  REQUIRE(eventually([&] { return reading.load(); }));
  // Answered inside one read (no read ended meanwhile): with the hand-over, nearly every time;
  // without it, never (the answer waited for the read's end, and the count moves first). A
  // service thread slow to wake on a loaded machine may miss a read's end now and then: of
  // twenty tries, one is asked to land.
  int inside = 0;
  for (int k = 0; k < 20; ++k) {
    const uint64_t before = reads.load();
    bb_grant_info_t g{sizeof g};
    CHECK(bb_trainer_task_grant(t.h, id, &g) == BB_OK);
    if (reads.load() == before) ++inside;
  }
  stop = true;
  reader.join();
  CHECK(inside > 0);
  CHECK(pattern_ok(reinterpret_cast<uint64_t>(buf.data()), buf.size(), 3));
}

TEST_CASE("a_mem_need_larger_than_all_the_lent_memory_is_not_tried_again_and_again") {
  // Taken for "no room now", it was tried again whenever memory was released or a task
  // attached, for good, and failed each time.
  RuntimeDir dir;
  Trainer t("gbig");
  t.lend(BB_GRANT_HOST, kMiB);
  Child big(task_args("gbig", "big", "attach-only", {"--mem", std::to_string(2 * kMiB)}));
  REQUIRE(big.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return t.grants().grants_failed == 1; }));
  for (const char* name : {"other1", "other2"}) {  // each attach tries the waiting ones again
    Child other(task_args("gbig", name, "attach-only"));
    REQUIRE(other.wait_line("ATTACHED") != "");
    REQUIRE(eventually([&] { return t.stats().tasks_attached == 2; }));
    other.signal(SIGKILL);
    CHECK(other.wait_exit() != -1);
    REQUIRE(eventually([&] { return t.stats().tasks_attached == 1; }));
  }
  CHECK(t.grants().grants_failed == 1);
  CHECK(t.grant_of(t.task_id("big")).state == BB_GRANT_STATE_NONE);
  // Asked for by name, it says why.
  CHECK(bb_trainer_grant(t.h, t.task_id("big"), 0, nullptr) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("larger than all the lent memory") != std::string::npos);
}

TEST_CASE("a_task_at_its_descriptor_limit_is_told_why_its_grant_cannot_be_mapped") {
  // A host grant comes as a memfd. A task with no room for another descriptor used to report
  // the grant as corrupt ("the trainer's libbubble may be of another version").
  RuntimeDir dir;
  Trainer t("gfd");
  Child task(task_args("gfd", "w", "imperative",
                       {"--mem", std::to_string(kMiB), "--fd-room-attached", "0"}));
  REQUIRE(task.wait_line("ATTACHED") != "");
  // Granted once its limit is down: the wait it is in maps the grant.
  t.lend(BB_GRANT_HOST, 4 * kMiB, -1, 0, false);
  uint64_t gid = 0;
  REQUIRE(bb_trainer_grant(t.h, t.task_id("w"), 0, &gid) == BB_OK);
  const std::string result = task.wait_line("RESULT");
  CAPTURE(result);
  CHECK(result.rfind("RESULT BB_E_SYSTEM ", 0) == 0);
  CHECK(result.find("limit of open descriptors") != std::string::npos);
  CHECK(result.find("another version") == std::string::npos);
  CHECK(task.wait_exit() == 0);
  // The grant went back, and nothing of it stays lent.
  CHECK(eventually([&] { return t.grants().active == 0; }));
}

TEST_CASE("a_task_is_told_its_own_ordinal_of_the_gpu_its_grant_is_on") {
  // The trainer lends memory of its GPU 1 of two. A task that numbers the GPUs otherwise
  // (CUDA_VISIBLE_DEVICES, as the agent sets it) must run its device work on its own ordinal
  // of that GPU, which only the mapping knows (it finds the GPU by UUID).
  RuntimeDir dir;
  ScopedEnv env("BUBBLE_CUDA_DRIVER", double_path());
  ScopedEnv two("BUBBLE_CUDA_DOUBLE_DEVICES", "2");
  struct Case {
    const char* backend;
    const char* visible;  // the task's CUDA_VISIBLE_DEVICES, nullptr: unset
    int device;           // what bb_task_grant says
  };
  const Case cases[] = {{"cuda-ipc", nullptr, 1}, {"cuda-ipc", "1,0", 0}, {"cuda-vmm", "1", 0},
                        {"cuda-vmm", "0,1", 1}, {"host", nullptr, -1}};
  for (const Case& c : cases) {
    CAPTURE(c.backend);
    CAPTURE(c.visible ? c.visible : "(unset)");
    Child trainer({trainer_bin(), "gd", "0", "--lend", std::string(c.backend) + ":4194304",
                   "--lend-device", std::string(c.backend) == "host" ? "0" : "1",
                   "--await-tasks", "1"});
    REQUIRE(trainer.wait_line("LENT") != "");
    std::string line;
    {
      std::optional<ScopedEnv> visible;
      if (c.visible) visible.emplace("CUDA_VISIBLE_DEVICES", c.visible);
      Child task(task_args("gd", "dev", "iterative",
                           {"--mem", std::to_string(kMiB), "--grant-seed", "5", "--grant-device"}));
      line = task.wait_line("GRANT");
      trainer.signal(SIGTERM);
      CHECK(trainer.wait_line("CLOSED") == "CLOSED BB_OK");
      CHECK(task.wait_exit() == 0);
    }
    INFO(line);
    REQUIRE(line != "");
    CHECK(arg_of(line + " ", "device") == std::to_string(c.device));
    CHECK(trainer.wait_exit() == 0);
  }
}

TEST_CASE("a_cuda_grant_copied_out_as_its_task_is_killed_is_never_read_once_released") {
  // The trainer reads its task's results while the task may die at any instruction. Reading
  // the grant's device address directly can meet the release's unmap (a GPU fault, fatal to the
  // trainer's context); bb_trainer_read_grant holds the release back for the copy. The double
  // records any copy that met unmapped memory as a violation.
  RuntimeDir dir;
  ScopedEnv env("BUBBLE_CUDA_DRIVER", double_path());
  const int fds_before = count_fds();
  {
    Trainer t("gk");
    t.lend(BB_GRANT_CUDA_VMM, 16 * kMiB);
    double_log(true);
    for (int round = 1; round <= 3; ++round) {
      CAPTURE(round);
      Child task(task_args("gk", "victim" + std::to_string(round), "iterative",
                           {"--mem", std::to_string(kMiB), "--grant-seed", "7"}));
      REQUIRE(task.wait_line("ATTACHED") != "");
      const uint64_t gid = t.until_granted(task);
      REQUIRE(gid != 0);
      std::atomic<bool> stop{false};
      std::atomic<uint64_t> ok{0}, gone{0}, torn{0}, other{0};
      std::thread reader([&] {
        std::vector<uint32_t> buf(kMiB / 4);
        while (!stop.load()) {
          const bb_status st = bb_trainer_read_grant(t.h, gid, 0, buf.data(), kMiB);
          if (st == BB_OK)
            (pattern_ok(reinterpret_cast<uint64_t>(buf.data()), kMiB, 7) ? ok : torn)++;
          else
            (st == BB_E_NOT_FOUND ? gone : other)++;
        }
      });
      REQUIRE(eventually([&] { return ok.load() > 0; }));
      task.signal(SIGKILL);
      CHECK(task.wait_exit() != -1);
      REQUIRE(eventually([&] { return t.grants().released_dead == uint64_t(round); }));
      const bool refused_after = eventually([&] { return gone.load() > 0; });
      stop = true;
      reader.join();
      CHECK(refused_after);
      CHECK(torn.load() == 0);
      CHECK(other.load() == 0);
    }
    bbdouble_counts c{};
    std::string violations;
    REQUIRE(double_counts(&c, &violations));
    CHECK_MESSAGE(c.violations == 0, violations);
    check_lender_empty(t.grants());
  }
  CHECK(fds_back_to(fds_before));
}

TEST_CASE("task_without_a_cuda_driver_gives_a_cuda_grant_back") {
  RuntimeDir dir;
  ScopedEnv env("BUBBLE_CUDA_DRIVER", double_path());
  Trainer t("gn");
  t.lend(BB_GRANT_CUDA_VMM, 8 * kMiB);
  std::unique_ptr<Child> task;
  {
    ScopedEnv none("BUBBLE_CUDA_DRIVER", "/nonexistent/libcuda.so.1");
    task = std::make_unique<Child>(task_args("gn", "cpu", "iterative", {"--mem", "4096"}));
  }
  REQUIRE(task->wait_line("ATTACHED") != "");
  // Its runtime cannot map the grant: it says why, gives the grant back and finishes.
  CHECK(task->wait_line("RESULT").find("BB_E_UNSUPPORTED") != std::string::npos);
  CHECK(task->wait_exit() == 0);
  REQUIRE(eventually([&] { return t.stats().tasks_attached == 0 && t.grants().active == 0; }));
  const bb_grant_stats_t s = t.grants();
  CHECK(s.grants_made == 1);
  CHECK(s.tasks_killed == 0);
  check_lender_empty(s);
}

// A task attached from this process (the tests' own thread), needing mem_need bytes.
bb_task_h attach_in_process(const char* job, const char* name, uint64_t mem_need) {
  bb_task_options_t o;
  bb_task_options_init(&o);
  o.mem_need = mem_need;
  bb_task_h task = nullptr;
  const bb_status st = bb_task_attach(job, 0, name, &o, &task);
  INFO(bb_last_error());
  REQUIRE(st == BB_OK);
  return task;
}

TEST_CASE("a_task_in_the_trainers_own_process_is_never_killed_for_its_grant") {
  // A holder past its revoke deadline is killed: one in the trainer's own process would take
  // the trainer with it. It is kept like a holder the kill cannot reach.
  RuntimeDir dir;
  Trainer t("self");
  t.lend(BB_GRANT_HOST, kMiB);
  bb_task_h task = attach_in_process("self", "inproc", 65536);
  // Mapped (a grant never mapped is believed given back, and nobody is killed for it): the
  // task maps what it is offered while it waits for a start.
  REQUIRE(eventually([&] {
    bb_task_wait_start(task, 10'000'000, nullptr);
    bb_task_grant_t g{sizeof g};
    return bb_task_grant(task, &g) == BB_OK && g.ptr != nullptr;
  }));
  const uint64_t id = t.task_id("inproc");
  REQUIRE(bb_trainer_revoke(t.h, id, bb_now_ns() + 50'000'000ull) == BB_OK);
  // Well past the deadline, this process is still here, and the grant still out.
  REQUIRE(eventually([&] { return bb_now_ns() > t.grant_of(id).deadline_ns + 500'000'000ull; }));
  CHECK(t.grants().tasks_killed == 0);
  CHECK(t.grant_of(id).state == BB_GRANT_STATE_REVOKING);
  bb_task_detach(task);  // it gives the grant back as it goes
  REQUIRE(eventually([&] { return t.grants().revokes_acked == 1; }));
  check_lender_empty(t.grants());
}

TEST_CASE("a_start_whose_grant_was_revoked_before_the_task_looked_is_handed_back") {
  // A task with a mem_need runs only with its grant. The bubble thread named the grant in the
  // start; the revoke came before the task looked at either: the task does not run without it.
  RuntimeDir dir;
  Trainer t("withdrawn");
  t.lend(BB_GRANT_HOST, kMiB);
  bb_task_h task = attach_in_process("withdrawn", "needs", 65536);
  const uint64_t id = t.task_id("needs");
  REQUIRE(eventually([&] { return t.grant_of(id).id != 0; }));  // granted when it attached
  const uint64_t grant = t.grant_of(id).id;
  REQUIRE(bb_bubble_begin(t.h, 100'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) == BB_OK);
  REQUIRE(eventually([&] {
    for (const auto& k : t.tasks())
      if (k.id == id) return k.running != 0;
    return false;
  }));
  REQUIRE(bb_trainer_revoke(t.h, id, bb_now_ns() + 2'000'000'000ull) == BB_OK);
  bb_start_info_t info{sizeof info};
  const bb_status st = bb_task_wait_start(task, 100'000'000, &info);
  INFO("started with grant " << info.grant_id << " at " << info.grant_ptr);
  CHECK(st == BB_E_TIMEOUT);  // the start was handed back, and no other came in this bubble
  // It said so at once: the revoke is acked without anything mapped, the task not killed.
  REQUIRE(eventually([&] { return t.grants().revokes_acked == 1; }));
  CHECK(t.grants().tasks_killed == 0);
  CHECK(grant != 0);
  CHECK(bb_bubble_end(t.h) == BB_OK);
  bb_task_detach(task);
  check_lender_empty(t.grants());
}

TEST_CASE("a_grant_its_task_cannot_unmap_is_never_said_to_be_free") {
  RuntimeDir dir;
  ScopedEnv env("BUBBLE_CUDA_DRIVER", double_path());
  Trainer t("gu");
  t.lend(BB_GRANT_CUDA_VMM, 8 * kMiB);
  std::unique_ptr<Child> task;
  {
    ScopedEnv fail("BUBBLE_CUDA_DOUBLE_FAIL", "unmap");  // the task's driver cannot unmap
    task = std::make_unique<Child>(
        task_args("gu", "stuck", "iterative", {"--mem", std::to_string(kMiB), "--grant-seed", "7"}));
  }
  REQUIRE(task->wait_line("ATTACHED") != "");
  REQUIRE(t.until_granted(*task) != 0);
  const uint64_t id = t.task_id("stuck");
  // The task tries to unmap when it acks its pause, and fails. Saying the grant is given back
  // (as a second try that finds nothing left to unmap would) would let the trainer hand the
  // bytes to another task while they may still be mapped here. The memory is free again only
  // once the task is gone: its run ends with the error, or the deadline's kill ends it.
  REQUIRE(bb_trainer_revoke(t.h, id, bb_now_ns() + 1'000'000'000ull) == BB_OK);
  const std::string result = task->wait_line("RESULT", 15000);
  INFO("the task said: " << result);
  CHECK(result.find("BB_OK") == std::string::npos);
  const int status = task->wait_exit(15000);
  CHECK((killed_by_sigkill(status) || (status != -1 && WIFEXITED(status))));
  REQUIRE(eventually([&] { return t.grants().released_dead == 1; }));
  const bb_grant_stats_t s = t.grants();
  CHECK(s.revokes_acked == 0);
  check_lender_empty(s);
}

TEST_CASE("grant_words_from_a_task_are_believed_only_when_exact") {
  RuntimeDir dir;
  Trainer t("gw");
  t.lend(BB_GRANT_HOST, 1 * kMiB);
  std::string sock;
  REQUIRE(bb::core::hub_paths(dir.path(), "gw", 0, &sock, nullptr) == BB_OK);
  // This process plays a task at the wire level. It must give the grant back before it closes
  // its connection: the trainer kills a task that leaves holding one, and that would be us.
  bbtest::RawAttach raw;
  REQUIRE(bbtest::raw_attach(sock, "raw", &raw));
  const uint64_t id = t.task_id("raw");
  uint64_t gid = 0;
  REQUIRE(bb_trainer_grant(t.h, id, 4096, &gid) == BB_OK);

  // The descriptor came first, then the record in the slot names the same grant.
  char buf[bb::shm::kWireMaxMessage];
  int fds[2], nfds;
  const long n = bb::shm::recv_msg(raw.sock, buf, fds, &nfds);
  REQUIRE(bb::shm::check_msg(buf, n, bb::shm::MsgType::kGrantFd, sizeof(bb::shm::GrantFdMsg)));
  REQUIRE(nfds == 1);
  bb::shm::GrantFdMsg m;
  std::memcpy(&m, buf, sizeof m);
  CHECK(m.grant_id == gid);
  close(fds[0]);
  std::string err;
  bbtest::RawViews v;
  REQUIRE_MESSAGE(bbtest::map_raw(raw, &v, &err), err);
  const bb::shm::SlotCtl* ctl = v.ctl;
  bb::shm::TaskPage* p = v.task;
  CHECK(ctl->grant_id.load() == gid);
  CHECK(ctl->grant.id == gid);
  CHECK(ctl->grant.size == 4096);

  auto nudge = [&](uint64_t claimed) {
    auto a = bb::shm::make_msg<bb::shm::GrantAckMsg>(bb::shm::MsgType::kGrantAck);
    a.grant_id = claimed;
    REQUIRE(bb::shm::send_msg(raw.sock, &a, sizeof a, nullptr, 0) == 0);
  };
  // Wrong ids, a nudge that claims the right one, and junk on the socket: the grant stays.
  p->grant_released.store(gid + 1);
  nudge(gid);
  const char junk[] = "not a message";
  REQUIRE(bb::shm::send_msg(raw.sock, junk, sizeof junk, nullptr, 0) == 0);
  p->grant_released.store(~gid);
  nudge(~gid);
  // Each call below is served by the service thread, at the latest in the loop after the one
  // that found these messages queued, and the grant words are looked at in every loop.
  REQUIRE(bb_trainer_revoke(t.h, id, bb_now_ns() + 60'000'000'000ull) == BB_OK);
  CHECK(t.grant_of(id).state == BB_GRANT_STATE_REVOKING);
  CHECK(t.grants().active + t.grants().revoking == 1);
  CHECK(ctl->revoke_id.load() == gid);
  CHECK(t.stats().tasks_attached == 1);
  // The exact id: released at once, and counted as an ack.
  p->grant_released.store(gid);
  nudge(gid);
  REQUIRE(eventually([&] { return t.grants().revokes_acked == 1; }));
  check_lender_empty(t.grants());
  CHECK(ctl->grant_id.load() == 0);
  CHECK(ctl->revoke_id.load() == 0);
  CHECK(t.grants().tasks_killed == 0);

  // A task that corrupts its slot is never started again, so its grant is asked back.
  uint64_t gid2 = 0;
  REQUIRE(bb_trainer_grant(t.h, id, 4096, &gid2) == BB_OK);
  const long n2 = bb::shm::recv_msg(raw.sock, buf, fds, &nfds);
  CHECK(n2 == long(sizeof(bb::shm::GrantFdMsg)));
  for (int f = 0; f < nfds; ++f) close(fds[f]);
  // Acked (as the page says), it is started again: what the lie below must stop.
  p->acked_epoch.store(ctl->given_epoch.load());
  const uint64_t acked_starts = t.stats().starts;
  REQUIRE(t.bubbles_until([&] { return t.stats().starts > acked_starts; }, 200));
  // Its report ring claims more than the ring holds: a lie the trainer catches when it drains.
  p->reports.tail.store(ctl->report_head.load() + 1000);
  REQUIRE(t.bubbles_until([&] { return ctl->revoke_id.load() == gid2; }, 200));
  CHECK(ctl->bad.load() == 1);
  p->acked_epoch.store(ctl->given_epoch.load());
  const uint64_t starts = t.stats().starts;
  for (int k = 0; k < 20; ++k) t.bubble();
  CHECK(t.stats().starts == starts);  // and, acked or not, it is started no more
  p->grant_released.store(gid2);
  nudge(gid2);
  REQUIRE(eventually([&] { return t.grants().revokes_acked == 2; }));
  check_lender_empty(t.grants());
  CHECK(t.grants().tasks_killed == 0);
}

// A grant's descriptor goes over the task's socket. A task that has not read its socket for a
// while (its queue full) is not written off: the automatic grant is tried again until the
// descriptor fits, and then made. A manual grant says why it could not be sent.
TEST_CASE("an_automatic_grant_a_full_socket_refused_is_made_once_the_task_reads") {
  RuntimeDir dir;
  Trainer t("gf");
  std::string sock;
  REQUIRE(bb::core::hub_paths(dir.path(), "gf", 0, &sock, nullptr) == BB_OK);
  bb_lend_options_t lo;
  bb_lend_options_init(&lo);
  lo.backend = BB_GRANT_HOST;
  lo.bytes = 1 * kMiB;
  lo.auto_grant = 0;
  REQUIRE(bb_trainer_lend(t.h, &lo) == BB_OK);
  // This process plays a task that never reads its socket (and gives back every grant through
  // its page, so it is never killed for one).
  bbtest::RawAttach raw;
  REQUIRE(bbtest::raw_attach(sock, "deafear", &raw, 4096));
  const uint64_t id = t.task_id("deafear");
  std::string err;
  bbtest::RawViews v;
  REQUIRE_MESSAGE(bbtest::map_raw(raw, &v, &err), err);
  const bb::shm::SlotCtl* ctl = v.ctl;
  bb::shm::TaskPage* p = v.task;

  // Fill its socket with grants' descriptors, one grant at a time.
  bb_status st = BB_OK;
  int sent = 0;
  for (; sent < 4096; ++sent) {
    uint64_t gid = 0;
    st = bb_trainer_grant(t.h, id, 4096, &gid);
    if (st != BB_OK) break;
    p->grant_released.store(gid);
    REQUIRE(eventually([&] { return t.grants().active == 0; }));
  }
  const std::string why = bb_last_error();
  INFO("after " << sent << " grants: " << why);
  REQUIRE(st == BB_E_BUSY);
  CHECK(why.find("cannot send the grant's descriptor") != std::string::npos);
  CHECK(ctl->grant_id.load() == 0);
  check_lender_empty(t.grants());

  // Lent afresh with automatic grants: the attempt finds the socket full and is tried again.
  REQUIRE(bb_trainer_unlend(t.h, 0) == BB_OK);
  lo.auto_grant = 1;
  REQUIRE(bb_trainer_lend(t.h, &lo) == BB_OK);
  REQUIRE(eventually([&] { return t.grants().grants_made >= 2; }));  // made, unsent, undone
  CHECK(ctl->grant_id.load() == 0);
  // None stays out (the lender's counts are read as they are: an attempt may be under way).
  CHECK(eventually([&] { return t.grants().active == 0; }));

  // The task reads its socket: an attempt then sends the descriptor (maybe while the task still
  // reads) and the grant is made.
  std::vector<uint64_t> queued;  // the grants whose descriptors it read, in order
  auto drain = [&] {
    char buf[bb::shm::kWireMaxMessage];
    int fds[2], nfds;
    long n;
    while ((n = bb::shm::recv_msg(raw.sock, buf, fds, &nfds, MSG_DONTWAIT)) > 0) {
      for (int f = 0; f < nfds; ++f) close(fds[f]);
      REQUIRE(bb::shm::check_msg(buf, n, bb::shm::MsgType::kGrantFd, sizeof(bb::shm::GrantFdMsg)));
      CHECK(nfds == 1);
      bb::shm::GrantFdMsg m;
      std::memcpy(&m, buf, sizeof m);
      queued.push_back(m.grant_id);
    }
  };
  drain();
  REQUIRE(eventually([&] {
    drain();
    return ctl->grant_id.load() != 0;
  }));
  const uint64_t gid = ctl->grant_id.load();
  CHECK(t.grant_of(id).state == BB_GRANT_STATE_ACTIVE);
  CHECK(t.grant_of(id).bytes == 4096);
  // Its descriptor went before its id was published: it is the last one queued.
  drain();
  REQUIRE(!queued.empty());
  CHECK(queued.back() == gid);
  CHECK(queued.size() == size_t(sent) + 1);
  p->grant_released.store(gid);
  REQUIRE(eventually([&] { return t.grants().active == 0; }));
  CHECK(t.grants().tasks_killed == 0);
}
