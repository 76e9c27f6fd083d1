#include "daemon/list_fit.h"

#include <algorithm>
#include <string>

namespace bb::daemon {

namespace {

// Roughly what a record costs on the wire: texts are padded to words and each has a pointer.
size_t text_cost(const std::string& t) { return (t.size() + 8) / 8 * 8 + 8; }

size_t spec_cost(const TaskSpec& s) {
  size_t n = 0;
  for (const auto& a : s.argv) n += text_cost(a);
  for (const auto& e : s.env) n += text_cost(e);
  return n;
}

size_t record_cost(const TaskRow& r) {
  return 256 + spec_cost(r.spec) + text_cost(r.spec.name) + text_cost(r.spec.cwd) +
         text_cost(r.spec.hub) + text_cost(r.spec.mps_mem_limit) + text_cost(r.state) +
         text_cost(r.origin) + text_cost(r.hub) + text_cost(r.message);
}

}  // namespace

size_t fit_list(std::vector<TaskRow>* rows, const ListBudget& budget, size_t max_entry_bytes) {
  size_t specs = 0, total = 0;
  for (auto& r : *rows) specs += spec_cost(r.spec);
  if (specs > budget.specs) {
    // The newest records (highest ids) keep their full spec first.
    std::vector<TaskRow*> order;
    for (auto& r : *rows) order.push_back(&r);
    std::sort(order.begin(), order.end(), [](auto* x, auto* y) { return x->id > y->id; });
    specs = 0;
    for (TaskRow* r : order) {
      size_t cost = spec_cost(r->spec);
      if (specs + cost <= budget.specs) {
        specs += cost;
        continue;
      }
      if (r->spec.argv.size() > 1) r->spec.argv.resize(1);
      if (!r->spec.argv.empty() && r->spec.argv[0].size() > max_entry_bytes) {
        r->spec.argv[0].resize(max_entry_bytes);
      }
      r->spec.env.clear();
      r->message += " [arguments and environment left out: the list reply is at its size limit]";
    }
  }
  for (auto& r : *rows) total += record_cost(r);
  if (total <= budget.total) return 0;
  std::vector<size_t> idx(rows->size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  // Tasks not yet ended first (`bubblectl wait` looks for them in this list, and an old queued
  // or running task left out would read as gone), then the newest ended ones.
  std::sort(idx.begin(), idx.end(), [&](size_t x, size_t y) {
    const bool ex = state_is_final((*rows)[x].state), ey = state_is_final((*rows)[y].state);
    if (ex != ey) return !ex;
    // Ended ones by when they ended: a long task that has just ended is still wanted (its
    // `wait`), a short one that ended long ago less so.
    if (ex && (*rows)[x].ended_at != (*rows)[y].ended_at)
      return (*rows)[x].ended_at > (*rows)[y].ended_at;
    return (*rows)[x].id > (*rows)[y].id;
  });
  std::vector<bool> keep(rows->size(), false);
  total = 0;
  for (size_t i : idx) {
    total += record_cost((*rows)[i]);
    if (total > budget.total) break;
    keep[i] = true;
  }
  std::vector<TaskRow> kept;
  for (size_t i = 0; i < rows->size(); ++i) {
    if (keep[i]) kept.push_back(std::move((*rows)[i]));
  }
  const size_t omitted = rows->size() - kept.size();
  rows->swap(kept);
  return omitted;
}

}  // namespace bb::daemon
