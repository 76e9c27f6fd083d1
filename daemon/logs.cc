#include "daemon/logs.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

namespace bb::daemon {

namespace {

// Where the data of a file of `size` bytes begins: past the hole a bound punched at its start.
off_t data_start(int fd, off_t size) {
  const off_t at = lseek(fd, 0, SEEK_DATA);
  if (at >= 0) return std::min(at, size);
  return errno == ENXIO ? size : 0;  // ENXIO: no data at all; other errors: no holes known
}

}  // namespace

int64_t bound_log(const std::string& path, uint64_t max_bytes, std::string* error) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return 0;
    *error = "cannot open " + path + ": " + strerror(errno);
    return -1;
  }
  struct stat st;
  int64_t dropped = 0;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    const off_t start = data_start(fd, st.st_size);
    if (static_cast<uint64_t>(st.st_size - start) > max_bytes) {
      const off_t block = st.st_blksize > 0 ? st.st_blksize : 4096;
      // Whole blocks only: a partly punched block would stay on disk, zero-filled, and read as
      // data.
      const off_t keep_from = (st.st_size - static_cast<off_t>(max_bytes / 2)) / block * block;
      if (keep_from > start) {
        if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, keep_from) != 0) {
          *error = "cannot drop old output from " + path + " (" + strerror(errno) +
                   "): its file system does not punch holes, so task logs are not bounded";
          close(fd);
          return -1;
        }
        dropped = keep_from - start;
      }
    }
  }
  close(fd);
  return dropped;
}

bool read_log(const std::string& path, int64_t offset, uint32_t max, LogRead* out,
              std::string* error) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    *error = "no log at " + path + " yet (the task has not been launched)";
    return false;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) st.st_size = 0;
  const off_t size = st.st_size;
  const off_t kept = data_start(fd, size);
  off_t start;
  if (offset < 0) {
    start = std::max(size > static_cast<off_t>(max) ? size - static_cast<off_t>(max) : 0, kept);
  } else {
    start = std::max(std::min<off_t>(static_cast<off_t>(offset), size), kept);
  }
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
