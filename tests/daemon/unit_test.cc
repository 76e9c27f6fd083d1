// The agent's pure pieces: pause escalation, placement, frame cutting, durable records.
#include <doctest/doctest.h>

#include "agent.capnp.h"
#include "daemon/enforcer.h"
#include "daemon/frame.h"
#include "daemon/list_fit.h"
#include "daemon/logs.h"
#include "daemon/placement.h"
#include "daemon/proc.h"
#include "daemon/store.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <capnp/message.h>
#include <sqlite3.h>

using namespace bb::daemon;

namespace {
constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kMiB = 1ull << 20;
}  // namespace

TEST_CASE("enforcer_acked_pause_is_no_violation") {
  EnforceConfig cfg{5 * kMs, 3};
  EnforceState st;
  CHECK(enforce_step(cfg, &st, {false, 1}, {100 * kMs, 0}, 101 * kMs) == Verdict::kNone);
  CHECK(enforce_step(cfg, &st, {false, 1}, {100 * kMs, 102 * kMs}, 110 * kMs) == Verdict::kNone);
  CHECK(st.violations == 0);
}

TEST_CASE("enforcer_stops_continues_then_kills_a_task_that_never_acks") {
  EnforceConfig cfg{5 * kMs, 3};
  EnforceState st;
  PauseState never{100 * kMs, 0};
  CHECK(enforce_step(cfg, &st, {false, 1}, never, 104 * kMs) == Verdict::kNone);
  CHECK(enforce_step(cfg, &st, {false, 1}, never, 106 * kMs) == Verdict::kStop);
  CHECK(st.violations == 1);
  // Stays stopped until the hub's next bubble.
  CHECK(enforce_step(cfg, &st, {false, 1}, never, 150 * kMs) == Verdict::kNone);
  CHECK(enforce_step(cfg, &st, {true, 2}, never, 200 * kMs) == Verdict::kContinue);
  // Inside the bubble it was continued in: no deadline yet.
  CHECK(enforce_step(cfg, &st, {true, 2}, never, 260 * kMs) == Verdict::kNone);
  // The bubble ended and the old pause is still not acked: due after the grace period.
  CHECK(enforce_step(cfg, &st, {false, 2}, never, 300 * kMs) == Verdict::kNone);
  CHECK(enforce_step(cfg, &st, {false, 2}, never, 306 * kMs) == Verdict::kStop);
  CHECK(st.violations == 2);
  CHECK(enforce_step(cfg, &st, {true, 3}, never, 400 * kMs) == Verdict::kContinue);
  // A new pause request (it was started again) counts from its own time.
  PauseState again{450 * kMs, 0};
  CHECK(enforce_step(cfg, &st, {false, 3}, again, 451 * kMs) == Verdict::kNone);
  CHECK(enforce_step(cfg, &st, {false, 3}, again, 456 * kMs) == Verdict::kKill);
  CHECK(st.violations == 3);
}

TEST_CASE("enforcer_ignores_an_old_request_once_a_later_start_was_acked") {
  EnforceConfig cfg{5 * kMs, 3};
  EnforceState st;
  PauseState yielded{100 * kMs, 0, false};
  CHECK(enforce_step(cfg, &st, {false, 4}, yielded, 500 * kMs) == Verdict::kNone);
  CHECK(st.violations == 0);
}

TEST_CASE("enforcer_kill_after_one_kills_at_first_violation") {
  EnforceConfig cfg{1 * kMs, 1};
  EnforceState st;
  CHECK(enforce_step(cfg, &st, {false, 1}, {10 * kMs, 0}, 12 * kMs) == Verdict::kKill);
}

TEST_CASE("placement_by_memory_fit") {
  std::vector<HubCandidate> hubs(3);
  const uint64_t free[] = {256 * kMiB, 1024 * kMiB, 4096 * kMiB};
  for (int i = 0; i < 3; ++i) {
    hubs[i].name = "j:" + std::to_string(i);
    hubs[i].alive = hubs[i].had_bubble = true;
    hubs[i].free_mem = free[i];
    hubs[i].free_slots = 8;
  }
  TaskSpec big;
  big.mem_need = 2048 * kMiB;
  CHECK(place_task(big, hubs).hub == 2);
  hubs[2].granted = 2048 * kMiB;
  hubs[2].tasks = 1;
  TaskSpec huge;
  huge.mem_need = 3072 * kMiB;
  PlaceResult r = place_task(huge, hubs);
  CHECK(r.hub == -1);
  CHECK(r.reason.find("MiB") != std::string::npos);
  TaskSpec small;
  small.mem_need = 512 * kMiB;
  CHECK(place_task(small, hubs).hub == 1);  // fewest tasks among those it fits
  TaskSpec pinned;
  pinned.hub = "j:0";
  CHECK(place_task(pinned, hubs).hub == 0);
  pinned.hub = "other:0";
  CHECK(place_task(pinned, hubs).hub == -1);
}

TEST_CASE("placement_skips_draining_full_and_unreported_hubs") {
  std::vector<HubCandidate> hubs(3);
  for (int i = 0; i < 3; ++i) {
    hubs[i].name = "j:" + std::to_string(i);
    hubs[i].alive = true;
    hubs[i].had_bubble = true;
    hubs[i].free_slots = 4;
    hubs[i].free_mem = 8192 * kMiB;
  }
  hubs[0].draining = true;
  hubs[1].free_slots = 0;
  hubs[2].had_bubble = false;
  hubs[2].free_mem = UINT64_MAX;
  TaskSpec t;
  t.mem_need = kMiB;
  CHECK(place_task(t, hubs).hub == -1);
  t.mem_need = 0;
  CHECK(place_task(t, hubs).hub == 2);
}

TEST_CASE("hub_names_parse") {
  std::string job;
  uint32_t rank = 0;
  CHECK(parse_hub_name("train.v2:7", &job, &rank));
  CHECK(job == "train.v2");
  CHECK(rank == 7);
  CHECK_FALSE(parse_hub_name("train", &job, &rank));
  CHECK_FALSE(parse_hub_name(":1", &job, &rank));
  CHECK_FALSE(parse_hub_name("a:70000", &job, &rank));
  CHECK_FALSE(parse_hub_name("a:1x", &job, &rank));
  // The job is held to the library's job id rules, and the reason is the library's sentence.
  std::string why;
  CHECK_FALSE(parse_hub_name("../../etc:0", &job, &rank, &why));
  CHECK(why.find("must not start with '.'") != std::string::npos);
  CHECK_FALSE(parse_hub_name("a/b:0", &job, &rank, &why));
  CHECK(why.find("use only letters, digits") != std::string::npos);
  CHECK_FALSE(parse_hub_name(std::string(48, 'j') + ":0", &job, &rank, &why));
  CHECK(why.find("characters long") != std::string::npos);
  CHECK_FALSE(parse_hub_name("a:70000", &job, &rank, &why));
  CHECK(why.find("out of range 0..65535") != std::string::npos);
}

TEST_CASE("a_frame_over_the_maximum_is_never_encoded") {
  capnp::MallocMessageBuilder msg;
  auto resp = msg.initRoot<bb::proto::Response>();
  resp.setId(7);
  resp.setOk(std::string(2 << 20, 'x'));  // a 2 MiB text
  std::vector<uint8_t> bytes;
  std::string error;
  CHECK_FALSE(encode_frame(msg, 1 << 20, &bytes, &error));
  CHECK(bytes.empty());
  CHECK(error.find("exceeds the maximum frame of 1048576 bytes") != std::string::npos);
  // Under a larger maximum the same message is one frame that reads back whole.
  REQUIRE(encode_frame(msg, 4 << 20, &bytes, &error));
  FrameReader fr(4 << 20);
  fr.feed(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  std::unique_ptr<capnp::MessageReader> r;
  REQUIRE(fr.next(&r, &error) == FrameReader::Result::kFrame);
  CHECK(r->getRoot<bb::proto::Response>().getOk().size() == size_t(2 << 20));
}

TEST_CASE("frames_roundtrip_split_anywhere") {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<bb::proto::Request>();
  req.setId(42);
  req.initHello().setProtocolVersion(bb::proto::PROTOCOL_VERSION);
  std::vector<uint8_t> bytes;
  std::string error;
  REQUIRE(encode_frame(msg, 1 << 20, &bytes, &error));
  bytes.insert(bytes.end(), bytes.begin(), bytes.end());  // two frames back to back
  FrameReader fr(1 << 20);
  int frames = 0;
  for (uint8_t b : bytes) {
    fr.feed(reinterpret_cast<const char*>(&b), 1);
    std::unique_ptr<capnp::MessageReader> r;
    std::string err;
    auto res = fr.next(&r, &err);
    REQUIRE(res != FrameReader::Result::kError);
    if (res == FrameReader::Result::kFrame) {
      CHECK(r->getRoot<bb::proto::Request>().getId() == 42);
      ++frames;
    }
  }
  CHECK(frames == 2);
  CHECK(fr.pending() == 0);
}

TEST_CASE("a_large_frame_arriving_in_pieces_takes_its_own_size_not_twice_it") {
  // The agent's memory bound counts each reader's buffer capacity: a frame grown by doubling
  // as its pieces came could count (and take) up to twice its size.
  capnp::MallocMessageBuilder msg;
  auto hello = msg.initRoot<bb::proto::Request>().initHello();
  hello.setProtocolVersion(bb::proto::PROTOCOL_VERSION);
  hello.setClient(std::string(4 << 20, 'x'));
  std::vector<uint8_t> bytes;
  std::string error;
  REQUIRE(encode_frame(msg, 16 << 20, &bytes, &error));
  FrameReader fr(16 << 20);
  std::unique_ptr<capnp::MessageReader> r;
  size_t fed = 0;
  while (bytes.size() - fed > 100000) {  // pieces of an odd size, as reads may come
    fr.feed(reinterpret_cast<const char*>(bytes.data()) + fed, 100000);
    fed += 100000;
    REQUIRE(fr.next(&r, &error) == FrameReader::Result::kNeedMore);
    CHECK(fr.held_bytes() <= std::max<size_t>(bytes.size(), 2 * fed));
  }
  CHECK(fr.held_bytes() <= bytes.size() + 64 * 1024);
  fr.feed(reinterpret_cast<const char*>(bytes.data()) + fed, bytes.size() - fed);
  REQUIRE(fr.next(&r, &error) == FrameReader::Result::kFrame);
}

TEST_CASE("a_reader_lets_go_of_a_large_frame_once_it_is_done_with") {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<bb::proto::Request>();
  req.setId(7);
  auto hello = req.initHello();
  hello.setProtocolVersion(bb::proto::PROTOCOL_VERSION);
  hello.setClient(std::string(4 << 20, 'x'));  // a client name of 4 MiB
  std::vector<uint8_t> bytes;
  std::string error;
  REQUIRE(encode_frame(msg, 16 << 20, &bytes, &error));
  FrameReader fr(16 << 20);
  fr.feed(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  std::unique_ptr<capnp::MessageReader> r;
  REQUIRE(fr.next(&r, &error) == FrameReader::Result::kFrame);
  CHECK(r->getRoot<bb::proto::Request>().getId() == 7);
  r.reset();
  CHECK(fr.held_bytes() >= (4u << 20));
  // Idle after it: the next look for a frame gives the memory back.
  REQUIRE(fr.next(&r, &error) == FrameReader::Result::kNeedMore);
  CHECK(fr.held_bytes() <= 64 * 1024);
  // Also when the next frame's first bytes came with it.
  std::vector<uint8_t> two = bytes;
  two.insert(two.end(), bytes.begin(), bytes.begin() + 10);
  fr.feed(reinterpret_cast<const char*>(two.data()), two.size());
  REQUIRE(fr.next(&r, &error) == FrameReader::Result::kFrame);
  r.reset();
  REQUIRE(fr.next(&r, &error) == FrameReader::Result::kNeedMore);
  CHECK(fr.pending() == 10);
  CHECK(fr.held_bytes() <= 64 * 1024);
  // And the rest of that frame completes it.
  fr.feed(reinterpret_cast<const char*>(bytes.data()) + 10, bytes.size() - 10);
  REQUIRE(fr.next(&r, &error) == FrameReader::Result::kFrame);
  CHECK(r->getRoot<bb::proto::Request>().getId() == 7);
}

TEST_CASE("frames_reject_bad_lengths_and_garbage") {
  std::unique_ptr<capnp::MessageReader> r;
  std::string err;
  {
    FrameReader fr(1024);
    const char len[4] = {0x00, 0x10, 0x00, 0x00};  // 4096 > 1024
    fr.feed(len, 4);
    CHECK(fr.next(&r, &err) == FrameReader::Result::kError);
    CHECK(err.find("exceeds the maximum") != std::string::npos);
  }
  {
    FrameReader fr(1024);
    const char len[4] = {0x07, 0, 0, 0};
    fr.feed(len, 4);
    CHECK(fr.next(&r, &err) == FrameReader::Result::kError);
  }
  {
    FrameReader fr(1024);
    char frame[4 + 16] = {16, 0, 0, 0};
    for (int i = 4; i < 20; ++i) frame[i] = static_cast<char>(0xff);  // segment count 2^32
    fr.feed(frame, sizeof frame);
    CHECK(fr.next(&r, &err) == FrameReader::Result::kError);
    CHECK(err.find("does not") != std::string::npos);
  }
  {
    FrameReader fr(1024);
    const char part[6] = {64, 0, 0, 0, 1, 2};
    fr.feed(part, 6);
    CHECK(fr.next(&r, &err) == FrameReader::Result::kNeedMore);
    CHECK(fr.pending() == 6);
  }
}

TEST_CASE("store_keeps_tasks_and_actions_across_reopen") {
  char dir[] = "/tmp/bb-store-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  std::string path = std::string(dir) + "/db";
  int64_t id = 0;
  {
    Store s;
    REQUIRE(s.open(path).empty());
    TaskRow row;
    row.spec.name = "t";
    row.spec.argv = {"/bin/echo", "a b", ""};
    row.spec.env = {"A=1"};
    row.spec.mem_need = 5 * kMiB;
    REQUIRE(s.insert_task(&row));
    id = row.id;
    row.state = "finished";
    row.exit_code = 3;
    REQUIRE(s.update_task(row));
    ActionRow a;
    a.task = id;
    a.action = "stop";
    REQUIRE(s.insert_action(a));
  }
  {
    Store s;
    REQUIRE(s.open(path).empty());
    std::vector<TaskRow> rows;
    REQUIRE(s.load_tasks(&rows));
    REQUIRE(rows.size() == 1);
    CHECK(rows[0].id == id);
    CHECK(rows[0].spec.argv == std::vector<std::string>{"/bin/echo", "a b", ""});
    CHECK(rows[0].spec.env == std::vector<std::string>{"A=1"});
    CHECK(rows[0].state == "finished");
    CHECK(rows[0].exit_code == 3);
    CHECK(rows[0].spec.mem_need == 5 * kMiB);
    CHECK(s.load_actions(0).size() == 1);
    CHECK(s.count_actions() == 1);
    // "All" and any larger count stop at the bound, keeping the newest.
    for (const char* what : {"continue", "kill"}) {
      ActionRow more;
      more.task = id;
      more.action = what;
      REQUIRE(s.insert_action(more));
    }
    auto newest = s.load_actions(0, 2);
    REQUIRE(newest.size() == 2);
    CHECK(newest[0].action == "continue");
    CHECK(newest[1].action == "kill");
    CHECK(s.load_actions(5, 2).size() == 2);
    CHECK(s.load_actions(1, 2).size() == 1);
    CHECK(s.load_actions(0).size() == 3);
  }
  REQUIRE(system((std::string("rm -rf ") + dir).c_str()) == 0);
}

// A database from an agent before ns_outside existed: opening it adds the column (0 for the old
// rows), and a task's figure round-trips from then on.
// Records the agent cannot read whole are an error, never a shorter list: an agent that went on
// with part of them would launch none of the rest and delete their logs as orphans.
TEST_CASE("store_says_when_it_cannot_read_every_task") {
  char dir[] = "/tmp/bb-store-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  std::string path = std::string(dir) + "/db";
  {
    Store s;
    REQUIRE(s.open(path).empty());
    for (int k = 0; k < 64; ++k) {  // rows over many pages, the last ones at the file's end
      TaskRow row;
      row.spec.name = "t" + std::to_string(k);
      row.spec.argv = {"/bin/echo", std::string(2000, char('a' + k % 26))};
      REQUIRE(s.insert_task(&row));
    }
    std::vector<TaskRow> rows;
    REQUIRE(s.load_tasks(&rows));
    CHECK(rows.size() == 64);
  }
  {
    // Overwrite the last page of the file (the newest rows) with garbage.
    FILE* f = fopen(path.c_str(), "r+b");
    REQUIRE(f != nullptr);
    REQUIRE(fseek(f, 0, SEEK_END) == 0);
    const long size = ftell(f);
    REQUIRE(size > 8192);
    REQUIRE(fseek(f, size - 4096, SEEK_SET) == 0);
    std::string junk(4096, '\xff');
    REQUIRE(fwrite(junk.data(), 1, junk.size(), f) == junk.size());
    fclose(f);
  }
  {
    Store s;
    REQUIRE(s.open(path).empty());  // its first pages (the schema) are whole
    std::vector<TaskRow> rows;
    CHECK_FALSE(s.load_tasks(&rows));
    CHECK(s.last_error().find("read the tasks") != std::string::npos);
  }
  REQUIRE(system((std::string("rm -rf ") + dir).c_str()) == 0);
}

TEST_CASE("store_adds_a_column_an_older_database_lacks") {
  char dir[] = "/tmp/bb-store-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/db";
  {
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
    const char* old_schema =
        "CREATE TABLE tasks (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, "
        "argv BLOB NOT NULL, env BLOB NOT NULL, cwd TEXT NOT NULL, hub_spec TEXT NOT NULL, "
        "gpu INTEGER NOT NULL, priority INTEGER NOT NULL, mem_need INTEGER NOT NULL, "
        "mps_priority INTEGER NOT NULL, mps_mem_limit TEXT NOT NULL, state TEXT NOT NULL, "
        "origin TEXT NOT NULL, hub TEXT NOT NULL, pid INTEGER NOT NULL, pid_start INTEGER NOT "
        "NULL, exit_code INTEGER NOT NULL, signal INTEGER NOT NULL, violations INTEGER NOT NULL, "
        "attempts INTEGER NOT NULL, submitted_at INTEGER NOT NULL, started_at INTEGER NOT NULL, "
        "ended_at INTEGER NOT NULL, message TEXT NOT NULL, steps INTEGER NOT NULL, "
        "ns_in_bubbles INTEGER NOT NULL);"
        "INSERT INTO tasks VALUES (NULL, 'old', X'', X'', '/', '', 0, 0, 0, 0, '', 'finished', "
        "'submitted', 'j:0', 0, 0, 0, 0, 0, 1, 0, 0, 0, '', 7, 1234);";
    CHECK(sqlite3_exec(db, old_schema, nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
  }
  {
    Store s;
    REQUIRE(s.open(path).empty());
    std::vector<TaskRow> rows;
    REQUIRE(s.load_tasks(&rows));
    REQUIRE(rows.size() == 1);
    CHECK(rows[0].spec.name == "old");
    CHECK(rows[0].steps == 7);
    CHECK(rows[0].ns_in_bubbles == 1234);
    CHECK(rows[0].ns_outside == 0);
    TaskRow row;
    row.spec.name = "new";
    row.ns_outside = 99;
    REQUIRE(s.insert_task(&row));
    row.ns_outside = 100;
    REQUIRE(s.update_task(row));
  }
  {
    Store s;  // opened again: the column is there, nothing is added twice
    REQUIRE(s.open(path).empty());
    std::vector<TaskRow> rows;
    REQUIRE(s.load_tasks(&rows));
    REQUIRE(rows.size() == 2);
    CHECK(rows[1].spec.name == "new");
    CHECK(rows[1].ns_outside == 100);
  }
  REQUIRE(system((std::string("rm -rf ") + dir).c_str()) == 0);
}

TEST_CASE("store_deletes_tasks_with_their_actions_trims_actions_and_counts_what_went") {
  char dir[] = "/tmp/bb-store-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  std::string path = std::string(dir) + "/db";
  std::vector<int64_t> ids;
  {
    Store s;
    REQUIRE(s.open(path).empty());
    CHECK(s.pruned_tasks() == 0);
    for (int i = 0; i < 4; ++i) {
      TaskRow row;
      row.spec.name = "t" + std::to_string(i);
      REQUIRE(s.insert_task(&row));
      ids.push_back(row.id);
      for (const char* what : {"stop", "kill"}) {
        ActionRow a;
        a.task = row.id;
        a.action = what;
        REQUIRE(s.insert_action(a));
      }
    }
    // Tasks 0 and 1 go with their actions; of the four actions left only the newest three stay.
    REQUIRE(s.delete_tasks({ids[0], ids[1]}, 3));
    CHECK(s.pruned_tasks() == 2);
    std::vector<TaskRow> rows;
    REQUIRE(s.load_tasks(&rows));
    REQUIRE(rows.size() == 2);
    CHECK(rows[0].id == ids[2]);
    CHECK(rows[1].id == ids[3]);
    auto acts = s.load_actions(0);
    REQUIRE(acts.size() == 3);
    CHECK((acts[0].task == ids[2] && acts[0].action == "kill"));
    CHECK((acts[2].task == ids[3] && acts[2].action == "kill"));
    // Fewer actions than the bound: none trimmed; an id not there deletes and counts nothing.
    REQUIRE(s.delete_tasks({ids[0]}, 100));
    CHECK(s.load_actions(0).size() == 3);
    std::vector<TaskRow> two;
    REQUIRE(s.load_tasks(&two));
    CHECK(two.size() == 2);
  }
  {
    Store s;  // all of it is on disk, and a new task never gets a deleted one's id
    REQUIRE(s.open(path).empty());
    CHECK(s.pruned_tasks() == 2);
    TaskRow row;
    REQUIRE(s.insert_task(&row));
    CHECK(row.id > ids[3]);
  }
  REQUIRE(system((std::string("rm -rf ") + dir).c_str()) == 0);
}

namespace {
// An SQLite VFS over the default one that counts the syncs of the files it opens: what a
// durable write costs the disk, seen from SQLite's side.
struct SyncCounter {
  static inline int syncs = 0;
  static inline sqlite3_vfs* real = nullptr;
  static inline sqlite3_vfs vfs{};
  static inline sqlite3_io_methods methods{};
  struct File {
    sqlite3_file base;
    sqlite3_file* inner;  // the default VFS's file, right after this struct
  };
  static sqlite3_file* in(sqlite3_file* f) { return reinterpret_cast<File*>(f)->inner; }

  static void install() {
    if (real) return;
    real = sqlite3_vfs_find(nullptr);
    vfs = *real;
    vfs.zName = "bb-sync-counter";
    vfs.szOsFile = int(sizeof(File)) + real->szOsFile;
    vfs.xOpen = [](sqlite3_vfs*, const char* name, sqlite3_file* f, int flags, int* out) {
      File* w = reinterpret_cast<File*>(f);
      w->inner = reinterpret_cast<sqlite3_file*>(w + 1);
      const int rc = real->xOpen(real, name, w->inner, flags, out);
      // The base's methods say whether xClose is owed: only when the inner file opened.
      w->base.pMethods = w->inner->pMethods ? &methods : nullptr;
      if (w->inner->pMethods && methods.iVersion == 0) wrap(w->inner->pMethods);
      return rc;
    };
    REQUIRE(sqlite3_vfs_register(&vfs, 0) == SQLITE_OK);
  }
  // Every method passes through to the inner file; xSync also counts.
  static void wrap(const sqlite3_io_methods* m) {
    methods = *m;
    methods.xClose = [](sqlite3_file* f) { return in(f)->pMethods->xClose(in(f)); };
    methods.xRead = [](sqlite3_file* f, void* b, int n, sqlite3_int64 o) {
      return in(f)->pMethods->xRead(in(f), b, n, o);
    };
    methods.xWrite = [](sqlite3_file* f, const void* b, int n, sqlite3_int64 o) {
      return in(f)->pMethods->xWrite(in(f), b, n, o);
    };
    methods.xTruncate = [](sqlite3_file* f, sqlite3_int64 n) {
      return in(f)->pMethods->xTruncate(in(f), n);
    };
    methods.xSync = [](sqlite3_file* f, int flags) {
      ++syncs;
      return in(f)->pMethods->xSync(in(f), flags);
    };
    methods.xFileSize = [](sqlite3_file* f, sqlite3_int64* n) {
      return in(f)->pMethods->xFileSize(in(f), n);
    };
    methods.xLock = [](sqlite3_file* f, int l) { return in(f)->pMethods->xLock(in(f), l); };
    methods.xUnlock = [](sqlite3_file* f, int l) { return in(f)->pMethods->xUnlock(in(f), l); };
    methods.xCheckReservedLock = [](sqlite3_file* f, int* r) {
      return in(f)->pMethods->xCheckReservedLock(in(f), r);
    };
    methods.xFileControl = [](sqlite3_file* f, int op, void* a) {
      return in(f)->pMethods->xFileControl(in(f), op, a);
    };
    methods.xSectorSize = [](sqlite3_file* f) { return in(f)->pMethods->xSectorSize(in(f)); };
    methods.xDeviceCharacteristics = [](sqlite3_file* f) {
      return in(f)->pMethods->xDeviceCharacteristics(in(f));
    };
    methods.xShmMap = [](sqlite3_file* f, int i, int n, int e, void volatile** p) {
      return in(f)->pMethods->xShmMap(in(f), i, n, e, p);
    };
    methods.xShmLock = [](sqlite3_file* f, int o, int n, int fl) {
      return in(f)->pMethods->xShmLock(in(f), o, n, fl);
    };
    methods.xShmBarrier = [](sqlite3_file* f) { in(f)->pMethods->xShmBarrier(in(f)); };
    methods.xShmUnmap = [](sqlite3_file* f, int d) { return in(f)->pMethods->xShmUnmap(in(f), d); };
    methods.xFetch = [](sqlite3_file* f, sqlite3_int64 o, int n, void** p) {
      return in(f)->pMethods->xFetch(in(f), o, n, p);
    };
    methods.xUnfetch = [](sqlite3_file* f, sqlite3_int64 o, void* p) {
      return in(f)->pMethods->xUnfetch(in(f), o, p);
    };
  }
};
}  // namespace

// The agent writes on its loop thread: a submission is synced before its id goes back, but the
// writes enforcement makes as often as every bubble (task updates, actions) are not, or each
// would stall the loop for a disk flush. All of them are in the file for the next open.
TEST_CASE("store_syncs_submissions_but_not_the_frequent_records") {
  SyncCounter::install();
  char dir[] = "/tmp/bb-store-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/db";
  int64_t id = 0;
  {
    Store s;
    REQUIRE(s.open(path, "bb-sync-counter").empty());
    int before = SyncCounter::syncs;
    TaskRow row;
    row.spec.name = "t";
    REQUIRE(s.insert_task(&row));
    id = row.id;
    CHECK(SyncCounter::syncs > before);
    before = SyncCounter::syncs;
    REQUIRE(s.set_meta("draining", "1"));
    CHECK(SyncCounter::syncs > before);
    before = SyncCounter::syncs;
    // 100 of each: well below the 1000 pages at which SQLite checkpoints (and syncs) the WAL.
    for (int i = 0; i < 100; ++i) {
      row.state = i % 2 ? "running" : "stopped";
      row.violations = uint32_t(i);
      REQUIRE(s.update_task(row));
      ActionRow a;
      a.task = id;
      a.action = i % 2 ? "continue" : "stop";
      REQUIRE(s.insert_action(a));
    }
    TaskRow attached;
    attached.spec.name = "a";
    attached.origin = "attached";  // adopted when it attached: not a submission
    REQUIRE(s.insert_task(&attached));
    CHECK(SyncCounter::syncs == before);
  }
  {
    Store s;
    REQUIRE(s.open(path).empty());
    std::vector<TaskRow> rows;
    REQUIRE(s.load_tasks(&rows));
    REQUIRE(rows.size() == 2);
    CHECK(rows[1].origin == "attached");
    CHECK(rows[0].violations == 99);
    CHECK(rows[0].state == "running");
    CHECK(s.count_actions() == 100);
    CHECK(s.get_meta("draining") == "1");
  }
  REQUIRE(system((std::string("rm -rf ") + dir).c_str()) == 0);
}

TEST_CASE("a_log_past_its_bound_drops_its_oldest_output_and_keeps_its_offsets") {
  using bb::daemon::bound_log;
  using bb::daemon::read_log;
  char dir[] = "/tmp/bblogs-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/1.out";
  std::string error;
  uint64_t kept = 0;
  CHECK(bound_log(path, 65536, &kept, &error).dropped == 0);  // no log yet: nothing to do
  // 1 MiB of numbered 16-byte lines, appended as a task appends.
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  std::string all;
  for (int i = 0; i < 65536; ++i) {
    char line[17];
    snprintf(line, sizeof line, "line %010d\n", i);
    all += line;
  }
  REQUIRE(write(fd, all.data(), all.size()) == ssize_t(all.size()));
  CHECK(bound_log(path, 2 << 20, &kept, &error).dropped == 0);  // within a larger bound
  CHECK(kept == 0);
  const bb::daemon::LogBound b = bound_log(path, 65536, &kept, &error);
  INFO(error);
  REQUIRE_FALSE(b.failed);
  REQUIRE(b.dropped > 0);
  CHECK(kept == uint64_t(b.dropped));
  struct stat st;
  REQUIRE(stat(path.c_str(), &st) == 0);
  CHECK(st.st_size == off_t(all.size()));        // offsets still count what went
  CHECK(uint64_t(st.st_blocks) * 512 <= 65536);  // the disk holds at most the bound
  struct statfs sf;
  REQUIRE(statfs(dir, &sf) == 0);
  CHECK(all.size() - kept <= 32768 + uint64_t(sf.f_bsize));  // about half is kept
  CHECK(bound_log(path, 65536, &kept, &error).dropped == 0);  // within the bound now
  // The tail reads as it was written.
  bb::daemon::LogRead r;
  REQUIRE(read_log(path, -1, 100, kept, &r, &error));
  CHECK(r.data == all.substr(all.size() - 100));
  CHECK(r.truncated);
  CHECK(r.dropped == kept);
  CHECK(r.end == all.size());
  // A follower reading from before the kept output resumes where it begins, told so; one past
  // it reads on unchanged. The same holds for a reader that knows nothing of the bound (an
  // agent restarted since): the file says where its data begins.
  for (uint64_t known : {kept, uint64_t(0)}) {
    REQUIRE(read_log(path, 0, 64, known, &r, &error));
    CHECK(r.truncated);
    CHECK(r.data == all.substr(kept, 64));
    CHECK(r.end == kept + 64);
  }
  REQUIRE(read_log(path, int64_t(all.size()) - 32, 64, kept, &r, &error));
  CHECK_FALSE(r.truncated);
  CHECK(r.data == all.substr(all.size() - 32));
  // The task goes on appending after its old output was dropped.
  REQUIRE(write(fd, "more\n", 5) == 5);
  close(fd);
  REQUIRE(read_log(path, int64_t(all.size()), 64, kept, &r, &error));
  CHECK(r.data == "more\n");
  CHECK_FALSE(read_log(std::string(dir) + "/2.out", -1, 64, 0, &r, &error));
  CHECK(error.find("no log at") != std::string::npos);
  // Something other than a log file at the path (a FIFO nobody writes) is left alone at once.
  const std::string fifo = std::string(dir) + "/3.out";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  uint64_t fifo_kept = 0;
  const bb::daemon::LogBound f = bound_log(fifo, 65536, &fifo_kept, &error);
  CHECK_FALSE(f.failed);
  CHECK(f.dropped == 0);
  unlink(fifo.c_str());
  unlink(path.c_str());
  rmdir(dir);
}

TEST_CASE("process_identity_includes_start_time") {
  ProcStat st;
  REQUIRE(read_proc_stat(getpid(), &st));
  CHECK(st.start_time > 0);
  CHECK(same_process(getpid(), st.start_time));
  CHECK_FALSE(same_process(getpid(), st.start_time + 1));
}

TEST_CASE("a_task_group_is_signalled_only_in_members_that_are_the_tasks") {
  // A group's number outlives its members: once the group is empty it may come back as someone
  // else's. Only members that started at or after the recorded leader, with the task's id in
  // their environment, are the task's.
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    setpgid(0, 0);
    char* argv[] = {const_cast<char*>("sleep"), const_cast<char*>("60"), nullptr};
    char* envp[] = {const_cast<char*>("BUBBLE_TASK_ID=7"), nullptr};
    execve("/bin/sleep", argv, envp);
    _exit(127);
  }
  struct Reap {
    pid_t pid;
    ~Reap() {
      if (pid <= 0) return;
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reap{child};
  ProcStat st;
  // Signal 0 only checks. Wait for the exec (the environment is the new image's).
  for (int i = 0; i < 2000 && signal_task_group(child, 0, "BUBBLE_TASK_ID=7", 0) == 0; ++i)
    usleep(1000);
  REQUIRE(read_proc_stat(child, &st));
  REQUIRE(st.pgid == child);
  CHECK(signal_task_group(child, st.start_time, "BUBBLE_TASK_ID=7", 0) == 1);
  CHECK(signal_task_group(child, st.start_time, "BUBBLE_TASK_ID=70", 0) == 0);  // another task
  CHECK(signal_task_group(child, st.start_time, "BUBBLE_TASK_ID=", 0) == 0);
  CHECK(signal_task_group(child, st.start_time + 1, "BUBBLE_TASK_ID=7", 0) == 0);  // older
  CHECK(signal_task_group(getpgrp(), 0, "BUBBLE_TASK_ID=7", 0) == 0);  // another group
  CHECK(signal_task_group(child, st.start_time, "BUBBLE_TASK_ID=7", SIGKILL) == 1);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  reap.pid = 0;  // reaped
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
}

TEST_CASE("boot_id_names_this_boot") {
  const std::string id = boot_id();
  CHECK(id.size() == 36);  // a UUID
  CHECK(id == boot_id());
}

namespace {
TaskRow row_with_args(int64_t id, size_t args, size_t arg_bytes) {
  TaskRow r;
  r.id = id;
  r.spec.name = "t" + std::to_string(id);
  r.spec.argv.push_back("/bin/task");
  for (size_t i = 0; i < args; ++i) r.spec.argv.push_back(std::string(arg_bytes, 'x'));
  r.spec.env.push_back("K=" + std::string(arg_bytes, 'y'));
  r.message = "running";
  return r;
}
}  // namespace

TEST_CASE("list_fit_leaves_out_ended_rows_before_an_old_task_that_still_runs") {
  std::vector<TaskRow> rows;
  for (int64_t id = 1; id <= 40; ++id) {
    rows.push_back(row_with_args(id, 0, 0));
    rows.back().state = id == 2 ? "running" : id == 3 ? "queued" : "finished";
  }
  // Room for about ten records.
  const ListBudget budget{1u << 20, 10 * 420};
  const size_t omitted = fit_list(&rows, budget, 16);
  CHECK(omitted > 0);
  bool running = false, queued = false;
  for (const TaskRow& r : rows) {
    running |= r.id == 2;
    queued |= r.id == 3;
  }
  CHECK(running);
  CHECK(queued);
  for (size_t i = 1; i < rows.size(); ++i) CHECK(rows[i - 1].id < rows[i].id);  // order kept
  CHECK(rows.back().id == 40);
}

TEST_CASE("list_fit_keeps_everything_under_the_budget") {
  std::vector<TaskRow> rows;
  for (int64_t id = 1; id <= 10; ++id) rows.push_back(row_with_args(id, 2, 100));
  CHECK(fit_list(&rows, ListBudget{}, 4096) == 0);
  REQUIRE(rows.size() == 10);
  CHECK(rows[0].spec.argv.size() == 3);
  CHECK(rows[0].message == "running");
}

TEST_CASE("list_fit_drops_arguments_of_the_oldest_first_then_says_how_many_rows_it_left_out") {
  std::vector<TaskRow> rows;
  for (int64_t id = 1; id <= 40; ++id) rows.push_back(row_with_args(id, 4, 1000));
  // Room for the arguments of about ten records (about 5 KB each), and for those ten plus about
  // ten trimmed ones (a few hundred bytes each) in all.
  const ListBudget budget{10 * 5200, 10 * 5500 + 10 * 500};
  const size_t omitted = fit_list(&rows, budget, 16);
  CHECK(omitted > 0);
  CHECK(rows.size() + omitted == 40);
  // What is kept is the newest, in the original order.
  for (size_t i = 1; i < rows.size(); ++i) CHECK(rows[i - 1].id < rows[i].id);
  CHECK(rows.back().id == 40);
  CHECK(rows.front().id == int64_t(omitted) + 1);
  // The newest keep their arguments; older ones keep their command (cut to the entry bound)
  // and say so.
  CHECK(rows.back().spec.argv.size() == 5);
  CHECK(rows.back().message == "running");
  CHECK(rows.front().spec.argv.size() == 1);
  CHECK(rows.front().spec.argv[0] == "/bin/task");
  CHECK(rows.front().spec.env.empty());
  CHECK(rows.front().message.find("arguments and environment left out") != std::string::npos);
}

TEST_CASE("a_task's_figures_add_up_its_slots_and_never_go_back") {
  TaskRow row;
  const std::pair<std::string, uint64_t> a{"j:0", 1}, b{"j:0", 2}, other{"k:0", 1};
  update_figures(&row, a, {10, 100, 1});
  update_figures(&row, b, {5, 50, 0});
  CHECK(row.steps == 15);
  CHECK(row.ns_in_bubbles == 150);
  CHECK(row.ns_outside == 1);
  // A slot that leaves keeps its share.
  slot_gone(&row, a);
  update_figures(&row, b, {6, 60, 0});
  CHECK(row.steps == 16);
  CHECK(row.ns_in_bubbles == 160);
  CHECK(row.slot_figures.size() == 1);
  // A slot of another hub adds to them (a task re-placed, or attached to two hubs).
  update_figures(&row, other, {3, 30, 2});
  CHECK(row.steps == 19);
  CHECK(row.ns_outside == 3);
  // A hub task id whose counts went back belongs to a new trainer's slot: the old counts stay.
  update_figures(&row, b, {1, 10, 0});
  CHECK(row.steps == 10 + 6 + 3 + 1);
  CHECK(row.ns_in_bubbles == 100 + 60 + 30 + 10);
  // Loaded by a restarted agent, which sees only the slots still held: never below what was
  // recorded, and growing with them once they pass it.
  TaskRow loaded;
  loaded.loaded = {100, 1000, 10};
  update_figures(&loaded, a, {40, 400, 4});
  CHECK(loaded.steps == 100);
  CHECK(loaded.ns_in_bubbles == 1000);
  update_figures(&loaded, a, {120, 1200, 12});
  CHECK(loaded.steps == 120);
  CHECK(loaded.ns_outside == 12);
}
