# The control protocol between bubblectl (or any client) and bubbled, the node agent.
#
# Framing on the Unix stream socket: every message is a 4-byte little-endian length followed by
# that many bytes of one Cap'n Proto message in the standard (unpacked) serialization, segment
# table included. The length is a multiple of 8 and at most maxFrameBytes. A frame that breaks
# any of these rules, or does not decode, gets an Error reply and the connection is closed.
#
# The first request on a connection must be `hello`; the agent refuses any other protocol
# version. After that, a client sends one Request at a time and reads one Response per Request.
# Fields are only ever added at the end of a struct (Cap'n Proto keeps older readers working).

@0xcf40e014fb6c59c8;

$import "/capnp/c++.capnp".namespace("bb::proto");

const protocolVersion :UInt32 = 1;
const maxFrameBytes :UInt32 = 16777216;

struct Request {
  id @0 :UInt64;  # echoed in the Response
  union {
    hello @1 :Hello;
    submit @2 :TaskSpec;
    list @3 :ListRequest;
    status @4 :Void;
    cancel @5 :UInt64;         # task id
    drain @6 :DrainRequest;
    logs @7 :LogsRequest;
    events @8 :EventsRequest;  # the hubs' event logs, for trace and timeline
    actions @9 :UInt32;        # the last N enforcement actions (0 = all kept, at most 10000)
  }
}

struct Response {
  id @0 :UInt64;
  union {
    error @1 :Error;
    hello @2 :HelloReply;
    submit @3 :UInt64;         # the new task's id, durable once this reply is sent
    list @4 :List(TaskRecord);
    status @5 :StatusReply;
    ok @6 :Text;               # what was done, in one sentence
    logs @7 :LogsReply;
    events @8 :EventsReply;
    actions @9 :List(Action);
  }
  # list: the oldest records left out to keep the reply inside one frame (0: none). They stay in
  # the agent's records; `list` without `all` shows only queued and live tasks.
  omitted @10 :UInt32;
}

struct Error {
  code @0 :Code;
  message @1 :Text;  # what is wrong and what to do
  enum Code {
    badFrame @0;       # malformed, truncated or oversized frame: the connection is closed
    badVersion @1;
    badRequest @2;
    permission @3;
    notFound @4;
    state @5;
    internal @6;
  }
}

struct Hello {
  protocolVersion @0 :UInt32;
  client @1 :Text;
}

struct HelloReply {
  protocolVersion @0 :UInt32;
  agentVersion @1 :Text;
  pid @2 :Int32;
  metricsPort @3 :UInt16;  # 0 = metrics disabled
  runtimeDir @4 :Text;
  stateDir @5 :Text;
}

struct TaskSpec {
  name @0 :Text;
  argv @1 :List(Text);
  env @2 :List(Text);            # extra KEY=VALUE pairs on top of the agent's environment
  cwd @3 :Text;                  # "" = the agent's working directory
  hub @4 :Text;                  # "auto" or "JOB:RANK"
  gpu @5 :Int32 = -1;            # device for CUDA_VISIBLE_DEVICES; -1 = the hub's device
  priority @6 :Int32;
  memNeed @7 :UInt64;            # device bytes the task needs during a bubble
  mpsPriority @8 :Int32 = -1;    # CUDA_MPS_CLIENT_PRIORITY (0 normal, 1 below normal); -1 = unset
  mpsMemLimit @9 :Text;          # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT value, e.g. "2G"; "" = unset
}

struct TaskRecord {
  id @0 :UInt64;
  spec @1 :TaskSpec;
  state @2 :Text;        # queued, running, stopped, finished, failed, killed, cancelled, lost
  origin @3 :Text;       # submitted, or attached (started outside the agent)
  hub @4 :Text;          # where it runs or last ran ("" = not placed)
  pid @5 :Int32;
  exitCode @6 :Int32;    # valid when state is finished or failed
  signal @7 :Int32;      # the signal that ended it, 0 if none
  violations @8 :UInt32; # pauses it did not ack in time
  attempts @9 :UInt32;   # launches (re-placement after a hub went away adds one)
  submittedAt @10 :Int64;  # wall clock, Unix ms
  startedAt @11 :Int64;
  endedAt @12 :Int64;
  message @13 :Text;     # why it is in its state
  steps @14 :UInt64;
  nsInBubbles @15 :UInt64;
  nsOutside @16 :UInt64;  # its step time that ran past bubbles' ends
}

struct ListRequest {
  all @0 :Bool;  # include finished records (default: only queued and live ones)
}

struct HubStatus {
  name @0 :Text;  # JOB:RANK
  trainerPid @1 :Int32;
  alive @2 :Bool;
  draining @3 :Bool;
  bubbles @4 :UInt64;
  bubbleNs @5 :UInt64;
  bubblesPerSec @6 :Float64;   # over the last sampling window
  harvestedNs @7 :UInt64;      # side-task step time inside bubbles
  tasks @8 :UInt32;            # attached now
  memGranted @9 :UInt64;       # summed memNeed of tasks placed or attached here
  freeMem @10 :UInt64;         # of the last bubble (UINT64_MAX = unknown)
  inBubble @11 :Bool;
  gpu @12 :Int32;
}

struct StatusReply {
  hubs @0 :List(HubStatus);
  queued @1 :UInt32;
  running @2 :UInt32;
  draining @3 :Bool;   # the agent launches no queued task
  actions @4 :UInt64;  # enforcement actions recorded
  pruned @5 :UInt64;     # ended tasks deleted from the records (over the records' life)
  keepEnded @6 :UInt32;  # how many ended tasks the agent keeps (bubbled --keep-ended)
}

struct DrainRequest {
  hub @0 :Text;   # "" = the whole agent
  undo @1 :Bool;  # undrain
}

struct LogsRequest {
  task @0 :UInt64;
  stderr @1 :Bool;
  maxBytes @2 :UInt32 = 65536;  # the tail, or what follows `offset`
  offset @3 :Int64 = -1;        # >= 0: up to maxBytes from this byte of the log (following it)
}

struct LogsReply {
  path @0 :Text;
  data @1 :Data;
  truncated @2 :Bool;  # the tail only: earlier bytes were left out
  end @3 :UInt64;      # the byte after `data`: the offset to ask from next
  final @4 :Bool;      # the task has ended: nothing more will be written
  dropped @5 :UInt64;  # bytes of the oldest output the agent dropped to keep the log within
                       # bubbled --log-max-bytes (the log's offsets still count them)
}

struct EventsRequest {
  seconds @0 :Float64 = 10;  # how far back
}

struct HubEvents {
  hub @0 :Text;
  taskNames @1 :List(SlotName);
  tsNs @2 :List(UInt64);   # CLOCK_MONOTONIC, parallel lists (compact)
  type @3 :List(UInt16);
  slot @4 :List(UInt16);
  a @5 :List(UInt64);
  b @6 :List(UInt64);
  lost @7 :UInt64;         # events overwritten before the agent read them
}

struct SlotName {
  slot @0 :UInt16;
  name @1 :Text;
}

struct EventsReply {
  nowNs @0 :UInt64;
  hubs @1 :List(HubEvents);
}

struct Action {
  atMs @0 :Int64;    # wall clock, Unix ms
  task @1 :UInt64;   # 0 if the task is not the agent's
  pid @2 :Int32;
  hub @3 :Text;
  action @4 :Text;   # stop, continue, kill, replace, cancel
  detail @5 :Text;
}
