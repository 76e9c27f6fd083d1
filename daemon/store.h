// Durable records: every submission, every task's fate and every enforcement action, in an
// SQLite database in WAL mode. Every write is in the file when it returns, so an agent killed at
// any point loses nothing. A submission (and set_meta: the drain setting) is also synced to the
// disk before it returns, so it survives a power loss; the other writes are not (synchronous=NORMAL): they
// happen on the agent's loop, as often as enforcement acts, and a sync each would stall the
// loop for a disk's flush. A power loss can lose the last of them, which describe processes
// that died with the machine; the next sync (a submission, or SQLite's checkpoint) carries them.
#pragma once

#include "daemon/task.h"

#include <sqlite3.h>

#include <string>
#include <vector>

namespace bb::daemon {

class Store {
 public:
  Store() = default;
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Opens (creating if needed) the database. Returns "" or an error sentence. vfs: an SQLite
  // VFS name (tests count syncs through one); nullptr is the default.
  std::string open(const std::string& path, const char* vfs = nullptr);

  // Inserts a new task and sets row->id.
  bool insert_task(TaskRow* row);
  bool update_task(const TaskRow& row);
  // Every task, oldest first, into *out; false (last_error() says why) unless all were read.
  bool load_tasks(std::vector<TaskRow>* out);
  bool insert_action(const ActionRow& action);
  // The newest `limit` actions (0 = all), oldest first, never more than `most`: the table is kept
  // whole, and a reply must stay well inside one control frame (a row is at most a few hundred
  // bytes).
  static constexpr uint32_t kMostActionsLoaded = 10000;
  std::vector<ActionRow> load_actions(uint32_t limit, uint32_t most = kMostActionsLoaded);
  uint64_t count_actions();
  // Deletes the tasks `ids` and their actions, trims the actions to the newest `keep_actions`
  // (a task that keeps running can add actions without end; record() trims them as well),
  // and adds the number of tasks deleted to the count pruned_tasks() reports: all in one transaction,
  // so either all of it is on disk when this returns true, or none of it.
  static constexpr uint64_t kMostActionsKept = 100000;
  bool delete_tasks(const std::vector<int64_t>& ids, uint64_t keep_actions = kMostActionsKept);
  // Deletes all but the newest `keep` actions, of any task.
  bool trim_actions(uint64_t keep = kMostActionsKept);
  // Ended tasks deleted from these records over their whole life.
  uint64_t pruned_tasks();

  std::string get_meta(const std::string& key);
  bool set_meta(const std::string& key, const std::string& value);

  const std::string& last_error() const { return error_; }

 private:
  bool exec(const char* sql);
  bool add_missing_columns();
  sqlite3_stmt* prepare(const char* sql);
  bool fail(const char* what);
  // Runs f with synchronous=FULL: what it commits is on the disk when it returns. Inside a
  // transaction SQLite keeps the level it began with, so f just runs (its commit decides).
  template <typename F>
  bool synced(F&& f) {
    if (!sqlite3_get_autocommit(db_)) return f();
    if (!exec("PRAGMA synchronous=FULL;")) return false;
    const bool ok = f();
    // Back to NORMAL even after a failure; an error here only costs later writes a sync.
    const std::string err = error_;
    (void)exec("PRAGMA synchronous=NORMAL;");
    error_ = err;
    return ok;
  }

  sqlite3* db_ = nullptr;
  std::string error_;
};

}  // namespace bb::daemon
