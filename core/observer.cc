#include "core/observer.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>

#include "core/clock.h"
#include "core/error.h"
#include "core/paths.h"
#include "shm/segment.h"
#include "shm/wire.h"

namespace bb::core {

struct HubObserver::Impl {
  shm::Fd sock;
  shm::Mapping hub_map;
  shm::HubView hub;
  std::string job;
  uint32_t rank = 0;
  // Task pages mapped read-only, by slot, for the generation they belong to.
  struct Page {
    uint32_t generation = 0;
    shm::Mapping map;
  };
  mutable std::map<uint32_t, Page> pages;
  // The connection failed or carried something it should not: it is shut down (its descriptor
  // stays, for whoever polls fd()) and alive() is false.
  mutable bool broken = false;
  // Requests sent and not answered yet, oldest first. The trainer answers in order, so an
  // answer is always the oldest's. A request its caller stopped waiting for (it timed out) is
  // still owed its answer, which is read and dropped: no late answer is taken for a later
  // request's.
  struct Pending {
    shm::MsgType type;
    uint32_t slot = 0;
    uint32_t gen = 0;
    bool dropped = false;
  };
  mutable std::deque<Pending> pending;
  // At most this many requests are in flight without waiting (set_async). Their answers then
  // fit the trainer's socket buffer many times over: the trainer never has to drop one (it
  // answers without blocking), so the order above holds.
  static constexpr size_t kMaxInFlight = 8;
  // Stops asked while that many were in flight, each task's once, sent as answers make room
  // (a page lookup is not queued: the next snapshot asks again).
  mutable std::deque<Pending> queued;
  bool async = false;
  mutable std::vector<StopAnswer> stop_answers;  // read, not yet handed out by pump()
  uint32_t timeout_ms = 5000;

  bb_status break_off(bb_status st, std::string* error, const std::string& why) const {
    shutdown(sock.get(), SHUT_RDWR);
    broken = true;
    if (error) *error = why;
    return st;
  }
  static bb_status say(bb_status st, std::string* error, const char* why) {
    if (error) *error = why;
    return st;
  }

  bb_status send(shm::MsgType type, uint32_t slot, uint32_t gen, std::string* error) const {
    auto q = shm::make_msg<shm::SlotRequestMsg>(type);
    q.slot = slot;
    q.generation = gen;
    if (int e = shm::send_msg(sock.get(), &q, sizeof q, nullptr, 0, async ? MSG_DONTWAIT : 0)) {
      if (e == EAGAIN || e == EWOULDBLOCK)
        return say(BB_E_TIMEOUT, error, "the trainer is not reading its requests (busy or "
                   "stopped?): try again later");
      return break_off(BB_E_TRAINER_GONE, error,
                       std::string("the trainer went away: ") + std::strerror(e));
    }
    pending.push_back({type, slot, gen, false});
    return BB_OK;
  }

  // The next answer, if one comes within wait_ms (0: only one already there). BB_E_TIMEOUT if
  // none did; another status if the connection broke.
  bb_status read_answer(uint32_t wait_ms, shm::ReplyMsg* r, shm::Fd* fd,
                        std::string* error) const {
    if (wait_ms) {
      // Waited for with poll, not the socket's receive timeout: whoever watches fd() may have
      // made the socket non-blocking (libuv's uv_poll does), and a recv would return at once.
      pollfd p{sock.get(), POLLIN, 0};
      int ready;
      const uint64_t until = now_ns() + uint64_t(wait_ms) * 1'000'000;
      do {
        const uint64_t now = now_ns();
        ready = poll(&p, 1, now >= until ? 0 : int((until - now + 999'999) / 1'000'000));
      } while (ready < 0 && errno == EINTR);
      if (ready <= 0) return BB_E_TIMEOUT;
    }
    alignas(8) char buf[shm::kWireMaxMessage];
    int fds[2], nfds;
    const long n = shm::recv_msg(sock.get(), buf, fds, &nfds, MSG_DONTWAIT);
    shm::Fd f0(fds[0]), f1(fds[1]);
    if (n == -EAGAIN || n == -EWOULDBLOCK) return BB_E_TIMEOUT;
    if (n == -EMFILE)
      return break_off(BB_E_SYSTEM, error,
                       "a task's page comes as a descriptor, and " + shm::no_fd_room_message());
    if (n <= 0)
      return break_off(BB_E_TRAINER_GONE, error, "the trainer closed the observer connection");
    if (pending.empty())
      return break_off(BB_E_CORRUPT, error, "the trainer sent an answer to no request");
    if (!shm::check_msg(buf, n, shm::MsgType::kReply, sizeof(shm::ReplyMsg)))
      return break_off(BB_E_CORRUPT, error, "malformed reply from the trainer");
    std::memcpy(r, buf, sizeof *r);
    r->error[sizeof r->error - 1] = 0;
    *fd = std::move(f0);
    return BB_OK;
  }

  // Reads the answers already there and settles their requests: a page is mapped, a stop's
  // outcome kept for pump(), a dropped request's answer discarded. BB_OK unless the
  // connection broke.
  bb_status drain(std::string* error) const {
    for (;;) {
      shm::ReplyMsg r;
      shm::Fd fd;
      const bb_status st = read_answer(0, &r, &fd, error);
      if (st == BB_E_TIMEOUT) return send_queued(error);
      if (st != BB_OK) return st;
      const Pending q = pending.front();
      pending.pop_front();
      if (q.dropped) continue;
      if (q.type == shm::MsgType::kGetTaskPage) {
        if (r.status == BB_OK) map_page(q.slot, q.gen, fd.get());
      } else {
        stop_answers.push_back({uint64_t(q.slot) | uint64_t(q.gen) << 32, bb_status(r.status),
                                r.status == BB_OK ? std::string() : std::string(r.error)});
      }
    }
  }

  bb_status send_queued(std::string* error) const {
    while (!queued.empty() && pending.size() < kMaxInFlight) {
      const Pending q = queued.front();
      const bb_status st = send(q.type, q.slot, q.gen, error);
      if (st == BB_E_TIMEOUT) return BB_OK;  // its socket is full: at the next drain
      if (st != BB_OK) return st;
      queued.pop_front();
    }
    return BB_OK;
  }

  // One request, one answer, waited for up to timeout_ms.
  bb_status request(shm::MsgType type, uint32_t slot, uint32_t gen, int* fd_out,
                    std::string* error) const {
    if (broken) return say(BB_E_TRAINER_GONE, error, "the connection to the trainer is closed");
    if (const bb_status st = drain(error); st != BB_OK) return st;
    if (!pending.empty())
      return say(BB_E_TIMEOUT, error,
                 "the trainer has not yet answered an earlier request: try again later");
    if (const bb_status st = send(type, slot, gen, error); st != BB_OK) return st;
    shm::ReplyMsg r;
    shm::Fd fd;
    const bb_status st = read_answer(timeout_ms, &r, &fd, error);
    if (st == BB_E_TIMEOUT) {
      pending.back().dropped = true;
      return say(BB_E_TIMEOUT, error, "the trainer did not answer in time (busy or stopped?)");
    }
    if (st != BB_OK) return st;
    pending.pop_front();
    if (r.status != BB_OK) {
      if (error) *error = r.error;
      return bb_status(r.status);
    }
    if (fd_out) *fd_out = fd.release();
    return BB_OK;
  }

  // The same without waiting (set_async): the answer is read by a later drain().
  bb_status send_async(shm::MsgType type, uint32_t slot, uint32_t gen,
                       std::string* error) const {
    if (broken) return say(BB_E_TRAINER_GONE, error, "the connection to the trainer is closed");
    if (const bb_status st = drain(error); st != BB_OK) return st;
    if (pending.size() < kMaxInFlight && queued.empty()) return send(type, slot, gen, error);
    if (type != shm::MsgType::kStopTask)
      return say(BB_E_TIMEOUT, error, "the trainer has not answered the earlier requests yet "
                 "(busy or stopped?): try again later");
    for (const Pending& q : queued)
      if (q.slot == slot && q.gen == gen) return BB_OK;  // asked already
    queued.push_back({type, slot, gen, false});
    return BB_OK;
  }

  const shm::TaskPage* map_page(uint32_t slot, uint32_t gen, int fd) const {
    std::string err;
    if (shm::segment_size(fd) != int64_t(shm::kTaskPageSize)) return nullptr;
    shm::Mapping m = shm::map_segment(fd, shm::kTaskPageSize, false, &err);
    if (!m) return nullptr;
    Page& p = pages[slot];
    p.generation = gen;
    p.map = std::move(m);
    return reinterpret_cast<const shm::TaskPage*>(p.map.data());
  }

  const shm::TaskPage* page(uint32_t slot, uint32_t gen) const {
    auto it = pages.find(slot);
    if (it != pages.end() && it->second.generation == gen) {
      return reinterpret_cast<const shm::TaskPage*>(it->second.map.data());
    }
    if (async) {
      // Asked once; the page shows in the snapshot after its answer came.
      for (const Pending& q : pending)
        if (q.type == shm::MsgType::kGetTaskPage && q.slot == slot && q.gen == gen) return nullptr;
      send_async(shm::MsgType::kGetTaskPage, slot, gen, nullptr);
      return nullptr;
    }
    int fd = -1;
    if (request(shm::MsgType::kGetTaskPage, slot, gen, &fd, nullptr) != BB_OK) return nullptr;
    shm::Fd owned(fd);
    return map_page(slot, gen, fd);
  }
};

HubObserver::HubObserver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HubObserver::~HubObserver() = default;

bb_status HubObserver::open(const std::string& runtime_dir, const std::string& job,
                            uint32_t rank, std::unique_ptr<HubObserver>* out,
                            std::string* error, uint32_t timeout_ms) {
  auto set = [&](bb_status st) {
    if (error) *error = last_error();
    return st;
  };
  bb_status st;
  if ((st = check_job_id(job.c_str())) != BB_OK || (st = check_rank(rank)) != BB_OK)
    return set(st);
  std::string dir, path;
  if ((st = resolve_runtime_dir(runtime_dir.empty() ? nullptr : runtime_dir.c_str(), false,
                                &dir)) != BB_OK)
    return set(st);
  if ((st = hub_paths(dir, job.c_str(), rank, &path, nullptr)) != BB_OK) return set(st);
  auto impl = std::make_unique<Impl>();
  impl->sock.reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  if (!impl->sock)
    return set(fail(BB_E_SYSTEM, "socket() failed: %s", std::strerror(errno)));
  // Both before the connect: a trainer that stopped accepting (stopped, frozen) fills its
  // backlog, and a connect to a full backlog waits for as long as the send timeout allows.
  const uint32_t ms = timeout_ms ? timeout_ms : 1;
  const timeval tv{time_t(ms / 1000), suseconds_t(ms % 1000) * 1000};
  setsockopt(impl->sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(impl->sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (connect(impl->sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return set(fail(BB_E_TIMEOUT, "the trainer of hub %s.%u is not accepting connections "
                      "(its backlog is full: stopped or hung?)", job.c_str(), rank));
    if (errno == EACCES || errno == EPERM)
      return set(fail(BB_E_PERMISSION, "no permission to connect to hub socket %s: observe it as "
                      "the trainer's user (or one its trainer allows, with its runtime directory "
                      "opened to it)", path.c_str()));
    return set(fail(BB_E_NOT_FOUND, "no trainer serves hub %s.%u at %s", job.c_str(), rank,
                    path.c_str()));
  }
  auto m = shm::make_msg<shm::AttachObserverMsg>(shm::MsgType::kAttachObserver);
  const int sent = shm::send_msg(impl->sock.get(), &m, sizeof m, nullptr, 0);
  // A trainer that refuses before reading (too many connections) has shut its side: the send
  // fails, and its answer is there to read.
  if (sent != 0 && sent != EPIPE && sent != ECONNRESET)
    return set(fail(BB_E_SYSTEM, "cannot send the observer request to %s: %s", path.c_str(),
                    std::strerror(sent)));
  alignas(8) char buf[shm::kWireMaxMessage];
  int fds[2], nfds;
  const long n = shm::recv_msg(impl->sock.get(), buf, fds, &nfds);
  shm::Fd hub_fd(fds[0]), extra(fds[1]);
  if (n == -EAGAIN || n == -EWOULDBLOCK)
    return set(fail(BB_E_TIMEOUT, "the trainer of hub %s.%u did not answer within %u ms",
                    job.c_str(), rank, ms));
  if (n == -EMFILE)
    return set(fail_msg(BB_E_SYSTEM, "cannot observe hub " + job + "." + std::to_string(rank) +
                        ": its memory comes as descriptors, and " + shm::no_fd_room_message()));
  if (n <= 0)
    return set(fail(BB_E_TRAINER_GONE, "the trainer of hub %s.%u closed the connection",
                    job.c_str(), rank));
  if (!shm::check_msg(buf, n, shm::MsgType::kAttachReply, sizeof(shm::AttachReplyMsg)))
    return set(fail(BB_E_VERSION, "hub %s.%u did not answer as a compatible libbubble trainer",
                    job.c_str(), rank));
  shm::AttachReplyMsg r;
  std::memcpy(&r, buf, sizeof r);
  r.error[sizeof r.error - 1] = 0;
  if (r.status != BB_OK) return set(fail_msg(bb_status(r.status), r.error));
  const int64_t size = shm::segment_size(hub_fd.get());
  std::string err;
  if (size <= 0) return set(fail(BB_E_CORRUPT, "the hub segment is empty"));
  impl->hub_map = shm::map_segment(hub_fd.get(), size_t(size), false, &err);
  if (!impl->hub_map) return set(fail_msg(BB_E_SYSTEM, err));
  if (!shm::validate_hub(impl->hub_map.data(), uint64_t(size), &err))
    return set(fail_msg(BB_E_VERSION, err));
  impl->hub.base = impl->hub_map.data();
  impl->timeout_ms = ms;
  impl->job = job;
  impl->rank = rank;
  out->reset(new HubObserver(std::move(impl)));
  return BB_OK;
}

HubSnapshot HubObserver::snapshot() const {
  const shm::HubView& hub = impl_->hub;
  HubSnapshot s;
  s.job = impl_->job;
  s.rank = impl_->rank;
  s.trainer_pid = hub.header()->creator_pid;
  s.max_slots = hub.header()->max_slots;
  const shm::BubbleState* b = hub.bubble();
  for (int tries = 0; tries < 100; ++tries) {  // seqlock read; give up on a torn view quietly
    const uint64_t v0 = b->version.load(std::memory_order_acquire);
    if (v0 & 1) continue;
    s.in_bubble = b->open.load(std::memory_order_relaxed) != 0;
    s.bubble_seq = b->seq.load(std::memory_order_relaxed);
    s.bubble_begin_ns = b->begin_ns.load(std::memory_order_relaxed);
    s.bubble_deadline_ns = b->deadline_ns.load(std::memory_order_relaxed);
    s.bubble_end_ns = b->end_ns.load(std::memory_order_relaxed);
    s.next_begin_ns = b->next_begin_ns.load(std::memory_order_relaxed);
    s.free_mem = b->free_mem.load(std::memory_order_relaxed);
    s.bubbles = b->bubbles.load(std::memory_order_relaxed);
    s.bubble_ns = b->bubble_ns.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (b->version.load(std::memory_order_relaxed) == v0) break;
  }
  s.task_ns_in_bubbles = hub.stats()->ns_in_bubbles.load(std::memory_order_relaxed);
  for (uint32_t i = 0; i < s.max_slots; ++i) {
    const shm::SlotCtl* c = hub.slot(i);
    if (shm::SlotState(c->state.load(std::memory_order_acquire)) != shm::SlotState::kActive)
      continue;
    TaskSnapshot t;
    const uint32_t gen = c->generation.load(std::memory_order_acquire);
    t.slot = i;
    t.id = uint64_t(i) | uint64_t(gen) << 32;
    t.pid = c->pid;
    t.priority = c->priority;
    t.mem_need = c->mem_need;
    t.min_step_ns = c->min_step_ns;
    char name[shm::kNameBytes];
    std::memcpy(name, c->name, sizeof name);
    name[sizeof name - 1] = 0;
    t.name = name;
    t.bad = c->bad.load(std::memory_order_relaxed) != 0;
    t.steps = c->steps.load(std::memory_order_relaxed);
    t.step_ns = c->step_ns.load(std::memory_order_relaxed);
    t.ns_in_bubbles = c->ns_in_bubbles.load(std::memory_order_relaxed);
    t.ns_outside = c->ns_outside.load(std::memory_order_relaxed);
    // Given to another task while we copied it: the row would mix the two (Trainer::tasks()).
    if (!shm::slot_still(c, gen)) continue;
    const uint32_t paused_epoch = c->paused_epoch.load(std::memory_order_acquire);
    if (const shm::TaskPage* p = impl_->page(i, gen)) {
      // The task's words: clamp to known values rather than trust them.
      const uint32_t st = p->state.load(std::memory_order_relaxed);
      t.state = st <= uint32_t(TaskRunState::kFailed) ? TaskRunState(st) : TaskRunState::kIdle;
      const uint32_t acked = p->acked_epoch.load(std::memory_order_acquire);
      const uint32_t given = c->given_epoch.load(std::memory_order_relaxed);
      t.started = given != 0 && acked != given;
      if (paused_epoch != 0) {
        t.pause_requested_ns = c->pause_requested_ns.load(std::memory_order_relaxed);
        // An ack of this epoch or of a later one (the task was started again and acked that)
        // answers the request. Epochs wrap, so compare by distance.
        if (int32_t(acked - paused_epoch) >= 0)
          t.pause_acked_ns = p->ack_ns.load(std::memory_order_relaxed);
      }
    }
    s.tasks.push_back(std::move(t));
  }
  return s;
}

namespace {

enum class Peek { kGot, kNotYet, kOverwritten };

// Copies entry `at` of a stream, checking its commit word before and after the copy.
Peek peek_event(const shm::HubView& hub, shm::EventStream stream, uint64_t at, Event* ev) {
  const uint32_t capacity = hub.header()->event_capacity;
  const shm::EventEntry& e = hub.event_entries(stream)[at & (capacity - 1)];
  const uint32_t want = shm::event_commit(at);
  const uint32_t c0 = e.commit.load(std::memory_order_acquire);
  if (c0 != want) {
    // 0: the writer is rewriting it a lap later; a later index: rewritten already.
    if (c0 == 0 || int32_t(c0 - want) > 0) return Peek::kOverwritten;
    return Peek::kNotYet;
  }
  ev->type = EventType(e.kind.load(std::memory_order_relaxed));
  ev->slot = e.slot.load(std::memory_order_relaxed);
  ev->ts_ns = e.ts_ns.load(std::memory_order_relaxed);
  ev->a = e.a.load(std::memory_order_relaxed);
  ev->b = e.b.load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  return e.commit.load(std::memory_order_relaxed) == c0 ? Peek::kGot : Peek::kOverwritten;
}

}  // namespace

size_t HubObserver::read_events(EventCursor* cursor, Event* out, size_t cap,
                                uint64_t* lost) const {
  static_assert(sizeof(EventCursor::next) / sizeof(uint64_t) == shm::kEventStreams);
  const shm::HubView& hub = impl_->hub;
  const uint32_t capacity = hub.header()->event_capacity;
  uint64_t skipped = 0;
  struct Head {
    uint64_t pos, end;
    bool have;
    Event ev;
  } heads[shm::kEventStreams];
  for (uint32_t k = 0; k < shm::kEventStreams; ++k) {
    const uint64_t next = hub.events(shm::EventStream(k))->next.load(std::memory_order_acquire);
    uint64_t pos = std::min(cursor->next[k], next);  // a cursor from an earlier hub: start over
    if (next > capacity && pos < next - capacity) {
      skipped += next - capacity - pos;
      pos = next - capacity;
    }
    heads[k] = Head{pos, next, false, {}};
  }
  // Fills a stream's head with its next readable event, if any.
  auto fill = [&](uint32_t k) {
    Head& h = heads[k];
    while (!h.have && h.pos < h.end) {
      switch (peek_event(hub, shm::EventStream(k), h.pos, &h.ev)) {
        case Peek::kGot: h.have = true; return;
        case Peek::kNotYet: h.end = h.pos; return;
        case Peek::kOverwritten: ++skipped; ++h.pos; break;
      }
    }
  };
  size_t n = 0;
  while (n < cap) {
    int pick = -1;
    for (uint32_t k = 0; k < shm::kEventStreams; ++k) {
      fill(k);
      if (heads[k].have && (pick < 0 || heads[k].ev.ts_ns < heads[pick].ev.ts_ns)) pick = int(k);
    }
    if (pick < 0) break;
    out[n++] = heads[pick].ev;
    heads[pick].have = false;
    ++heads[pick].pos;
  }
  // A head read but not returned is read again next time.
  for (uint32_t k = 0; k < shm::kEventStreams; ++k) cursor->next[k] = heads[k].pos;
  if (lost) *lost = skipped;
  return n;
}

bool HubObserver::alive() const {
  if (impl_->broken) return false;
  if (impl_->hub.stats()->closing.load(std::memory_order_acquire)) return false;
  pollfd p{impl_->sock.get(), POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return true;
  if (p.revents & (POLLHUP | POLLERR)) return false;
  char c;
  return recv(impl_->sock.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT) != 0;
}

int HubObserver::fd() const { return impl_->sock.get(); }

bb_status HubObserver::stop_task(uint64_t task_id, std::string* error) {
  const uint32_t slot = uint32_t(task_id & 0xffffffffu), gen = uint32_t(task_id >> 32);
  if (impl_->async) return impl_->send_async(shm::MsgType::kStopTask, slot, gen, error);
  return impl_->request(shm::MsgType::kStopTask, slot, gen, nullptr, error);
}

void HubObserver::set_async() { impl_->async = true; }

bool HubObserver::pump(std::vector<StopAnswer>* stops) {
  if (impl_->broken || impl_->drain(nullptr) != BB_OK) return false;
  if (stops) stops->insert(stops->end(), impl_->stop_answers.begin(), impl_->stop_answers.end());
  impl_->stop_answers.clear();
  return true;
}

}  // namespace bb::core
