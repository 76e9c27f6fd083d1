// The C++ side task of the cross-language test; same protocol as xlang_task.c, plus the
// grant-loop mode (an imperative task that fills its host grant, then acks its revoke).
#include <bubble/bubble.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <unistd.h>

namespace {

void emit(const std::string& line) { std::cout << line << std::endl; }

void work(std::chrono::milliseconds step) {
  const char* slow = std::getenv("BUBBLE_XLANG_SLOW_FILE");
  if (slow && access(slow, F_OK) == 0) {
    emit("slow");
    step = std::chrono::minutes(1);
  }
  std::this_thread::sleep_for(step);
}

struct xlang_task : bubble::side_task {
  std::chrono::milliseconds step_len;
  explicit xlang_task(std::chrono::milliseconds s) : step_len(s) {}
  bubble::step_result step(const bubble::step_info& info) override {
    work(step_len);
    emit("step " + std::to_string(info.bubble_seq));
    return bubble::step_result::more;
  }
  void pause() override { emit("pause"); }
};

constexpr uint64_t kGrantBytes = 64 * 1024;

// Fills the grant a start names with the test's pattern, then gives it back when revoked.
void grant_loop(bubble::task& task, uint32_t seed) {
  auto start = task.wait_start();
  auto g = task.grant();
  if (!g || g->id != start->grant_id || g->ptr != start->grant_ptr)
    throw std::runtime_error("started without the grant bubble::task::grant() reports");
  uint32_t* w = g->host_data<uint32_t>();
  for (uint64_t i = 0; i < g->bytes / 4; ++i) w[i] = seed ^ uint32_t(i * 2654435761u);
  emit("granted " + std::to_string(g->id));
  while (!task.should_pause()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  task.ack_pause();
  emit("pause");
  for (;; std::this_thread::sleep_for(std::chrono::milliseconds(1))) {
    g = task.grant();
    if (g && g->revoking()) {
      task.ack_revoke();
      emit("acked " + std::to_string(g->id));
      break;
    }
  }
  for (;;) (void)task.wait_start();  // until told to stop
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 6) {
    std::cerr << "usage: " << argv[0] << " JOB RANK NAME run|loop STEP_MS\n"
              << "       " << argv[0] << " JOB RANK NAME grant-loop SEED\n";
    return 2;
  }
  const std::string mode = argv[4];
  std::chrono::milliseconds step_len(std::atol(argv[5]));
  bubble::task_options opts;
  if (mode == "grant-loop") opts.mem_need = kGrantBytes;
  bubble::task task(argv[1], static_cast<uint32_t>(std::atoi(argv[2])), argv[3], opts);
  emit("attached");
  if (mode == "grant-loop") {
    try {
      grant_loop(task, static_cast<uint32_t>(std::atol(argv[5])));
    } catch (const bubble::error& e) {
      if (e.code() != bubble::status::E_STOPPED) throw;
    }
  } else if (mode == "run") {
    xlang_task t(step_len);
    if (task.run(t) != bubble::outcome::stopped) return 1;
  } else {
    try {
      for (;;) {
        auto start = task.wait_start();
        while (!task.should_pause()) {
          auto t0 = std::chrono::steady_clock::now();
          work(step_len);
          task.report_step(std::chrono::steady_clock::now() - t0);
          emit("step " + std::to_string(start->bubble_seq));
        }
        task.ack_pause();
        emit("pause");
      }
    } catch (const bubble::error& e) {
      if (e.code() != bubble::status::E_STOPPED) throw;
    }
  }
  emit("stopped");
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
