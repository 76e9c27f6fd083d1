#include "daemon/store.h"

#include <time.h>

#include <cstdlib>

namespace bb::daemon {

int64_t wall_ms() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

namespace {

// argv and env are stored as NUL-separated blobs: any byte but NUL may appear in an argument.
std::string join0(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    out += s;
    out.push_back('\0');
  }
  return out;
}

std::vector<std::string> split0(const void* data, int len) {
  std::vector<std::string> out;
  const char* p = static_cast<const char*>(data);
  std::string cur;
  for (int i = 0; i < len; ++i) {
    if (p[i] == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(p[i]);
    }
  }
  return out;
}

std::string col_text(sqlite3_stmt* st, int i) {
  const unsigned char* t = sqlite3_column_text(st, i);
  return t ? std::string(reinterpret_cast<const char*>(t)) : std::string();
}

struct Stmt {
  sqlite3_stmt* st;
  ~Stmt() { sqlite3_finalize(st); }
};

const char kSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS tasks (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  name TEXT NOT NULL, argv BLOB NOT NULL, env BLOB NOT NULL, cwd TEXT NOT NULL,
  hub_spec TEXT NOT NULL, gpu INTEGER NOT NULL, priority INTEGER NOT NULL,
  mem_need INTEGER NOT NULL, mps_priority INTEGER NOT NULL, mps_mem_limit TEXT NOT NULL,
  state TEXT NOT NULL, origin TEXT NOT NULL, hub TEXT NOT NULL, pid INTEGER NOT NULL,
  pid_start INTEGER NOT NULL, exit_code INTEGER NOT NULL, signal INTEGER NOT NULL,
  violations INTEGER NOT NULL, attempts INTEGER NOT NULL, submitted_at INTEGER NOT NULL,
  started_at INTEGER NOT NULL, ended_at INTEGER NOT NULL, message TEXT NOT NULL,
  steps INTEGER NOT NULL, ns_in_bubbles INTEGER NOT NULL, ns_outside INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS actions (
  id INTEGER PRIMARY KEY AUTOINCREMENT, at_ms INTEGER NOT NULL, task INTEGER NOT NULL,
  pid INTEGER NOT NULL, hub TEXT NOT NULL, action TEXT NOT NULL, detail TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS actions_by_task ON actions (task);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
)sql";

constexpr char kTaskColumns[] =
    "name, argv, env, cwd, hub_spec, gpu, priority, mem_need, mps_priority, mps_mem_limit, "
    "state, origin, hub, pid, pid_start, exit_code, signal, violations, attempts, submitted_at, "
    "started_at, ended_at, message, steps, ns_in_bubbles, ns_outside";
// One SQL parameter ("?") per column of kTaskColumns, comma-separated.
std::string task_parameters() {
  std::string p = "?";
  for (const char* c = kTaskColumns; *c; ++c)
    if (*c == ',') p += ",?";
  return p;
}
constexpr int kTaskColumnCount = [] {
  int n = 1;
  for (const char* c = kTaskColumns; *c; ++c) n += *c == ',';
  return n;
}();

void bind_task(sqlite3_stmt* st, const TaskRow& r) {
  std::string argv = join0(r.spec.argv), env = join0(r.spec.env);
  int i = 1;
  sqlite3_bind_text(st, i++, r.spec.name.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_blob(st, i++, argv.data(), static_cast<int>(argv.size()), SQLITE_TRANSIENT);
  sqlite3_bind_blob(st, i++, env.data(), static_cast<int>(env.size()), SQLITE_TRANSIENT);
  sqlite3_bind_text(st, i++, r.spec.cwd.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, i++, r.spec.hub.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int(st, i++, r.spec.gpu);
  sqlite3_bind_int(st, i++, r.spec.priority);
  sqlite3_bind_int64(st, i++, static_cast<int64_t>(r.spec.mem_need));
  sqlite3_bind_int(st, i++, r.spec.mps_priority);
  sqlite3_bind_text(st, i++, r.spec.mps_mem_limit.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, i++, r.state.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, i++, r.origin.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st, i++, r.hub.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int(st, i++, r.pid);
  sqlite3_bind_int64(st, i++, static_cast<int64_t>(r.pid_start));
  sqlite3_bind_int(st, i++, r.exit_code);
  sqlite3_bind_int(st, i++, r.signal);
  sqlite3_bind_int(st, i++, static_cast<int>(r.violations));
  sqlite3_bind_int(st, i++, static_cast<int>(r.attempts));
  sqlite3_bind_int64(st, i++, r.submitted_at);
  sqlite3_bind_int64(st, i++, r.started_at);
  sqlite3_bind_int64(st, i++, r.ended_at);
  sqlite3_bind_text(st, i++, r.message.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(st, i++, static_cast<int64_t>(r.steps));
  sqlite3_bind_int64(st, i++, static_cast<int64_t>(r.ns_in_bubbles));
  sqlite3_bind_int64(st, i++, static_cast<int64_t>(r.ns_outside));
}

}  // namespace

Store::~Store() {
  if (db_) sqlite3_close(db_);
}

bool Store::fail(const char* what) {
  error_ = std::string(what) + ": " + (db_ ? sqlite3_errmsg(db_) : "no database");
  return false;
}

bool Store::exec(const char* sql) {
  char* msg = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &msg) != SQLITE_OK) {
    error_ = msg ? msg : "sqlite error";
    sqlite3_free(msg);
    return false;
  }
  return true;
}

sqlite3_stmt* Store::prepare(const char* sql) {
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db_, sql, -1, &st, nullptr) != SQLITE_OK) {
    fail("prepare");
    return nullptr;
  }
  return st;
}

// A database written by an agent from before a column existed gets it, with its default.
bool Store::add_missing_columns() {
  int have = 0;
  {
    Stmt s{prepare("SELECT COUNT(*) FROM pragma_table_info('tasks') WHERE name = 'ns_outside'")};
    if (!s.st || sqlite3_step(s.st) != SQLITE_ROW) return fail("read the tasks table's columns");
    have = sqlite3_column_int(s.st, 0);
  }  // finalized before the table changes
  return have != 0 || exec("ALTER TABLE tasks ADD COLUMN ns_outside INTEGER NOT NULL DEFAULT 0;");
}

std::string Store::open(const std::string& path, const char* vfs) {
  if (sqlite3_open_v2(path.c_str(), &db_,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                      vfs) != SQLITE_OK) {
    std::string e = "cannot open the database " + path + ": " +
                    (db_ ? sqlite3_errmsg(db_) : "out of memory") +
                    " (check the state directory, --state-dir)";
    return e;
  }
  // Only another process writing (an operator's sqlite3) makes a write wait; the agent's loop
  // waits with it, so not for long: a write refused is made again (Agent::save).
  sqlite3_busy_timeout(db_, 250);
  // WAL keeps readers and the writer apart. synchronous=NORMAL: a commit is in the file (an
  // agent that dies loses nothing) without a sync; submissions sync (synced(), store.h).
  if (!exec("PRAGMA journal_mode=WAL;") || !exec("PRAGMA synchronous=NORMAL;") ||
      !exec(kSchema) || !add_missing_columns()) {
    return "cannot initialize the database " + path + ": " + error_ +
           " (another bubbled may hold it, or it is not a bubbled database)";
  }
  return "";
}

bool Store::insert_task(TaskRow* row) {
  std::string sql = std::string("INSERT INTO tasks (") + kTaskColumns + ") VALUES (" +
                    task_parameters() + ")";
  Stmt s{prepare(sql.c_str())};
  if (!s.st) return false;
  bind_task(s.st, *row);
  auto insert = [&] {
    if (sqlite3_step(s.st) != SQLITE_DONE) return fail("insert task");
    row->id = sqlite3_last_insert_rowid(db_);
    return true;
  };
  // A submission's id is returned to its client: it must survive what the client survives. A
  // task that attached by itself is seen again if lost (it attaches as often as it likes; a
  // flush each time would stall the loop).
  return row->origin == "attached" ? insert() : synced(insert);
}

bool Store::update_task(const TaskRow& row) {
  std::string sql = "UPDATE tasks SET (" + std::string(kTaskColumns) + ") = (" +
                    task_parameters() + ") WHERE id = ?";
  Stmt s{prepare(sql.c_str())};
  if (!s.st) return false;
  bind_task(s.st, row);
  sqlite3_bind_int64(s.st, kTaskColumnCount + 1, row.id);
  if (sqlite3_step(s.st) != SQLITE_DONE) return fail("update task");
  return true;
}

bool Store::load_tasks(std::vector<TaskRow>* out) {
  out->clear();
  std::string sql = "SELECT id, " + std::string(kTaskColumns) + " FROM tasks ORDER BY id";
  Stmt s{prepare(sql.c_str())};
  if (!s.st) return false;
  int rc;
  while ((rc = sqlite3_step(s.st)) == SQLITE_ROW) {
    TaskRow r;
    int i = 0;
    r.id = sqlite3_column_int64(s.st, i++);
    r.spec.name = col_text(s.st, i++);
    r.spec.argv = split0(sqlite3_column_blob(s.st, i), sqlite3_column_bytes(s.st, i));
    ++i;
    r.spec.env = split0(sqlite3_column_blob(s.st, i), sqlite3_column_bytes(s.st, i));
    ++i;
    r.spec.cwd = col_text(s.st, i++);
    r.spec.hub = col_text(s.st, i++);
    r.spec.gpu = sqlite3_column_int(s.st, i++);
    r.spec.priority = sqlite3_column_int(s.st, i++);
    r.spec.mem_need = static_cast<uint64_t>(sqlite3_column_int64(s.st, i++));
    r.spec.mps_priority = sqlite3_column_int(s.st, i++);
    r.spec.mps_mem_limit = col_text(s.st, i++);
    r.state = col_text(s.st, i++);
    r.origin = col_text(s.st, i++);
    r.hub = col_text(s.st, i++);
    r.pid = sqlite3_column_int(s.st, i++);
    r.pid_start = static_cast<uint64_t>(sqlite3_column_int64(s.st, i++));
    r.exit_code = sqlite3_column_int(s.st, i++);
    r.signal = sqlite3_column_int(s.st, i++);
    r.violations = static_cast<uint32_t>(sqlite3_column_int(s.st, i++));
    r.attempts = static_cast<uint32_t>(sqlite3_column_int(s.st, i++));
    r.submitted_at = sqlite3_column_int64(s.st, i++);
    r.started_at = sqlite3_column_int64(s.st, i++);
    r.ended_at = sqlite3_column_int64(s.st, i++);
    r.message = col_text(s.st, i++);
    r.steps = static_cast<uint64_t>(sqlite3_column_int64(s.st, i++));
    r.ns_in_bubbles = static_cast<uint64_t>(sqlite3_column_int64(s.st, i++));
    r.ns_outside = static_cast<uint64_t>(sqlite3_column_int64(s.st, i++));
    out->push_back(std::move(r));
  }
  return rc == SQLITE_DONE || fail("read the tasks");
}

bool Store::insert_action(const ActionRow& a) {
  Stmt s{prepare(
      "INSERT INTO actions (at_ms, task, pid, hub, action, detail) VALUES (?,?,?,?,?,?)")};
  if (!s.st) return false;
  sqlite3_bind_int64(s.st, 1, a.at_ms);
  sqlite3_bind_int64(s.st, 2, a.task);
  sqlite3_bind_int(s.st, 3, a.pid);
  sqlite3_bind_text(s.st, 4, a.hub.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(s.st, 5, a.action.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(s.st, 6, a.detail.c_str(), -1, SQLITE_TRANSIENT);
  if (sqlite3_step(s.st) != SQLITE_DONE) return fail("insert action");
  return true;
}

std::vector<ActionRow> Store::load_actions(uint32_t limit, uint32_t most) {
  if (limit == 0 || limit > most) limit = most;
  std::vector<ActionRow> out;
  Stmt s{prepare(
      "SELECT at_ms, task, pid, hub, action, detail FROM "
      "(SELECT * FROM actions ORDER BY id DESC LIMIT ?) ORDER BY id")};
  if (!s.st) return out;
  sqlite3_bind_int64(s.st, 1, static_cast<int64_t>(limit));
  while (sqlite3_step(s.st) == SQLITE_ROW) {
    ActionRow a;
    a.at_ms = sqlite3_column_int64(s.st, 0);
    a.task = sqlite3_column_int64(s.st, 1);
    a.pid = sqlite3_column_int(s.st, 2);
    a.hub = col_text(s.st, 3);
    a.action = col_text(s.st, 4);
    a.detail = col_text(s.st, 5);
    out.push_back(std::move(a));
  }
  return out;
}

uint64_t Store::count_actions() {
  Stmt s{prepare("SELECT COUNT(*) FROM actions")};
  if (!s.st || sqlite3_step(s.st) != SQLITE_ROW) return 0;
  return static_cast<uint64_t>(sqlite3_column_int64(s.st, 0));
}

bool Store::delete_tasks(const std::vector<int64_t>& ids, uint64_t keep_actions) {
  if (!exec("BEGIN IMMEDIATE;")) return false;
  auto rollback = [this](const char* what) {
    const bool r = fail(what);
    const std::string e = error_;
    exec("ROLLBACK;");
    error_ = e;
    return r;
  };
  {
    Stmt task{prepare("DELETE FROM tasks WHERE id = ?")};
    Stmt acts{prepare("DELETE FROM actions WHERE task = ?")};
    if (!task.st || !acts.st) return rollback("prepare delete");
    int64_t deleted = 0;
    for (int64_t id : ids) {
      for (sqlite3_stmt* st : {task.st, acts.st}) {
        sqlite3_reset(st);
        sqlite3_bind_int64(st, 1, id);
        if (sqlite3_step(st) != SQLITE_DONE) return rollback("delete task");
        if (st == task.st) deleted += sqlite3_changes(db_);
      }
    }
    if (!trim_actions(keep_actions)) return rollback("trim actions");
    Stmt count{prepare("INSERT INTO meta (key, value) VALUES ('pruned_tasks', ?) "
                       "ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + ?")};
    if (!count.st) return rollback("prepare count pruned");
    sqlite3_bind_int64(count.st, 1, deleted);
    sqlite3_bind_int64(count.st, 2, deleted);
    if (sqlite3_step(count.st) != SQLITE_DONE) return rollback("count pruned");
  }
  return exec("COMMIT;") || rollback("commit");
}

bool Store::trim_actions(uint64_t keep) {
  // The newest `keep` stay (the OFFSET row is the newest of those that go).
  Stmt trim{prepare("DELETE FROM actions WHERE id <= "
                    "(SELECT id FROM actions ORDER BY id DESC LIMIT 1 OFFSET ?)")};
  if (!trim.st) return false;
  sqlite3_bind_int64(trim.st, 1, static_cast<int64_t>(keep));
  return sqlite3_step(trim.st) == SQLITE_DONE || fail("trim actions");
}

uint64_t Store::pruned_tasks() {
  const std::string v = get_meta("pruned_tasks");
  return v.empty() ? 0 : std::strtoull(v.c_str(), nullptr, 10);
}

std::string Store::get_meta(const std::string& key) {
  Stmt s{prepare("SELECT value FROM meta WHERE key = ?")};
  if (!s.st) return "";
  sqlite3_bind_text(s.st, 1, key.c_str(), -1, SQLITE_TRANSIENT);
  if (sqlite3_step(s.st) != SQLITE_ROW) return "";
  return col_text(s.st, 0);
}

bool Store::set_meta(const std::string& key, const std::string& value) {
  Stmt s{prepare("INSERT INTO meta (key, value) VALUES (?, ?) "
                 "ON CONFLICT(key) DO UPDATE SET value = excluded.value")};
  if (!s.st) return false;
  sqlite3_bind_text(s.st, 1, key.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(s.st, 2, value.c_str(), -1, SQLITE_TRANSIENT);
  return synced([&] { return sqlite3_step(s.st) == SQLITE_DONE || fail("set meta"); });
}

}  // namespace bb::daemon
