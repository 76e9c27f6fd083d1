// The C++ RAII layer (bindings/cpp/include/bubble/bubble.hpp) against the real library: a
// trainer and a task in one process, the task on its own thread.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <bubble/bubble.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <unistd.h>

using namespace std::chrono_literals;

namespace {

std::string unique_job() {
  static int n = 0;
  return "cpp-" + std::to_string(getpid()) + "-" + std::to_string(++n);
}

template <typename Pred>
bool eventually(Pred pred, std::chrono::seconds limit = 20s) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// Opens bubbles until pred() holds inside one. A task that has not yet acked the pause of the
// previous bubble is (rightly) not started, and nothing on the trainer side tells when that ack
// lands: so a bubble in which nothing started is closed and another one opened.
template <typename Pred>
bool bubble_until(bubble::trainer& t, Pred pred) {
  for (int attempt = 0; attempt < 20; ++attempt) {
    auto b = t.bubble(50ms, bubble::bubble_kind::steady);
    if (eventually(pred, 1s)) return true;
  }
  return false;
}

struct counting_task : bubble::side_task {
  std::atomic<int> inits{0}, steps{0}, pauses{0}, resumes{0}, finishes{0};
  std::atomic<uint64_t> last_seq{0};
  bubble::status finished_with = bubble::status::OK;
  int done_after = -1;

  void init() override { ++inits; }
  bubble::step_result step(const bubble::step_info& info) override {
    last_seq = info.bubble_seq;
    std::this_thread::sleep_for(1ms);
    return ++steps == done_after ? bubble::step_result::done : bubble::step_result::more;
  }
  void pause() override { ++pauses; }
  void resume() override { ++resumes; }
  void finish(bubble::status s) override {
    finished_with = s;
    ++finishes;
  }
};

struct step_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace

TEST_CASE("opening a hub twice fails with E_BUSY and the library's sentence") {
  auto job = unique_job();
  bubble::trainer t(job, 0);
  try {
    bubble::trainer again(job, 0);
    FAIL("a second trainer opened the same hub");
  } catch (const bubble::error& e) {
    CHECK(e.code() == bubble::status::E_BUSY);
    CHECK_FALSE(e.message().empty());
    CHECK(std::string(e.what()).find("BB_E_BUSY") != std::string::npos);
  }
}

TEST_CASE("attaching where no trainer serves fails with E_NOT_FOUND") {
  try {
    bubble::task k(unique_job(), 0, "orphan");
    FAIL("attached to a hub nobody opened");
  } catch (const bubble::error& e) {
    CHECK(e.code() == bubble::status::E_NOT_FOUND);
    CHECK_FALSE(e.message().empty());
  }
}

TEST_CASE("a bad job id is E_INVALID") {
  CHECK_THROWS_AS(bubble::trainer("no spaces allowed", 0), bubble::error);
  try {
    bubble::trainer t("no spaces allowed", 0);
  } catch (const bubble::error& e) {
    CHECK(e.code() == bubble::status::E_INVALID);
  }
}

TEST_CASE("a moved-from trainer refuses calls and the new owner keeps the hub") {
  auto job = unique_job();
  bubble::trainer a(job, 0);
  bubble::trainer b(std::move(a));
  CHECK_THROWS_AS(a.begin(), bubble::error);
  bubble::task k(job, 0, "follower");
  CHECK(eventually([&] { return b.tasks().size() == 1; }));
  b.close();
  // The hub is gone with its owner: the name can be opened again.
  bubble::trainer c(job, 0);
}

TEST_CASE("imperative: wait_start, should_pause, ack_pause follow the trainer's bubble") {
  auto job = unique_job();
  bubble::trainer t(job, 0);
  bubble::task k(job, 0, "imperative");
  CHECK_FALSE(k.wait_start(1ms).has_value());

  std::promise<void> go;
  std::thread trainer_side([&] {
    go.get_future().wait();
    t.begin(50ms, bubble::bubble_kind::steady);
  });
  go.set_value();
  auto start = k.wait_start(10s);
  trainer_side.join();
  REQUIRE(start.has_value());
  CHECK(start->kind == BB_BUBBLE_STEADY);
  CHECK_FALSE(k.should_pause());
  k.report_step(1ms);
  t.end();
  CHECK(eventually([&] { return k.should_pause(); }));
  k.ack_pause();
  CHECK(t.stats().bubbles == 1);
  // Step reports reach the trainer's counters through its service thread.
  CHECK(eventually([&] { return t.stats().steps == 1; }));
}

TEST_CASE("iterative: a side_task steps in bubbles, pauses after them and stops on request") {
  auto job = unique_job();
  bubble::trainer t(job, 0);
  counting_task ct;
  auto run = std::async(std::launch::async, [&] {
    bubble::task k(job, 0, "iterative");
    return k.run(ct);
  });
  REQUIRE(eventually([&] { return t.tasks().size() == 1 && ct.inits == 1; }));
  for (int i = 0; i < 3; ++i) {
    int before = ct.steps;
    REQUIRE(bubble_until(t, [&] { return ct.steps > before; }));
    REQUIRE(eventually([&] { return ct.pauses == i + 1; }));
  }
  CHECK(ct.resumes == 3);
  t.stop_task(t.tasks().at(0).id);
  REQUIRE(run.wait_for(20s) == std::future_status::ready);
  CHECK(run.get() == bubble::outcome::stopped);
  CHECK(ct.finishes == 1);
  CHECK(ct.finished_with == bubble::status::E_STOPPED);
  CHECK(eventually([&] { return t.stats().steps >= 3; }));
}

TEST_CASE("iterative: step() returning done finishes the run") {
  auto job = unique_job();
  bubble::trainer t(job, 0);
  counting_task ct;
  ct.done_after = 2;
  auto run = std::async(std::launch::async, [&] {
    bubble::task k(job, 0, "finisher");
    return k.run(ct);
  });
  REQUIRE(eventually([&] { return t.tasks().size() == 1; }));
  t.begin(200ms);
  REQUIRE(run.wait_for(20s) == std::future_status::ready);
  t.end();
  CHECK(run.get() == bubble::outcome::finished);
  CHECK(ct.steps == 2);
  CHECK(ct.finished_with == bubble::status::OK);
}

TEST_CASE("an exception thrown by step() comes out of run() unchanged") {
  struct throwing : bubble::side_task {
    bubble::step_result step(const bubble::step_info&) override { throw step_failure("boom"); }
  };
  auto job = unique_job();
  bubble::trainer t(job, 0);
  auto run = std::async(std::launch::async, [&] {
    bubble::task k(job, 0, "thrower");
    throwing th;
    return k.run(th);
  });
  REQUIRE(eventually([&] { return t.tasks().size() == 1; }));
  t.begin(50ms);
  REQUIRE(run.wait_for(20s) == std::future_status::ready);
  t.end();
  CHECK_THROWS_AS(run.get(), step_failure);
}

#ifdef BUBBLE_HPP_CONCEPTS
TEST_CASE("a type that merely has step() runs without deriving from side_task") {
  struct duck {
    int steps = 0;
    bubble::step_result step(const bubble::step_info&) {
      return ++steps == 3 ? bubble::step_result::done : bubble::step_result::more;
    }
  };
  static_assert(bubble::side_task_like<duck>);
  auto job = unique_job();
  bubble::trainer t(job, 0);
  duck d;
  auto run = std::async(std::launch::async, [&] {
    bubble::task k(job, 0, "duck");
    return k.run(d);
  });
  REQUIRE(eventually([&] { return t.tasks().size() == 1; }));
  t.begin(200ms);
  REQUIRE(run.wait_for(20s) == std::future_status::ready);
  t.end();
  CHECK(run.get() == bubble::outcome::finished);
  CHECK(d.steps == 3);
}
#endif

TEST_CASE("tasks() reports names, priorities and ids") {
  auto job = unique_job();
  bubble::trainer t(job, 0);
  bubble::task_options o;
  o.priority = 7;
  o.mem_need = 1 << 20;
  bubble::task a(job, 0, "alpha", o);
  bubble::task b(job, 0, "beta");
  // The trainer's service thread lists a task shortly after its attach returns.
  REQUIRE(eventually([&] { return t.tasks().size() == 2; }));
  auto tasks = t.tasks();
  REQUIRE(tasks.size() == 2);
  auto& alpha = tasks[0].name == "alpha" ? tasks[0] : tasks[1];
  auto& beta = tasks[0].name == "alpha" ? tasks[1] : tasks[0];
  CHECK(alpha.priority == 7);
  CHECK(alpha.mem_need == (1u << 20));
  CHECK(alpha.pid == getpid());
  CHECK(beta.name == "beta");
  CHECK(alpha.id != beta.id);
  b.detach();
  CHECK(eventually([&] { return t.tasks().size() == 1; }));
}

int main(int argc, char** argv) {
  // A private runtime directory: no hub of another run or user is ever touched.
  char dir[] = "/tmp/bb-cpp-XXXXXX";
  if (!mkdtemp(dir)) return 1;
  setenv("BUBBLE_RUNTIME_DIR", dir, 1);
  doctest::Context ctx(argc, argv);
  int rc = ctx.run();
  std::filesystem::remove_all(dir);
  return rc;
}
