// The attach protocol on a hub's socket (SOCK_SEQPACKET: each message arrives whole or not at
// all). Fixed-size little structs, checked field by field by the receiver; descriptors travel
// with SCM_RIGHTS. This is how a task or an observer obtains the hub segment (read-only) and
// its own task page, and how the trainer learns that a peer went away (the connection closes).
#pragma once

#include <cstddef>
#include <cstdint>

#include "shm/fd_passing.h"
#include "shm/layout.h"

namespace bb::shm {

constexpr uint32_t kWireMagic = 0x52574242;  // "BBWR"
constexpr uint16_t kWireVersion = 1;
constexpr size_t kWireErrorBytes = 200;
constexpr size_t kWireMaxMessage = 512;

enum class MsgType : uint16_t {
  kAttachTask = 1,      // task -> trainer
  kAttachObserver = 2,  // observer -> trainer
  kAttachReply = 3,     // trainer -> task/observer; fds: hub [, task page]
  kStopTask = 4,        // observer -> trainer
  kGetTaskPage = 5,     // observer -> trainer
  kReply = 6,           // trainer -> observer; fds: [task page]
  kGrantFd = 7,         // trainer -> task; fds: the grant's memory (host, cuda-vmm)
  kGrantAck = 8,        // task -> trainer: "look at my page's grant words now"
};

struct MsgHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t size;  // bytes of the whole message
  uint32_t reserved;
};

struct AttachTaskMsg {
  MsgHeader h;
  int32_t priority;
  int32_t pid;
  uint64_t mem_need;
  uint64_t min_step_ns;
  char name[kNameBytes];
};

struct AttachObserverMsg {
  MsgHeader h;
};

struct AttachReplyMsg {
  MsgHeader h;
  int32_t status;  // bb_status
  uint32_t slot;
  uint32_t generation;
  uint32_t layout_version;
  uint64_t hub_size;
  char error[kWireErrorBytes];
};

struct SlotRequestMsg {
  MsgHeader h;
  uint32_t slot;
  uint32_t generation;
};

struct ReplyMsg {
  MsgHeader h;
  int32_t status;
  uint32_t reserved;
  char error[kWireErrorBytes];
};

// Sent before SlotCtl::grant_id names the grant, so a task that sees the id finds the
// descriptor already queued on its connection.
struct GrantFdMsg {
  MsgHeader h;
  uint64_t grant_id;
  uint64_t map_size;
};

// Carries nothing the trainer believes: it only wakes the hub service, which then reads the
// task's page (TaskPage::grant_released) instead of waiting for its next tick.
struct GrantAckMsg {
  MsgHeader h;
  uint64_t grant_id;
};

template <typename M>
M make_msg(MsgType type) {
  M m{};
  m.h.magic = kWireMagic;
  m.h.version = kWireVersion;
  m.h.type = uint16_t(type);
  m.h.size = sizeof(M);
  return m;
}

// Sends one message with up to 2 descriptors (flags: e.g. MSG_DONTWAIT). Returns 0 or an errno
// value.
int send_msg(int sock, const void* msg, size_t size, const int* fds, int nfds, int flags = 0);

// Receives one message (blocking per the socket's mode, or not with flags = MSG_DONTWAIT) into
// buf (kWireMaxMessage bytes) and up to 2 descriptors (CLOEXEC; unused slots set to -1). Returns
// the message size, 0 on EOF, or -errno. A message too long, with more than 2 descriptors or
// with other ancillary data gives -EMSGSIZE and hands every descriptor that came with it to
// dispose (recv_with_fds; nullptr: closed at once); one whose descriptors this process had no
// room for gives -EMFILE (no_fd_room_message says so).
long recv_msg(int sock, void* buf, int* fds, int* nfds, int flags = 0,
              DisposeFds dispose = nullptr);

// Checks magic, version, type and size of a received message. Returns false when it is not a
// well-formed message of that type.
bool check_msg(const void* buf, long got, MsgType type, size_t size);

}  // namespace bb::shm
