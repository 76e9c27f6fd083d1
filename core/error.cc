#include "core/error.h"

#include <cstdarg>
#include <cstdio>

namespace bb::core {
namespace {
thread_local char t_message[512];
}

bb_status fail(bb_status status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(t_message, sizeof t_message, fmt, ap);
  va_end(ap);
  return status;
}

bb_status fail_msg(bb_status status, const std::string& message) {
  std::snprintf(t_message, sizeof t_message, "%s", message.c_str());
  return status;
}

const char* last_error() { return t_message; }
void clear_error() { t_message[0] = '\0'; }

}  // namespace bb::core
