// The hub the plugin opens for its process's rank, and its configuration from the environment.
//
// NCCL calls the plugin's init once per communicator; a pipeline stage usually has several (the
// world, its send/recv pairs). They all feed one hub: a hub belongs to a GPU process, not to a
// communicator. The first init opens it, the last finalize closes it.
//
// Environment (read at the first init):
//   BUBBLE_JOB          hub job id (default "nccl")
//   BUBBLE_RANK         hub rank; else RANK (torchrun), OMPI_COMM_WORLD_RANK, SLURM_PROCID,
//                       PMI_RANK, else the rank in the first communicator NCCL initialises
//   BUBBLE_NCCL_LEND    lend memory to side tasks: "<host|cuda-ipc|cuda-vmm>:<bytes>[K|M|G]"
//   BUBBLE_NCCL_DEVICE  CUDA device ordinal of the lent memory; else the device current on the
//                       thread NCCL calls init on (the communicator's), else LOCAL_RANK, else 0
//   BUBBLE_NCCL_MAX_RUNNING  tasks started per bubble (default 1)
//   BUBBLE_RUNTIME_DIR  where hub sockets live (as for every libbubble hub)
#pragma once

#include <bubble/bubble.h>

#include <cstdint>
#include <string>

#include "plugins/nccl_profiler/recv_waits.h"

namespace bb::nccl {

struct HubConfig {
  std::string job = "nccl";
  uint32_t rank = 0;
  std::string rank_source;   // which variable (or "communicator") gave the rank
  uint32_t max_running = 1;
  uint32_t lend_backend = 0; // bb_grant_backend; 0 = lend nothing
  uint64_t lend_bytes = 0;
  int32_t device = 0;
};

// Reads the environment. comm_rank < 0: the interface version gives no rank (v3), so one of the
// variables must. On a bad value returns false and *error says which variable and what to do.
bool hub_config_from_env(int comm_rank, HubConfig* out, std::string* error);

// "1G" -> 1073741824. False on anything else than digits with an optional K/M/G suffix.
bool parse_bytes(const std::string& s, uint64_t* out);

// The process's hub: a trainer handle whose bubbles follow the receive waits.
class RankHub final : public WaitSink {
 public:
  // Opens the hub and lends memory if configured (a failed lend is reported in *warning and
  // the hub still serves bubbles). On failure returns the status and *error.
  static bb_status open(const HubConfig& cfg, RankHub** out, std::string* error,
                        std::string* warning);
  ~RankHub() override;

  void wait_begins() override;
  void wait_ends() override;

  const HubConfig& config() const { return cfg_; }
  bb_trainer_h trainer() const { return trainer_; }

 private:
  RankHub(const HubConfig& cfg, bb_trainer_h t) : cfg_(cfg), trainer_(t) {}
  HubConfig cfg_;
  bb_trainer_h trainer_;
};

}  // namespace bb::nccl
