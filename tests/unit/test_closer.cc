// The closer thread: what the hub's service thread must not close itself (core/closer.h).
#include <doctest/doctest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "core/closer.h"

namespace {

bool eventually(bool (*cond)(uint64_t), uint64_t arg) {
  for (int i = 0; i < 2000; ++i) {
    if (cond(arg)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond(arg);
}

}  // namespace

TEST_CASE("a_close_that_blocks_is_left_to_the_closer_thread_and_its_caller_goes_on") {
  // A TCP socket lingering over data its peer does not read: its close waits until the peer
  // reads (or 30 s pass). This is what a task could hand a hub on a kernel before 6.16.
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(listener >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  REQUIRE(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(listen(listener, 1) == 0);
  REQUIRE(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  const int lingering = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(connect(lingering, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  const int peer = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  REQUIRE(peer >= 0);
  // Fill both buffers: the peer reads nothing yet.
  REQUIRE(fcntl(lingering, F_SETFL, O_NONBLOCK) == 0);
  char chunk[65536] = {};
  size_t sent = 0;
  for (;;) {
    const ssize_t n = send(lingering, chunk, sizeof chunk, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += size_t(n);
  }
  REQUIRE(sent > 0);
  const linger lg{1, 30};
  REQUIRE(setsockopt(lingering, SOL_SOCKET, SO_LINGER, &lg, sizeof lg) == 0);

  const bb::core::CloserStats before = bb::core::closer_stats();
  bb::core::close_elsewhere(&lingering, 1);
  // Back here with the close still waiting on the peer: it was queued, not done by this thread.
  const bb::core::CloserStats handed = bb::core::closer_stats();
  CHECK(handed.queued == before.queued + 1);
  CHECK(handed.closed_inline == before.closed_inline);
  CHECK(handed.closed == before.closed);
  // The peer reads everything, then sees the end: the lingering close completes on its thread.
  size_t got = 0;
  for (;;) {
    const ssize_t n = recv(peer, chunk, sizeof chunk, 0);
    if (n <= 0) {
      CHECK(n == 0);  // a clean end, after every byte
      break;
    }
    got += size_t(n);
  }
  CHECK(got == sent);
  CHECK(eventually([](uint64_t closed) { return bb::core::closer_stats().closed > closed; },
                   before.closed));
  close(peer);
  close(listener);
}

TEST_CASE("descriptors_handed_to_the_closer_are_closed_and_negative_ones_skipped") {
  int p[2];
  REQUIRE(pipe2(p, O_CLOEXEC) == 0);
  const bb::core::CloserStats before = bb::core::closer_stats();
  const int fds[3] = {-1, p[1], -1};
  bb::core::close_elsewhere(fds, 3);
  // The write end closes: the read end sees the end of the pipe.
  char c;
  CHECK(read(p[0], &c, 1) == 0);
  const bb::core::CloserStats after = bb::core::closer_stats();
  CHECK(after.queued == before.queued + 1);
  close(p[0]);
}
