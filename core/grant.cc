#include "core/grant.h"

#include <unistd.h>

#include <cstring>

#include "core/cuda_driver.h"

namespace bb::core {

const char* grant_backend_name(GrantBackend b) {
  switch (b) {
    case GrantBackend::kHost: return "host";
    case GrantBackend::kCudaIpc: return "cuda-ipc";
    case GrantBackend::kCudaVmm: return "cuda-vmm";
    default: return "none";
  }
}

bool parse_grant_backend(const char* name, GrantBackend* out) {
  if (!name) return false;
  for (GrantBackend b : {GrantBackend::kHost, GrantBackend::kCudaIpc, GrantBackend::kCudaVmm}) {
    if (std::strcmp(name, grant_backend_name(b)) == 0) {
      *out = b;
      return true;
    }
  }
  return false;
}

void GrantExporter::descriptor_sent(uint64_t, GrantHandle* handle) {
  if (handle->fd >= 0) close(handle->fd);
  handle->fd = -1;
}

bb_status validate_grant(const Grant& g, std::string* error) {
  auto bad = [&](const std::string& what) {
    *error = "invalid grant record (" + what + "): the trainer's libbubble may be of another "
             "version, or the record was overwritten";
    return BB_E_CORRUPT;
  };
  switch (g.backend) {
    case GrantBackend::kHost:
    case GrantBackend::kCudaIpc:
    case GrantBackend::kCudaVmm: break;
    default: return bad("unknown backend " + std::to_string(static_cast<uint32_t>(g.backend)));
  }
  if (g.id == 0) return bad("id 0");
  if (g.size == 0) return bad("size 0");
  const GrantHandle& h = g.handle;
  if (h.map_size < g.size) return bad("map size below grant size");
  if (h.map_offset + h.map_size < h.map_offset) return bad("map range overflows");
  if (g.offset + g.size < g.offset) return bad("grant range overflows");
  if (g.backend == GrantBackend::kHost && (h.map_offset != 0 || h.device != -1))
    return bad("host grant with a map offset or device");
  if (g.backend != GrantBackend::kHost && h.device < 0) return bad("CUDA grant without device");
  if (g.backend == GrantBackend::kCudaVmm && h.map_offset != 0)
    return bad("cuda-vmm grant with a map offset");
  return BB_OK;
}

bb_status map_grant(const Grant& g, int fd, std::unique_ptr<GrantMapping>* out,
                    std::string* error, const CudaDriver* drv) {
  out->reset();
  bb_status st = validate_grant(g, error);
  if (st != BB_OK) return st;
  if (g.backend == GrantBackend::kHost) return map_host_grant(g, fd, out, error);
  if (!drv) {
    std::string why;
    drv = cuda_driver(&why);
    if (!drv) {
      *error = std::string("cannot map a ") + grant_backend_name(g.backend) +
               " grant without the CUDA driver: " + why;
      return BB_E_UNSUPPORTED;
    }
  }
  if (g.backend == GrantBackend::kCudaIpc) return map_cuda_ipc_grant(*drv, g, out, error);
  return map_cuda_vmm_grant(*drv, g, fd, out, error);
}

}  // namespace bb::core
