#include "daemon/logs.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>

namespace bb::daemon {

namespace {

// Where the kept output of a file of `size` bytes begins: past the hole a bound punched at its
// start, by what this process remembers or, failing that, by the file itself.
off_t kept_start(int fd, off_t size, uint64_t kept_from) {
  off_t at = lseek(fd, 0, SEEK_DATA);
  if (at < 0) at = errno == ENXIO ? size : 0;  // ENXIO: no data at all; else no holes known
  return std::min(std::max(at, static_cast<off_t>(std::min<uint64_t>(kept_from, size))), size);
}

// The unit the file system frees in: a punch of whole units gives all of them back.
off_t free_unit(int fd) {
  struct statfs sf;
  if (fstatfs(fd, &sf) == 0 && sf.f_bsize >= 512 && sf.f_bsize <= (1 << 20)) return sf.f_bsize;
  return 4096;
}

}  // namespace

LogBound bound_log(const std::string& path, uint64_t max_bytes, uint64_t* kept_from,
                   std::string* error) {
  LogBound r;
  // Read-only and non-blocking to look: something other than a regular file at the path (a
  // FIFO) is never waited on, and a log within its bound is not opened for writing at all.
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return r;
    r.failed = true;
    *error = "cannot open the log " + path + ": " + strerror(errno);
    return r;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return r;
  }
  const off_t start = kept_start(fd, st.st_size, *kept_from);
  const off_t unit = free_unit(fd);
  close(fd);
  if (static_cast<uint64_t>(st.st_size - start) <= max_bytes) {
    *kept_from = static_cast<uint64_t>(start);
    return r;
  }
  const off_t keep_from = (st.st_size - static_cast<off_t>(max_bytes / 2)) / unit * unit;
  if (keep_from <= start) {
    *kept_from = static_cast<uint64_t>(start);
    return r;
  }
  const int wfd = open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
  if (wfd < 0 || fallocate(wfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, keep_from) != 0) {
    const int err = errno;
    if (wfd >= 0) close(wfd);
    r.failed = true;
    r.unsupported = err == EOPNOTSUPP || err == ENOSYS;
    *error = "cannot drop old output from the log " + path + ": " + strerror(err) +
             (r.unsupported ? " (its file system does not punch holes, so task logs there are "
                              "not bounded)"
                            : "");
    return r;
  }
  close(wfd);
  r.dropped = keep_from - start;
  *kept_from = static_cast<uint64_t>(keep_from);
  return r;
}

bool read_log(const std::string& path, int64_t offset, uint32_t max, uint64_t kept_from,
              LogRead* out, std::string* error) {
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    *error = errno == ENOENT ? "no log at " + path + " yet (the task has not been launched)"
             : errno == ELOOP ? "the log " + path + " is a symbolic link, which is not followed: "
                                "remove it (the agent writes its logs there itself)"
                              : "cannot open the log " + path + ": " + strerror(errno);
    return false;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) st.st_size = 0;
  const off_t size = st.st_size;
  const off_t kept = kept_start(fd, size, kept_from);
  off_t start;
  if (offset < 0)
    start = std::max(size > static_cast<off_t>(max) ? size - static_cast<off_t>(max) : 0, kept);
  else
    start = std::max(std::min<off_t>(static_cast<off_t>(offset), size), kept);
  // From an offset (following), truncated means the bound dropped what was to come next.
  out->truncated = offset < 0 ? start > 0 : start > offset;
  out->dropped = static_cast<uint64_t>(kept);
  out->data.assign(static_cast<size_t>(std::min<off_t>(size - start, max)), '\0');
  const ssize_t n = pread(fd, out->data.data(), out->data.size(), start);
  close(fd);
  out->data.resize(n > 0 ? static_cast<size_t>(n) : 0);
  out->end = static_cast<uint64_t>(start) + out->data.size();
  return true;
}

}  // namespace bb::daemon
