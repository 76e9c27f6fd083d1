#include "core/paths.h"

#include <dirent.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/observer.h"

namespace bb::core {

bb_status check_job_id(const char* job_id) {
  if (!job_id) return fail(BB_E_INVALID, "job id is NULL: pass the training job's id, e.g. \"run42\"");
  const size_t n = std::strlen(job_id);
  if (n == 0 || n > BB_NAME_MAX)
    return fail(BB_E_INVALID, "job id \"%.60s\" must be 1 to %u characters long", job_id,
                BB_NAME_MAX);
  if (job_id[0] == '.')
    return fail(BB_E_INVALID, "job id \"%s\" must not start with '.'", job_id);
  for (size_t i = 0; i < n; ++i) {
    const char c = job_id[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok)
      return fail(BB_E_INVALID,
                  "job id \"%s\" has character %d at position %zu: use only letters, digits, "
                  "'_', '-' and '.'",
                  job_id, int(static_cast<unsigned char>(c)), i);
  }
  return BB_OK;
}

bb_status check_task_name(const char* name) {
  if (!name) return fail(BB_E_INVALID, "task name is NULL: pass a short name such as \"pagerank\"");
  const size_t n = std::strlen(name);
  if (n == 0 || n > BB_NAME_MAX)
    return fail(BB_E_INVALID, "task name \"%.60s\" must be 1 to %u characters long", name,
                BB_NAME_MAX);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c > 0x7e)
      return fail(BB_E_INVALID,
                  "task name has a non-printable character at position %zu: use printable ASCII",
                  i);
  }
  return BB_OK;
}

bb_status check_rank(uint32_t rank) {
  if (rank > 65535) return fail(BB_E_INVALID, "rank %u is out of range 0..65535", rank);
  return BB_OK;
}

std::string default_runtime_dir() {
  if (const char* d = std::getenv("BUBBLE_RUNTIME_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x && *x) return std::string(x) + "/bubble";
  return "/tmp/bubble-" + std::to_string(geteuid());
}

bb_status resolve_runtime_dir(const char* option, bool create, std::string* out) {
  std::string dir = option && *option ? option : default_runtime_dir();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (create && mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return fail(BB_E_SYSTEM, "cannot create runtime directory %s: %s (set BUBBLE_RUNTIME_DIR to a "
                "writable directory)", dir.c_str(), std::strerror(errno));
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT)
      return fail(BB_E_NOT_FOUND, "runtime directory %s does not exist: no trainer has opened a "
                  "hub there (is BUBBLE_RUNTIME_DIR the same for the trainer and the task?)",
                  dir.c_str());
    return fail(BB_E_SYSTEM, "cannot inspect runtime directory %s: %s", dir.c_str(),
                std::strerror(errno));
  }
  if (!S_ISDIR(st.st_mode))
    return fail(BB_E_INVALID, "runtime directory %s is not a directory", dir.c_str());
  if (st.st_uid != geteuid())
    return fail(BB_E_PERMISSION, "runtime directory %s belongs to uid %u, not to us (uid %u): "
                "use a directory of your own via BUBBLE_RUNTIME_DIR", dir.c_str(),
                unsigned(st.st_uid), unsigned(geteuid()));
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    return fail(BB_E_PERMISSION, "runtime directory %s is writable by others (mode %03o): "
                "chmod 700 it or choose another BUBBLE_RUNTIME_DIR", dir.c_str(),
                unsigned(st.st_mode & 0777));
  *out = dir;
  return BB_OK;
}

bb_status hub_paths(const std::string& dir, const char* job_id, uint32_t rank,
                    std::string* socket_path, std::string* lock_path) {
  const std::string base = dir + "/" + job_id + "." + std::to_string(rank);
  if (base.size() + 5 >= sizeof(sockaddr_un{}.sun_path))
    return fail(BB_E_INVALID, "hub socket path %s.sock is longer than a Unix socket allows (%zu "
                "bytes): use a shorter BUBBLE_RUNTIME_DIR or job id", base.c_str(),
                sizeof(sockaddr_un{}.sun_path) - 1);
  *socket_path = base + ".sock";
  if (lock_path) *lock_path = base + ".lock";
  return BB_OK;
}

std::string hub_socket_path(const std::string& runtime_dir, const std::string& job,
                            uint32_t rank) {
  const std::string dir = runtime_dir.empty() ? default_runtime_dir() : runtime_dir;
  return dir + "/" + job + "." + std::to_string(rank) + ".sock";
}

std::vector<HubName> list_hubs(const std::string& runtime_dir) {
  std::vector<HubName> hubs;
  const std::string dir = runtime_dir.empty() ? default_runtime_dir() : runtime_dir;
  DIR* d = opendir(dir.c_str());
  if (!d) return hubs;
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n.size() < 8 || n.compare(n.size() - 5, 5, ".sock") != 0) continue;
    n.resize(n.size() - 5);
    const size_t dot = n.rfind('.');
    if (dot == std::string::npos || dot == 0 || dot + 1 == n.size()) continue;
    const std::string r = n.substr(dot + 1);
    if (r.size() > 5 || r.find_first_not_of("0123456789") != std::string::npos) continue;
    HubName h{n.substr(0, dot), uint32_t(std::stoul(r))};
    if (check_job_id(h.job.c_str()) != BB_OK || h.rank > 65535) continue;
    hubs.push_back(std::move(h));
  }
  closedir(d);
  std::sort(hubs.begin(), hubs.end(), [](const HubName& a, const HubName& b) {
    return a.job != b.job ? a.job < b.job : a.rank < b.rank;
  });
  clear_error();
  return hubs;
}

}  // namespace bb::core
