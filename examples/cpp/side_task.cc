// A side task that sums squares, one small chunk per step, only inside the trainer's bubbles.
#include <bubble/bubble.hpp>

#include <cstdint>
#include <iostream>

struct sum_of_squares : bubble::side_task {
  uint64_t next = 0, total = 0, steps = 0;
  bubble::step_result step(const bubble::step_info&) override {
    for (int i = 0; i < 10000; ++i, ++next) total += next * next;
    ++steps;
    return bubble::step_result::more;
  }
};

int main(int argc, char** argv) try {
  bubble::task task(argc > 1 ? argv[1] : "example", 0, "cpp-side-task");
  sum_of_squares work;
  task.run(work);  // until the trainer stops the task or leaves
  std::cout << work.steps << " steps, sum " << work.total << std::endl;
} catch (const bubble::error& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
