// The thread-local "last error" behind bb_last_error(): every failing path records one sentence
// that says what went wrong and what to do about it.
#pragma once

#include <bubble/bubble.h>

#include <string>

namespace bb::core {

// Records the message for this thread and returns status, so a failing path is one line:
//   return fail(BB_E_INVALID, "rank %u is out of range 0..65535", rank);
bb_status fail(bb_status status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
bb_status fail_msg(bb_status status, const std::string& message);
const char* last_error();
void clear_error();

}  // namespace bb::core
