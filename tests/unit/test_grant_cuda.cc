// The CUDA grant backends and the run-time driver loader, against the fake driver.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include "core/cuda_driver.h"
#include "core/grant_lender.h"
#include "test_grant_support.h"

using namespace bb::core;
using bb::test::count_open_fds;
using bb::test::Double;
using bb::test::pattern_ok;
using bb::test::pattern_word;
using bb::test::Peer;
using bb::test::peer_request;
using bb::test::PeerReply;
using bb::test::ScopedEnv;
using Calls = std::vector<std::string>;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGran = 2 * kMiB;  // the double's default granularity

// One driver table over the double for the whole file; each test resets the double's log.
const CudaDriver& drv() {
  static std::unique_ptr<CudaDriver> d = [] {
    std::unique_ptr<CudaDriver> out;
    std::string err;
    REQUIRE_MESSAGE(CudaDriver::open(BUBBLE_CUDA_DOUBLE_PATH, &out, &err) == BB_OK, err);
    return out;
  }();
  return *d;
}

Double& dbl() {
  static Double d(drv());
  REQUIRE(d.ok());
  return d;
}

// Resets the double and remembers nothing is outstanding; the destructor checks it stays so.
struct Clean {
  Clean() {
    dbl().reset();
    bbdouble_counts c = dbl().counts();
    REQUIRE(c.physical + c.mappings + c.reservations + c.device_allocs + c.ipc_opens +
                c.ctx_retains == 0);
  }
  ~Clean() {
    bbdouble_counts c = dbl().counts();
    CHECK(c.physical == 0);
    CHECK(c.mappings == 0);
    CHECK(c.reservations == 0);
    CHECK(c.device_allocs == 0);
    CHECK(c.ipc_opens == 0);
    CHECK(c.ctx_retains == 0);
    CHECK(c.streams == 0);
    CHECK_MESSAGE(c.violations == 0, dbl().violations());
  }
};

// Sets one of the double's BUBBLE_CUDA_DOUBLE_* variables for a scope. The double reads them
// when reset, which also restarts the call counts of "@N" failure specs, so it resets it. It
// does not reset again on the way out: that would clear violations before Clean sees them.
struct DoubleEnv {
  ScopedEnv env;
  DoubleEnv(const char* name, const char* value) : env(name, value) { dbl().reset(); }
};

LendOptions options(GrantBackend b, uint64_t bytes, uint64_t device_ptr = 0) {
  LendOptions o;
  o.backend = b;
  o.bytes = bytes;
  o.device_ptr = device_ptr;
  o.driver = &drv();
  return o;
}

// Creates a lender over the double, requiring the status expect; err_out gets the message.
std::unique_ptr<GrantLender> lender(const LendOptions& o, bb_status expect = BB_OK,
                                    std::string* err_out = nullptr) {
  std::unique_ptr<GrantLender> l;
  std::string err;
  bb_status st = GrantLender::create(o, &l, &err);
  REQUIRE_MESSAGE(st == expect, err);
  if (err_out) *err_out = err;
  return l;
}

std::unique_ptr<GrantLender> lender(GrantBackend b, uint64_t bytes, uint64_t device_ptr = 0,
                                    bb_status expect = BB_OK, std::string* err_out = nullptr) {
  return lender(options(b, bytes, device_ptr), expect, err_out);
}

// A peer process whose driver is the double, failing the calls of fail_spec if given.
void start_on_double(Peer& peer, const std::string& fail_spec = "") {
  REQUIRE(peer.start({std::string("BUBBLE_CUDA_DRIVER=") + BUBBLE_CUDA_DOUBLE_PATH,
                      "BUBBLE_CUDA_DOUBLE_FAIL=" + fail_spec}));
}

// The peer's own driver after it mapped, wrote and unmapped: it holds nothing, and it kept no
// descriptor.
void check_peer_left_nothing(const PeerReply& rep) {
  REQUIRE(rep.counts_valid == 1);
  CHECK(rep.counts.physical == 0);
  CHECK(rep.counts.mappings == 0);
  CHECK(rep.counts.reservations == 0);
  CHECK(rep.counts.ctx_retains == 0);
  CHECK(rep.counts.violations == 0);
  CHECK(rep.fds_after == rep.fds_before);
}

}  // namespace

TEST_CASE("the driver loader resolves its table through cuGetProcAddress") {
  Clean clean;
  std::unique_ptr<CudaDriver> d;
  std::string err;
  REQUIRE_MESSAGE(CudaDriver::open(BUBBLE_CUDA_DOUBLE_PATH, &d, &err) == BB_OK, err);
  CHECK(d->via_proc_address);
#define BB_COUNT_ENTRY_(name, fn, symbol) +1
  constexpr uint64_t kEntries = 0 BB_CUDA_DRIVER_FUNCTIONS(BB_COUNT_ENTRY_);
#undef BB_COUNT_ENTRY_
  CHECK(dbl().counts().proc_lookups == kEntries);  // one lookup per entry of the table
  CHECK(d->driver_version == 13000);
  CHECK(d->device_count == 1);
  CHECK(d->path == BUBBLE_CUDA_DOUBLE_PATH);
  CHECK(dbl().calls("cuInit") == Calls{"cuInit"});
  CHECK(d->describe("cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY) ==
        "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)");
}

TEST_CASE("the driver loader falls back to dlsym of versioned names") {
  Clean clean;
  DoubleEnv env("BUBBLE_CUDA_DOUBLE_NO_PROC_ADDRESS", "1");
  std::unique_ptr<CudaDriver> d;
  std::string err;
  REQUIRE_MESSAGE(CudaDriver::open(BUBBLE_CUDA_DOUBLE_PATH, &d, &err) == BB_OK, err);
  CHECK(!d->via_proc_address);
  CHECK(dbl().counts().proc_lookups == 0);
  // The _v2 entry points really are the ones found.
  CHECK(reinterpret_cast<void*>(d->MemAlloc) == dlsym(d->dl_handle, "cuMemAlloc_v2"));
  CHECK(reinterpret_cast<void*>(d->DevicePrimaryCtxRelease) ==
        dlsym(d->dl_handle, "cuDevicePrimaryCtxRelease_v2"));
  CHECK(reinterpret_cast<void*>(d->StreamDestroy) == dlsym(d->dl_handle, "cuStreamDestroy_v2"));
  // The default-stream names, not the per-thread (_ptsz) ones.
  CHECK(reinterpret_cast<void*>(d->MemsetD8Async) == dlsym(d->dl_handle, "cuMemsetD8Async"));
  CHECK(reinterpret_cast<void*>(d->MemcpyAsync) == dlsym(d->dl_handle, "cuMemcpyAsync"));
  CHECK(reinterpret_cast<void*>(d->StreamSynchronize) ==
        dlsym(d->dl_handle, "cuStreamSynchronize"));
}

TEST_CASE("a missing CUDA driver gives BB_E_UNSUPPORTED with a clear message") {
  std::unique_ptr<CudaDriver> d;
  std::string err;
  CHECK(CudaDriver::open("/nonexistent/libcuda.so.1", &d, &err) == BB_E_UNSUPPORTED);
  CHECK(!d);
  CHECK(err.find("/nonexistent/libcuda.so.1") != std::string::npos);
  CHECK(err.find("BUBBLE_CUDA_DRIVER") != std::string::npos);
  CHECK(err.find("host grant backend") != std::string::npos);

  // Through the process-wide loader, as the hub and tasks use it: in a child, because the
  // driver is loaded once per process.
  int rc = bb::test::run_in_child([] {
    setenv("BUBBLE_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
    std::string e;
    if (cuda_driver(&e) != nullptr) return 1;
    if (e.find("/nonexistent/libcuda.so.1") == std::string::npos) return 2;
    for (GrantBackend b : {GrantBackend::kCudaIpc, GrantBackend::kCudaVmm}) {
      LendOptions o;
      o.backend = b;
      o.bytes = 4 * kMiB;
      std::unique_ptr<GrantLender> l;
      e.clear();
      if (GrantLender::create(o, &l, &e) != BB_E_UNSUPPORTED || l) return 3;
      if (e.find("needs the CUDA driver") == std::string::npos ||
          e.find("BUBBLE_CUDA_DRIVER") == std::string::npos)
        return 4;
    }
    Grant g;
    g.id = 1;
    g.size = kGran;
    g.backend = GrantBackend::kCudaVmm;
    g.handle.map_size = kGran;
    g.handle.device = 0;
    std::unique_ptr<GrantMapping> m;
    if (map_grant(g, 0, &m, &e) != BB_E_UNSUPPORTED) return 5;
    if (e.find("without the CUDA driver") == std::string::npos) return 6;
    // Everything else still works.
    LendOptions o;
    o.backend = GrantBackend::kHost;
    o.bytes = 1 * kMiB;
    std::unique_ptr<GrantLender> l;
    if (GrantLender::create(o, &l, &e) != BB_OK || l->grant(100, 1, &g, &e) != BB_OK) return 7;
    return 0;
  });
  CHECK(rc == 0);
}

TEST_CASE("the process-wide loader honours BUBBLE_CUDA_DRIVER") {
  int rc = bb::test::run_in_child([] {
    setenv("BUBBLE_CUDA_DRIVER", BUBBLE_CUDA_DOUBLE_PATH, 1);
    std::string e;
    const CudaDriver* d = cuda_driver(&e);
    if (!d || d->path != BUBBLE_CUDA_DOUBLE_PATH) return 1;
    if (cuda_driver(&e) != d) return 2;  // resolved once
    LendOptions o;
    o.backend = GrantBackend::kCudaVmm;
    o.bytes = 4 * kMiB;  // driver left null: the process's driver
    std::unique_ptr<GrantLender> l;
    Grant g;
    if (GrantLender::create(o, &l, &e) != BB_OK || l->grant(1, 1, &g, &e) != BB_OK) return 3;
    return 0;
  });
  CHECK(rc == 0);
}

TEST_CASE("a driver without GPUs or without VMM is refused with the reason") {
  Clean clean;
  {
    DoubleEnv env("BUBBLE_CUDA_DOUBLE_DEVICES", "0");
    std::unique_ptr<CudaDriver> d;
    std::string err;
    CHECK(CudaDriver::open(BUBBLE_CUDA_DOUBLE_PATH, &d, &err) == BB_E_UNSUPPORTED);
    CHECK(err.find("found no GPU") != std::string::npos);
  }
  {
    DoubleEnv env("BUBBLE_CUDA_DOUBLE_NO_VMM", "1");
    std::string err;
    lender(GrantBackend::kCudaVmm, 8 * kMiB, 0, BB_E_UNSUPPORTED, &err);
    CHECK(err.find("use the cuda-ipc backend") != std::string::npos);
  }
  dbl().reset();
  LendOptions o = options(GrantBackend::kCudaVmm, 8 * kMiB);
  o.device = 3;
  std::string err;
  lender(o, BB_E_INVALID, &err);
  CHECK(err.find("device 3 does not exist") != std::string::npos);
}

TEST_CASE("cuda-vmm: lend, grant, import, write, unmap, release in the driver's order") {
  const int fds_before = count_open_fds();
  {
    Clean clean;
    auto l = lender(GrantBackend::kCudaVmm, 16 * kMiB + 12345);
    CHECK(l->capacity() == 16 * kMiB);
    CHECK(l->alignment() == kGran);
    CHECK(dbl().calls("cuMemAddressReserve,cuMemCreate") == Calls{"cuMemAddressReserve"});

    dbl().reset();
    std::string err;
    Grant g;
    REQUIRE_MESSAGE(l->grant(3 * kMiB, 1, &g, &err) == BB_OK, err);
    CHECK(g.backend == GrantBackend::kCudaVmm);
    CHECK(g.size == 3 * kMiB);
    CHECK(g.handle.map_size == 4 * kMiB);
    CHECK(g.handle.map_offset == 0);
    CHECK(g.offset % kGran == 0);
    CHECK(g.handle.device == 0);
    REQUIRE(g.handle.fd >= 0);
    CHECK(bb::test::cloexec(g.handle.fd));  // the driver's descriptor is inheritable
    CHECK(dbl().calls("cuMemCreate,cuMemMap,cuMemSetAccess,cuMemExportToShareableHandle,"
                      "cuMemUnmap,cuMemRelease") ==
          Calls{"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemExportToShareableHandle"});
    std::string log = dbl().log();
    CHECK(log.find("cuMemCreate size=4194304 types=1") != std::string::npos);
    CHECK(log.find("dev=0 flags=3") != std::string::npos);  // read-write for the device

    dbl().reset();
    std::unique_ptr<GrantMapping> m;
    REQUIRE_MESSAGE(map_grant(wire_copy(g), g.handle.fd, &m, &err, &drv()) == BB_OK, err);
    CHECK(dbl().calls("cuMemImportFromShareableHandle,cuMemAddressReserve,cuMemMap,"
                      "cuMemSetAccess") ==
          Calls{"cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap",
                "cuMemSetAccess"});
    CHECK(m->size() == 3 * kMiB);
    CHECK(m->grant_id() == g.id);
    CHECK(m->ptr() != reinterpret_cast<void*>(l->address(g.id)));
    auto* w = static_cast<uint32_t*>(m->ptr());
    for (uint64_t i = 0; i < g.size / 4; ++i) w[i] = pattern_word(99, i);
    CHECK(pattern_ok(l->address(g.id), g.size, 99));  // same physical memory

    dbl().reset();
    REQUIRE(m->unmap(&err) == BB_OK);
    CHECK(m->unmap(&err) == BB_OK);  // idempotent
    CHECK(dbl().calls("cuMemUnmap,cuMemRelease,cuMemAddressFree") ==
          Calls{"cuMemUnmap", "cuMemRelease", "cuMemAddressFree"});

    dbl().reset();
    REQUIRE(l->release(g.id, &err) == BB_OK);
    CHECK(dbl().calls("cuMemUnmap,cuMemRelease,cuMemAddressFree") ==
          Calls{"cuMemUnmap", "cuMemRelease"});
    CHECK(dbl().counts().physical == 0);
    CHECK(dbl().counts().reservations == 1);  // the lent range itself
    l.reset();
    CHECK(dbl().calls("cuMemAddressFree") == Calls{"cuMemAddressFree"});
  }
  CHECK(count_open_fds() == fds_before);
}

TEST_CASE("cuda-vmm: grants never overlap and a lender torn down with live grants frees all") {
  Clean clean;
  auto l = lender(GrantBackend::kCudaVmm, 10 * kMiB);
  std::string err;
  std::vector<Grant> gs;
  for (uint64_t size : {uint64_t{1}, kGran + 1, 3 * kMiB}) {
    Grant g;
    REQUIRE(l->grant(size, 1, &g, &err) == BB_OK);
    gs.push_back(g);
  }
  Grant g;
  CHECK(l->grant(kGran + 1, 1, &g, &err) == BB_E_NOMEM);  // 2 + 4 + 4 = 10 MiB taken
  for (size_t i = 0; i < gs.size(); ++i)
    for (size_t j = i + 1; j < gs.size(); ++j)
      CHECK((gs[i].offset + gs[i].handle.map_size <= gs[j].offset ||
             gs[j].offset + gs[j].handle.map_size <= gs[i].offset));
  CHECK(dbl().counts().physical == 3);
  CHECK(l->stats().granted_bytes == 10 * kMiB);
  l.reset();  // Clean checks that nothing is left
}

TEST_CASE("cuda-vmm: every injected exporter failure leaves nothing allocated") {
  struct Case {
    const char* spec;
    bb_status status;
    const char* says;
  };
  const Case cases[] = {
      {"oom", BB_E_NOMEM, "cuMemCreate of a 2097152-byte grant failed: CUDA_ERROR_OUT_OF_MEMORY"},
      {"map", BB_E_SYSTEM, "cuMemMap of a grant into the lent range failed"},
      {"access", BB_E_PERMISSION, "cuMemSetAccess on a grant failed"},
      {"export", BB_E_UNSUPPORTED, "cuMemExportToShareableHandle of a grant failed"},
  };
  const int fds_before = count_open_fds();
  for (const Case& c : cases) {
    CAPTURE(c.spec);
    Clean clean;
    auto l = lender(GrantBackend::kCudaVmm, 8 * kMiB);
    {
      DoubleEnv fail("BUBBLE_CUDA_DOUBLE_FAIL", c.spec);
      std::string err;
      Grant g;
      CHECK(l->grant(kGran, 1, &g, &err) == c.status);
      CHECK_MESSAGE(err.find(c.says) != std::string::npos, err);
      bbdouble_counts n = dbl().counts();
      CHECK(n.physical == 0);
      CHECK(n.mappings == 0);
      CHECK(n.reservations == 1);
      CHECK(l->stats().granted_bytes == 0);
      CHECK(l->stats().grants_failed == 1);
    }
    dbl().reset();
    std::string err;
    Grant g;
    REQUIRE(l->grant(8 * kMiB, 1, &g, &err) == BB_OK);  // the whole range is free again
    CHECK(g.offset == 0);
  }
  {
    Clean clean;
    DoubleEnv fail("BUBBLE_CUDA_DOUBLE_FAIL", "reserve");
    std::string err;
    lender(GrantBackend::kCudaVmm, 8 * kMiB, 0, BB_E_NOMEM, &err);
    CHECK(err.find("cuMemAddressReserve") != std::string::npos);
  }
  CHECK(count_open_fds() == fds_before);
}

TEST_CASE("cuda-vmm: every injected importer failure leaves nothing of the import") {
  // The exporter's own reserve/map/access are call 1 of their kind; the importer's are call 2.
  const char* specs[] = {"import", "reserve@2", "map@2", "access@2"};
  const int fds_before = count_open_fds();
  for (const char* spec : specs) {
    CAPTURE(spec);
    Clean clean;
    DoubleEnv fail("BUBBLE_CUDA_DOUBLE_FAIL", spec);
    auto l = lender(GrantBackend::kCudaVmm, 8 * kMiB);
    std::string err;
    Grant g;
    REQUIRE_MESSAGE(l->grant(kGran, 1, &g, &err) == BB_OK, err);
    const bbdouble_counts before = dbl().counts();
    std::unique_ptr<GrantMapping> m;
    CHECK(map_grant(wire_copy(g), g.handle.fd, &m, &err, &drv()) != BB_OK);
    CHECK(!m);
    CHECK(!err.empty());
    bbdouble_counts after = dbl().counts();
    CHECK(after.physical == before.physical);
    CHECK(after.mappings == before.mappings);
    CHECK(after.reservations == before.reservations);
    CHECK(after.ctx_retains == before.ctx_retains);
  }
  CHECK(count_open_fds() == fds_before);
}

TEST_CASE("cuda-vmm: an importer refuses a record whose size is not granular") {
  Clean clean;
  auto l = lender(GrantBackend::kCudaVmm, 8 * kMiB);
  std::string err;
  Grant g;
  REQUIRE(l->grant(kGran, 1, &g, &err) == BB_OK);
  Grant bad = wire_copy(g);
  bad.handle.map_size += 4096;
  std::unique_ptr<GrantMapping> m;
  CHECK(map_grant(bad, g.handle.fd, &m, &err, &drv()) == BB_E_CORRUPT);
  CHECK(err.find("granularity") != std::string::npos);
  bad = wire_copy(g);
  bad.handle.device = -1;
  CHECK(map_grant(bad, g.handle.fd, &m, &err, &drv()) == BB_E_CORRUPT);
  int p[2];
  REQUIRE(pipe2(p, O_CLOEXEC) == 0);
  CHECK(map_grant(wire_copy(g), p[0], &m, &err, &drv()) == BB_E_INVALID);
  close(p[0]);
  close(p[1]);
}

TEST_CASE("cuda-ipc: an owned lent range, one handle for all grants, nothing allocated per grant") {
  Clean clean;
  auto l = lender(GrantBackend::kCudaIpc, 1 * kMiB + 100);
  CHECK(l->capacity() == 1 * kMiB + 0);
  CHECK(l->alignment() == 256);
  CHECK(dbl().calls("cuMemAlloc,cuMemGetAddressRange,cuIpcGetMemHandle") ==
        Calls{"cuMemAlloc", "cuMemGetAddressRange", "cuIpcGetMemHandle"});
  dbl().reset();
  std::string err;
  Grant a, b;
  REQUIRE(l->grant(1000, 1, &a, &err) == BB_OK);
  REQUIRE(l->grant(300, 2, &b, &err) == BB_OK);
  // Per grant only the clearing, in relaxed capture mode: one stream for all, then a memset
  // and a wait per grant.
  const std::string mode = "cuThreadExchangeStreamCaptureMode";
  CHECK(dbl().calls() == Calls{mode, "cuCtxGetCurrent", "cuCtxSetCurrent", "cuStreamCreate",
                               "cuMemsetD8Async", "cuStreamSynchronize", "cuCtxSetCurrent", mode,
                               mode, "cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemsetD8Async",
                               "cuStreamSynchronize", "cuCtxSetCurrent", mode});
  CHECK(a.handle.fd == -1);
  CHECK(a.handle.map_offset == a.offset);
  CHECK(b.handle.map_offset == b.offset);
  CHECK(a.offset + 1024 <= b.offset);
  CHECK(std::memcmp(a.handle.ipc, b.handle.ipc, kIpcHandleBytes) == 0);
  // The exporting process cannot open its own handle (the real driver refuses too).
  std::unique_ptr<GrantMapping> m;
  CHECK(map_grant(wire_copy(a), -1, &m, &err, &drv()) != BB_OK);
  CHECK(err.find("exported it itself") != std::string::npos);
  REQUIRE(l->release(a.id, &err) == BB_OK);
  REQUIRE(l->release(b.id, &err) == BB_OK);
  dbl().reset();
  l.reset();
  CHECK(dbl().calls("cuMemFree") == Calls{"cuMemFree"});
}

TEST_CASE("cuda-ipc: lending part of the trainer's own allocation") {
  Clean clean;
  CudaPrimaryContext ctx;
  std::string err;
  REQUIRE(ctx.retain(drv(), 0, &err) == BB_OK);
  CUdeviceptr base = 0;
  {
    CudaContextScope scope(drv(), ctx.get());
    REQUIRE(drv().MemAlloc(&base, 4 * kMiB) == CUDA_SUCCESS);
  }
  {
    auto l = lender(GrantBackend::kCudaIpc, 2 * kMiB, base + kMiB);
    Grant g;
    REQUIRE(l->grant(4096, 1, &g, &err) == BB_OK);
    CHECK(g.handle.map_offset == kMiB + g.offset);
    CHECK(l->address(g.id) == base + kMiB + g.offset);
    std::string e2;
    lender(GrantBackend::kCudaIpc, 2 * kMiB, base + 3 * kMiB, BB_E_INVALID, &e2);
    CHECK(e2.find("runs past the end of its allocation") != std::string::npos);
    // "All of it": a size whose end, added up, wraps below the allocation's end.
    e2.clear();
    lender(GrantBackend::kCudaIpc, UINT64_MAX - 4095, base + kMiB, BB_E_INVALID, &e2);
    CHECK(e2.find("runs past the end of its allocation") != std::string::npos);
    lender(GrantBackend::kCudaIpc, 2 * kMiB, 0x1000, BB_E_SYSTEM, &e2);
    CHECK(e2.find("cuMemGetAddressRange") != std::string::npos);
  }
  {
    CudaContextScope scope(drv(), ctx.get());
    REQUIRE(drv().MemFree(base) == CUDA_SUCCESS);
  }
  ctx.reset();
}

TEST_CASE("cuda-ipc: a failed handle export frees the range the lender allocated") {
  Clean clean;
  DoubleEnv fail("BUBBLE_CUDA_DOUBLE_FAIL", "export");
  std::string err;
  lender(GrantBackend::kCudaIpc, kMiB, 0, BB_E_UNSUPPORTED, &err);
  CHECK(err.find("cuIpcGetMemHandle") != std::string::npos);
  CHECK(err.find("use cuda-vmm otherwise") != std::string::npos);
}

TEST_CASE("cuda-ipc: handle bytes cross to another process, which writes the grant") {
  Clean clean;
  auto l = lender(GrantBackend::kCudaIpc, 4 * kMiB);
  Peer peer;
  start_on_double(peer);
  std::string err;
  Grant held, brief;
  REQUIRE(l->grant(kMiB, 1, &held, &err) == BB_OK);
  REQUIRE(l->grant(3000, 1, &brief, &err) == BB_OK);
  PeerReply rep = peer.exchange(peer_request(bb::test::kPeerMapWriteHold, held, 1234));
  REQUIRE_MESSAGE(rep.status == BB_OK, rep.error);
  REQUIRE(rep.counts_valid == 1);
  CHECK(rep.counts.ipc_opens == 1);
  CHECK(pattern_ok(l->address(held.id), held.size, 1234));

  // A second grant on the same handle: opened and closed on its own (the driver counts).
  rep = peer.exchange(peer_request(bb::test::kPeerMapWriteUnmap, brief, 777));
  REQUIRE_MESSAGE(rep.status == BB_OK, rep.error);
  CHECK(rep.counts.ipc_opens == 1);  // the held grant's reference remains
  CHECK(pattern_ok(l->address(brief.id), brief.size, 777));
  CHECK(pattern_ok(l->address(held.id), held.size, 1234));  // the neighbour is untouched

  rep = peer.exchange(peer_request(bb::test::kPeerRevoke, brief, 777));
  CHECK_MESSAGE(rep.status == BB_OK, rep.error);
  CHECK(rep.counts.ipc_opens == 0);
  CHECK(rep.counts.ctx_retains == 0);
  CHECK(rep.counts.violations == 0);
  CHECK(peer.stop() == 0);
  REQUIRE(l->release(held.id, &err) == BB_OK);
  REQUIRE(l->release(brief.id, &err) == BB_OK);
}

TEST_CASE("cuda-vmm: the descriptor crosses a socket and the other process maps it") {
  const int fds_before = count_open_fds();
  {
    Clean clean;
    auto l = lender(GrantBackend::kCudaVmm, 8 * kMiB);
    Peer peer;
    start_on_double(peer);
    std::string err;
    Grant g;
    REQUIRE(l->grant(5 * kMiB, 1, &g, &err) == BB_OK);
    const PeerReply rep =
        peer.exchange(peer_request(bb::test::kPeerMapWriteUnmap, g, 4242), g.handle.fd);
    CHECK_MESSAGE(rep.status == BB_OK, rep.error);
    check_peer_left_nothing(rep);
    CHECK(pattern_ok(l->address(g.id), g.size, 4242));
    CHECK(peer.stop() == 0);
    REQUIRE(l->release(g.id, &err) == BB_OK);
  }
  CHECK(count_open_fds() == fds_before);
}

TEST_CASE("cuda-vmm: an import failure in the other process leaves it nothing") {
  Clean clean;
  auto l = lender(GrantBackend::kCudaVmm, 4 * kMiB);
  for (const char* spec : {"import", "map", "access", "reserve"}) {
    CAPTURE(spec);
    Peer peer;
    start_on_double(peer, spec);
    std::string err;
    Grant g;
    REQUIRE(l->grant(kGran, 1, &g, &err) == BB_OK);
    const PeerReply rep =
        peer.exchange(peer_request(bb::test::kPeerMapWriteUnmap, g, 1), g.handle.fd);
    CHECK(rep.status != BB_OK);
    CHECK(std::string(rep.error).find("grant") != std::string::npos);
    check_peer_left_nothing(rep);
    CHECK(peer.stop() == 0);
    REQUIRE(l->release(g.id, &err) == BB_OK);
  }
}

// ---- which GPU: a grant names it by UUID, since processes number their GPUs differently ------

namespace {

// A driver table opened afresh: the double re-read BUBBLE_CUDA_DOUBLE_DEVICES when it was reset,
// and the shared table still counts the GPUs it saw first.
std::unique_ptr<CudaDriver> fresh_driver() {
  std::unique_ptr<CudaDriver> d;
  std::string err;
  REQUIRE_MESSAGE(CudaDriver::open(BUBBLE_CUDA_DOUBLE_PATH, &d, &err) == BB_OK, err);
  return d;
}

}  // namespace

TEST_CASE("a grant of the trainer's second GPU maps in a task that sees only that GPU") {
  // The agent launches a task with CUDA_VISIBLE_DEVICES=<its GPU>, so the trainer's device 1 is
  // the task's device 0. Mapped by ordinal, the grant failed ("device 1 does not exist") or,
  // where the task saw both GPUs in another order, landed on the wrong GPU (peer access, which
  // the double records as a violation).
  Clean clean;
  DoubleEnv two("BUBBLE_CUDA_DOUBLE_DEVICES", "2");
  const auto d = fresh_driver();
  REQUIRE(d->device_count == 2);
  for (GrantBackend b : {GrantBackend::kCudaIpc, GrantBackend::kCudaVmm}) {
    const std::string name = grant_backend_name(b);
    CAPTURE(name);
    LendOptions o = options(b, 4 * kMiB);
    o.driver = d.get();
    o.device = 1;
    auto l = lender(o);
    std::string err;
    Grant g;
    REQUIRE(l->grant(kGran, 1, &g, &err) == BB_OK);
    CHECK(g.handle.device == 1);
    for (const char* visible : {"1", "1,0"}) {
      CAPTURE(visible);
      Peer peer;
      REQUIRE(peer.start({std::string("BUBBLE_CUDA_DRIVER=") + BUBBLE_CUDA_DOUBLE_PATH,
                          std::string("CUDA_VISIBLE_DEVICES=") + visible}));
      const PeerReply rep = peer.exchange(peer_request(bb::test::kPeerMapWriteUnmap, g, 99),
                                          b == GrantBackend::kCudaVmm ? g.handle.fd : -1);
      CHECK_MESSAGE(rep.status == BB_OK, rep.error);
      check_peer_left_nothing(rep);  // no violation: no peer access to another GPU
      CHECK(pattern_ok(l->address(g.id), g.size, 99));
      CHECK(peer.stop() == 0);
    }
    // A task that does not see the GPU at all is told which one, and why.
    Peer blind;
    REQUIRE(blind.start({std::string("BUBBLE_CUDA_DRIVER=") + BUBBLE_CUDA_DOUBLE_PATH,
                         "CUDA_VISIBLE_DEVICES=0"}));
    const PeerReply rep = blind.exchange(peer_request(bb::test::kPeerMapWriteUnmap, g, 1),
                                         b == GrantBackend::kCudaVmm ? g.handle.fd : -1);
    CHECK(rep.status == BB_E_UNSUPPORTED);
    const std::string why = rep.error;
    CHECK_MESSAGE(why.find("which this process does not see") != std::string::npos, why);
    CHECK_MESSAGE(why.find("CUDA_VISIBLE_DEVICES=0") != std::string::npos, why);
    CHECK_MESSAGE(why.find("GPU-") != std::string::npos, why);
    check_peer_left_nothing(rep);
    CHECK(blind.stop() == 0);
    REQUIRE(l->release(g.id, &err) == BB_OK);
  }
}

TEST_CASE("cuda-ipc: memory of another GPU than the lender's device is refused with the fix") {
  Clean clean;
  DoubleEnv two("BUBBLE_CUDA_DOUBLE_DEVICES", "2");
  const auto d = fresh_driver();
  // Memory the trainer allocated on its device 1 ...
  CUcontext ctx = nullptr;
  CUdevice dev = 0;
  REQUIRE(d->DeviceGet(&dev, 1) == CUDA_SUCCESS);
  REQUIRE(d->DevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS);
  CUdeviceptr p = 0;
  {
    CudaContextScope scope(*d, ctx);
    REQUIRE(d->MemAlloc(&p, 4 * kMiB) == CUDA_SUCCESS);
  }
  // ... lent as if it were device 0's (the option's default).
  LendOptions o = options(GrantBackend::kCudaIpc, 4 * kMiB, p);
  o.driver = d.get();
  std::string err;
  lender(o, BB_E_INVALID, &err);
  CHECK_MESSAGE(err.find("memory of CUDA device 1, not of device 0") != std::string::npos, err);
  CHECK_MESSAGE(err.find("set the lend options' device to 1") != std::string::npos, err);
  o.device = 1;
  lender(o);  // as it should be
  {
    CudaContextScope scope(*d, ctx);
    REQUIRE(d->MemFree(p) == CUDA_SUCCESS);
  }
  REQUIRE(d->DevicePrimaryCtxRelease(dev) == CUDA_SUCCESS);
}

TEST_CASE("the lender keeps no grant descriptor once the task has it") {
  // A trainer's forked workers (a data loader's) inherit every descriptor the trainer holds; a
  // grant's kept the memory allocated after its release, for as long as any worker lived.
  for (GrantBackend b : {GrantBackend::kCudaVmm, GrantBackend::kHost}) {
    const std::string name = grant_backend_name(b);
    CAPTURE(name);
    const int fds_before = count_open_fds();
    {
      Clean clean;
      auto l = lender(b, 8 * kMiB);
      std::string err;
      Grant g;
      REQUIRE(l->grant(kGran, 1, &g, &err) == BB_OK);
      REQUIRE(g.handle.fd >= 0);
      REQUIRE(fcntl(g.handle.fd, F_GETFD) >= 0);
      const int with_grant = count_open_fds();
      l->descriptor_sent(g.id);
      CHECK(count_open_fds() == with_grant - 1);
      CHECK(fcntl(g.handle.fd, F_GETFD) == -1);
      Grant now;
      REQUIRE(l->find(g.id, &now) == BB_OK);
      CHECK(now.handle.fd == -1);
      REQUIRE(l->release(g.id, &err) == BB_OK);  // unmaps and releases; closes nothing twice
    }
    CHECK(count_open_fds() == fds_before);
  }
}

// ---- clearing: no grant shows what an earlier holder (or the trainer) left -------------------

namespace {

// key=value of the nth logged call of name (from 0), "" if there is none.
std::string logged_arg(const std::string& name, const std::string& key, int nth = 0) {
  const std::string all = dbl().log();
  size_t pos = 0;
  while (pos < all.size()) {
    const size_t nl = all.find('\n', pos);
    const std::string line = all.substr(pos, nl - pos);
    pos = nl == std::string::npos ? all.size() : nl + 1;
    if (line.compare(0, name.size() + 1, name + " ") != 0 || nth-- > 0) continue;
    const size_t k = line.find(" " + key + "=");
    if (k == std::string::npos) return "";
    const size_t v = k + key.size() + 2;
    return line.substr(v, line.find(' ', v) - v);
  }
  return "";
}

bool bytes_are(uint64_t addr, uint64_t size, unsigned char value) {
  const auto* b = reinterpret_cast<const unsigned char*>(addr);
  for (uint64_t i = 0; i < size; ++i)
    if (b[i] != value) return false;
  return true;
}

// The one memset of the last grant: on the exporter's own non-blocking stream (never the
// default one), exactly [addr, addr + size), waited for on that stream before anything else.
void check_cleared_on_private_stream(uint64_t addr, uint64_t size) {
  const std::string stream = logged_arg("cuMemsetD8Async", "stream");
  CHECK(stream != "");
  CHECK(stream != "0");
  CHECK(logged_arg("cuMemsetD8Async", "ptr") == std::to_string(addr));
  CHECK(logged_arg("cuMemsetD8Async", "size") == std::to_string(size));
  CHECK(logged_arg("cuMemsetD8Async", "value") == "0");
  CHECK(logged_arg("cuStreamSynchronize", "stream") == stream);
  CHECK(logged_arg("cuMemsetD8Async", "ptr", 1) == "");  // one per grant
  const Calls order = dbl().calls("cuMemsetD8Async,cuStreamSynchronize");
  CHECK(order == Calls{"cuMemsetD8Async", "cuStreamSynchronize"});
}

}  // namespace

TEST_CASE("cuda-ipc: each grant's window is zeroed on a private stream before it is offered") {
  Clean clean;
  auto l = lender(GrantBackend::kCudaIpc, 4 * kMiB);
  std::string err;
  // The trainer fills the whole lent range (a first holder of all of it).
  Grant all;
  REQUIRE(l->grant(4 * kMiB, 1, &all, &err) == BB_OK);
  const uint64_t base = l->address(all.id);
  CHECK(bytes_are(base, 4 * kMiB, 0));  // zeroed, though cuMemAlloc left 0xa5 there
  std::memset(reinterpret_cast<void*>(base), 0x5c, 4 * kMiB);
  REQUIRE(l->release(all.id, &err) == BB_OK);

  dbl().reset();
  Grant g;
  REQUIRE(l->grant(kMiB + 100, 2, &g, &err) == BB_OK);
  REQUIRE(l->address(g.id) == base);  // the same memory, for a new owner
  const uint64_t rounded = kMiB + 256;
  check_cleared_on_private_stream(base, rounded);
  CHECK(logged_arg("cuStreamCreate", "flags") == "");  // the stream of the first grant serves
  CHECK(bytes_are(base, rounded, 0));
  CHECK(bytes_are(base + rounded, 4 * kMiB - rounded, 0x5c));  // nothing outside the grant

  // Another process, the new holder, finds its grant all zero.
  Peer peer;
  start_on_double(peer);
  const PeerReply rep = peer.exchange(peer_request(bb::test::kPeerMapWriteUnmap, g, 31));
  REQUIRE_MESSAGE(rep.status == BB_OK, rep.error);
  CHECK(rep.was_zero == 1);
  CHECK(pattern_ok(base, g.size, 31));
  CHECK(peer.stop() == 0);
  REQUIRE(l->release(g.id, &err) == BB_OK);
  CHECK(dbl().counts().streams == 1);
  dbl().reset();
  l.reset();
  CHECK(dbl().calls("cuStreamDestroy,cuMemFree") == Calls{"cuStreamDestroy", "cuMemFree"});
}

TEST_CASE("cuda-vmm: each grant is zeroed before its descriptor exists; the next holder reads 0") {
  const int fds_before = count_open_fds();
  {
    Clean clean;
    auto l = lender(GrantBackend::kCudaVmm, 8 * kMiB);
    Peer peer;
    start_on_double(peer);
    std::string err;
    for (uint32_t holder = 1; holder <= 2; ++holder) {
      CAPTURE(holder);
      dbl().reset();
      Grant g;
      REQUIRE(l->grant(kGran, holder, &g, &err) == BB_OK);
      CHECK(g.offset == 0);  // the same range each time
      check_cleared_on_private_stream(l->address(g.id), kGran);
      // Memory made, mapped for the trainer, cleared and waited for, and only then exported.
      CHECK(dbl().calls("cuMemCreate,cuMemMap,cuMemSetAccess,cuStreamCreate,cuMemsetD8Async,"
                        "cuStreamSynchronize,cuMemExportToShareableHandle") ==
            (holder == 1 ? Calls{"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuStreamCreate",
                                 "cuMemsetD8Async", "cuStreamSynchronize",
                                 "cuMemExportToShareableHandle"}
                         : Calls{"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemsetD8Async",
                                 "cuStreamSynchronize", "cuMemExportToShareableHandle"}));
      CHECK(logged_arg("cuStreamCreate", "flags") == (holder == 1 ? "1" : ""));  // non-blocking
      const PeerReply rep =
          peer.exchange(peer_request(bb::test::kPeerMapWriteUnmap, g, 100 + holder), g.handle.fd);
      REQUIRE_MESSAGE(rep.status == BB_OK, rep.error);
      CHECK(rep.was_zero == 1);
      CHECK(pattern_ok(l->address(g.id), g.size, 100 + holder));
      REQUIRE(l->release(g.id, &err) == BB_OK);
    }
    CHECK(peer.stop() == 0);
  }
  CHECK(count_open_fds() == fds_before);
}

TEST_CASE("clear off: grants skip the memset and show what was there") {
  const int fds_before = count_open_fds();
  {
    Clean clean;
    std::string err;
    {
      LendOptions o = options(GrantBackend::kCudaIpc, 2 * kMiB);
      o.clear = false;
      auto l = lender(o);
      Grant a;
      REQUIRE(l->grant(kMiB, 1, &a, &err) == BB_OK);
      const uint64_t at = l->address(a.id);
      CHECK(bytes_are(at, kMiB, 0xa5));  // what cuMemAlloc left
      std::memset(reinterpret_cast<void*>(at), 0x77, kMiB);
      REQUIRE(l->release(a.id, &err) == BB_OK);
      Grant b;
      REQUIRE(l->grant(kMiB, 1, &b, &err) == BB_OK);
      CHECK(l->address(b.id) == at);
      CHECK(bytes_are(l->address(b.id), kMiB, 0x77));  // the previous holder's bytes
      REQUIRE(l->release(b.id, &err) == BB_OK);
    }
    {
      LendOptions o = options(GrantBackend::kCudaVmm, 4 * kMiB);
      o.clear = false;
      auto l = lender(o);
      Grant a;
      REQUIRE(l->grant(kGran, 1, &a, &err) == BB_OK);
      CHECK(bytes_are(l->address(a.id), kGran, 0xa5));  // cuMemCreate does not zero
      REQUIRE(l->release(a.id, &err) == BB_OK);
    }
    CHECK(dbl().calls("cuStreamCreate,cuMemsetD8Async,cuStreamSynchronize").empty());
  }
  CHECK(count_open_fds() == fds_before);
}

TEST_CASE("a grant whose clearing fails is not made, names the call and leaves nothing") {
  struct Case {
    const char* spec;
    const char* says;
  };
  const Case cases[] = {
      {"stream", "cuStreamCreate of the lender's stream failed: "
                 "CUDA_ERROR_OUT_OF_MEMORY"},
      {"memset", "cuMemsetD8Async clearing a grant failed: CUDA_ERROR_LAUNCH_FAILED"},
      {"sync", "cuStreamSynchronize waiting for a grant to be cleared failed: "
               "CUDA_ERROR_ILLEGAL_ADDRESS"},
  };
  const int fds_before = count_open_fds();
  for (GrantBackend b : {GrantBackend::kCudaIpc, GrantBackend::kCudaVmm}) {
    for (const Case& c : cases) {
      CAPTURE(grant_backend_name(b));
      CAPTURE(c.spec);
      Clean clean;
      auto l = lender(b, 4 * kMiB);
      std::string err;
      Grant g;
      {
        DoubleEnv fail("BUBBLE_CUDA_DOUBLE_FAIL", c.spec);
        CHECK(l->grant(kGran, 1, &g, &err) != BB_OK);
        CHECK_MESSAGE(err.find(c.says) != std::string::npos, err);
        const bbdouble_counts n = dbl().counts();
        CHECK(n.physical == 0);
        CHECK(n.mappings == 0);
        CHECK(n.streams == 0);  // a stream that failed is dropped
        CHECK(dbl().calls("cuMemExportToShareableHandle").empty());
        const LenderStats s = l->stats();
        CHECK(s.granted_bytes == 0);
        CHECK(s.active == 0);
        CHECK(s.grants_failed == 1);
      }
      // The range went back: the whole lent range is granted next, cleared.
      dbl().reset();
      REQUIRE_MESSAGE(l->grant(4 * kMiB, 1, &g, &err) == BB_OK, err);
      CHECK(g.offset == 0);
      CHECK(bytes_are(l->address(g.id), 4 * kMiB, 0));
    }
  }
  CHECK(count_open_fds() == fds_before);
}

TEST_CASE("a live grant's bytes are copied out on the lender's stream, a released one's never") {
  for (GrantBackend b : {GrantBackend::kCudaIpc, GrantBackend::kCudaVmm}) {
    CAPTURE(grant_backend_name(b));
    Clean clean;
    auto l = lender(b, 8 * kMiB);
    std::string err;
    Grant g, dst;
    REQUIRE_MESSAGE(l->grant(kMiB, 1, &g, &err) == BB_OK, err);
    REQUIRE_MESSAGE(l->grant(kMiB, 2, &dst, &err) == BB_OK, err);
    // The task's results: the double's device memory is host memory.
    auto* w = reinterpret_cast<uint32_t*>(l->address(g.id));
    for (uint64_t i = 0; i < g.size / 4; ++i) w[i] = pattern_word(61, i);

    dbl().reset();
    std::vector<uint32_t> host(g.size / 4);
    REQUIRE_MESSAGE(l->read(g.id, 0, host.data(), g.size, &err) == BB_OK, err);
    CHECK(pattern_ok(reinterpret_cast<uint64_t>(host.data()), g.size, 61));
    // One copy on the lender's non-blocking stream, waited for; the stream that clears grants.
    CHECK(dbl().calls("cuMemcpyAsync,cuStreamSynchronize,cuCtxSynchronize") ==
          Calls{"cuMemcpyAsync", "cuStreamSynchronize"});
    CHECK(logged_arg("cuMemcpyAsync", "src") == std::to_string(l->address(g.id)));
    CHECK(logged_arg("cuMemcpyAsync", "stream") != "0");
    CHECK(logged_arg("cuStreamSynchronize", "stream") == logged_arg("cuMemcpyAsync", "stream"));

    // Part of it, to device memory of the same GPU.
    REQUIRE_MESSAGE(l->read(g.id, 4096, reinterpret_cast<void*>(l->address(dst.id)), 8, &err) ==
                        BB_OK,
                    err);
    const auto* d = reinterpret_cast<const uint32_t*>(l->address(dst.id));
    CHECK(d[0] == pattern_word(61, 1024));
    CHECK(d[1] == pattern_word(61, 1025));
    CHECK(d[2] == 0);  // the rest of the other grant is as it was cleared

    // Only the grant's bytes: not past its end, nor a range whose end wraps.
    CHECK(l->read(g.id, g.size - 4, host.data(), 8, &err) == BB_E_INVALID);
    CHECK(err.find("outside grant") != std::string::npos);
    CHECK(l->read(g.id, UINT64_MAX, host.data(), 2, &err) == BB_E_INVALID);
    CHECK(l->read(g.id, g.size, host.data(), 0, &err) == BB_OK);

    // Revoking: still the holder's, still readable.
    REQUIRE(l->revoke(g.id, 1, &err) == BB_OK);
    REQUIRE(l->read(g.id, 0, host.data(), 4, &err) == BB_OK);

    // A failed copy names the call; the next one works on a fresh stream.
    {
      DoubleEnv fail("BUBBLE_CUDA_DOUBLE_FAIL", "memcpy@1");
      CHECK(l->read(g.id, 0, host.data(), 4, &err) == BB_E_SYSTEM);
      CHECK(err.find("cuMemcpyAsync copying a grant out failed") != std::string::npos);
      REQUIRE_MESSAGE(l->read(g.id, 0, host.data(), 4, &err) == BB_OK, err);
      CHECK(dbl().calls("cuStreamDestroy,cuStreamCreate") ==
            Calls{"cuStreamDestroy", "cuStreamCreate"});
    }

    // Released: refused, never read.
    REQUIRE(l->release(g.id, &err) == BB_OK);
    dbl().reset();
    CHECK(l->read(g.id, 0, host.data(), 4, &err) == BB_E_NOT_FOUND);
    CHECK(err.find("grant " + std::to_string(g.id) + " is not live") != std::string::npos);
    CHECK(dbl().calls("cuMemcpyAsync").empty());
    REQUIRE(l->release(dst.id, &err) == BB_OK);
  }
}

TEST_CASE("grants are lent, cleared, copied out and given back during a graph capture, which "
          "stays intact") {
  // The application captures a CUDA graph in global mode (torch.cuda.graph's default) while
  // the lender works on another thread: every allocation, free, wait and copy to host memory of
  // the lender is an unsafe call to that capture unless made in relaxed mode.
  for (GrantBackend b : {GrantBackend::kCudaIpc, GrantBackend::kCudaVmm}) {
    CAPTURE(grant_backend_name(b));
    Clean clean;
    void* const captured = reinterpret_cast<void*>(0x6a7b);
    dbl().capture(captured, true);
    struct EndCapture {
      void* s;
      ~EndCapture() { dbl().capture(s, false); }
    } end{captured};
    std::string err;
    auto l = lender(b, 8 * kMiB);
    Grant g;
    REQUIRE_MESSAGE(l->grant(kMiB, 1, &g, &err) == BB_OK, err);  // cleared on the lender's stream
    auto* w = reinterpret_cast<uint32_t*>(l->address(g.id));
    for (uint64_t i = 0; i < g.size / 4; ++i) w[i] = pattern_word(62, i);
    std::vector<uint32_t> host(g.size / 4);
    REQUIRE_MESSAGE(l->read(g.id, 0, host.data(), g.size, &err) == BB_OK, err);
    CHECK(pattern_ok(reinterpret_cast<uint64_t>(host.data()), g.size, 62));
    REQUIRE_MESSAGE(l->release(g.id, &err) == BB_OK, err);
    l.reset();
    CHECK(dbl().capture_status(captured) == int(CU_STREAM_CAPTURE_STATUS_ACTIVE));
    // The thread's own mode is put back: the application's, not libbubble's.
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    REQUIRE(drv().ThreadExchangeStreamCaptureMode(&mode) == CUDA_SUCCESS);
    CHECK(mode == CU_STREAM_CAPTURE_MODE_GLOBAL);
    REQUIRE(drv().ThreadExchangeStreamCaptureMode(&mode) == CUDA_SUCCESS);
  }
}
