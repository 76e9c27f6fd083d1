#include "daemon/enforcer.h"

namespace bb::daemon {

Verdict enforce_step(const EnforceConfig& cfg, EnforceState* st, HubMoment hub, PauseState pause,
                     uint64_t now_ns) {
  if (st->stopped) {
    if (hub.in_bubble && hub.bubble_seq > st->stop_seq) {
      st->stopped = false;
      st->continued = true;
      st->cont_seq = hub.bubble_seq;
      st->due_ns = 0;
      return Verdict::kContinue;
    }
    return Verdict::kNone;
  }
  // The hub reports an ack time only for an ack of this very pause request.
  bool outstanding = pause.started && pause.requested_ns != 0 && pause.acked_ns == 0;
  if (!outstanding) {
    st->due_ns = 0;
    st->continued = false;
    st->seen_request_ns = pause.requested_ns;
    return Verdict::kNone;
  }
  if (pause.requested_ns != st->seen_request_ns) {
    st->seen_request_ns = pause.requested_ns;
    st->due_ns = pause.requested_ns + cfg.grace_ns;
    st->continued = false;
  } else if (st->continued && st->due_ns == 0 &&
             (!hub.in_bubble || hub.bubble_seq > st->cont_seq)) {
    // The bubble it was continued in is over and the old pause is still not acked.
    st->due_ns = now_ns + cfg.grace_ns;
  }
  if (st->due_ns == 0 || now_ns < st->due_ns) return Verdict::kNone;
  st->due_ns = 0;
  st->continued = false;
  ++st->violations;
  if (st->violations >= cfg.kill_after) return Verdict::kKill;
  st->stopped = true;
  st->stop_seq = hub.bubble_seq;
  return Verdict::kStop;
}

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::kNone: return "none";
    case Verdict::kStop: return "stop";
    case Verdict::kContinue: return "continue";
    case Verdict::kKill: return "kill";
  }
  return "?";
}

}  // namespace bb::daemon
