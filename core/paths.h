// Names and places: which hub names are valid, and where a hub's socket and lock file live.
#pragma once

#include <bubble/bubble.h>

#include <cstdint>
#include <string>

namespace bb::core {

// 1..BB_NAME_MAX of [A-Za-z0-9_.-], not starting with '.' (so never "." or ".." or hidden).
bb_status check_job_id(const char* job_id);
// 1..BB_NAME_MAX printable ASCII characters.
bb_status check_task_name(const char* name);
bb_status check_rank(uint32_t rank);

// Resolves the runtime directory (option, else $BUBBLE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/bubble,
// else /tmp/bubble-<uid>) and, when create is true, creates it 0700. Refuses a directory that is
// not ours or that others can write, so nobody else can plant or replace a hub socket.
bb_status resolve_runtime_dir(const char* option, bool create, std::string* out);

// "<dir>/<job>.<rank>.sock" and ".lock"; fails if the socket path would not fit a sockaddr_un.
bb_status hub_paths(const std::string& dir, const char* job_id, uint32_t rank,
                    std::string* socket_path, std::string* lock_path);

}  // namespace bb::core
