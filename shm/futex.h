// Futex waits and wakes on words in shared memory (never FUTEX_PRIVATE: the waiter and the
// waker are different processes). A wait on a read-only mapping is allowed by the kernel.
#pragma once

#include <atomic>
#include <cstdint>

namespace bb::shm {

enum class WaitResult { kChanged, kTimeout, kInterrupted };

// Sleeps while *word == expected, at most timeout_ns (< 0: no limit). Returns kChanged when the
// word differed or a wake arrived (the caller rechecks), kTimeout, or kInterrupted on a signal.
WaitResult futex_wait(const std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);

// Wakes up to `count` sleepers on word. Returns how many were woken (0 if none slept).
int futex_wake(std::atomic<uint32_t>* word, int count);

// Spins up to spin_ns for *word != expected. Returns true when it changed, and then sets
// *seen_ns (if given) to when it saw the change: the CLOCK_MONOTONIC read made just before the
// load that saw it, so at most one poll early, or 0 if the word differed at the first look.
// Between loads: a pause instruction (cpu_relax), which leaves the core to its other hardware
// thread, possibly the trainer's, and then the clock read, so a spinning waiter knows when its
// wait ended without reading the clock again once it has. The pause cost nothing measurable
// here (signal_latency, alternating runs); an SMT machine is where it matters.
bool spin_until_changed(const std::atomic<uint32_t>* word, uint32_t expected, uint64_t spin_ns,
                        uint64_t* seen_ns = nullptr);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace bb::shm
