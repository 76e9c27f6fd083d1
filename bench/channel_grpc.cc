// gRPC on loopback: the waker makes one unary call per signal; the waiter is an async server
// whose completion queue it blocks on (Next) or polls (AsyncNext with a deadline of now).
// This is how FreeRide signals its side tasks.
#include "channel.h"

#ifdef BENCH_HAVE_GRPC

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdio>

#include "bench_support.h"
#include "signal.grpc.pb.h"

namespace bench {
namespace {

struct PortBox {
  std::atomic<int> port{0};
};

class GrpcChannel : public Channel {
 public:
  GrpcChannel() = default;
  const char* name() const override { return "gRPC unary call (loopback)"; }
  bool supports(bool) const override { return true; }
  bool prepare(bool, std::string*) override {
    box_ = std::make_unique<Shared<PortBox>>();
    return true;
  }
  void cleanup() override { box_.reset(); }

  bool setup_waker(std::string* why) override {
    if (!wait_for([&] { return (*box_)->port.load() != 0; }, 10'000'000'000ull)) {
      *why = "the gRPC server did not start";
      return false;
    }
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string((*box_)->port.load()),
                                   grpc::InsecureChannelCredentials());
    if (!channel_->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
      *why = "cannot connect to the gRPC server";
      return false;
    }
    stub_ = bench::Signal::NewStub(channel_);
    return true;
  }
  bool signal() override {
    grpc::ClientContext ctx;
    bench::Wake req;
    bench::Ack rep;
    req.set_seq(++seq_);
    return stub_->Send(&ctx, req, &rep).ok();
  }

  int run_waiter(bool busy, const std::function<void()>& ready,
                 const std::function<bool()>& on_wake) override {
    bench::Signal::AsyncService service;
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service);
    std::unique_ptr<grpc::ServerCompletionQueue> cq = b.AddCompletionQueue();
    std::unique_ptr<grpc::Server> server = b.BuildAndStart();
    if (!server || port == 0) return 1;

    struct Call {
      grpc::ServerContext ctx;
      bench::Wake req;
      bench::Ack rep;
      grpc::ServerAsyncResponseWriter<bench::Ack> writer{&ctx};
      bool finishing = false;
    };
    auto request = [&] {
      Call* c = new Call;
      service.RequestSend(&c->ctx, &c->req, &c->writer, cq.get(), cq.get(), c);
    };
    request();
    (*box_)->port.store(port);
    ready();
    // After the last signal, run until its reply has gone out.
    bool more = true;
    for (;;) {
      void* tag = nullptr;
      bool ok = false;
      if (busy) {
        const auto st = cq->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
        if (st == grpc::CompletionQueue::TIMEOUT) {
          __builtin_ia32_pause();
          continue;
        }
        if (st != grpc::CompletionQueue::GOT_EVENT) break;
      } else if (!cq->Next(&tag, &ok)) {
        break;
      }
      Call* c = static_cast<Call*>(tag);
      if (c->finishing || !ok) {
        delete c;
        if (!more) break;
        continue;
      }
      more = on_wake();
      if (more) request();
      c->finishing = true;
      c->writer.Finish(c->rep, grpc::Status::OK, c);
    }
    // Let the last reply go out before the server goes away.
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    cq->Shutdown();
    void* tag;
    bool ok;
    while (cq->Next(&tag, &ok)) delete static_cast<Call*>(tag);
    return 0;
  }

 private:
  std::unique_ptr<Shared<PortBox>> box_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<bench::Signal::Stub> stub_;
  uint64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<Channel> make_grpc_channel() { return std::make_unique<GrpcChannel>(); }

}  // namespace bench

#else  // !BENCH_HAVE_GRPC

namespace bench {
namespace {

class MissingGrpc : public Channel {
 public:
  const char* name() const override { return "gRPC"; }
  bool supports(bool) const override { return true; }
  bool prepare(bool, std::string* why) override {
    *why = "not built: CMake found no gRPC/protobuf (Debian: libgrpc++-dev, "
           "protobuf-compiler-grpc)";
    return false;
  }
  bool setup_waker(std::string*) override { return false; }
  bool signal() override { return false; }
  int run_waiter(bool, const std::function<void()>&, const std::function<bool()>&) override {
    return 1;
  }
};

}  // namespace

std::unique_ptr<Channel> make_grpc_channel() { return std::make_unique<MissingGrpc>(); }

}  // namespace bench

#endif
