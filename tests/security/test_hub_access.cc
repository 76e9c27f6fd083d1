// Who can reach a hub, and what a peer can send it.
//
// The cases that switch to another uid run the probe under `setpriv --reuid 65534` and need
// root; without root they say so and check nothing else. The agent's side (its socket mode and
// peer credentials) is tested in tests/daemon/test_access.py.
#include <bubble/bubble.h>
#include <doctest/doctest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/paths.h"
#include "shm/fd_passing.h"
#include "shm/wire.h"
#include "tests/helpers/proc.h"

using bbtest::Child;
using bbtest::RuntimeDir;

namespace {

constexpr uint32_t kNobody = 65534;

bool root() {
  if (geteuid() == 0) return true;
  MESSAGE("skipped: switching to another uid needs root (run the tests as root to cover it)");
  return false;
}

// A copy of the probe that any uid can run: the build tree may sit under a directory only its
// owner may enter (root's home is 0700 on Debian). The probe links only system libraries.
// Removed when the tests end.
const std::string& reachable_probe() {
  struct Copy {
    std::string dir, path;
    Copy() {
      char tmpl[] = "/tmp/bb-probe-XXXXXX";
      REQUIRE(mkdtemp(tmpl) != nullptr);
      dir = tmpl;
      path = dir + "/probe";
      REQUIRE(chmod(dir.c_str(), 0755) == 0);
      std::ifstream in(BB_SECURITY_PROBE, std::ios::binary);
      std::ofstream out(path, std::ios::binary);
      out << in.rdbuf();
      out.close();
      REQUIRE(out.good());
      REQUIRE(chmod(path.c_str(), 0755) == 0);
    }
    ~Copy() {
      unlink(path.c_str());
      rmdir(dir.c_str());
    }
  };
  static Copy copy;
  return copy.path;
}

// Runs the probe as uid/gid 65534 with no supplementary groups; returns its RESULT line.
std::string as_nobody(const std::vector<std::string>& args, uint32_t uid = kNobody) {
  std::vector<std::string> argv = {"/usr/bin/setpriv", "--reuid=" + std::to_string(uid),
                                   "--regid=" + std::to_string(uid), "--clear-groups",
                                   reachable_probe()};
  argv.insert(argv.end(), args.begin(), args.end());
  Child c(argv);
  std::string line = c.wait_line("RESULT", 20000);
  c.wait_exit(10000);
  INFO("probe " << args[0] << ": " << line);
  return line;
}

bool has(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

// Refused with no descriptor crossing, and told why: the trainer reads the request before it
// answers a foreign uid, so the reply arrives instead of a connection reset.
bool refused(const std::string& r) { return has(r, "RESULT BB_E_PERMISSION fds=0"); }

struct Hub {
  bb_trainer_h h = nullptr;
  std::string sock;
  Hub(const RuntimeDir& dir, const char* job, uint32_t allow_uid = UINT32_MAX) {
    bb_trainer_options_t o;
    bb_trainer_options_init(&o);
    o.allow_uid = allow_uid;
    const bb_status st = bb_trainer_open(job, 0, &o, &h);
    INFO(bb_last_error());
    REQUIRE(st == BB_OK);
    REQUIRE(bb::core::hub_paths(dir.path(), job, 0, &sock, nullptr) == BB_OK);
  }
  ~Hub() { bb_trainer_close(h); }
  uint32_t attached() const {
    bb_trainer_stats_t s{sizeof s};
    bb_trainer_stats(h, &s);
    return s.tasks_attached;
  }
};

// Lets another uid through the file system to the socket, so the trainer's own peer check is
// what must refuse it.
void open_up(const RuntimeDir& dir, const std::string& sock) {
  REQUIRE(chmod(dir.path().c_str(), 0755) == 0);
  REQUIRE(chmod(sock.c_str(), 0666) == 0);
}

int connect_hub(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path.c_str());
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// Sends raw bytes (and descriptors) as one message; returns the trainer's reply status, or 1
// when it sent none. *closed tells whether it then hung up (after a refusal).
int exchange(const std::string& sock, const void* msg, size_t len, const int* fds, int nfds,
             std::string* error, bool* closed) {
  const int c = connect_hub(sock);
  REQUIRE(bb::shm::send_msg(c, msg, len, fds, nfds) == 0);
  alignas(8) char buf[bb::shm::kWireMaxMessage];
  int got[2], ngot = 0;
  const long n = bb::shm::recv_msg(c, buf, got, &ngot);
  for (int i = 0; i < ngot; ++i) close(got[i]);
  int status = 1;
  if (bb::shm::check_msg(buf, n, bb::shm::MsgType::kAttachReply, sizeof(bb::shm::AttachReplyMsg))) {
    bb::shm::AttachReplyMsg r;
    std::memcpy(&r, buf, sizeof r);
    r.error[sizeof r.error - 1] = 0;
    status = r.status;
    *error = r.error;
  }
  // An attached task's connection stays open (it is its liveness channel): only a refusal
  // must end in a hang-up.
  *closed = status != BB_OK && bb::shm::recv_msg(c, buf, got, &ngot) == 0;
  close(c);
  return status;
}

int open_fds() { return int(bbtest::list_dir("/proc/self/fd").size()); }

// The descriptor number of this process's memfd named `name` (-1 if none).
int memfd_named(const std::string& name) {
  for (const auto& f : bbtest::list_dir("/proc/self/fd")) {
    char target[256];
    const ssize_t n = readlink(("/proc/self/fd/" + f).c_str(), target, sizeof target - 1);
    if (n > 0 && std::string(target, size_t(n)).rfind("/memfd:" + name, 0) == 0) return std::stoi(f);
  }
  return -1;
}

}  // namespace

TEST_CASE("another_uid_cannot_reach_a_hub_in_its_private_runtime_dir") {
  if (!root()) return;
  RuntimeDir dir;  // 0700, as every runtime dir libbubble creates
  Hub hub(dir, "private");
  CHECK(has(as_nobody({"attach-raw", hub.sock}), "errno EACCES"));
  CHECK(has(as_nobody({"observe-raw", hub.sock}), "errno EACCES"));
  // Through the C ABI the task side refuses a runtime dir that is not its user's, and says so.
  const std::string api = as_nobody({"attach-api", dir.path(), "private", "0"});
  CHECK(has(api, "BB_E_PERMISSION"));
  CHECK(has(api, "belongs to uid 0"));
  CHECK(hub.attached() == 0);
}

TEST_CASE("another_uid_is_refused_by_the_trainer_even_when_the_socket_is_opened_up") {
  if (!root()) return;
  RuntimeDir dir;
  Hub hub(dir, "opened");
  open_up(dir, hub.sock);
  for (const char* what : {"attach-raw", "observe-raw"}) {
    const std::string r = as_nobody({what, hub.sock});
    CHECK(refused(r));
    CHECK_MESSAGE(has(r, "uid 65534 may not attach to this hub"), "refused without its reason: " << r);
  }
  CHECK(hub.attached() == 0);
  // The owner still gets in.
  bb_task_h t = nullptr;
  REQUIRE(bb_task_attach("opened", 0, "owner", nullptr, &t) == BB_OK);
  CHECK(bbtest::eventually([&] { return hub.attached() == 1; }));
  bb_task_detach(t);
}

// A task of the trainer's own uid on a hub the allowed uid may reach, and the probe's arguments
// that name its slot to `probe_cmd` (page-raw, stop-raw). Detached when it goes.
struct Victim {
  RuntimeDir dir;
  Hub hub;
  bb_task_h task = nullptr;
  std::vector<std::string> args;
  // A hub that lets the allowed uid in (its socket opened up to it) and a task on it.
  Victim(const char* job, const char* probe_cmd) : hub(dir, job, kNobody) {
    open_up(dir, hub.sock);
    REQUIRE(bb_task_attach(job, 0, "victim", nullptr, &task) == BB_OK);
    REQUIRE(bbtest::eventually([&] { return hub.attached() == 1; }));
    bb_task_info_t info{sizeof info};
    size_t count = 0;
    REQUIRE(bb_trainer_tasks(hub.h, &info, 1, &count) == BB_OK);
    REQUIRE(count == 1);
    args = {probe_cmd, hub.sock, std::to_string(info.id & 0xffffffffu),
            std::to_string(info.id >> 32)};
  }
  ~Victim() { bb_task_detach(task); }
  // The probe's line, run as the allowed uid, and as the trainer's own (root here).
  std::string by_guest() const { return as_nobody(args); }
  std::string by_owner() const {
    Child owner({reachable_probe(), args[0], args[1], args[2], args[3]});
    const std::string line = owner.wait_line("RESULT", 20000);
    owner.wait_exit(10000);
    return line;
  }
  Victim(const Victim&) = delete;
  Victim& operator=(const Victim&) = delete;
};

TEST_CASE("allow_uid_admits_that_uid_and_no_other") {
  if (!root()) return;
  RuntimeDir dir;
  Hub hub(dir, "shared", kNobody);
  open_up(dir, hub.sock);
  CHECK(has(as_nobody({"attach-raw", hub.sock}), "RESULT BB_OK fds=2"));
  const std::string other = as_nobody({"attach-raw", hub.sock}, kNobody - 1);
  CHECK(refused(other));
  CHECK_MESSAGE(has(other, "uid 65533 may not attach"), "refused without its reason: " << other);
}

TEST_CASE("an_allowed_uid_gets_no_task_page_it_could_write") {
  // A task page's descriptor can write: given to the allow_uid user it would let that user
  // forge any task's acks, grant words and reports. The trainer's own uid still gets it.
  if (!root()) return;
  Victim v("pages", "page-raw");
  const std::string guest = v.by_guest();
  CHECK_MESSAGE(has(guest, "RESULT BB_E_PERMISSION fds=0"), guest);
  CHECK_MESSAGE(has(guest, "task pages go only to the trainer's own uid"), guest);
  // The owner (root here) still gets it, as the agent does.
  const std::string own = v.by_owner();
  CHECK_MESSAGE(has(own, "RESULT BB_OK fds=1"), own);
}

TEST_CASE("an_allowed_uid_cannot_stop_the_trainers_tasks") {
  // Watching is what allow_uid admits: a stop from that uid would let one of its tasks stop
  // every task on the hub (the agent refuses its cancel for the same reason).
  if (!root()) return;
  Victim v("stops", "stop-raw");
  const std::string guest = v.by_guest();
  CHECK_MESSAGE(has(guest, "RESULT BB_E_PERMISSION"), guest);
  CHECK_MESSAGE(has(guest, "stops come only from the trainer's own uid"), guest);
  CHECK(bb_task_wait_start(v.task, 0, nullptr) == BB_E_TIMEOUT);  // not told to stop
  // The owner (root here) still may, as the agent's cancel does.
  const std::string own = v.by_owner();
  CHECK_MESSAGE(has(own, "RESULT BB_OK"), own);
  CHECK(bbtest::eventually([&] { return bb_task_wait_start(v.task, 0, nullptr) == BB_E_STOPPED; }));
}

TEST_CASE("another_uid_cannot_open_the_trainers_memory_through_proc") {
  if (!root()) return;
  RuntimeDir dir;
  Hub hub(dir, "procfs");
  bb_task_h t = nullptr;
  REQUIRE(bb_task_attach("procfs", 0, "inproc", nullptr, &t) == BB_OK);
  const int hub_fd = memfd_named("bubble-hub");
  const int page_fd = memfd_named("bubble-task");
  REQUIRE(hub_fd >= 0);
  REQUIRE(page_fd >= 0);
  const std::string self = "/proc/" + std::to_string(getpid());
  for (const std::string& path : {self + "/fd/" + std::to_string(hub_fd),
                                  self + "/fd/" + std::to_string(page_fd), self + "/mem",
                                  self + "/map_files"}) {
    const std::string r = as_nobody({"open", path});
    CHECK_MESSAGE((has(r, "errno EACCES") || has(r, "errno EPERM")), path << ": " << r);
  }
  // The owner can (the same user is trusted with its own processes' memory).
  CHECK(open((self + "/fd/" + std::to_string(hub_fd)).c_str(), O_RDONLY | O_CLOEXEC) >= 0);
  bb_task_detach(t);
}

TEST_CASE("a_runtime_dir_writable_by_others_or_owned_by_another_user_is_refused") {
  RuntimeDir dir;
  REQUIRE(chmod(dir.path().c_str(), 0777) == 0);
  bb_trainer_h h = nullptr;
  CHECK(bb_trainer_open("loose", 0, nullptr, &h) == BB_E_PERMISSION);
  CHECK(has(bb_last_error(), "writable by others"));
  bb_task_h t = nullptr;
  CHECK(bb_task_attach("loose", 0, "t", nullptr, &t) == BB_E_PERMISSION);
  CHECK(dir.files().empty());
  // A symlink to such a directory is judged by what it points to.
  const std::string link = dir.path() + ".link";
  REQUIRE(chmod(dir.path().c_str(), 0700) == 0);
  REQUIRE(symlink(dir.path().c_str(), link.c_str()) == 0);
  REQUIRE(chmod(dir.path().c_str(), 0770) == 0);
  bb_trainer_options_t o;
  bb_trainer_options_init(&o);
  o.runtime_dir = link.c_str();
  CHECK(bb_trainer_open("loose", 0, &o, &h) == BB_E_PERMISSION);
  unlink(link.c_str());
  REQUIRE(chmod(dir.path().c_str(), 0700) == 0);
  if (!root()) return;
  REQUIRE(chown(dir.path().c_str(), kNobody, kNobody) == 0);
  CHECK(bb_trainer_open("theirs", 0, nullptr, &h) == BB_E_PERMISSION);
  CHECK(has(bb_last_error(), "belongs to uid 65534"));
  CHECK(bb_task_attach("theirs", 0, "t", nullptr, &t) == BB_E_PERMISSION);
  CHECK(dir.files().empty());
  REQUIRE(chown(dir.path().c_str(), 0, 0) == 0);
}

TEST_CASE("attach_messages_with_bad_names_or_sizes_are_refused_and_leak_nothing") {
  RuntimeDir dir;
  Hub hub(dir, "wire");
  const int fds_before = open_fds();
  std::string error;
  bool closed = false;
  auto m = bb::shm::make_msg<bb::shm::AttachTaskMsg>(bb::shm::MsgType::kAttachTask);
  // A name that fills its field with no terminator: cut to the 47-byte bound, and accepted as
  // such (the trainer terminates it itself), never read past.
  std::memset(m.name, 'A', sizeof m.name);
  CHECK(exchange(hub.sock, &m, sizeof m, nullptr, 0, &error, &closed) == BB_OK);
  // Control characters and an empty name are refused with the rule.
  for (const char* bad : {"tab\there", "esc\x1b[2J", ""}) {
    std::memset(m.name, 0, sizeof m.name);
    std::snprintf(m.name, sizeof m.name, "%s", bad);
    CHECK(exchange(hub.sock, &m, sizeof m, nullptr, 0, &error, &closed) == BB_E_INVALID);
    CHECK((has(error, "non-printable") || has(error, "1 to 47")));
    CHECK(closed);
  }
  // A header that claims a size other than what arrived, and a datagram larger than any
  // message: refused as malformed.
  auto lying = m;
  lying.h.size = sizeof m + 64;
  CHECK(exchange(hub.sock, &lying, sizeof lying, nullptr, 0, &error, &closed) == BB_E_INVALID);
  // A datagram larger than any message is cut by the kernel; the trainer hangs up on it.
  std::vector<char> big(4 * bb::shm::kWireMaxMessage, 'x');
  std::memcpy(big.data(), &m, sizeof m);
  exchange(hub.sock, big.data(), big.size(), nullptr, 0, &error, &closed);
  CHECK(closed);
  // Descriptors sent along with a hello are refused by the kernel where it can
  // (SO_PASSRIGHTS, Linux 6.16+; see test_hostile.cc), elsewhere closed by the trainer, not kept.
  int junk[2];
  REQUIRE(pipe2(junk, O_CLOEXEC) == 0);
  std::snprintf(m.name, sizeof m.name, "with-fds");
  const int probe = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  const bool refused_by_kernel = bb::shm::refuse_passed_fds(probe);
  close(probe);
  if (refused_by_kernel) {
    const int c = connect_hub(hub.sock);
    CHECK(bb::shm::send_with_fds(c, &m, sizeof m, junk, 2, 0) == EPERM);
    close(c);
  } else {
    CHECK(exchange(hub.sock, &m, sizeof m, junk, 2, &error, &closed) == BB_OK);
  }
  close(junk[0]);
  close(junk[1]);
  // Every connection above is gone: the trainer (this process) holds what it held before.
  // (A dead task's slot and page are released at the trainer's next bubble call.)
  CHECK(bbtest::eventually([&] {
    bb_bubble_begin(hub.h, 1000, BB_MEM_UNKNOWN, BB_BUBBLE_OTHER);
    bb_bubble_end(hub.h);
    return hub.attached() == 0 && open_fds() == fds_before;
  }));
  CHECK(open_fds() == fds_before);
}

// A same-uid peer is untrusted (a side task). It can open connections that never say hello
// (each dropped after 2 s, but it can keep reconnecting) and observer connections (kept for
// good); each holds a descriptor in the trainer, and without a bound it
// could exhaust the training process's descriptor table. The bound: at most 64 connections
// besides attached tasks, and a clear refusal (BB_E_FULL) beyond, which the peer reads even
// when its request was already on its way (the trainer answers without reading it).
TEST_CASE("a_peer_cannot_hold_unbounded_connections_to_a_hub") {
  RuntimeDir dir;
  Hub hub(dir, "flood");
  const int fds_before = open_fds();
  constexpr int kFlood = 1000;
  std::vector<int> conns;
  for (int i = 0; i < kFlood; ++i) {
    const int c = connect_hub(hub.sock);
    auto m = bb::shm::make_msg<bb::shm::AttachObserverMsg>(bb::shm::MsgType::kAttachObserver);
    // Past the cap the trainer answers and closes at once, so the send may find it closed.
    const int rc = bb::shm::send_msg(c, &m, sizeof m, nullptr, 0);
    REQUIRE((rc == 0 || rc == EPIPE || rc == ECONNRESET));
    conns.push_back(c);
  }
  // Every connection is answered: the first 64 are observers, the rest refused, clearly.
  int observing = 0, refused = 0;
  std::string why;
  for (int c : conns) {
    alignas(8) char buf[bb::shm::kWireMaxMessage];
    int got[2], ngot = 0;
    const long n = bb::shm::recv_msg(c, buf, got, &ngot);
    for (int i = 0; i < ngot; ++i) close(got[i]);
    if (!bb::shm::check_msg(buf, n, bb::shm::MsgType::kAttachReply,
                            sizeof(bb::shm::AttachReplyMsg)))
      continue;
    bb::shm::AttachReplyMsg r;
    std::memcpy(&r, buf, sizeof r);
    r.error[sizeof r.error - 1] = 0;
    observing += r.status == BB_OK;
    if (r.status == BB_E_FULL) {
      ++refused;
      why = r.error;
    }
  }
  CHECK(observing == 64);
  CHECK(refused == kFlood - 64);
  CHECK(why.find("close some and retry") != std::string::npos);
  // A task turned away now hears the same answer, not a reset connection.
  bb_task_h t = nullptr;
  CHECK(bb_task_attach("flood", 0, "late", nullptr, &t) == BB_E_FULL);
  CHECK(std::string(bb_last_error()).find("close some and retry") != std::string::npos);
  // What the trainer holds beyond our kFlood sockets: the 64 it keeps, once it has closed the
  // refused ones (its closer thread does, a moment later).
  CHECK(bbtest::eventually([&] { return open_fds() - fds_before - kFlood <= 64; }));
  for (int c : conns) close(c);
}
