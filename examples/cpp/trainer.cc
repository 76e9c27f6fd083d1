// A toy training loop that lends the time it waits on its pipeline neighbours to side tasks.
#include <bubble/bubble.hpp>

#include <chrono>
#include <iostream>
#include <thread>

using namespace std::chrono_literals;

int main(int argc, char** argv) try {
  bubble::trainer trainer(argc > 1 ? argv[1] : "example", 0);
  std::cout << "hub open" << std::endl;
  while (trainer.tasks().empty()) std::this_thread::sleep_for(10ms);  // wait for a side task
  for (int it = 0; it < 20; ++it) {
    trainer.iteration();
    std::this_thread::sleep_for(5ms);  // forward and backward compute
    auto bubble = trainer.bubble(5ms, bubble::bubble_kind::steady);
    std::this_thread::sleep_for(5ms);  // waiting for the next stage: a bubble
  }
  auto s = trainer.stats();
  std::cout << s.bubbles << " bubbles, " << s.steps << " side-task steps" << std::endl;
} catch (const bubble::error& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
