// A task's figures over all the hub slots it held (daemon/task.h).
#include "daemon/task.h"

#include <algorithm>

namespace bb::daemon {

namespace {
void add(TaskFigures* to, const TaskFigures& f) {
  to->steps += f.steps;
  to->ns_in_bubbles += f.ns_in_bubbles;
  to->ns_outside += f.ns_outside;
}
}  // namespace

void update_figures(TaskRow* row, const std::pair<std::string, uint64_t>& key,
                    const TaskFigures& now) {
  auto it = row->slot_figures.find(key);
  if (it != row->slot_figures.end() &&
      (now.steps < it->second.steps || now.ns_in_bubbles < it->second.ns_in_bubbles ||
       now.ns_outside < it->second.ns_outside)) {
    // A hub task id used again (a new trainer on the same hub name): another slot.
    add(&row->slots_gone, it->second);
  }
  row->slot_figures[key] = now;
  TaskFigures sum = row->slots_gone;
  for (const auto& [k, f] : row->slot_figures) add(&sum, f);
  row->steps = std::max(row->loaded.steps, sum.steps);
  row->ns_in_bubbles = std::max(row->loaded.ns_in_bubbles, sum.ns_in_bubbles);
  row->ns_outside = std::max(row->loaded.ns_outside, sum.ns_outside);
}

void slot_gone(TaskRow* row, const std::pair<std::string, uint64_t>& key) {
  auto it = row->slot_figures.find(key);
  if (it == row->slot_figures.end()) return;
  add(&row->slots_gone, it->second);
  row->slot_figures.erase(it);
}

}  // namespace bb::daemon
