#include "daemon/paths.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

namespace bb::daemon {

namespace {
std::string env(const char* name) {
  const char* v = getenv(name);
  return v && *v ? std::string(v) : std::string();
}
}  // namespace

std::string default_agent_socket(const std::string& runtime_dir) {
  std::string s = env("BUBBLE_AGENT_SOCKET");
  if (!s.empty()) return s;
  return runtime_dir + "/agent/bubbled.sock";
}

std::string absolute_path(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  char* cwd = getcwd(nullptr, 0);
  if (!cwd) return path;  // the directory is gone: the path resolves against nothing better
  std::string out = cwd;
  free(cwd);
  std::string rest = path;
  while (rest.rfind("./", 0) == 0) rest.erase(0, 2);
  return out == "/" ? "/" + rest : out + "/" + rest;
}

std::string default_state_dir() {
  std::string s = env("BUBBLE_STATE_DIR");
  if (!s.empty()) return s;
  s = env("XDG_STATE_HOME");
  if (!s.empty()) return s + "/bubble";
  s = env("HOME");
  if (!s.empty()) return s + "/.local/state/bubble";
  return "/var/tmp/bubble-" + std::to_string(getuid());
}

std::string make_dirs(const std::string& path, unsigned mode) {
  if (path.empty()) return "empty directory path";
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (mkdir(cur.c_str(), mode) != 0 && errno != EEXIST) {
      return "cannot create directory " + cur + ": " + strerror(errno);
    }
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return path + " exists but is not a directory: remove it or choose another path";
  }
  return "";
}

std::string check_private_dir(const std::string& path, const std::string& risk,
                              const std::string& fix) {
  // stat, not lstat: a symbolic link to a directory of our own is fine, and one to anybody
  // else's is refused for what it leads to.
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return "cannot inspect " + path + ": " + strerror(errno);
  if (st.st_uid != geteuid()) {
    return path + " belongs to uid " + std::to_string(st.st_uid) + ", not to this agent's uid " +
           std::to_string(geteuid()) + ": whoever owns it could " + risk + "; remove it, or "
           "choose a directory of your own (" + fix + ")";
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    char mode[8];
    snprintf(mode, sizeof mode, "%03o", unsigned(st.st_mode & 0777));
    return path + " is writable by others (mode " + mode + "): they could " + risk +
           "; chmod 700 it, or choose another directory (" + fix + ")";
  }
  return "";
}

}  // namespace bb::daemon
