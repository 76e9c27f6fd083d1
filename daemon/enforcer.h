// Pause enforcement: the escalation rule for a task that does not ack a pause in time.
//
// The hub records when the trainer asked a task to pause and when the task acked. A task that
// has not acked within the grace period commits a violation: it is stopped (SIGSTOP) and
// continued (SIGCONT) when its hub begins the next bubble; after `kill_after` violations it is
// killed. A continued task that still has not acked by the end of the bubble it was continued
// in plus the grace period commits another violation: a task that never looks at its pause flag
// cannot escape by never being started again.
//
// Pure logic over snapshot values, so it is tested without processes or hubs.
#pragma once

#include <cstdint>

namespace bb::daemon {

struct EnforceConfig {
  uint64_t grace_ns = 5'000'000;
  uint32_t kill_after = 3;  // the violation that kills (1 = kill at the first)
};

struct EnforceState {
  uint64_t seen_request_ns = 0;  // the pause request being tracked
  uint64_t due_ns = 0;           // the ack is due by then (0 = nothing due)
  bool stopped = false;          // SIGSTOPped by us
  uint64_t stop_seq = 0;         // hub bubble_seq when stopped
  bool continued = false;        // SIGCONTed, ack still outstanding
  uint64_t cont_seq = 0;         // the bubble it was continued in
  uint32_t violations = 0;
  bool marked_bad = false;       // the trainer found its slot corrupt; recorded once
  bool in_trainer_noted = false; // a task inside its trainer's process: its violation recorded
  bool unsignalable = false;     // a signal to it failed (EPERM: another user's): recorded, left
};

enum class Verdict { kNone, kStop, kContinue, kKill };

struct HubMoment {
  bool in_bubble = false;
  uint64_t bubble_seq = 0;
};

struct PauseState {
  uint64_t requested_ns = 0;
  uint64_t acked_ns = 0;  // 0 = this request is not acked yet
  // Started and not yet acked since (the hub's own view). A task that acked a later start (it
  // yielded before its bubble ended) owes nothing, whatever an older request says.
  bool started = true;
};

// Advances the task's state by one observation at now_ns and says what to do to it.
Verdict enforce_step(const EnforceConfig& cfg, EnforceState* st, HubMoment hub, PauseState pause,
                     uint64_t now_ns);

const char* verdict_name(Verdict v);

}  // namespace bb::daemon
