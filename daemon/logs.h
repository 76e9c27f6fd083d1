// A launched task's output files (<state>/logs/<id>.out and .err): kept to a bound while the task
// writes them, and read by byte offset for `bubblectl logs [--follow]`.
//
// The bound drops the oldest output by punching a hole from the start of the file
// (fallocate PUNCH_HOLE): the disk blocks go back, while the file keeps its length, so the byte
// offsets a follower holds stay valid and the task's appends (O_APPEND) are never raced with a
// copy or a truncation. Where the kept data begins is read back from the file itself
// (lseek SEEK_DATA), so it survives an agent restart.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace bb::daemon {

// If the log at `path` holds more than max_bytes of data, drops its oldest part so that at most
// half of max_bytes (rounded to the file system's block) remains. Returns the bytes dropped
// (0 when within the bound or when there is no file), or -1 with *error set when the file
// system cannot punch holes (the bound cannot be kept there) or the file cannot be opened.
int64_t bound_log(const std::string& path, uint64_t max_bytes, std::string* error);

struct LogRead {
  std::string data;
  uint64_t end = 0;        // the byte after data: where to read from next
  uint64_t dropped = 0;    // bytes before the kept output that the bound dropped
  bool truncated = false;  // earlier output exists that is not in data
};

// Up to max bytes of the log at `path`: its tail (offset < 0), or from `offset` on. Output the
// bound dropped is skipped: a read from before the kept output starts where it begins, with
// truncated set. False, with *error, when there is no log.
bool read_log(const std::string& path, int64_t offset, uint32_t max, LogRead* out,
              std::string* error);

}  // namespace bb::daemon
