// A one-way wake-up channel between two processes, the peers signal_latency compares libbubble
// with. The waker sends one signal per round; the waiter blocks (or busy-polls) until it
// arrives. The harness stamps both ends; a channel only moves the wake-up.
//
// Lifecycle: prepare() in the orchestrating process before the fork (descriptors, names), then
// in each child its own setup (connections, runtimes). The waiter reports readiness only once a
// signal sent from then on is sure to arrive.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace bench {

class Channel {
 public:
  virtual ~Channel() = default;
  virtual const char* name() const = 0;
  // Whether the channel has a blocking (busy = false) or a busy-polling (busy = true) wait.
  virtual bool supports(bool busy) const = 0;
  // In the orchestrator, before forking: false (and *why) when the channel cannot run here.
  virtual bool prepare(bool busy, std::string* why) { (void)busy; (void)why; return true; }
  // In the orchestrator, after both children exited.
  virtual void cleanup() {}
  // Whether a child must leave through exit() (static destructors run) rather than _exit():
  // iceoryx deregisters from RouDi only in its runtime's destructor.
  virtual bool exit_cleanly() const { return false; }

  // Waker child.
  virtual bool setup_waker(std::string* why) = 0;
  virtual bool signal() = 0;
  // Called before the stamp of each signal: what a sender prepares ahead (a buffer it borrows)
  // is not part of the wake-up, as libbubble's start block is there before its stamp.
  virtual bool prepare_signal() { return true; }

  // Waiter child: set up, call ready() once signals will arrive, then call on_wake() for every
  // signal received (stamping comes first thing inside it) until it returns false.
  virtual int run_waiter(bool busy, const std::function<void()>& ready,
                         const std::function<bool()>& on_wake) = 0;
};

// Kernel mechanisms (always built).
std::unique_ptr<Channel> make_futex_channel(uint32_t* shared_word);
std::unique_ptr<Channel> make_spin_channel(uint32_t* shared_word);
// The same spin carrying a time: the waker reads bb_now_ns() and stores it on the line the
// waiter polls before it bumps the word, and the waiter reads it once it sees the bump. A
// libbubble start has this shape (its block carries the bubble's begin time and deadline, read
// from the clock inside bb_bubble_begin), so this is the floor of that design. `shared_line` is
// one cache line (64 bytes, aligned).
std::unique_ptr<Channel> make_spin_timed_channel(void* shared_line);
// The timed spin with a readiness check in front: the waiter, once it has seen a bump, writes
// how many it has seen on a second line, and the waker loads that line before it signals (and
// counts the times it found the waiter behind; it signals anyway). A libbubble start has this
// shape too: bb_bubble_begin starts only a task that acked its last run, which it learns from a
// line the task wrote. `shared_lines` is two cache lines (128 bytes, aligned).
std::unique_ptr<Channel> make_spin_handshake_channel(void* shared_lines);
std::unique_ptr<Channel> make_eventfd_channel();
std::unique_ptr<Channel> make_pipe_channel();
std::unique_ptr<Channel> make_unix_socket_channel();
std::unique_ptr<Channel> make_mqueue_channel();

// Optional peers: a channel whose prepare() explains why it cannot run when it was not built.
std::unique_ptr<Channel> make_iceoryx_channel(const std::string& work_dir);
std::unique_ptr<Channel> make_grpc_channel();

}  // namespace bench
