// Attaching to a hub at the wire level, without the task runtime: for tests and fuzzers that
// play a misbehaving task (one that writes whatever it likes into its page).
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "shm/layout.h"
#include "shm/segment.h"
#include "shm/wire.h"

namespace bbtest {

inline sockaddr_un hub_address(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path.c_str());
  return a;
}

inline int connect_hub(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const sockaddr_un a = hub_address(path);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

struct RawAttach {
  int sock = -1;
  int hub_fd = -1;
  int page_fd = -1;
  bb::shm::AttachReplyMsg reply{};
  ~RawAttach() {
    for (int fd : {sock, hub_fd, page_fd})
      if (fd >= 0) close(fd);
  }
};

// Sends an attach request as a task named `name` (asking for mem_need bytes of lent memory);
// true when the trainer granted a slot.
inline bool raw_attach(const std::string& socket_path, const char* name, RawAttach* out,
                       uint64_t mem_need = 0) {
  out->sock = connect_hub(socket_path);
  if (out->sock < 0) return false;
  auto m = bb::shm::make_msg<bb::shm::AttachTaskMsg>(bb::shm::MsgType::kAttachTask);
  std::snprintf(m.name, sizeof m.name, "%s", name);
  m.mem_need = mem_need;
  if (bb::shm::send_msg(out->sock, &m, sizeof m, nullptr, 0) != 0) return false;
  char buf[bb::shm::kWireMaxMessage];
  int fds[2], nfds;
  const long n = bb::shm::recv_msg(out->sock, buf, fds, &nfds);
  out->hub_fd = fds[0];
  out->page_fd = fds[1];
  if (!bb::shm::check_msg(buf, n, bb::shm::MsgType::kAttachReply, sizeof out->reply)) return false;
  std::memcpy(&out->reply, buf, sizeof out->reply);
  return out->reply.status == 0 && nfds == 2;
}

// The hub and the task page of a raw attach, mapped as its task maps them (the page writable).
struct RawViews {
  bb::shm::Mapping hub, page;
  const bb::shm::SlotCtl* ctl = nullptr;
  bb::shm::TaskPage* task = nullptr;
};

inline bool map_raw(const RawAttach& raw, RawViews* out, std::string* error) {
  out->hub = bb::shm::map_segment(raw.hub_fd, size_t(bb::shm::segment_size(raw.hub_fd)), false,
                                  error);
  out->page = bb::shm::map_segment(raw.page_fd, bb::shm::kTaskPageSize, true, error);
  if (!out->hub || !out->page) return false;
  out->ctl = bb::shm::HubView{out->hub.data()}.slot(raw.reply.slot);
  out->task = reinterpret_cast<bb::shm::TaskPage*>(out->page.data());
  return true;
}

}  // namespace bbtest
