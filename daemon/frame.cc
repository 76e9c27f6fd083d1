#include "daemon/frame.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#include <kj/exception.h>

namespace bb::daemon {

bool encode_frame(capnp::MessageBuilder& message, uint32_t max_frame_bytes,
                  std::vector<uint8_t>* out, std::string* error) {
  // The size first: a message far too large is never copied out.
  const size_t words = capnp::computeSerializedSizeInWords(message);
  const size_t size = words * sizeof(capnp::word);
  if (size > max_frame_bytes) {
    *error = "a message of " + std::to_string(size) + " bytes exceeds the maximum frame of " +
             std::to_string(max_frame_bytes) + " bytes";
    return false;
  }
  kj::Array<capnp::word> flat = capnp::messageToFlatArray(message);
  kj::ArrayPtr<const kj::byte> bytes = flat.asBytes();
  out->resize(4 + bytes.size());
  const uint32_t len = static_cast<uint32_t>(bytes.size());
  for (int i = 0; i < 4; ++i) (*out)[i] = static_cast<uint8_t>(len >> (8 * i));
  memcpy(out->data() + 4, bytes.begin(), bytes.size());
  return true;
}

void FrameReader::feed(const char* data, size_t len) {
  // What was cut already goes now, in one move (not one per frame, which made a run of small
  // pipelined frames cost the square of their number).
  if (start_ > 0) {
    buf_.erase(buf_.begin(), buf_.begin() + static_cast<ptrdiff_t>(start_));
    start_ = 0;
  }
  buf_.insert(buf_.end(), data, data + len);
}

FrameReader::Result FrameReader::next(std::unique_ptr<capnp::MessageReader>* reader,
                                      std::string* error) {
  // The last frame's reader is done with (valid until this call), and an idle connection should
  // not hold the memory of the largest frame it ever sent (up to max_ twice over).
  body_ = nullptr;
  // Waiting for more: what was cut goes now (once per wait, not once per frame), so the memory
  // of a large frame is not kept for the few bytes of the next one behind it.
  auto need_more = [&] {
    if (start_ > 0) {
      buf_.erase(buf_.begin(), buf_.begin() + static_cast<ptrdiff_t>(start_));
      start_ = 0;
    }
    if (buf_.capacity() > kKeepBytes && buf_.size() <= kKeepBytes) buf_.shrink_to_fit();
    return Result::kNeedMore;
  };
  const uint8_t* at = buf_.data() + start_;
  const size_t have = buf_.size() - start_;
  if (have < 4) return need_more();
  uint32_t len = 0;
  for (int i = 0; i < 4; ++i) len |= static_cast<uint32_t>(at[i]) << (8 * i);
  if (len == 0 || len % 8 != 0) {
    *error = "frame length " + std::to_string(len) +
             " is not a positive multiple of 8: the peer does not speak the bubbled protocol";
    return Result::kError;
  }
  if (len > max_) {
    *error = "frame of " + std::to_string(len) + " bytes exceeds the maximum of " +
             std::to_string(max_) + " bytes";
    return Result::kError;
  }
  if (have < 4 + static_cast<size_t>(len)) {
    need_more();  // the frame now starts the buffer
    // Once a frame is past the size an idle reader keeps, room for the whole of it at once:
    // grown by doubling, its buffer could take up to twice its size, depending on how its
    // bytes happened to arrive (and the memory bound counts the buffer's capacity).
    if (have > kKeepBytes) buf_.reserve(4 + static_cast<size_t>(len));
    return Result::kNeedMore;
  }
  body_ = kj::heapArray<capnp::word>(len / 8);
  memcpy(body_.begin(), at + 4, len);
  start_ += 4 + static_cast<size_t>(len);
  try {
    capnp::ReaderOptions opts;
    // Bounds the work a hostile frame can cause: no more words traversed than it holds (times
    // a small factor for legitimately shared structure).
    opts.traversalLimitInWords = static_cast<uint64_t>(len / 8) * 4 + 64;
    opts.nestingLimit = 16;
    auto flat = std::make_unique<capnp::FlatArrayMessageReader>(body_.asPtr(), opts);
    if (flat->getEnd() != body_.end()) {
      *error = "frame body does not match its Cap'n Proto segment table";
      return Result::kError;
    }
    *reader = std::move(flat);
    return Result::kFrame;
  } catch (const kj::Exception& e) {
    *error = std::string("frame does not decode: ") + e.getDescription().cStr();
    return Result::kError;
  }
}

bool write_frame_fd(int fd, const std::vector<uint8_t>& bytes, std::string* error) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      *error = std::string("cannot send to the agent: ") + strerror(errno);
      return false;
    }
    off += static_cast<size_t>(n);
  }
  return true;
}

bool read_frame_fd(int fd, FrameReader* frames, std::unique_ptr<capnp::MessageReader>* reader,
                   std::string* error) {
  for (;;) {
    switch (frames->next(reader, error)) {
      case FrameReader::Result::kFrame: return true;
      case FrameReader::Result::kError: return false;
      case FrameReader::Result::kNeedMore: break;
    }
    char buf[65536];
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *error = std::string("cannot read from the agent: ") + strerror(errno);
      return false;
    }
    if (n == 0) {
      *error = "the agent closed the connection";
      return false;
    }
    frames->feed(buf, static_cast<size_t>(n));
  }
}

}  // namespace bb::daemon
