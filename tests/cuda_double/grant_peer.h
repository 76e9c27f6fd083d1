// The wire protocol between grant tests and bubble_grant_peer, a stand-in side task.
//
// The test (exporter) and the peer (importer) share a SOCK_SEQPACKET socket, which the peer
// inherits as a descriptor number given on its command line. Each PeerRequest may carry the
// grant's descriptor; each is answered by one PeerReply, except a revoke when the peer was
// started with "ignore-revoke" (it then never answers, like a task that hangs).
#pragma once

#include <cstdint>

#include "core/grant.h"
#include "tests/cuda_double/cuda_double.h"

namespace bb::test {

enum PeerOp : uint32_t {
  kPeerMapWriteUnmap = 1,  // map, fill with the pattern, unmap, reply
  kPeerMapWriteHold = 2,   // map, fill with the pattern, reply, keep the mapping
  kPeerRevoke = 3,         // unmap the held grant, reply (the ack)
};

struct PeerRequest {
  uint32_t op = 0;
  uint32_t seed = 0;
  core::Grant grant;
};

struct PeerReply {
  int32_t status = 0;          // bb_status of the peer's work
  int32_t truncate_errno = 0;  // host grants: errno of ftruncate(fd, 0) on the received fd
  uint64_t grant_id = 0;
  int32_t fds_before = 0;      // open descriptors before the request arrived
  int32_t fds_after = 0;       // and after it was handled (the received fd closed)
  uint32_t counts_valid = 0;   // 1 when the peer's driver is the double
  uint32_t was_zero = 0;       // map requests: 1 when every byte of the grant read 0 when mapped
  bbdouble_counts counts{};    // the peer's double after the request
  char error[512] = {};
};

// The pattern a peer writes: word i of the grant holds pattern_word(seed, i).
inline uint32_t pattern_word(uint32_t seed, uint64_t i) {
  return seed ^ static_cast<uint32_t>(i * 2654435761u);
}

}  // namespace bb::test
