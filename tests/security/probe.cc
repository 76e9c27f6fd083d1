// What another user can do to a hub: run under another uid (setpriv) by the security tests.
//
//   bb_security_probe attach-api RUNTIME_DIR JOB RANK   bb_task_attach through the C ABI
//   bb_security_probe attach-raw SOCKET                  a task's attach at the wire level
//   bb_security_probe observe-raw SOCKET                 an observer's attach at the wire level
//   bb_security_probe page-raw SOCKET SLOT GENERATION    an observer asking for a task's page
//   bb_security_probe stop-raw SOCKET SLOT GENERATION    an observer asking a task to stop
//   bb_security_probe open PATH                          open(PATH, O_RDONLY)
//
// Prints one line: "RESULT <outcome> <detail>", where outcome is a bb_status name, "fds=<n>"
// follows a wire reply, and "errno <NAME>" reports a failed system call.
#include <bubble/bubble.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "shm/wire.h"

namespace {

int result_errno(const char* what) {
  std::printf("RESULT errno %s (%s)\n", strerrorname_np(errno), what);
  return 0;
}

// A connection to the hub socket with a 10 s receive timeout; -1 (errno set) on failure.
int connect_to(const char* path) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    const int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

int wire(const char* path, bool task) {
  const int fd = connect_to(path);
  if (fd < 0) return result_errno("connect");
  int sent;
  if (task) {
    auto m = bb::shm::make_msg<bb::shm::AttachTaskMsg>(bb::shm::MsgType::kAttachTask);
    std::snprintf(m.name, sizeof m.name, "intruder");
    sent = bb::shm::send_msg(fd, &m, sizeof m, nullptr, 0);
  } else {
    auto m = bb::shm::make_msg<bb::shm::AttachObserverMsg>(bb::shm::MsgType::kAttachObserver);
    sent = bb::shm::send_msg(fd, &m, sizeof m, nullptr, 0);
  }
  // The trainer may have answered and hung up before the request arrived.
  if (sent != 0 && sent != EPIPE && sent != ECONNRESET) {
    errno = sent;
    return result_errno("send");
  }
  alignas(8) char buf[bb::shm::kWireMaxMessage];
  int fds[2], nfds = 0;
  const long n = bb::shm::recv_msg(fd, buf, fds, &nfds);
  for (int i = 0; i < nfds; ++i) close(fds[i]);
  if (n < 0) {
    errno = int(-n);
    return result_errno("recv");
  }
  if (!bb::shm::check_msg(buf, n, bb::shm::MsgType::kAttachReply, sizeof(bb::shm::AttachReplyMsg))) {
    std::printf("RESULT no-reply fds=%d\n", nfds);
    return 0;
  }
  bb::shm::AttachReplyMsg r;
  std::memcpy(&r, buf, sizeof r);
  r.error[sizeof r.error - 1] = 0;
  std::printf("RESULT %s fds=%d %s\n", bb_status_name(bb_status(r.status)), nfds, r.error);
  close(fd);
  return 0;
}

// Attaches as an observer and asks for the page of the task in slot/generation (or, with stop,
// for it to stop); says whether a descriptor came and whether it maps writable.
int page(const char* path, uint32_t slot, uint32_t generation, bool stop = false) {
  const int fd = connect_to(path);
  if (fd < 0) return result_errno("connect");
  auto m = bb::shm::make_msg<bb::shm::AttachObserverMsg>(bb::shm::MsgType::kAttachObserver);
  if (bb::shm::send_msg(fd, &m, sizeof m, nullptr, 0) != 0) return result_errno("send");
  alignas(8) char buf[bb::shm::kWireMaxMessage];
  int fds[2], nfds = 0;
  long n = bb::shm::recv_msg(fd, buf, fds, &nfds);
  for (int i = 0; i < nfds; ++i) close(fds[i]);
  if (!bb::shm::check_msg(buf, n, bb::shm::MsgType::kAttachReply, sizeof(bb::shm::AttachReplyMsg)))
    return std::printf("RESULT no-attach-reply\n"), 0;
  auto q = bb::shm::make_msg<bb::shm::SlotRequestMsg>(stop ? bb::shm::MsgType::kStopTask
                                                           : bb::shm::MsgType::kGetTaskPage);
  q.slot = slot;
  q.generation = generation;
  if (bb::shm::send_msg(fd, &q, sizeof q, nullptr, 0) != 0) return result_errno("send");
  n = bb::shm::recv_msg(fd, buf, fds, &nfds);
  if (!bb::shm::check_msg(buf, n, bb::shm::MsgType::kReply, sizeof(bb::shm::ReplyMsg)))
    return std::printf("RESULT no-reply\n"), 0;
  bb::shm::ReplyMsg r;
  std::memcpy(&r, buf, sizeof r);
  r.error[sizeof r.error - 1] = 0;
  bool writable = false;
  if (nfds > 0) {
    void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
    writable = p != MAP_FAILED;
    if (writable) munmap(p, 4096);
  }
  for (int i = 0; i < nfds; ++i) close(fds[i]);
  std::printf("RESULT %s fds=%d%s %s\n", bb_status_name(bb_status(r.status)), nfds,
              writable ? " writable" : "", r.error);
  close(fd);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A refusing trainer may hang up before our request is sent: report that, do not die of it.
  signal(SIGPIPE, SIG_IGN);
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "attach-api" && argc == 5) {
    bb_task_options_t o;
    bb_task_options_init(&o);
    o.runtime_dir = argv[2];
    bb_task_h t = nullptr;
    const bb_status st = bb_task_attach(argv[3], uint32_t(std::atoi(argv[4])), "intruder", &o, &t);
    std::printf("RESULT %s %s\n", bb_status_name(st), st == BB_OK ? "" : bb_last_error());
    bb_task_detach(t);
    return 0;
  }
  if ((cmd == "attach-raw" || cmd == "observe-raw") && argc == 3)
    return wire(argv[2], cmd == "attach-raw");
  if ((cmd == "page-raw" || cmd == "stop-raw") && argc == 5)
    return page(argv[2], uint32_t(std::strtoul(argv[3], nullptr, 10)),
                uint32_t(std::strtoul(argv[4], nullptr, 10)), cmd == "stop-raw");
  if (cmd == "open" && argc == 3) {
    const int fd = open(argv[2], O_RDONLY | O_CLOEXEC);
    if (fd < 0) return result_errno("open");
    char c;
    const ssize_t n = read(fd, &c, 1);
    std::printf("RESULT opened read=%zd\n", n);
    close(fd);
    return 0;
  }
  std::fprintf(stderr, "usage: %s attach-api DIR JOB RANK | attach-raw SOCK | observe-raw SOCK | "
               "page-raw SOCK SLOT GENERATION | stop-raw SOCK SLOT GENERATION | open PATH\n",
               argv[0]);
  return 64;
}
