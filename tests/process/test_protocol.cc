// The hub socket protocol against peers that are not libbubble of the same version.
#include <bubble/bubble.h>
#include <doctest/doctest.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "core/paths.h"
#include "shm/layout.h"
#include "shm/segment.h"
#include "shm/wire.h"
#include "tests/helpers/proc.h"
#include "tests/helpers/raw_attach.h"

using bbtest::RuntimeDir;

namespace {

int listen_at(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path.c_str());
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(listen(fd, 4) == 0);
  return fd;
}

int connect_to(const std::string& path) {
  const int fd = bbtest::connect_hub(path);
  REQUIRE(fd >= 0);
  return fd;
}

// A trainer from a hypothetical future release: it answers the attach with a hub whose layout
// version this libbubble does not know.
void serve_foreign_hub(int listen_fd, uint32_t layout_version) {
  int c = accept(listen_fd, nullptr, nullptr);
  char buf[bb::shm::kWireMaxMessage];
  int fds[2], nfds;
  bb::shm::recv_msg(c, buf, fds, &nfds);
  std::string err;
  const auto g = bb::shm::hub_geometry(4, 64);
  bb::shm::Fd hub = bb::shm::create_segment("foreign", g.layout_size, &err);
  bb::shm::Fd page = bb::shm::create_segment("foreign-page", bb::shm::kTaskPageSize, &err);
  {
    bb::shm::Mapping m = bb::shm::map_segment(hub.get(), g.layout_size, true, &err);
    bb::shm::init_hub(m.data(), g, "future", 0);
    reinterpret_cast<bb::shm::HubHeader*>(m.data())->layout_version = layout_version;
  }
  auto r = bb::shm::make_msg<bb::shm::AttachReplyMsg>(bb::shm::MsgType::kAttachReply);
  r.status = BB_OK;
  r.layout_version = layout_version;
  r.hub_size = g.layout_size;
  const int out[2] = {hub.get(), page.get()};
  bb::shm::send_msg(c, &r, sizeof r, out, 2);
  char x;
  (void)!read(c, &x, 1);  // until the task hangs up
  close(c);
}

}  // namespace

TEST_CASE("layout_version_mismatch_gives_a_clear_error") {
  RuntimeDir dir;
  std::string sock;
  REQUIRE(bb::core::hub_paths(dir.path(), "future", 0, &sock, nullptr) == BB_OK);
  const int lfd = listen_at(sock);
  std::thread server([&] { serve_foreign_hub(lfd, 99); });
  const int fds_before = int(bbtest::list_dir("/proc/self/fd").size());
  bb_task_h task = nullptr;
  CHECK(bb_task_attach("future", 0, "t", nullptr, &task) == BB_E_VERSION);
  CHECK(task == nullptr);
  const std::string msg = bb_last_error();
  CHECK(msg.find("layout version 99") != std::string::npos);
  CHECK(msg.find("same libbubble release") != std::string::npos);
  server.join();
  // The failed attach closed everything it received.
  CHECK(int(bbtest::list_dir("/proc/self/fd").size()) == fds_before);
  close(lfd);
  unlink(sock.c_str());
}

TEST_CASE("trainer_refuses_another_protocol_version_and_malformed_hellos") {
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("proto", 0, nullptr, &t) == BB_OK);
  std::string sock;
  REQUIRE(bb::core::hub_paths(dir.path(), "proto", 0, &sock, nullptr) == BB_OK);
  char buf[bb::shm::kWireMaxMessage];
  int fds[2], nfds;
  {
    // Protocol version 2 of the attach message.
    const int c = connect_to(sock);
    auto m = bb::shm::make_msg<bb::shm::AttachTaskMsg>(bb::shm::MsgType::kAttachTask);
    m.h.version = 2;
    std::snprintf(m.name, sizeof m.name, "x");
    REQUIRE(bb::shm::send_msg(c, &m, sizeof m, nullptr, 0) == 0);
    const long n = bb::shm::recv_msg(c, buf, fds, &nfds);
    REQUIRE(bb::shm::check_msg(buf, n, bb::shm::MsgType::kAttachReply, sizeof(bb::shm::AttachReplyMsg)));
    bb::shm::AttachReplyMsg r;
    std::memcpy(&r, buf, sizeof r);
    CHECK(r.status == BB_E_VERSION);
    CHECK(nfds == 0);
    CHECK(bb::shm::recv_msg(c, buf, fds, &nfds) == 0);  // and the connection is closed
    close(c);
  }
  {
    // Garbage of the right length, then garbage of the wrong length.
    for (size_t len : {sizeof(bb::shm::AttachTaskMsg), size_t(3),
                       bb::shm::kWireMaxMessage + 100 /* larger than any message */}) {
      const int c = connect_to(sock);
      std::vector<char> junk(len, 'Z');
      REQUIRE(send(c, junk.data(), junk.size(), 0) == ssize_t(len));
      const long n = bb::shm::recv_msg(c, buf, fds, &nfds);
      REQUIRE(n == long(sizeof(bb::shm::AttachReplyMsg)));
      bb::shm::AttachReplyMsg r;
      std::memcpy(&r, buf, sizeof r);
      CHECK(r.status == BB_E_INVALID);
      CHECK(bb::shm::recv_msg(c, buf, fds, &nfds) == 0);
      close(c);
    }
  }
  {
    // A peer that connects and says nothing does not hold up anyone else.
    const int silent = connect_to(sock);
    bb_task_h task = nullptr;
    CHECK(bb_task_attach("proto", 0, "after-silent", nullptr, &task) == BB_OK);
    bb_task_detach(task);
    close(silent);
  }
  // The hub still works after all that.
  CHECK(bb_bubble_begin(t, 1000, BB_MEM_UNKNOWN, BB_BUBBLE_OTHER) == BB_OK);
  CHECK(bb_bubble_end(t) == BB_OK);
  bb_trainer_close(t);
  CHECK(dir.files().empty());
}

TEST_CASE("hub_segment_cannot_be_made_writable_by_a_task") {
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("ro", 0, nullptr, &t) == BB_OK);
  std::string sock;
  REQUIRE(bb::core::hub_paths(dir.path(), "ro", 0, &sock, nullptr) == BB_OK);
  const int c = connect_to(sock);
  auto m = bb::shm::make_msg<bb::shm::AttachTaskMsg>(bb::shm::MsgType::kAttachTask);
  std::snprintf(m.name, sizeof m.name, "sneaky");
  REQUIRE(bb::shm::send_msg(c, &m, sizeof m, nullptr, 0) == 0);
  char buf[bb::shm::kWireMaxMessage];
  int fds[2], nfds;
  REQUIRE(bb::shm::recv_msg(c, buf, fds, &nfds) > 0);
  REQUIRE(nfds == 2);
  const int64_t size = bb::shm::segment_size(fds[0]);
  std::string err;
  // Mapping the hub writable fails, through the passed descriptor or /proc reopening alike.
  CHECK_FALSE(bb::shm::map_segment(fds[0], size_t(size), true, &err));
  const std::string proc = "/proc/self/fd/" + std::to_string(fds[0]);
  const int reopened = open(proc.c_str(), O_RDWR);
  if (reopened >= 0) {
    CHECK_FALSE(bb::shm::map_segment(reopened, size_t(size), true, &err));
    CHECK(write(reopened, "x", 1) < 0);
    close(reopened);
  }
  // A read-only mapping cannot be upgraded either.
  bb::shm::Mapping ro = bb::shm::map_segment(fds[0], size_t(size), false, &err);
  REQUIRE(ro);
  CHECK(mprotect(ro.data(), 4096, PROT_READ | PROT_WRITE) != 0);
  // Its own task page, though, is writable.
  CHECK(bb::shm::map_segment(fds[1], bb::shm::kTaskPageSize, true, &err));
  close(fds[0]);
  close(fds[1]);
  close(c);
  bb_trainer_close(t);
}

TEST_CASE("an_observer_whose_answers_do_not_fit_its_socket_is_dropped_never_answered_out_of_order") {
  // An observer pairs each answer with its request by their order. Answers the trainer cannot
  // send (the observer's socket is full) must not be skipped, which would put every later answer
  // on the wrong request: the connection is dropped instead, and the observer sees its end.
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("flood", 0, nullptr, &t) == BB_OK);
  bb_task_h task = nullptr;
  REQUIRE(bb_task_attach("flood", 0, "paged", nullptr, &task) == BB_OK);
  bb_task_info_t info{sizeof info};
  size_t count = 0;
  REQUIRE(bbtest::eventually([&] {
    return bb_trainer_tasks(t, &info, 1, &count) == BB_OK && count == 1;
  }));
  std::string sock;
  REQUIRE(bb::core::hub_paths(dir.path(), "flood", 0, &sock, nullptr) == BB_OK);
  const int c = connect_to(sock);
  auto hello = bb::shm::make_msg<bb::shm::AttachObserverMsg>(bb::shm::MsgType::kAttachObserver);
  REQUIRE(bb::shm::send_msg(c, &hello, sizeof hello, nullptr, 0) == 0);
  alignas(8) char buf[bb::shm::kWireMaxMessage];
  int fds[2], nfds = 0;
  long n = bb::shm::recv_msg(c, buf, fds, &nfds);
  for (int i = 0; i < nfds; ++i) close(fds[i]);
  REQUIRE(bb::shm::check_msg(buf, n, bb::shm::MsgType::kAttachReply,
                             sizeof(bb::shm::AttachReplyMsg)));
  // Far more requests than a socket queues answers for (net.unix.max_dgram_qlen, 10 by
  // default), none read meanwhile.
  constexpr int kRequests = 200;
  auto q = bb::shm::make_msg<bb::shm::SlotRequestMsg>(bb::shm::MsgType::kGetTaskPage);
  q.slot = uint32_t(info.id & 0xffffffffu);
  q.generation = uint32_t(info.id >> 32);
  int sent = 0;
  for (; sent < kRequests; ++sent)
    if (bb::shm::send_msg(c, &q, sizeof q, nullptr, 0, MSG_DONTWAIT) != 0) break;
  REQUIRE(sent > 20);
  // Until the trainer has read every request (nothing of ours is left in its queue), so that
  // it answered, or failed to answer, each before we read any.
  REQUIRE(bbtest::eventually([&] {
    int queued = -1;
    return ioctl(c, SIOCOUTQ, &queued) == 0 && queued == 0;
  }));
  timeval tv{5, 0};
  setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  int answers = 0;
  bool ended = false;
  for (;;) {
    n = bb::shm::recv_msg(c, buf, fds, &nfds);
    for (int i = 0; i < nfds; ++i) close(fds[i]);
    if (n == 0 || n == -ECONNRESET) {
      ended = true;
      break;
    }
    if (n < 0) break;  // the timeout: neither all answers nor the end
    REQUIRE(bb::shm::check_msg(buf, n, bb::shm::MsgType::kReply, sizeof(bb::shm::ReplyMsg)));
    bb::shm::ReplyMsg r;
    std::memcpy(&r, buf, sizeof r);
    CHECK(r.status == BB_OK);
    CHECK(nfds == 1);
    if (++answers == sent) break;
  }
  INFO("sent " << sent << ", answered " << answers);
  CHECK((answers == sent || ended));
  close(c);
  bb_task_detach(task);
  bb_trainer_close(t);
}
