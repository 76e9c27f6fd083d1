// Predictive wake's arithmetic, apart from the waiting itself so that it can be tested alone
// (core/task.cc, Task::wait_for_doorbell, does the waiting).
//
// A predictive task sleeps until `head` before the trainer's predicted next bubble and spins
// from there. A timed sleep ends late (a thread's timer slack is 50 us by default, and waking
// an idle CPU takes more on a VM), so head is the lead plus how late the task's sleeps have been
// ending on average, learned from the sleeps themselves.
#pragma once

#include <algorithm>
#include <cstdint>

namespace bb::core {

// How long before the predicted bubble a predictive sleep should end: the lead, which stays the
// margin for a bubble earlier than predicted, plus the mean lateness, at most four leads of it
// (which bounds the spinning that lateness can add).
inline uint64_t wake_head(uint64_t lead_ns, uint64_t mean_late_ns) {
  return lead_ns + std::min(mean_late_ns, 4 * lead_ns);
}

// What one predictive sleep, asked to end at `asked_ns`, says about how late sleeps end. Gone to
// sleep at `slept_ns` and awake again at `woke_ns`; timed_out when its timer ended it. Returns
// true with *late_ns when it says something:
//   - past `asked_ns` when it woke: late by at least woke - asked (a wake that ended it then
//     found the timer not yet fired), exactly that when the timer ended it;
//   - ended by its timer before or at `asked_ns`: not late at all;
//   - ended by a wake before `asked_ns`, or with nothing left to sleep when it began (the task
//     lost its CPU on the way): nothing.
inline bool sleep_lateness(bool timed_out, uint64_t slept_ns, uint64_t asked_ns, uint64_t woke_ns,
                           uint64_t* late_ns) {
  if (slept_ns >= asked_ns) return false;
  if (woke_ns > asked_ns) {
    *late_ns = woke_ns - asked_ns;
    return true;
  }
  if (!timed_out) return false;
  *late_ns = 0;
  return true;
}

}  // namespace bb::core
