// Length-prefixed Cap'n Proto frames on a byte stream (the control protocol's wire format).
//
// A frame is a 4-byte little-endian length and that many bytes of one standard-serialized
// Cap'n Proto message. Lengths are checked before any byte of the body is buffered, so a peer
// can never make the agent allocate more than the maximum frame size.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace bb::daemon {

// Serializes a message into one frame (length prefix included) in *out. False, with *error
// saying how large it would be, when its body exceeds max_frame_bytes: the peer would refuse such
// a frame and close the connection, so it is never sent.
bool encode_frame(capnp::MessageBuilder& message, uint32_t max_frame_bytes,
                  std::vector<uint8_t>* out, std::string* error);

// Accumulates stream bytes and cuts them into frames.
class FrameReader {
 public:
  explicit FrameReader(uint32_t max_frame_bytes) : max_(max_frame_bytes) {}

  enum class Result { kNeedMore, kFrame, kError };

  // Appends received bytes.
  void feed(const char* data, size_t len);
  // Cuts the next frame if one is complete. On kFrame, *reader holds the decoded message
  // (valid until the next call); on kError, *error says what is wrong with the stream.
  Result next(std::unique_ptr<capnp::MessageReader>* reader, std::string* error);
  // Bytes buffered that do not yet form a frame (a truncated frame at EOF).
  size_t pending() const { return buf_.size() - start_; }
  // Memory held for the stream (buffer capacity and the current frame's copy).
  size_t held_bytes() const { return buf_.capacity() + body_.size() * sizeof(capnp::word); }

 private:
  static constexpr size_t kKeepBytes = 64 * 1024;  // buffer kept between frames, at most
  uint32_t max_;
  std::vector<uint8_t> buf_;
  size_t start_ = 0;             // where in buf_ the next frame begins (the rest was cut)
  kj::Array<capnp::word> body_;  // aligned copy of the current frame's body
};

// Blocking helpers for the CLI: write one encoded frame / read one frame from a socket
// descriptor.
bool write_frame_fd(int fd, const std::vector<uint8_t>& frame, std::string* error);
bool read_frame_fd(int fd, FrameReader* frames, std::unique_ptr<capnp::MessageReader>* reader,
                   std::string* error);

}  // namespace bb::daemon
