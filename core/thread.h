// The library's own threads (the hub's service thread, the stream-timing watcher) live inside
// the application's process. A signal sent to the process goes to any thread that does not block
// it, and the application's handler then runs on that thread: a handler that sets a flag for its
// main loop, or a program that blocks SIGTERM on its threads to take it with sigwait or a
// signalfd, would see its signal run, or sit, on a thread it does not know about. So these
// threads start with every asynchronous signal blocked. The synchronous ones (a fault in the
// thread itself) stay open: blocked, the kernel would kill the process without the application's
// crash handler.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <thread>
#include <utility>

namespace bb::core {

// A std::thread named `name` (at most 15 characters; shown by ps, top and debuggers) running fn
// with the asynchronous signals blocked from its first instruction (the mask is inherited; the
// caller's own mask is restored before returning, also when the thread cannot be made, which
// throws std::system_error like std::thread).
template <class F>
std::thread start_library_thread(const char* name, F&& fn) {
  sigset_t quiet, old;
  sigfillset(&quiet);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS})
    sigdelset(&quiet, sig);
  pthread_sigmask(SIG_BLOCK, &quiet, &old);
  std::thread t;
  try {
    t = std::thread([name, fn = std::forward<F>(fn)]() mutable {
      pthread_setname_np(pthread_self(), name);
      fn();
    });
  } catch (...) {
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    throw;
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return t;
}

}  // namespace bb::core
