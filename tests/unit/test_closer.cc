// The closer thread: what the hub's service thread must not close itself (core/closer.h).
#include <doctest/doctest.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

TEST_CASE("a_lingering_socket_handed_to_the_closer_is_reset_not_waited_on") {
  // A TCP socket set to linger over data its peer does not read: its close would wait until the
  // peer reads (or 30 s pass). A task could hand a hub one on a kernel before 6.16. The closer
  // makes it close at once, resetting the connection, so it holds no place in its queue.
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
  CHECK(bb::core::closer_stats().queued == before.queued + 1);
  // The peer finds its connection reset: the close did not wait for it to read (a lingering
  // close would have let it read every byte and then see a clean end).
  ssize_t last = 0;
  while ((last = recv(peer, chunk, sizeof chunk, 0)) > 0) {
  }
  const int err = errno;
  CHECK(last < 0);
  CHECK(err == ECONNRESET);
  CHECK(eventually([](uint64_t closed) { return bb::core::closer_stats().closed > closed; },
                   before.closed));
  close(peer);
  close(listener);
}

TEST_CASE("the_closers_queue_is_bounded_by_the_descriptor_limit") {
  rlimit r{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &r) == 0);
  const uint64_t want = std::clamp<uint64_t>(r.rlim_cur / 8, 16, 4096);
  CHECK(bb::core::closer_stats().max_queued == want);
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

// ThreadSanitizer ends a child of a multi-threaded process that starts a thread (die_after_fork).
#if !defined(__SANITIZE_THREAD__)
TEST_CASE("a_child_forked_after_the_closer_started_has_a_closer_of_its_own") {
  // The parent's closer runs, and is past its start: a thread forked over while it is still
  // starting may hold the allocator's lock (the sanitizers' allocators have no fork handler),
  // which would leave the child unable to allocate at all.
  REQUIRE(eventually([](uint64_t) { return bb::core::closer_stats().started; }, 0));
  int data[2], hold[2];
  REQUIRE(pipe2(data, O_CLOEXEC) == 0);
  REQUIRE(pipe2(hold, O_CLOEXEC) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(data[0]);
    close(hold[1]);
    bb::core::close_elsewhere(&data[1], 1);
    char c;
    (void)!read(hold[0], &c, 1);  // stays until the parent has looked
    _exit(0);
  }
  close(data[1]);
  close(hold[0]);
  // Only the child's write end is left, and only its closer can close it while it waits.
  pollfd p{data[0], POLLIN, 0};
  const bool ended = poll(&p, 1, 20000) == 1;
  CHECK(ended);
  char c;
  if (ended) CHECK(read(data[0], &c, 1) == 0);
  close(hold[1]);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  close(data[0]);
}
#endif
