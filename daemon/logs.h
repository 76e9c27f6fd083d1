// A launched task's output files (<state>/logs/<id>.out and .err): kept to a bound while the task
// writes them, and read by byte offset for `bubblectl logs [--follow]`.
//
// The bound drops the oldest output by punching a hole from the start of the file
// (fallocate PUNCH_HOLE): the disk blocks go back, while the file keeps its length, so the byte
// offsets a follower holds stay valid and the task's appends (O_APPEND) are never raced with a
// copy or a truncation. Where the kept output begins is remembered by the caller (`kept_from`);
// after a restart it is read back from the file itself (lseek SEEK_DATA), which may place it up
// to a block early on a file system that frees less than was punched.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace bb::daemon {

struct LogBound {
  int64_t dropped = 0;       // bytes dropped by this call
  bool failed = false;       // *error says why; the log is left as it was
  bool unsupported = false;  // the file system cannot punch holes: no log there can be bounded
};

// If the regular file at `path` holds more than max_bytes of output past *kept_from, drops its
// oldest part so that about half of max_bytes remains (rounded down to the file system's block,
// so whole blocks go back), and moves *kept_from to where the kept output begins. *kept_from
// starts at 0 for a log this process has not bounded yet. No file is nothing to do. Opens the
// file for writing only when it punches.
LogBound bound_log(const std::string& path, uint64_t max_bytes, uint64_t* kept_from,
                   std::string* error);

struct LogRead {
  std::string data;
  uint64_t end = 0;        // the byte after data: where to read from next
  uint64_t dropped = 0;    // bytes before the kept output that the bound dropped
  bool truncated = false;  // earlier output exists that is not in data
};

// Up to max bytes of the log at `path`: its tail (offset < 0), or from `offset` on. Output the
// bound dropped is skipped (kept_from, as bound_log keeps it, or 0 when not known): a read from
// before the kept output starts where it begins, with truncated set. False, with *error, when
// there is no log.
bool read_log(const std::string& path, int64_t offset, uint32_t max, uint64_t kept_from,
              LogRead* out, std::string* error);

}  // namespace bb::daemon
