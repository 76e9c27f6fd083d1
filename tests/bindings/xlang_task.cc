// The C++ side task of the cross-language test; same protocol as xlang_task.c.
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

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 6) {
    std::cerr << "usage: " << argv[0] << " JOB RANK NAME run|loop STEP_MS\n";
    return 2;
  }
  std::chrono::milliseconds step_len(std::atol(argv[5]));
  bubble::task task(argv[1], static_cast<uint32_t>(std::atoi(argv[2])), argv[3]);
  emit("attached");
  if (std::string(argv[4]) == "run") {
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
