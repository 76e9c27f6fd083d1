// Descriptor passing: SCM_RIGHTS with strict receiving, and pidfd_open.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "shm/fd_passing.h"
#include "test_grant_support.h"

using bb::shm::recv_fds;
using bb::shm::send_fds;
using bb::test::cloexec;
using bb::test::count_open_fds;

namespace {

struct SocketPair {
  int a = -1, b = -1;
  explicit SocketPair(int type = SOCK_SEQPACKET) {
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, type | SOCK_CLOEXEC, 0, sv) == 0);
    a = sv[0];
    b = sv[1];
  }
  ~SocketPair() {
    close(a);
    close(b);
  }
};

int memfd_with(const char* text) {
  int fd = memfd_create("fd-passing-test", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, text, strlen(text)) == static_cast<ssize_t>(strlen(text)));
  return fd;
}

std::string read_all(int fd) {
  char buf[64] = {};
  ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  return n > 0 ? std::string(buf, n) : std::string();
}

}  // namespace

TEST_CASE("send_fds passes data and descriptors that arrive close-on-exec") {
  const int before = count_open_fds();
  {
    SocketPair sp;
    int fds[3] = {memfd_with("zero"), memfd_with("one"), memfd_with("two")};
    for (int fd : fds) fcntl(fd, F_SETFD, 0);  // the sender's flags must not matter
    std::string err;
    const char msg[] = "grant!";
    REQUIRE(send_fds(sp.a, msg, sizeof msg, fds, 3, &err) == BB_OK);
    char buf[32];
    int got[4];
    size_t len = 0, n = 0;
    REQUIRE(recv_fds(sp.b, buf, sizeof buf, &len, got, 4, &n, &err) == BB_OK);
    CHECK(len == sizeof msg);
    CHECK(std::string(buf) == "grant!");
    REQUIRE(n == 3);
    CHECK(got[3] == -1);
    const char* want[] = {"zero", "one", "two"};
    for (int i = 0; i < 3; ++i) {
      CHECK(got[i] != fds[i]);
      CHECK(cloexec(got[i]));
      CHECK(read_all(got[i]) == want[i]);
      close(got[i]);
      close(fds[i]);
    }
  }
  CHECK(count_open_fds() == before);
}

TEST_CASE("recv_fds rejects a message with more descriptors than asked and leaks none") {
  const int before = count_open_fds();
  {
    SocketPair sp;
    int fds[4] = {memfd_with("a"), memfd_with("b"), memfd_with("c"), memfd_with("d")};
    std::string err;
    char one = 'x';
    REQUIRE(send_fds(sp.a, &one, 1, fds, 4, &err) == BB_OK);
    for (int fd : fds) close(fd);
    char buf[8];
    int got[2];
    size_t len = 9, n = 9;
    CHECK(recv_fds(sp.b, buf, sizeof buf, &len, got, 2, &n, &err) == BB_E_CORRUPT);
    CHECK(err.find("more than the 2 descriptor") != std::string::npos);
    CHECK(n == 0);
    CHECK(len == 0);
    CHECK(got[0] == -1);
    CHECK(got[1] == -1);

    // Descriptors sent to a receiver that expects none are refused the same way.
    int extra = memfd_with("e");
    REQUIRE(send_fds(sp.a, &one, 1, &extra, 1, &err) == BB_OK);
    close(extra);
    CHECK(recv_fds(sp.b, buf, sizeof buf, &len, nullptr, 0, &n, &err) == BB_E_CORRUPT);
  }
  CHECK(count_open_fds() == before);
}

TEST_CASE("recv_fds rejects a message longer than the buffer and closes its descriptors") {
  const int before = count_open_fds();
  {
    SocketPair sp;
    int fd = memfd_with("x");
    std::string err;
    char big[100] = {};
    REQUIRE(send_fds(sp.a, big, sizeof big, &fd, 1, &err) == BB_OK);
    close(fd);
    char small[10];
    int got = -1;
    size_t len, n;
    CHECK(recv_fds(sp.b, small, sizeof small, &len, &got, 1, &n, &err) == BB_E_CORRUPT);
    CHECK(err.find("longer than the 10 bytes") != std::string::npos);
    CHECK(got == -1);
  }
  CHECK(count_open_fds() == before);
}

TEST_CASE("send_fds bounds its arguments") {
  SocketPair sp;
  std::string err;
  int fds[bb::shm::kMaxPassedFds + 1];
  for (auto& f : fds) f = 0;
  char c = 0;
  CHECK(send_fds(sp.a, &c, 1, fds, bb::shm::kMaxPassedFds + 1, &err) == BB_E_INVALID);
  CHECK(err.find("at most 16") != std::string::npos);
  CHECK(send_fds(sp.a, &c, 0, nullptr, 0, &err) == BB_E_INVALID);
  int bad = -1;
  CHECK(send_fds(sp.a, &c, 1, &bad, 1, &err) == BB_E_INVALID);
  char buf[4];
  int got[bb::shm::kMaxPassedFds + 1];
  size_t len, n;
  CHECK(recv_fds(sp.b, buf, 4, &len, got, bb::shm::kMaxPassedFds + 1, &n, &err) == BB_E_INVALID);
}

TEST_CASE("recv_fds reports a closed peer as an empty message and an empty socket as timeout") {
  SocketPair sp;
  std::string err;
  char buf[4];
  size_t len = 1, n = 1;
  fcntl(sp.b, F_SETFL, O_NONBLOCK);
  CHECK(recv_fds(sp.b, buf, 4, &len, nullptr, 0, &n, &err) == BB_E_TIMEOUT);
  shutdown(sp.a, SHUT_WR);
  CHECK(recv_fds(sp.b, buf, 4, &len, nullptr, 0, &n, &err) == BB_OK);
  CHECK(len == 0);
  CHECK(n == 0);
  char c = 1;
  CHECK(send_fds(sp.b, &c, 1, nullptr, 0, &err) == BB_OK);  // the other direction still works
  shutdown(sp.b, SHUT_RDWR);
  CHECK(send_fds(sp.a, &c, 1, nullptr, 0, &err) == BB_E_SYSTEM);  // EPIPE, and no SIGPIPE
}

TEST_CASE("pidfd_open_pid names a process until it exits, and a pid without one is not found") {
  const int before = count_open_fds();
  struct Kid {  // killed and reaped whatever the test does
    pid_t pid = -1;
    ~Kid() {
      if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  } kid;
  kid.pid = fork();
  REQUIRE(kid.pid >= 0);
  if (kid.pid == 0)
    for (;;) pause();
  std::string err;
  int pidfd = -1;
  REQUIRE(bb::shm::pidfd_open_pid(kid.pid, &pidfd, &err) == BB_OK);
  CHECK(cloexec(pidfd));
  pollfd p{pidfd, POLLIN, 0};
  CHECK(poll(&p, 1, 0) == 0);  // alive: not readable
  kill(kid.pid, SIGKILL);
  CHECK(poll(&p, 1, 10000) == 1);  // readable once it has exited, reaped or not
  close(pidfd);
  // Above any pid_max the kernel allows (2^22): no process has it.
  CHECK(bb::shm::pidfd_open_pid(0x3fffffff, &pidfd, &err) == BB_E_NOT_FOUND);
  CHECK(pidfd == -1);
  CHECK(!err.empty());
  waitpid(kid.pid, nullptr, 0);
  kid.pid = -1;
  CHECK(count_open_fds() == before);
}

namespace {

std::vector<int> g_disposed;
void record_disposed(const int* fds, size_t n) { g_disposed.insert(g_disposed.end(), fds, fds + n); }

// Sends n descriptors in one message with sendmsg itself (send_fds stops at kMaxPassedFds, a
// hostile peer does not).
void send_many(int sock, const std::vector<int>& fds) {
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  char one = 'x';
  iovec iov{&one, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  REQUIRE(sendmsg(sock, &msg, 0) == 1);
}

}  // namespace

TEST_CASE("every descriptor of a message that broke its bounds goes to the receiver's dispose") {
  // The kernel closes what does not fit the receiver's control buffer, in the receiving thread,
  // where a close can block; the receiver takes them all and hands them on instead.
  const int before = count_open_fds();
  {
    SocketPair sp;
    std::vector<int> sent;
    for (int i = 0; i < 200; ++i) sent.push_back(memfd_with("many"));
    send_many(sp.a, sent);
    send_many(sp.a, std::vector<int>(sent.begin(), sent.begin() + 5));
    for (int fd : sent) close(fd);
    char buf[8];
    int got[2];
    size_t n = 9;
    bb::shm::RecvProblem problem;
    for (size_t max_fds : {size_t(2), size_t(0)}) {  // two too many, and any at all
      g_disposed.clear();
      const long len = bb::shm::recv_with_fds(sp.b, buf, sizeof buf, max_fds ? got : nullptr,
                                              max_fds, &n, 0, &problem, record_disposed);
      CHECK(len == 1);
      CHECK(problem == bb::shm::RecvProblem::kTooManyFds);
      CHECK(n == 0);
      CHECK(g_disposed.size() == (max_fds ? 200u : 5u));
      for (int fd : g_disposed) {
        CHECK(fcntl(fd, F_GETFD) == FD_CLOEXEC);  // open, handed over, close-on-exec
        close(fd);
      }
    }
  }
  CHECK(count_open_fds() == before);
}
