// Shared-memory segments as memfds: anonymous (nothing in /dev/shm to leak: a segment lives
// exactly as long as some process maps it or holds its descriptor), passed between processes
// over Unix sockets, and sealable so that no holder can ever map them writable again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace bb::shm {

// An mmap'd region that unmaps itself.
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* addr, size_t size) : addr_(addr), size_(size) {}
  ~Mapping() { reset(); }
  Mapping(Mapping&& o) noexcept : addr_(o.addr_), size_(o.size_) { o.addr_ = nullptr; o.size_ = 0; }
  Mapping& operator=(Mapping&& o) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  void reset();
  unsigned char* data() const { return static_cast<unsigned char*>(addr_); }
  size_t size() const { return size_; }
  explicit operator bool() const { return addr_ != nullptr; }

 private:
  void* addr_ = nullptr;
  size_t size_ = 0;
};

// A descriptor that closes itself.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept { if (this != &o) { reset(); fd_ = o.release(); } return *this; }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { int f = fd_; fd_ = -1; return f; }
  void reset(int fd = -1);
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Creates a zero-filled memfd of `size` bytes that can be sealed later. Returns an invalid Fd and
// sets *error on failure.
Fd create_segment(const char* debug_name, size_t size, std::string* error);

// Maps the whole segment. writable=false maps PROT_READ only.
Mapping map_segment(int fd, size_t size, bool writable, std::string* error);

// Forbids any future writable mapping or write() of the segment (F_SEAL_FUTURE_WRITE), and any
// resize. Existing writable mappings (the creator's) keep working.
bool seal_read_only(int fd, std::string* error);

// Forbids any resize of the segment (and further seals), writes stay allowed. A segment the
// creator maps and hands to a peer that may not be trusted (a task page) needs it: shrunk by the
// peer, the creator's mapping would fault (SIGBUS) where it reads past the new end.
bool seal_size(int fd, std::string* error);

// Size of the segment behind fd, or -1.
int64_t segment_size(int fd);

}  // namespace bb::shm
