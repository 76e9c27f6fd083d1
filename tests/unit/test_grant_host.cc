// The host grant backend through GrantLender, within one process and with a real second process.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/grant_lender.h"
#include "test_grant_support.h"

using namespace bb::core;
using bb::test::count_open_fds;
using bb::test::pattern_ok;
using bb::test::Peer;
using bb::test::peer_request;
using bb::test::PeerReply;
using bb::test::PeerRequest;

namespace {

std::unique_ptr<GrantLender> host_lender(uint64_t bytes, uint32_t max_grants = 16) {
  LendOptions o;
  o.backend = GrantBackend::kHost;
  o.bytes = bytes;
  o.max_grants = max_grants;
  std::unique_ptr<GrantLender> l;
  std::string err;
  REQUIRE_MESSAGE(GrantLender::create(o, &l, &err) == BB_OK, err);
  return l;
}

bool fd_open(int fd) { return fcntl(fd, F_GETFD) >= 0; }

const uint64_t kPage = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));

}  // namespace

TEST_CASE("host lender grants sealed close-on-exec memfds mapped into the lent range") {
  const int before = count_open_fds();
  {
    auto l = host_lender(16 * kPage);
    CHECK(l->capacity() == 16 * kPage);
    std::string err;
    Grant g;
    REQUIRE(l->grant(5000, 42, &g, &err) == BB_OK);
    CHECK(g.id != 0);
    CHECK(g.backend == GrantBackend::kHost);
    CHECK(g.size == 5000);
    CHECK(g.handle.map_size == 2 * kPage);
    CHECK(g.handle.device == -1);
    REQUIRE(g.handle.fd >= 0);
    CHECK(bb::test::cloexec(g.handle.fd));
    int seals = fcntl(g.handle.fd, F_GET_SEALS);
    CHECK((seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) ==
          (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL));
    CHECK(ftruncate(g.handle.fd, 0) != 0);
    CHECK(wire_copy(g).handle.fd == -1);
    CHECK(validate_grant(wire_copy(g), &err) == BB_OK);

    // The trainer's view and an importer's view are the same memory.
    uint64_t addr = l->address(g.id);
    REQUIRE(addr != 0);
    std::memset(reinterpret_cast<void*>(addr), 0x5a, g.size);
    std::unique_ptr<GrantMapping> m;
    REQUIRE(map_grant(wire_copy(g), g.handle.fd, &m, &err) == BB_OK);
    CHECK(static_cast<unsigned char*>(m->ptr())[4999] == 0x5a);
    static_cast<unsigned char*>(m->ptr())[0] = 0x11;
    CHECK(reinterpret_cast<unsigned char*>(addr)[0] == 0x11);
    REQUIRE(m->unmap(&err) == BB_OK);

    LenderStats s = l->stats();
    CHECK(s.active == 1);
    CHECK(s.granted_bytes == 2 * kPage);
    CHECK(s.requested_bytes == 5000);
    CHECK(s.free_bytes == 14 * kPage);

    int fd = g.handle.fd;
    REQUIRE(l->release(g.id, &err) == BB_OK);
    CHECK(!fd_open(fd));
    CHECK(l->address(g.id) == 0);
    CHECK(l->release(g.id, &err) == BB_E_NOT_FOUND);
    s = l->stats();
    CHECK(s.active == 0);
    CHECK(s.granted_bytes == 0);
    CHECK(s.free_bytes == s.capacity);
    CHECK(s.grants_made == 1);
  }
  CHECK(count_open_fds() == before);
}

TEST_CASE("host grants never overlap and refusals say why") {
  auto l = host_lender(8 * kPage, 4);
  std::string err;
  Grant a, b, c, d, e;
  REQUIRE(l->grant(3 * kPage, 1, &a, &err) == BB_OK);
  REQUIRE(l->grant(1, 1, &b, &err) == BB_OK);
  REQUIRE(l->grant(2 * kPage, 2, &c, &err) == BB_OK);
  CHECK(l->grant(3 * kPage, 3, &d, &err) == BB_E_NOMEM);
  CHECK(err.find(std::to_string(2 * kPage) + " of " + std::to_string(8 * kPage)) !=
        std::string::npos);
  REQUIRE(l->grant(kPage, 3, &d, &err) == BB_OK);
  CHECK(l->grant(1, 3, &e, &err) == BB_E_FULL);
  CHECK(err.find("max_grants") != std::string::npos);
  CHECK(l->grant(0, 3, &e, &err) == BB_E_INVALID);
  Grant all[] = {a, b, c, d};
  for (const Grant& x : all)
    for (const Grant& y : all)
      if (x.id != y.id)
        CHECK((x.offset + x.handle.map_size <= y.offset || y.offset + y.handle.map_size <= x.offset));
  // A dead owner's grants all come back.
  CHECK(l->release_owner(1) == 2);
  CHECK(l->stats().active == 2);
  CHECK(l->stats().granted_bytes == 3 * kPage);
  CHECK(l->stats().grants_failed == 3);
}

TEST_CASE("map_grant refuses descriptors and records that are not the grant") {
  auto l = host_lender(4 * kPage);
  std::string err;
  Grant g;
  REQUIRE(l->grant(2 * kPage, 1, &g, &err) == BB_OK);
  std::unique_ptr<GrantMapping> m;
  CHECK(map_grant(wire_copy(g), -1, &m, &err) == BB_E_INVALID);
  int p[2];
  REQUIRE(pipe2(p, O_CLOEXEC) == 0);
  CHECK(map_grant(wire_copy(g), p[0], &m, &err) == BB_E_CORRUPT);
  close(p[0]);
  close(p[1]);
  int small = memfd_create("small", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(ftruncate(small, kPage) == 0);
  CHECK(map_grant(wire_copy(g), small, &m, &err) == BB_E_CORRUPT);
  CHECK(err.find("not the grant's memory") != std::string::npos);
  close(small);
  Grant bad = wire_copy(g);
  bad.backend = static_cast<GrantBackend>(9);
  CHECK(map_grant(bad, g.handle.fd, &m, &err) == BB_E_CORRUPT);
  bad = wire_copy(g);
  bad.handle.map_size = bad.size - 1;
  CHECK(map_grant(bad, g.handle.fd, &m, &err) == BB_E_CORRUPT);
  CHECK(!m);
}

TEST_CASE("a host grant crosses to another process, which writes it and cannot shrink it") {
  const int before = count_open_fds();
  {
    auto l = host_lender(64 * kPage);
    Peer peer;
    REQUIRE(peer.start({}));
    std::string err;
    for (uint32_t round = 0; round < 3; ++round) {
      Grant g;
      REQUIRE(l->grant((round + 1) * 3 * kPage + 123, 7, &g, &err) == BB_OK);
      const PeerRequest req = peer_request(bb::test::kPeerMapWriteUnmap, g, 0xabc0 + round);
      const PeerReply rep = peer.exchange(req, g.handle.fd);
      CHECK_MESSAGE(rep.status == BB_OK, rep.error);
      CHECK(rep.grant_id == g.id);
      CHECK(rep.truncate_errno == EPERM);
      CHECK(rep.fds_after == rep.fds_before);  // the peer kept no descriptor
      CHECK(pattern_ok(l->address(g.id), g.size, req.seed));
      REQUIRE(l->release(g.id, &err) == BB_OK);
    }
    CHECK(l->stats().granted_bytes == 0);
    CHECK(peer.stop() == 0);
  }
  CHECK(count_open_fds() == before);
}

TEST_CASE("revocation: the range stays out of use until the holder acks") {
  auto l = host_lender(8 * kPage);
  Peer peer;
  REQUIRE(peer.start({}));
  std::string err;
  Grant g;
  REQUIRE(l->grant(4 * kPage, 1, &g, &err) == BB_OK);
  PeerRequest req = peer_request(bb::test::kPeerMapWriteHold, g, 77);
  PeerReply rep = peer.exchange(req, g.handle.fd);
  REQUIRE_MESSAGE(rep.status == BB_OK, rep.error);

  const uint64_t now = bb::test::now_ns();
  REQUIRE(l->revoke(g.id, now + 60'000'000'000ull, &err) == BB_OK);
  CHECK(l->revoke(g.id, now, &err) == BB_E_STATE);
  GrantState state{};
  REQUIRE(l->find(g.id, nullptr, &state) == BB_OK);
  CHECK(state == GrantState::kRevoking);
  uint64_t ids[4];
  CHECK(l->overdue(now, ids, 4) == 0);
  // While revoking, its range is not handed out: only the other half fits.
  Grant other;
  CHECK(l->grant(5 * kPage, 2, &other, &err) == BB_E_NOMEM);
  REQUIRE(l->grant(4 * kPage, 2, &other, &err) == BB_OK);
  CHECK((other.offset >= g.offset + 4 * kPage || other.offset + 4 * kPage <= g.offset));
  CHECK(l->stats().revoking == 1);
  CHECK(l->stats().revoking_bytes == 4 * kPage);

  req.op = bb::test::kPeerRevoke;
  rep = peer.exchange(req);
  CHECK_MESSAGE(rep.status == BB_OK, rep.error);
  CHECK(pattern_ok(l->address(g.id), g.size, 77));
  REQUIRE(l->release(g.id, &err) == BB_OK);
  Grant again;
  REQUIRE(l->grant(4 * kPage, 3, &again, &err) == BB_OK);
  CHECK(again.offset == g.offset);
  CHECK(again.id != g.id);
  CHECK(peer.stop() == 0);
}

TEST_CASE("revocation: a holder that ignores REVOKE is overdue, killed, then released") {
  auto l = host_lender(4 * kPage);
  Peer peer;
  REQUIRE(peer.start({}, "ignore-revoke"));
  std::string err;
  Grant g;
  REQUIRE(l->grant(4 * kPage, 9, &g, &err) == BB_OK);
  PeerRequest req = peer_request(bb::test::kPeerMapWriteHold, g, 5);
  const PeerReply rep = peer.exchange(req, g.handle.fd);
  REQUIRE_MESSAGE(rep.status == BB_OK, rep.error);

  const uint64_t deadline = bb::test::now_ns();
  REQUIRE(l->revoke(g.id, deadline, &err) == BB_OK);
  req.op = bb::test::kPeerRevoke;
  REQUIRE(peer.send(req, -1, &err));
  CHECK(!peer.readable(200));  // no ack comes
  uint64_t ids[2] = {};
  REQUIRE(l->overdue(deadline, ids, 2) == 1);
  CHECK(ids[0] == g.id);
  Grant none;
  CHECK(l->grant(kPage, 1, &none, &err) == BB_E_NOMEM);  // still not reusable

  int status = peer.kill_now();
  CHECK(WIFSIGNALED(status));
  CHECK(pattern_ok(l->address(g.id), g.size, 5));  // the trainer's view survived the task
  REQUIRE(l->release(g.id, &err) == BB_OK);
  CHECK(l->overdue(deadline, ids, 2) == 0);
  CHECK(l->stats().granted_bytes == 0);
  REQUIRE(l->grant(kPage, 1, &none, &err) == BB_OK);
}

// The trainer asks with room for 64 ids and asks again when told there are more: overdue()
// counts every overdue grant even when only `cap` fit, and leaves out none that fit.
TEST_CASE("revocation: overdue counts past what fits, and a second ask gets them all") {
  auto l = host_lender(8 * kPage);
  std::string err;
  const uint64_t now = bb::test::now_ns();
  std::vector<uint64_t> made;
  for (uint64_t owner = 1; owner <= 5; ++owner) {
    Grant g;
    REQUIRE(l->grant(kPage, owner, &g, &err) == BB_OK);
    made.push_back(g.id);
  }
  // Three overdue, one revoking with a later deadline, one held: only the three count.
  for (size_t k = 0; k < 3; ++k) REQUIRE(l->revoke(made[k], now - 1000 + k, &err) == BB_OK);
  REQUIRE(l->revoke(made[3], now + 60'000'000'000ull, &err) == BB_OK);
  uint64_t few[2] = {0, 0};
  CHECK(l->overdue(now, few, 2) == 3);
  for (uint64_t id : few) CHECK(std::find(made.begin(), made.begin() + 3, id) != made.begin() + 3);
  CHECK(few[0] != few[1]);
  std::vector<uint64_t> all(3);
  REQUIRE(l->overdue(now, all.data(), all.size()) == 3);
  std::sort(all.begin(), all.end());
  std::vector<uint64_t> want(made.begin(), made.begin() + 3);
  std::sort(want.begin(), want.end());
  CHECK(all == want);
  CHECK(l->overdue(now, nullptr, 0) == 3);  // a count alone writes nothing
  REQUIRE(l->release(made[1], &err) == BB_OK);
  CHECK(l->overdue(now, all.data(), all.size()) == 2);
}

TEST_CASE("host: a live grant's bytes are copied out, a released one's never") {
  const int before = count_open_fds();
  {
    auto l = host_lender(8 * kPage);
    std::string err;
    Grant g;
    REQUIRE_MESSAGE(l->grant(2 * kPage + 100, 1, &g, &err) == BB_OK, err);
    auto* w = reinterpret_cast<uint32_t*>(l->address(g.id));
    for (uint64_t i = 0; i < g.size / 4; ++i) w[i] = bb::test::pattern_word(17, i);
    std::vector<uint32_t> out(g.size / 4);
    REQUIRE_MESSAGE(l->read(g.id, 0, out.data(), g.size, &err) == BB_OK, err);
    CHECK(pattern_ok(reinterpret_cast<uint64_t>(out.data()), g.size, 17));
    REQUIRE(l->read(g.id, 12, out.data(), 4, &err) == BB_OK);  // any offset, any length
    CHECK(out[0] == bb::test::pattern_word(17, 3));
    // The grant's bytes, not the page-rounded range's.
    CHECK(l->read(g.id, g.size - 1, out.data(), 2, &err) == BB_E_INVALID);
    CHECK(l->read(g.id + 1, 0, out.data(), 4, &err) == BB_E_NOT_FOUND);
    REQUIRE(l->release(g.id, &err) == BB_OK);
    CHECK(l->read(g.id, 0, out.data(), 4, &err) == BB_E_NOT_FOUND);
    CHECK(err.find("its task gave it back, left or died") != std::string::npos);
    // Larger than one piece (4 MiB): copied whole, piece after piece.
    auto big = host_lender(16ull << 20);
    Grant b;
    REQUIRE_MESSAGE(big->grant(10ull << 20, 1, &b, &err) == BB_OK, err);
    auto* bw = reinterpret_cast<uint32_t*>(big->address(b.id));
    for (uint64_t i = 0; i < b.size / 4; ++i) bw[i] = bb::test::pattern_word(23, i);
    std::vector<uint32_t> all(b.size / 4);
    REQUIRE_MESSAGE(big->read(b.id, 0, all.data(), b.size, &err) == BB_OK, err);
    CHECK(pattern_ok(reinterpret_cast<uint64_t>(all.data()), b.size, 23));
  }
  CHECK(count_open_fds() == before);
}
