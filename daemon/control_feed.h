// One control connection without a socket: bytes in, reply frames out, through exactly the
// frame cutting and request handling a socket client gets (as a client of the agent's own
// uid). For the fuzzer and tests; bubbled itself only serves sockets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace bb::daemon {

class Agent;

class ControlFeed {
 public:
  explicit ControlFeed(Agent* agent);
  ~ControlFeed();
  ControlFeed(const ControlFeed&) = delete;
  ControlFeed& operator=(const ControlFeed&) = delete;

  // Takes the next bytes of the stream; false once the agent has closed the connection.
  bool feed(const uint8_t* data, size_t len);
  // The client ends the stream (a partial frame then gets a badFrame error). False if the
  // connection was already closed.
  bool end();
  // Every reply frame so far, length prefixes included.
  const std::vector<uint8_t>& replies() const { return replies_; }

 private:
  void* conn_ = nullptr;
  std::vector<uint8_t> replies_;
};

}  // namespace bb::daemon
