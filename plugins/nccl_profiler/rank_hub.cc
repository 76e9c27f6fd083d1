#include "plugins/nccl_profiler/rank_hub.h"

#include <algorithm>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/cuda_driver.h"

namespace bb::nccl {
namespace {

// The device of the CUDA context current on the calling thread, if there is one. NCCL calls the
// plugin's init on the thread that made the communicator's device current, so this is the
// device the rank uses, numbered as this process numbers its GPUs (a LOCAL_RANK counts GPUs of
// the node, which is another number where each rank sees only its own).
bool current_cuda_device(int32_t* device) {
  std::string error;
  const core::CudaDriver* drv = core::cuda_driver(&error);
  int dev = -1;
  if (!drv || !drv->current_device(&dev)) return false;
  *device = int32_t(dev);
  return true;
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

bool parse_u32(const char* s, uint32_t max, uint32_t* out) {
  if (!s || !*s) return false;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (errno || *end || v > max || s[0] == '-') return false;
  *out = uint32_t(v);
  return true;
}

}  // namespace

bool parse_bytes(const std::string& s, uint64_t* out) {
  if (s.empty() || s[0] < '0' || s[0] > '9') return false;
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno) return false;
  uint64_t mul = 1;
  if (*end == 'K' || *end == 'k') mul = 1ull << 10, ++end;
  else if (*end == 'M' || *end == 'm') mul = 1ull << 20, ++end;
  else if (*end == 'G' || *end == 'g') mul = 1ull << 30, ++end;
  if (*end) return false;
  if (v > UINT64_MAX / mul) return false;
  *out = v * mul;
  return true;
}

bool hub_config_from_env(int comm_rank, HubConfig* out, std::string* error) {
  HubConfig c;
  if (const char* job = env("BUBBLE_JOB")) c.job = job;

  static const char* const kRankVars[] = {"BUBBLE_RANK", "RANK", "OMPI_COMM_WORLD_RANK",
                                          "SLURM_PROCID", "PMI_RANK"};
  bool have_rank = false;
  for (const char* var : kRankVars) {
    const char* v = env(var);
    if (!v) continue;
    if (!parse_u32(v, 65535, &c.rank)) {
      *error = std::string(var) + "='" + v + "' is not a rank in 0..65535: fix it or set "
               "BUBBLE_RANK to this process's rank";
      return false;
    }
    c.rank_source = var;
    have_rank = true;
    break;
  }
  if (!have_rank) {
    if (comm_rank < 0) {
      *error = "this NCCL's profiler interface does not tell the rank: set BUBBLE_RANK (or RANK) "
               "to this process's rank";
      return false;
    }
    c.rank = uint32_t(comm_rank);
    c.rank_source = "communicator";
  }

  if (const char* v = env("BUBBLE_NCCL_MAX_RUNNING")) {
    if (!parse_u32(v, BB_MAX_SLOTS_LIMIT, &c.max_running) || c.max_running == 0) {
      *error = std::string("BUBBLE_NCCL_MAX_RUNNING='") + v + "' must be 1.." +
               std::to_string(BB_MAX_SLOTS_LIMIT);
      return false;
    }
  }

  if (const char* v = env("BUBBLE_NCCL_LEND")) {
    const std::string s = v;
    const size_t colon = s.find(':');
    const std::string backend = s.substr(0, colon);
    if (backend == "host") c.lend_backend = BB_GRANT_HOST;
    else if (backend == "cuda-ipc") c.lend_backend = BB_GRANT_CUDA_IPC;
    else if (backend == "cuda-vmm") c.lend_backend = BB_GRANT_CUDA_VMM;
    if (!c.lend_backend || colon == std::string::npos ||
        !parse_bytes(s.substr(colon + 1), &c.lend_bytes) || c.lend_bytes == 0) {
      *error = "BUBBLE_NCCL_LEND='" + s + "' must look like cuda-vmm:256M (backend host, "
               "cuda-ipc or cuda-vmm; bytes with an optional K, M or G)";
      return false;
    }
    uint32_t dev = 0;
    const char* dv = env("BUBBLE_NCCL_DEVICE");
    const char* var = "BUBBLE_NCCL_DEVICE";
    int32_t current = -1;
    if (!dv && c.lend_backend != BB_GRANT_HOST && current_cuda_device(&current)) {
      c.device = current;
    } else {
      if (!dv) dv = env("LOCAL_RANK"), var = "LOCAL_RANK";
      if (dv && !parse_u32(dv, 1023, &dev)) {
        *error = std::string(var) + "='" + dv + "' is not a CUDA device ordinal: set "
                 "BUBBLE_NCCL_DEVICE to the device this rank uses";
        return false;
      }
      c.device = int32_t(dev);
    }
  }
  *out = c;
  return true;
}

bb_status RankHub::open(const HubConfig& cfg, RankHub** out, std::string* error,
                        std::string* warning) {
  *out = nullptr;
  bb_trainer_options_t opts;
  bb_trainer_options_init(&opts);
  opts.max_running = cfg.max_running;
  opts.max_slots = std::max(opts.max_slots, cfg.max_running);  // as many may run at once
  bb_trainer_h t = nullptr;
  bb_status st = bb_trainer_open(cfg.job.c_str(), cfg.rank, &opts, &t);
  if (st != BB_OK) {
    *error = "could not open the hub " + cfg.job + "." + std::to_string(cfg.rank) + " (rank from " +
             cfg.rank_source + "): " + bb_last_error();
    return st;
  }
  if (cfg.lend_backend) {
    bb_lend_options_t lend;
    bb_lend_options_init(&lend);
    lend.backend = cfg.lend_backend;
    lend.bytes = cfg.lend_bytes;
    lend.device = cfg.device;
    if (bb_trainer_lend(t, &lend) != BB_OK)
      *warning = std::string("BUBBLE_NCCL_LEND ignored, side tasks get no memory grant: ") +
                 bb_last_error();
  }
  try {
    *out = new RankHub(cfg, t);
  } catch (...) {
    bb_trainer_close(t);
    throw;
  }
  return BB_OK;
}

RankHub::~RankHub() { bb_trainer_close(trainer_); }

// Both run under the tracker's lock, which is what makes calls from NCCL's user and proxy
// threads "one thread at a time" as bb_bubble_begin/end require. Their failures cannot be
// reported to NCCL (a profiler must not disturb it) and, on a valid handle, do not happen.
void RankHub::wait_begins() { bb_bubble_begin(trainer_, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY); }

void RankHub::wait_ends() { bb_bubble_end(trainer_); }

}  // namespace bb::nccl
