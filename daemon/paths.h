// Where the agent keeps its socket, its database and task logs.
#pragma once

#include <string>

namespace bb::daemon {

// The agent's socket: $BUBBLE_AGENT_SOCKET, else <hub runtime dir>/agent/bubbled.sock (the
// runtime dir being $BUBBLE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/bubble, else /tmp/bubble-<uid>).
// The socket lives in a subdirectory so it can never be taken for a hub socket.
std::string default_agent_socket(const std::string& runtime_dir);

// Durable state (database, logs): $BUBBLE_STATE_DIR, else $XDG_STATE_HOME/bubble, else
// $HOME/.local/state/bubble, else /var/tmp/bubble-<uid>. Not the runtime dir: that one is
// usually a tmpfs and is lost at reboot.
std::string default_state_dir();

// path made absolute against the current directory ("" and absolute paths as they are). The
// agent hands its directories to tasks that run in other directories (their --cwd), and finds
// its launch wrappers again by the exit-file path on their command line.
std::string absolute_path(const std::string& path);

// mkdir -p with the given mode for directories it creates. Returns "" or an error sentence.
std::string make_dirs(const std::string& path, unsigned mode);

// "" when the directory is this process's own (owned by its effective uid) and nobody else
// may write in it; else an error sentence. What the agent reads back from its state directory
// (queued tasks, their argv and environment) it runs, so nobody else may write there.
// risk: what whoever else controls the directory could do ("plant tasks for the agent to
// run"); fix: where to choose another ("--state-dir, BUBBLE_STATE_DIR").
std::string check_private_dir(const std::string& path, const std::string& risk,
                              const std::string& fix);

}  // namespace bb::daemon
