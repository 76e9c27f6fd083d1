// trainer_sim: one stage of a pipeline-parallel trainer, without a GPU.
//
// It replays the schedule model's timeline for one stage at the schedule's real pace: where a
// GPU would run a forward or backward it sleeps, and around every idle interval it reports a
// bubble to libbubble, exactly as an instrumented training loop would. Side tasks attached to
// its hub then run in those bubbles. Only the public C API is used, plus the schedule model.

#include <bubble/bubble.h>

#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <string_view>

#include "core/schedule.h"

namespace {

volatile std::sig_atomic_t g_stop = 0;

void on_signal(int) { g_stop = 1; }

constexpr const char* kUsage =
    "usage: trainer_sim --job J --rank R --stages P --microbatches M\n"
    "                   --schedule gpipe|1f1b|interleaved|zbh1 --fwd-ms F --bwd-ms B\n"
    "                   [--stage S] [--chunks V] [--wgrad-ms W] [--comm-ms C]\n"
    "                   [--free-mem-mib N] [--activation-share A]\n"
    "                   [--predict] [--declare] [--duration-s T] [--iterations N]\n"
    "                   [--progress-s K] [--json] [--lend BACKEND:MIB[:DEVICE]]\n"
    "\n"
    "Plays one stage of a P-stage pipeline and reports its bubbles to libbubble.\n"
    "No GPU is used: the program sleeps where a GPU would compute, on absolute deadlines,\n"
    "so it keeps the schedule's pace. Side tasks attach to hub (J, R).\n"
    "\n"
    "  --job J             job id of the hub (1..47 of [A-Za-z0-9_.-])\n"
    "  --rank R            rank of the hub, 0..65535\n"
    "  --stage S           pipeline stage this process plays (default: --rank)\n"
    "  --stages P          pipeline depth\n"
    "  --microbatches M    micro-batches per iteration\n"
    "  --schedule K        gpipe, 1f1b, interleaved (needs --chunks) or zbh1 (needs --wgrad-ms)\n"
    "  --chunks V          model chunks per stage for interleaved (default 2)\n"
    "  --fwd-ms F          forward of one micro-batch through the stage, milliseconds\n"
    "  --bwd-ms B          backward of one micro-batch (zbh1: input-gradient part only)\n"
    "  --wgrad-ms W        zbh1 weight-gradient part\n"
    "  --comm-ms C         point-to-point transfer between stages (default 0)\n"
    "  --free-mem-mib N    free device memory when the stage holds no activations; each\n"
    "                      bubble reports N scaled down by the activations held at that\n"
    "                      moment (default: unknown)\n"
    "  --activation-share A  share of N the pipeline's peak activations take (default 0.5)\n"
    "  --predict           report bubbles with expected length 0, so libbubble's predictor\n"
    "                      learns their lengths (default: pass the model's lengths)\n"
    "  --declare           declare the schedule to libbubble (bb_trainer_set_schedule), so\n"
    "                      with --predict the lengths are known from the first iteration\n"
    "  --duration-s T      stop after T seconds (at an iteration's end)\n"
    "  --iterations N      stop after N iterations\n"
    "                      (neither: run until SIGINT or SIGTERM)\n"
    "  --progress-s K      a progress line on stderr every K seconds (default 5, 0 = none)\n"
    "  --json              end with one line 'SUMMARY {json}' on stdout\n"
    "  --lend B:N[:D]      lend N MiB to side tasks with backend B (host, cuda-ipc or\n"
    "                      cuda-vmm; CUDA ones on device D, default 0): each task that\n"
    "                      asks for memory is granted it (bb_trainer_lend)\n";

struct Flags {
  std::string job;
  long long rank = -1, stage = -1, stages = -1, microbatches = -1, chunks = -1;
  std::string schedule;
  double fwd_ms = -1, bwd_ms = -1, wgrad_ms = -1, comm_ms = 0;
  double free_mem_mib = -1, activation_share = 0.5;
  double duration_s = 0;
  long long iterations = 0;
  double progress_s = 5;
  bool json = false;
  bool predict = false;
  bool declare = false;
  // --lend: 0 = nothing lent.
  uint32_t lend_backend = 0;
  double lend_mib = 0;
  long long lend_device = 0;
};

[[noreturn]] void die_usage(const std::string& msg) {
  std::fprintf(stderr, "trainer_sim: %s\n(run trainer_sim --help for the flags)\n", msg.c_str());
  std::exit(2);
}

long long parse_int(const char* flag, const char* text, long long lo, long long hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi)
    die_usage(std::string(flag) + " needs a whole number in " + std::to_string(lo) + ".." +
              std::to_string(hi) + ", got '" + text + "'");
  return v;
}

double parse_num(const char* flag, const char* text, double lo, double hi, const char* unit) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (errno != 0 || end == text || *end != '\0' || !std::isfinite(v) || v < lo || v > hi) {
    char range[96];
    std::snprintf(range, sizeof range, "%g..%g", lo, hi);
    die_usage(std::string(flag) + " needs a number of " + unit + " in " + range + ", got '" +
              text + "'");
  }
  return v;
}

Flags parse_flags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (a == "--declare") {
      f.declare = true;
      continue;
    }
    if (a == "--json" || a == "--predict") {
      (a == "--json" ? f.json : f.predict) = true;
      continue;
    }
    if (a.substr(0, 2) != "--") die_usage("unexpected argument '" + std::string(a) + "'");
    if (i + 1 >= argc) die_usage(std::string(a) + " needs a value");
    const char* v = argv[++i];
    const char* flag = argv[i - 1];
    if (a == "--job") f.job = v;
    else if (a == "--rank") f.rank = parse_int(flag, v, 0, 65535);
    else if (a == "--stage") f.stage = parse_int(flag, v, 0, 1023);
    else if (a == "--stages") f.stages = parse_int(flag, v, 1, 1024);
    else if (a == "--microbatches") f.microbatches = parse_int(flag, v, 1, 65536);
    else if (a == "--chunks") f.chunks = parse_int(flag, v, 1, 64);
    else if (a == "--schedule") f.schedule = v;
    else if (a == "--fwd-ms") f.fwd_ms = parse_num(flag, v, 0.001, 3.6e6, "milliseconds");
    else if (a == "--bwd-ms") f.bwd_ms = parse_num(flag, v, 0.001, 3.6e6, "milliseconds");
    else if (a == "--wgrad-ms") f.wgrad_ms = parse_num(flag, v, 0.001, 3.6e6, "milliseconds");
    else if (a == "--comm-ms") f.comm_ms = parse_num(flag, v, 0, 3.6e6, "milliseconds");
    else if (a == "--free-mem-mib") f.free_mem_mib = parse_num(flag, v, 0, 1e9, "MiB");
    else if (a == "--activation-share") f.activation_share = parse_num(flag, v, 0, 1, "(a fraction)");
    else if (a == "--duration-s") f.duration_s = parse_num(flag, v, 0.001, 1e9, "seconds");
    else if (a == "--iterations") f.iterations = parse_int(flag, v, 1, 1ll << 62);
    else if (a == "--progress-s") f.progress_s = parse_num(flag, v, 0, 1e9, "seconds");
    else if (a == "--lend") {
      const std::string spec = v;
      const size_t c1 = spec.find(':');
      const size_t c2 = c1 == std::string::npos ? c1 : spec.find(':', c1 + 1);
      const std::string b = spec.substr(0, c1);
      f.lend_backend = b == "host" ? BB_GRANT_HOST : b == "cuda-ipc" ? BB_GRANT_CUDA_IPC
                       : b == "cuda-vmm" ? BB_GRANT_CUDA_VMM : 0;
      if (c1 == std::string::npos || f.lend_backend == 0)
        die_usage("--lend needs BACKEND:MIB[:DEVICE] with BACKEND host, cuda-ipc or cuda-vmm, "
                  "got '" + spec + "'");
      f.lend_mib = parse_num(flag, spec.substr(c1 + 1, c2 - c1 - 1).c_str(), 0.004, 1e7, "MiB");
      if (c2 != std::string::npos)
        f.lend_device = parse_int(flag, spec.substr(c2 + 1).c_str(), 0, 1023);
    }
    else die_usage("unknown flag '" + std::string(a) + "'");
  }
  if (f.job.empty()) die_usage("--job is required");
  if (f.rank < 0) die_usage("--rank is required");
  if (f.stages < 0) die_usage("--stages is required");
  if (f.microbatches < 0) die_usage("--microbatches is required");
  if (f.schedule.empty()) die_usage("--schedule is required (gpipe, 1f1b, interleaved or zbh1)");
  if (f.fwd_ms < 0) die_usage("--fwd-ms is required");
  if (f.bwd_ms < 0) die_usage("--bwd-ms is required");
  if (f.stage < 0) {
    if (f.rank >= f.stages)
      die_usage("--stage defaults to --rank (" + std::to_string(f.rank) +
                "), which is not below --stages " + std::to_string(f.stages) + "; pass --stage");
    f.stage = f.rank;
  }
  if (f.stage >= f.stages)
    die_usage("--stage " + std::to_string(f.stage) + " must be below --stages " +
              std::to_string(f.stages));
  return f;
}

uint64_t ms_to_ns(double ms) { return static_cast<uint64_t>(std::llround(ms * 1e6)); }

// Sleeps until the CLOCK_MONOTONIC instant t (the clock bb_now_ns() reads). Returns false if a
// stop signal arrived first.
bool sleep_until(uint64_t t) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(t / 1000000000ull);
  ts.tv_nsec = static_cast<long>(t % 1000000000ull);
  for (;;) {
    if (g_stop) return false;
    const int rc = clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr);
    if (rc == 0) return !g_stop;
    if (rc != EINTR) {
      std::fprintf(stderr, "trainer_sim: clock_nanosleep failed: %s\n", std::strerror(rc));
      return false;
    }
  }
}

const char* kind_name(bb_bubble_kind k) {
  switch (k) {
    case BB_BUBBLE_WARMUP: return "warmup";
    case BB_BUBBLE_STEADY: return "steady";
    case BB_BUBBLE_COOLDOWN: return "cooldown";
    default: return "other";
  }
}

struct Run {
  bb_trainer_h trainer = nullptr;
  uint64_t iterations = 0;
  uint64_t late_iterations = 0;  // iterations that began more than a period late (re-based)
  uint64_t start_ns = 0;
};

void print_progress(const Run& run) {
  bb_trainer_stats_t st;
  std::memset(&st, 0, sizeof st);
  st.size = sizeof st;
  if (bb_trainer_stats(run.trainer, &st) != BB_OK) {
    std::fprintf(stderr, "trainer_sim: bb_trainer_stats failed: %s\n", bb_last_error());
    return;
  }
  const double elapsed = (bb_now_ns() - run.start_ns) / 1e9;
  const double used = st.bubble_ns ? 100.0 * st.task_ns_in_bubbles / st.bubble_ns : 0.0;
  std::fprintf(stderr,
               "[%7.1fs] iterations %" PRIu64 "  bubbles %" PRIu64 "  bubble %.1f ms  tasks %u  "
               "side-task %.1f ms in bubbles (%.1f%%), %.1f ms outside\n",
               elapsed, run.iterations, st.bubbles, st.bubble_ns / 1e6, st.tasks_attached,
               st.task_ns_in_bubbles / 1e6, used, st.task_ns_outside / 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = parse_flags(argc, argv);

  bb::core::ScheduleParams sp;
  if (!bb::core::parse_schedule_kind(flags.schedule, &sp.kind))
    die_usage("--schedule must be gpipe, 1f1b, interleaved or zbh1, got '" + flags.schedule + "'");
  sp.stages = static_cast<uint32_t>(flags.stages);
  sp.microbatches = static_cast<uint32_t>(flags.microbatches);
  if (sp.kind == bb::core::ScheduleKind::kInterleaved) {
    sp.chunks = flags.chunks < 0 ? 2 : static_cast<uint32_t>(flags.chunks);
  } else if (flags.chunks >= 0 && flags.chunks != 1) {
    die_usage("--chunks only applies to --schedule interleaved");
  }
  if (sp.kind == bb::core::ScheduleKind::kZBH1) {
    if (flags.wgrad_ms < 0) die_usage("--schedule zbh1 needs --wgrad-ms");
    sp.wgrad_ns = ms_to_ns(flags.wgrad_ms);
  } else if (flags.wgrad_ms >= 0) {
    die_usage("--wgrad-ms only applies to --schedule zbh1; add it to --bwd-ms otherwise");
  }
  sp.fwd_ns = ms_to_ns(flags.fwd_ms);
  sp.bwd_ns = ms_to_ns(flags.bwd_ms);
  sp.comm_ns = ms_to_ns(flags.comm_ms);

  bb::core::Schedule sched;
  std::string err;
  if (bb::core::simulate_schedule(sp, &sched, &err) != BB_OK) {
    std::fprintf(stderr, "trainer_sim: bad schedule: %s\n", err.c_str());
    return 2;
  }
  const auto& tl = sched.stages[static_cast<size_t>(flags.stage)];
  const uint64_t period = sched.iteration_ns;

  // Free memory per bubble: the flag's figure minus the activations held then, where the
  // pipeline's peak activations take --activation-share of it.
  const bool mem_known = flags.free_mem_mib >= 0;
  auto free_mem_at = [&](double held) -> uint64_t {
    if (!mem_known) return BB_MEM_UNKNOWN;
    const double used = flags.activation_share * (1.0 - sched.relative_free(held));
    return static_cast<uint64_t>(flags.free_mem_mib * (1.0 - used) * 1024.0 * 1024.0);
  };

  std::printf("trainer_sim: job %s rank %lld stage %lld/%lld, %s p=%u m=%u%s, fwd %.3f ms, "
              "bwd %.3f ms\n",
              flags.job.c_str(), flags.rank, flags.stage, flags.stages,
              bb::core::schedule_kind_name(sp.kind), sp.stages, sp.microbatches,
              sp.kind == bb::core::ScheduleKind::kInterleaved
                  ? (" v=" + std::to_string(sp.chunks)).c_str()
                  : "",
              flags.fwd_ms, flags.bwd_ms);
  std::printf("model: iteration %.3f ms, this stage idles %.3f ms (%.1f%%) in %zu bubbles; "
              "pipeline bubble fraction %.1f%%\n",
              period / 1e6, tl.idle_ns / 1e6, 100.0 * sched.stage_bubble_fraction(flags.stage),
              tl.bubbles.size(), 100.0 * sched.bubble_fraction());
  constexpr size_t kListed = 16;
  for (size_t i = 0; i < tl.bubbles.size() && i < kListed; ++i) {
    const auto& b = tl.bubbles[i];
    std::printf("  bubble at %9.3f ms  %9.3f ms  %-8s  holds %.2f micro-batches%s\n",
                b.start_ns / 1e6, b.duration_ns / 1e6, kind_name(b.kind), b.held,
                mem_known ? (", free " + std::to_string(free_mem_at(b.held) >> 20) + " MiB").c_str()
                          : "");
  }
  if (tl.bubbles.size() > kListed) std::printf("  ... and %zu more\n", tl.bubbles.size() - kListed);
  std::fflush(stdout);

  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a signal must cut a sleep short
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  Run run;
  if (bb_trainer_open(flags.job.c_str(), static_cast<uint32_t>(flags.rank), nullptr,
                      &run.trainer) != BB_OK) {
    std::fprintf(stderr, "trainer_sim: cannot open hub (%s, %lld): %s\n", flags.job.c_str(),
                 flags.rank, bb_last_error());
    return 1;
  }

  if (flags.lend_backend != 0) {
    bb_lend_options_t lo;
    bb_lend_options_init(&lo);
    lo.backend = flags.lend_backend;
    lo.bytes = static_cast<uint64_t>(flags.lend_mib * 1048576.0);
    lo.device = static_cast<int32_t>(flags.lend_device);
    if (bb_trainer_lend(run.trainer, &lo) != BB_OK) {
      std::fprintf(stderr, "trainer_sim: cannot lend memory: %s\n", bb_last_error());
      bb_trainer_close(run.trainer);
      return 1;
    }
  }

  if (flags.declare) {
    bb_schedule_t decl;
    bb_schedule_init(&decl);
    decl.kind = static_cast<uint32_t>(sp.kind);  // bb_schedule_kind uses the same numbering
    decl.stages = sp.stages;
    decl.microbatches = sp.microbatches;
    decl.chunks = sp.chunks;
    decl.stage = static_cast<uint32_t>(flags.stage);
    decl.fwd_ns = sp.fwd_ns;
    decl.bwd_ns = sp.bwd_ns;
    decl.wgrad_ns = sp.wgrad_ns;
    decl.comm_ns = sp.comm_ns;
    if (bb_trainer_set_schedule(run.trainer, &decl) != BB_OK) {
      std::fprintf(stderr, "trainer_sim: cannot declare the schedule: %s\n", bb_last_error());
      bb_trainer_close(run.trainer);
      return 2;
    }
  }

  int rc = 0;
  run.start_ns = bb_now_ns();
  const uint64_t progress_ns = static_cast<uint64_t>(flags.progress_s * 1e9);
  const uint64_t stop_at =
      flags.duration_s > 0 ? run.start_ns + static_cast<uint64_t>(flags.duration_s * 1e9) : 0;
  uint64_t next_progress = progress_ns ? run.start_ns + progress_ns : UINT64_MAX;
  uint64_t base = run.start_ns;  // start of iteration 0, moved forward if the process falls behind
  bool in_bubble = false;

  auto fail = [&](const char* what) {
    std::fprintf(stderr, "trainer_sim: %s failed: %s\n", what, bb_last_error());
    rc = 1;
    g_stop = 1;
  };
  auto maybe_progress = [&] {
    if (bb_now_ns() >= next_progress) {
      print_progress(run);
      while (next_progress <= bb_now_ns()) next_progress += progress_ns;
    }
  };

  for (uint64_t it = 0; !g_stop; ++it) {
    if (flags.iterations > 0 && it >= static_cast<uint64_t>(flags.iterations)) break;
    uint64_t t0 = base + it * period;
    const uint64_t now = bb_now_ns();
    if (stop_at && now >= stop_at) break;
    if (now > t0 + period) {
      // Descheduled for more than a whole iteration: start afresh rather than replay a burst of
      // bubbles that already passed.
      base = now - it * period;
      t0 = now;
      ++run.late_iterations;
    }
    if (bb_trainer_iteration(run.trainer) != BB_OK) {
      fail("bb_trainer_iteration");
      break;
    }
    for (const auto& b : tl.bubbles) {
      if (!sleep_until(t0 + b.start_ns)) break;  // the stage computes up to the bubble
      const uint64_t expected = flags.predict ? 0 : b.duration_ns;
      if (bb_bubble_begin(run.trainer, expected, free_mem_at(b.held), b.kind) != BB_OK) {
        fail("bb_bubble_begin");
        break;
      }
      in_bubble = true;
      const bool slept = sleep_until(t0 + b.start_ns + b.duration_ns);
      if (bb_bubble_end(run.trainer) != BB_OK) {
        fail("bb_bubble_end");
        break;
      }
      in_bubble = false;
      maybe_progress();
      if (!slept) break;
    }
    if (g_stop || !sleep_until(t0 + period)) break;  // computes after its last bubble
    ++run.iterations;
    maybe_progress();
  }
  if (in_bubble) bb_bubble_end(run.trainer);

  bb_trainer_stats_t st;
  std::memset(&st, 0, sizeof st);
  st.size = sizeof st;
  if (bb_trainer_stats(run.trainer, &st) != BB_OK) {
    std::fprintf(stderr, "trainer_sim: bb_trainer_stats failed: %s\n", bb_last_error());
    rc = 1;
  }
  const uint64_t elapsed = bb_now_ns() - run.start_ns;

  std::printf("\nsummary: %" PRIu64 " iterations in %.2f s (%" PRIu64 " restarted late)\n",
              run.iterations, elapsed / 1e9, run.late_iterations);
  std::printf("  bubbles %" PRIu64 ", %.1f ms idle in total\n", st.bubbles, st.bubble_ns / 1e6);
  std::printf("  tasks attached %u; %" PRIu64 " starts, %" PRIu64 " pauses, %" PRIu64
              " wakes, %" PRIu64 " steps\n",
              st.tasks_attached, st.starts, st.pauses, st.wakes, st.steps);
  std::printf("  side-task time in bubbles %.1f ms (%.1f%% of bubble time), outside %.1f ms\n",
              st.task_ns_in_bubbles / 1e6,
              st.bubble_ns ? 100.0 * st.task_ns_in_bubbles / st.bubble_ns : 0.0,
              st.task_ns_outside / 1e6);
  std::printf("  start latency p50 %.1f us p99 %.1f us; pause latency p50 %.1f us p99 %.1f us\n",
              st.start_latency_p50_ns / 1e3, st.start_latency_p99_ns / 1e3,
              st.pause_latency_p50_ns / 1e3, st.pause_latency_p99_ns / 1e3);
  if (st.tasks_reclaimed || st.tasks_bad || st.events_dropped)
    std::printf("  tasks reclaimed %" PRIu64 ", marked bad %" PRIu64 ", events dropped %" PRIu64
                "\n",
                st.tasks_reclaimed, st.tasks_bad, st.events_dropped);
  if (flags.json) {
    // The job id passed bb_trainer_open's check ([A-Za-z0-9_.-]), so it needs no escaping.
    std::printf(
        "SUMMARY {\"job\":\"%s\",\"rank\":%lld,\"stage\":%lld,\"stages\":%u,"
        "\"microbatches\":%u,\"schedule\":\"%s\",\"chunks\":%u,\"iterations\":%" PRIu64
        ",\"late_iterations\":%" PRIu64 ",\"elapsed_ns\":%" PRIu64
        ",\"model_iteration_ns\":%" PRIu64 ",\"model_stage_idle_ns\":%" PRIu64
        ",\"model_bubble_fraction\":%.6f"
        ",\"tasks_attached\":%u,\"bubbles\":%" PRIu64 ",\"bubble_ns\":%" PRIu64
        ",\"starts\":%" PRIu64 ",\"pauses\":%" PRIu64 ",\"wakes\":%" PRIu64
        ",\"task_ns_in_bubbles\":%" PRIu64 ",\"task_ns_outside\":%" PRIu64 ",\"steps\":%" PRIu64
        ",\"start_latency_p50_ns\":%" PRIu64 ",\"start_latency_p99_ns\":%" PRIu64
        ",\"pause_latency_p50_ns\":%" PRIu64 ",\"pause_latency_p99_ns\":%" PRIu64
        ",\"tasks_reclaimed\":%" PRIu64 ",\"tasks_bad\":%" PRIu64 ",\"events_dropped\":%" PRIu64
        "}\n",
        flags.job.c_str(), flags.rank, flags.stage, sp.stages, sp.microbatches,
        bb::core::schedule_kind_name(sp.kind), sp.chunks, run.iterations, run.late_iterations,
        elapsed, period, tl.idle_ns, sched.bubble_fraction(), st.tasks_attached, st.bubbles,
        st.bubble_ns, st.starts, st.pauses, st.wakes, st.task_ns_in_bubbles, st.task_ns_outside,
        st.steps, st.start_latency_p50_ns, st.start_latency_p99_ns, st.pause_latency_p50_ns,
        st.pause_latency_p99_ns, st.tasks_reclaimed, st.tasks_bad, st.events_dropped);
  }
  std::fflush(stdout);

  if (bb_trainer_close(run.trainer) != BB_OK) {
    std::fprintf(stderr, "trainer_sim: bb_trainer_close failed: %s\n", bb_last_error());
    rc = 1;
  }
  return rc;
}
