// Fitting a `list` reply into one control frame, whatever was submitted before the size bounds
// existed or however long the agent's history has grown. Pure: no I/O.
#pragma once

#include <cstddef>
#include <vector>

#include "daemon/task.h"

namespace bb::daemon {

struct ListBudget {
  // Past this many bytes of argv and environment, records keep only their command (argv[0])
  // and their message says so; the newest records keep theirs first.
  size_t specs = 4u << 20;
  // Past this many bytes of records in all, the rows that ended longest ago are left out (then,
  // were the live ones alone too many, the oldest of those).
  size_t total = 12u << 20;
};

// Trims rows (in place, order kept) to the budget; an argv[0] kept alone is cut to
// max_entry_bytes. Returns how many rows were left out, for the reply to say so.
size_t fit_list(std::vector<TaskRow>* rows, const ListBudget& budget, size_t max_entry_bytes);

}  // namespace bb::daemon
