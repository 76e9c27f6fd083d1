#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace bb::shm {

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    reset();
    addr_ = o.addr_;
    size_ = o.size_;
    o.addr_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void Mapping::reset() {
  if (addr_) munmap(addr_, size_);
  addr_ = nullptr;
  size_ = 0;
}

void Fd::reset(int fd) {
  if (fd_ >= 0) close(fd_);
  fd_ = fd;
}

Fd create_segment(const char* debug_name, size_t size, std::string* error) {
  Fd fd(memfd_create(debug_name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) {
    *error = std::string("memfd_create failed: ") + std::strerror(errno);
    return Fd();
  }
  if (ftruncate(fd.get(), off_t(size)) != 0) {
    *error = std::string("cannot size a shared-memory segment to ") + std::to_string(size) +
             " bytes: " + std::strerror(errno);
    return Fd();
  }
  return fd;
}

Mapping map_segment(int fd, size_t size, bool writable, std::string* error) {
  const int prot = writable ? PROT_READ | PROT_WRITE : PROT_READ;
  void* p = mmap(nullptr, size, prot, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *error = std::string("cannot map a shared-memory segment: ") + std::strerror(errno);
    return Mapping();
  }
  return Mapping(p, size);
}

bool seal_read_only(int fd, std::string* error) {
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    *error = std::string("cannot seal the hub segment read-only (needs Linux 5.1+): ") +
             std::strerror(errno);
    return false;
  }
  return true;
}

bool seal_size(int fd, std::string* error) {
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    *error = std::string("cannot seal the size of a task page: ") + std::strerror(errno);
    return false;
  }
  return true;
}

int64_t segment_size(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return -1;
  return int64_t(st.st_size);
}

}  // namespace bb::shm
