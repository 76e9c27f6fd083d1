// The receive-wait bookkeeping on its own: handle lifetimes, stale and foreign pointers, and the
// pool running out, which NCCL can produce but a hub test cannot easily reach.
#include <doctest/doctest.h>

#include <vector>

#include "plugins/nccl_profiler/recv_waits.h"

using bb::nccl::RecvWaits;
using bb::nccl::Transition;

namespace {

struct CountingSink : bb::nccl::WaitSink {
  int begins = 0, ends = 0;
  void wait_begins() override { ++begins; }
  void wait_ends() override { ++ends; }
};

}  // namespace

TEST_CASE("recv_waits_channels_overlap_into_one_wait") {
  CountingSink sink;
  RecvWaits w(&sink);
  void* r = w.p2p_start(true, 3);
  w.stop(r);  // NCCL stops the task at enqueue, before its channels run
  void* k0 = w.kernel_channel_start(r, 0);
  void* k2 = w.kernel_channel_start(r, 2);
  CHECK(w.waiting() == 2);
  w.record(k2, Transition::kKernelChannelDone);
  w.stop(k2);
  void* k1 = w.kernel_channel_start(r, 1);
  w.stop(k0);
  w.stop(k1);
  CHECK(sink.begins == 1);
  CHECK(sink.ends == 1);
  CHECK(w.waiting() == 0);
  // All three channels are done and NCCL stopped the task: the record is free again, and a
  // late event naming it is ignored.
  CHECK(w.kernel_channel_start(r, 0) == nullptr);
  CHECK(sink.begins == 1);
}

TEST_CASE("recv_waits_ignore_pointers_that_are_not_theirs") {
  CountingSink sink;
  RecvWaits w(&sink);
  int foreign = 0;
  CHECK(w.kernel_channel_start(&foreign, 0) == nullptr);
  CHECK(w.proxy_step_start(&foreign) == nullptr);
  void* r = w.p2p_start(true, 1);
  // Inside the pool but not the start of a record, or a kernel slot passed as a proxy op.
  CHECK(w.kernel_channel_start(static_cast<char*>(r) + 8, 0) == nullptr);
  void* k = w.kernel_channel_start(r, 0);
  CHECK(w.proxy_step_start(k) == nullptr);
  CHECK(w.kernel_channel_start(r, RecvWaits::kChannels) == nullptr);
  w.record(&foreign, Transition::kKernelChannelDone);
  w.stop(&foreign);
  w.stop(nullptr);
  CHECK(w.waiting() == 1);
  w.stop(k);
  w.stop(k);  // a second stop of the same channel changes nothing
  CHECK(w.waiting() == 0);
  CHECK(sink.ends == 1);
  CHECK(w.p2p_start(false, 1) == nullptr);  // sends get no record
}

TEST_CASE("recv_waits_pool_exhaustion_reclaims_the_oldest_stopped_receive") {
  CountingSink sink;
  RecvWaits w(&sink);
  // v3 gives no channel count, so records are never known complete: the pool fills.
  std::vector<void*> recs;
  for (int i = 0; i < RecvWaits::kPoolSize; ++i) {
    recs.push_back(w.p2p_start(true, 0));
    REQUIRE(recs.back() != nullptr);
  }
  void* k = w.kernel_channel_start(recs[0], 0);
  CHECK(w.waiting() == 1);
  // Nothing stopped yet: nothing can be reclaimed.
  CHECK(w.p2p_start(true, 0) == nullptr);
  for (void* r : recs) w.stop(r);
  void* fresh = w.p2p_start(true, 0);
  REQUIRE(fresh != nullptr);
  CHECK(fresh != recs[0]);  // a new generation: the old handle no longer names it
  CHECK(w.records_reclaimed() == 1);
  CHECK(w.waiting() == 0);  // its wait ended with it
  CHECK(sink.ends == 1);
  // The oldest went: events naming it are ignored, the next oldest is still there.
  CHECK(w.kernel_channel_start(recs[0], 1) == nullptr);
  void* k1 = w.kernel_channel_start(recs[1], 1);
  CHECK(k1 != nullptr);
  w.stop(k1);
  w.stop(k);  // its late kernel stop belongs to an old generation
  CHECK(w.waiting() == 0);
  CHECK(sink.ends == 2);
}

TEST_CASE("recv_waits_a_late_event_of_a_reclaimed_receive_leaves_the_new_one_on_its_channel_alone") {
  CountingSink sink;
  RecvWaits w(&sink);
  std::vector<void*> recs;
  for (int i = 0; i < RecvWaits::kPoolSize; ++i) recs.push_back(w.p2p_start(true, 0));
  // The oldest receive's channel 3 runs, and its kernel and proxy op are still open when every
  // receive has been stopped by the host and the pool runs out.
  void* old_kernel = w.kernel_channel_start(recs[0], 3);
  void* old_op = w.proxy_op_start(recs[0], true, 3, false);
  void* old_step = w.proxy_step_start(old_op);
  REQUIRE(old_kernel != nullptr);
  REQUIRE(old_step != nullptr);
  for (void* r : recs) w.stop(r);
  void* fresh = w.p2p_start(true, 0);  // reuses the oldest's record
  REQUIRE(fresh != nullptr);
  REQUIRE(w.records_reclaimed() == 1);
  // The new receive waits on the same channel of the same record.
  void* kernel = w.kernel_channel_start(fresh, 3);
  void* op = w.proxy_op_start(fresh, true, 3, false);
  REQUIRE(kernel != nullptr);
  REQUIRE(op != nullptr);
  CHECK(w.waiting() == 1);
  // The old receive's late events (its data arriving, its kernel finishing, its host stop) end
  // nothing of the new one's.
  w.record(old_step, Transition::kRecvDataArrived);
  w.record(old_op, Transition::kRecvDataArrived);
  w.record(old_kernel, Transition::kKernelChannelDone);
  w.stop(old_kernel);
  w.stop(old_op);
  w.stop(recs[0]);
  CHECK(w.waiting() == 1);
  CHECK(w.proxy_step_start(old_op) == nullptr);
  // Its own events still do.
  void* step = w.proxy_step_start(op);
  REQUIRE(step != nullptr);
  w.record(step, Transition::kRecvDataArrived);
  CHECK(w.waiting() == 0);
  w.stop(kernel);
  w.stop(op);
  CHECK(sink.begins == 2);
  CHECK(sink.ends == 2);
}

TEST_CASE("recv_waits_reset_ends_an_open_wait") {
  CountingSink sink;
  RecvWaits w(&sink);
  void* r = w.p2p_start(true, 1);
  w.kernel_channel_start(r, 0);
  w.reset();
  CHECK(sink.ends == 1);
  CHECK(w.waiting() == 0);
  CHECK(w.waits_begun() == 1);
}
