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
#include <memory>
#include <optional>
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

uint32_t pattern_word(uint32_t seed, size_t i) { return seed ^ uint32_t(i * 2654435761u); }

void write_pattern(uint32_t* w, uint64_t bytes, uint32_t seed) {
  for (size_t i = 0; i < bytes / 4; ++i) w[i] = pattern_word(seed, i);
}

bool pattern_ok(const uint32_t* w, uint64_t bytes, uint32_t seed) {
  for (size_t i = 0; i < bytes / 4; ++i)
    if (w[i] != pattern_word(seed, i)) return false;
  return true;
}

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

TEST_CASE("a NUL byte in a job id, task name or runtime dir is E_INVALID, not a shorter name") {
  // Cut at the NUL, each of these names one that works here: the hub of `job`.
  auto job = unique_job();
  bubble::trainer t(job, 0);
  const std::string nul("\0x", 2);
  const std::string dir = std::string(std::getenv("BUBBLE_RUNTIME_DIR")) + nul;
  auto invalid = [](const std::string& what, auto make) {
    CAPTURE(what);
    try {
      make();
      FAIL("a name with a NUL byte was taken");
    } catch (const bubble::error& e) {
      CHECK(e.code() == bubble::status::E_INVALID);
      CHECK(e.message().find(what + " \"") == 0);
      CHECK(e.message().find("contains a NUL byte") != std::string::npos);
    }
  };
  invalid("job id", [&] { bubble::trainer(job + nul, 0); });
  invalid("runtime dir", [&] {
    bubble::trainer_options o;
    o.runtime_dir = dir;
    bubble::trainer(job, 1, o);
  });
  invalid("job id", [&] { bubble::task(job + nul, 0, "cut"); });
  invalid("task name", [&] { bubble::task(job, 0, "cut" + nul); });
  invalid("runtime dir", [&] {
    bubble::task_options o;
    o.runtime_dir = dir;
    bubble::task(job, 0, "cut", o);
  });
  CHECK(t.tasks().empty());
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

TEST_CASE("a scoped bubble follows its trainer when the trainer moves or goes") {
  SUBCASE("moved inside the scope: the bubble ends on the trainer it moved to") {
    std::optional<bubble::trainer> moved;
    bubble::trainer a(unique_job(), 0);
    {
      auto b = a.bubble(50ms);
      moved.emplace(std::move(a));
    }
    CHECK(moved->stats().bubbles == 1);
  }
  SUBCASE("assigned over inside the scope: the bubble of the trainer moved in stays open") {
    bubble::trainer x(unique_job(), 0), y(unique_job(), 0);
    y.begin(50ms);
    {
      auto b = x.bubble(50ms);
      x = std::move(y);  // x's own hub closes, and its bubble with it
    }
    CHECK(x.stats().bubbles == 0);
    x.end();
    CHECK(x.stats().bubbles == 1);
  }
  SUBCASE("destroyed inside the scope: nothing is left to end") {
    auto t = std::make_unique<bubble::trainer>(unique_job(), 0);
    auto b = t->bubble(50ms);
    t.reset();
  }
  SUBCASE("nested scopes both follow a move") {
    std::optional<bubble::trainer> moved;
    bubble::trainer a(unique_job(), 0);
    {
      auto outer = a.bubble(50ms);
      {
        auto inner = a.bubble(50ms);  // ends the outer's bubble and opens its own
        moved.emplace(std::move(a));
      }
      CHECK(moved->stats().bubbles == 2);
      moved->begin(50ms);
    }
    CHECK(moved->stats().bubbles == 3);  // the outer scope ended the bubble open at its end
  }
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
  // Its steps ran inside bubbles: its own figure says so (from its reports, a moment later).
  CHECK(eventually([&] { return t.tasks().at(0).ns_in_bubbles > 0; }));
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

// A task that detaches itself from a step, as one shutting down might: the run still uses the
// handle, so the detach is done as run() returns.
struct detaching_task : bubble::side_task {
  bubble::task* self = nullptr;
  int steps = 0;
  bubble::step_result step(const bubble::step_info&) override {
    std::this_thread::sleep_for(1ms);
    if (++steps == 1) self->detach();
    return steps == 3 ? bubble::step_result::done : bubble::step_result::more;
  }
};

TEST_CASE("iterative: detach() from a side_task method is done as run() returns") {
  auto job = unique_job();
  bubble::trainer t(job, 0);
  detaching_task dt;
  bool detached_after = false;
  auto run = std::async(std::launch::async, [&] {
    bubble::task k(job, 0, "detacher");
    dt.self = &k;
    const bubble::outcome o = k.run(dt);
    try {
      (void)k.native_handle();
    } catch (const bubble::error& e) {
      detached_after = e.code() == bubble::status::E_STATE;  // closed
    }
    return o;
  });
  REQUIRE(eventually([&] { return t.tasks().size() == 1; }));
  t.begin(200ms);
  REQUIRE(run.wait_for(20s) == std::future_status::ready);
  t.end();
  CHECK(run.get() == bubble::outcome::finished);  // the run went on after the detach
  CHECK(dt.steps == 3);
  CHECK(detached_after);
  CHECK(eventually([&] { return t.tasks().empty(); }));
}

// What a side_task method does to its own task, inside the task's run.
struct task_changer : bubble::side_task {
  enum class what { destroy, move_out, nested_run } act;
  std::unique_ptr<bubble::task>* owner = nullptr;
  std::optional<bubble::task> moved;
  int steps = 0;
  std::optional<bubble::status> nested;  // what run() inside run() threw
  explicit task_changer(what a) : act(a) {}
  bubble::step_result step(const bubble::step_info&) override {
    if (++steps == 1) {
      switch (act) {
        case what::destroy: owner->reset(); break;  // "clean up" from inside the run
        case what::move_out: moved.emplace(std::move(**owner)); break;
        case what::nested_run:
          (*owner)->detach();  // asked first: done as the outer run returns, not by the inner
          try {
            (*owner)->run(*this);
          } catch (const bubble::error& e) {
            nested = e.code();
          }
          break;
      }
    }
    return steps == 3 ? bubble::step_result::done : bubble::step_result::more;
  }
};

// A hub, and a task_changer's task run in one of its bubbles on another thread.
struct changed_run {
  std::string job = unique_job();
  bubble::trainer t{job, 0};
  task_changer c;
  std::unique_ptr<bubble::task> k;
  explicit changed_run(task_changer::what act) : c(act) {}
  // The outcome of the task's run.
  bubble::outcome run() {
    k = std::make_unique<bubble::task>(job, 0, "changer");
    c.owner = &k;
    bubble::task* raw = k.get();
    auto running = std::async(std::launch::async, [&] { return raw->run(c); });
    REQUIRE(eventually([&] { return t.tasks().size() == 1; }));
    t.begin(200ms);
    REQUIRE(running.wait_for(20s) == std::future_status::ready);
    t.end();
    return running.get();
  }
};

TEST_CASE("iterative: a task destroyed from inside its own run is detached as the run returns") {
  changed_run r(task_changer::what::destroy);
  CHECK(r.run() == bubble::outcome::finished);  // the run went on
  CHECK(r.c.steps == 3);
  CHECK(!r.k);
  CHECK(eventually([&] { return r.t.tasks().empty(); }));  // not left attached
}

TEST_CASE("iterative: a task moved from inside its own run keeps its handle in the new owner") {
  changed_run r(task_changer::what::move_out);
  CHECK(r.run() == bubble::outcome::finished);
  REQUIRE(r.c.moved);
  CHECK_THROWS_AS((void)r.k->native_handle(), bubble::error);  // moved from
  CHECK(r.c.moved->native_handle() != nullptr);
  CHECK(r.t.tasks().size() == 1);  // still attached, through its new owner
  r.c.moved->detach();             // which can detach it now that the run is over
  CHECK(eventually([&] { return r.t.tasks().empty(); }));
}

TEST_CASE("iterative: run() inside its own run() is refused with E_STATE and the run goes on") {
  changed_run r(task_changer::what::nested_run);
  CHECK(r.run() == bubble::outcome::finished);
  CHECK(r.c.nested == bubble::status::E_STATE);
  CHECK(r.c.steps == 3);
  CHECK_THROWS_AS((void)r.k->native_handle(), bubble::error);  // the detach asked for was done
  CHECK(eventually([&] { return r.t.tasks().empty(); }));
}

TEST_CASE("iterative: idle() runs while the task waits, and done from it finishes the run") {
  struct idler : bubble::side_task {
    std::atomic<int> idles{0};
    bubble::step_result step(const bubble::step_info&) override { return bubble::step_result::more; }
    bubble::step_result idle() override {
      return ++idles == 3 ? bubble::step_result::done : bubble::step_result::more;
    }
  };
  auto job = unique_job();
  bubble::trainer t(job, 0);
  idler id;
  bubble::task k(job, 0, "idler");
  CHECK(k.run(id) == bubble::outcome::finished);  // no bubble is ever begun
  CHECK(id.idles == 3);
}

TEST_CASE("an exception thrown by step() comes out of run() unchanged, and finish() still runs") {
  struct throwing : bubble::side_task {
    std::atomic<int> finishes{0};
    bubble::status finished_with = bubble::status::OK;
    bubble::step_result step(const bubble::step_info&) override { throw step_failure("boom"); }
    void finish(bubble::status s) override {
      finished_with = s;
      ++finishes;
    }
  };
  auto job = unique_job();
  bubble::trainer t(job, 0);
  throwing th;
  auto run = std::async(std::launch::async, [&] {
    bubble::task k(job, 0, "thrower");
    return k.run(th);
  });
  REQUIRE(eventually([&] { return t.tasks().size() == 1; }));
  t.begin(50ms);
  REQUIRE(run.wait_for(20s) == std::future_status::ready);
  t.end();
  CHECK_THROWS_AS(run.get(), step_failure);
  // Its cleanup is not skipped: finish() ran once, told how the run ended.
  CHECK(th.finishes == 1);
  CHECK(th.finished_with == bubble::status::E_CALLBACK);
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

TEST_CASE("host grant: the task writes it, the trainer reads it back, revoke is acked") {
  constexpr uint64_t kGrant = 64 * 1024;
  auto job = unique_job();
  bubble::trainer t(job, 0);
  t.lend({bubble::grant_backend::host, 1 << 20});
  try {
    t.lend({bubble::grant_backend::host, 1 << 20});
    FAIL("lent twice");
  } catch (const bubble::error& e) {
    CHECK(e.code() == bubble::status::E_BUSY);
  }

  // The task side on its own thread; every wait is bounded so a failure cannot hang the test.
  std::atomic<uint64_t> written{0}, acked{0}, rewritten{0};
  std::atomic<bool> quit{false}, paused{false};
  auto task_side = std::async(std::launch::async, [&]() -> std::string {
    bubble::task_options o;
    o.mem_need = kGrant;
    bubble::task k(job, 0, "granted", o);
    auto start = k.wait_start(20s);
    if (!start) return "never started";
    if (!start->grant_ptr || start->grant_bytes != kGrant) return "started without its grant";
    auto g = k.grant();
    if (!g || g->id != start->grant_id || g->ptr != start->grant_ptr) return "grant() disagrees";
    if (g->backend != bubble::grant_backend::host || g->revoking()) return "unexpected grant";
    if (g->device != -1) return "a host grant names a GPU";
    write_pattern(g->host_data<uint32_t>(), g->bytes, 7);
    written = g->id;
    while (!k.should_pause() && !quit) std::this_thread::sleep_for(1ms);
    k.ack_pause();
    paused = true;
    // Idle now: wait for the trainer to ask the grant back, then give it.
    if (!eventually([&] { g = k.grant(); return quit || (g && g->revoking()); })) return "no revoke";
    if (quit) return "quit";
    if (*g->revoke_deadline_ns <= bubble::now_ns()) return "deadline already passed";
    k.ack_revoke();
    if (k.grant()) return "the grant is still mapped after ack_revoke";
    acked = g->id;
    // The trainer grants again on request: the new grant is mapped on the next look.
    if (!eventually([&] { g = k.grant(); return quit || g.has_value(); })) return "no new grant";
    if (quit) return "quit";
    write_pattern(g->host_data<uint32_t>(), g->bytes, 11);
    rewritten = g->id;
    try {
      while (!quit) (void)k.wait_start(100ms);
    } catch (const bubble::error& e) {
      if (e.code() != bubble::status::E_STOPPED) throw;
    }
    return "stopped";
  });
  struct quit_on_exit {
    std::atomic<bool>& q;
    ~quit_on_exit() { q = true; }
  } guard{quit};

  REQUIRE(eventually([&] { return t.tasks().size() == 1; }));
  const uint64_t id = t.tasks()[0].id;
  // auto_grant: the attach with a mem_need is granted without being asked.
  REQUIRE(eventually([&] { return t.task_grant(id).has_value(); }));
  REQUIRE(bubble_until(t, [&] { return written != 0; }));
  auto g = t.task_grant(id);
  REQUIRE(g.has_value());
  CHECK(g->id == written);
  CHECK(g->task_id == id);
  CHECK(g->state == bubble::grant_state::active);
  CHECK(g->backend == bubble::grant_backend::host);
  CHECK(g->bytes == kGrant);
  CHECK(g->mapped);
  // The trainer reads what the task wrote at its own address of the grant.
  CHECK(pattern_ok(g->host_data<uint32_t>(), g->bytes, 7));
  // ... or copies it out, which a release waits for.
  std::vector<uint32_t> copy(g->bytes / 4);
  t.read_grant(g->id, 0, copy.data(), g->bytes);
  CHECK(pattern_ok(copy.data(), g->bytes, 7));
  try {
    t.read_grant(g->id, g->bytes - 4, copy.data(), 8);
    FAIL("a read past the grant's end was not refused");
  } catch (const bubble::error& e) {
    CHECK(e.code() == bubble::status::E_INVALID);
    CHECK(e.message().find("outside grant") != std::string::npos);
  }
  auto s = t.grants();
  CHECK(s.backend == BB_GRANT_HOST);
  CHECK(s.capacity == (1u << 20));
  CHECK(s.active == 1);
  CHECK(s.granted_bytes == kGrant);
  CHECK(s.grants_made == 1);

  // Revoked once idle: a pending revoke would be acked by the pause's ack already.
  REQUIRE(eventually([&] { return paused.load(); }));
  t.revoke(id, 30s);
  CHECK_THROWS_AS(t.revoke(id), bubble::error);  // already revoking, or already given back
  REQUIRE(eventually([&] { return t.grants().revokes_acked == 1; }));
  CHECK(eventually([&] { return acked == g->id; }));  // the task says so after its ack
  CHECK_FALSE(t.task_grant(id).has_value());
  try {
    t.read_grant(g->id, 0, copy.data(), 4);
    FAIL("a grant given back was read");
  } catch (const bubble::error& e) {
    CHECK(e.code() == bubble::status::E_NOT_FOUND);
  }
  s = t.grants();
  CHECK(s.revokes == 1);
  CHECK(s.tasks_killed == 0);
  CHECK(s.active == 0);
  CHECK(s.granted_bytes == 0);
  CHECK(s.free_bytes == s.capacity);

  const uint64_t again = t.grant(id);
  CHECK(again > g->id);
  CHECK_THROWS_AS(t.grant(id), bubble::error);  // one grant per task
  REQUIRE(eventually([&] { return rewritten == again; }));
  g = t.task_grant(id);
  REQUIRE(g.has_value());
  CHECK(pattern_ok(g->host_data<uint32_t>(), g->bytes, 11));

  t.stop_task(id);
  REQUIRE(task_side.wait_for(20s) == std::future_status::ready);
  CHECK(task_side.get() == "stopped");
  // Detaching gave the grant back.
  REQUIRE(eventually([&] { return t.grants().active == 0; }));
  CHECK(t.grants().tasks_killed == 0);
}

TEST_CASE("unlend gives the lent memory back, and lend may then lend again") {
  bubble::trainer t(unique_job(), 0);
  try {
    t.unlend();
    FAIL("unlent with nothing lent");
  } catch (const bubble::error& e) {
    CHECK(e.code() == bubble::status::E_STATE);
  }
  t.lend({bubble::grant_backend::host, 1 << 20});
  t.unlend(std::chrono::seconds(1));
  CHECK(t.grants().backend == 0);
  CHECK(t.grants().capacity == 0);
  t.lend({bubble::grant_backend::host, 2 << 20});
  CHECK(t.grants().capacity == (2u << 20));
}

TEST_CASE("a device grant is not handed out as a host pointer") {
  bubble::grant_info g{1, 1, bubble::grant_state::active, bubble::grant_backend::cuda_vmm,
                       true, 4096, 0, 0x7000'0000'0000ull, 0};
  try {
    (void)g.host_data();
    FAIL("a device address became a host pointer");
  } catch (const bubble::error& e) {
    CHECK(e.code() == bubble::status::E_STATE);
  }
}

TEST_CASE("set_schedule accepts a 1F1B pipeline and names what it rejects") {
  bubble::trainer t(unique_job(), 0);
  bubble::schedule sc;
  sc.stages = 4;
  sc.microbatches = 8;
  sc.stage = 1;
  sc.fwd = 2ms;
  sc.bwd = 4ms;
  t.set_schedule(sc);
  sc.stage = 4;
  try {
    t.set_schedule(sc);
    FAIL("a stage outside the pipeline was accepted");
  } catch (const bubble::error& e) {
    CHECK(e.code() == bubble::status::E_INVALID);
    CHECK(e.message().find("stage") != std::string::npos);
  }
  // Times unknown (measured), one bubble per receive: the field reaches the library, which
  // rejects a forward time without a backward one.
  sc.stage = 1;
  sc.fwd = {};
  sc.bwd = {};
  sc.bubbles = bubble::schedule_bubbles::receives;
  t.set_schedule(sc);
  sc.fwd = 2ms;
  try {
    t.set_schedule(sc);
    FAIL("a forward time without a backward time was accepted");
  } catch (const bubble::error& e) {
    CHECK(e.message().find("bwd_ns") != std::string::npos);
  }
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
