#!/usr/bin/env bash
# The libbubble demo: a simulated 4-stage 1F1B pipeline (one trainer_sim process and one hub per
# stage; the trainers sleep where GPUs would compute) with PageRank side tasks harvesting the
# bubbles, for about 20 seconds, then a summary.
#
#   bash examples/demo.sh [--duration-s N] [--no-setup]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
duration=20
setup=1
while (($#)); do
  case "$1" in
    --duration-s)
      [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "--duration-s ${2:-}: give a whole number of seconds, at least 1" >&2; exit 64; }
      duration="$2"; shift 2 ;;
    --no-setup) setup=0; shift ;;
    *) echo "usage: $0 [--duration-s N] [--no-setup]" >&2; exit 64 ;;
  esac
done
((setup)) && "$root/.ci/setup.sh" release
bin="$root/build/release"
py=/usr/bin/python3

run="$(mktemp -d /tmp/bubble-demo-XXXXXX)"
export BUBBLE_RUNTIME_DIR="$run/hubs"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$run"
}
trap cleanup EXIT INT TERM

# The node agent watches the hubs (it adopts the side tasks started below), polices pauses and
# draws the timeline. Its pause grace is raised from 5 ms to 25 ms here: the demo packs 4
# trainers, 5 side tasks and the agent onto whatever cores the machine has (2 on a small VM), so
# a task can be descheduled for a few milliseconds through no fault of its own.
"$bin/daemon/bubbled" --state-dir "$run/state" --metrics-port 0 --grace-ms 25 \
  > "$run/bubbled.log" 2>&1 &
pids+=($!)

stages=4
echo "== a ${stages}-stage 1F1B pipeline, 8 micro-batches, forward 4 ms, backward 8 ms per stage"
echo "   (trainer_sim sleeps where a GPU would compute; see examples/trainer_sim/README.md;
   it declares its schedule, and libbubble predicts every bubble's length)"
for ((r = 0; r < stages; r++)); do
  # Earlier stages hold more activations, so they have less free memory in their bubbles.
  "$bin/examples/trainer_sim/trainer_sim" --job demo --rank "$r" --stages "$stages" \
    --microbatches 8 --schedule 1f1b --fwd-ms 4 --bwd-ms 8 --free-mem-mib 16384 --predict --declare \
    --duration-s "$duration" --progress-s 5 --json > "$run/trainer$r.out" 2> "$run/trainer$r.err" &
  pids+=($!)
done
# Wait for the hubs, then attach an elastic PageRank task to each (it shrinks its last step of a
# bubble to the time left). Stage 0 gets a second task of the same priority: the two take turns
# (round-robin among equals). (Side tasks would use the GPU; here they use CPU cores, so the demo
# keeps their number near what the machine's cores can run.)
for ((r = 0; r < stages; r++)); do
  for _ in $(seq 100); do [ -S "$BUBBLE_RUNTIME_DIR/demo.$r.sock" ] && break; sleep 0.05; done
  "$bin/examples/c_task/c_task" --job demo --rank "$r" --name "pagerank-$r" --elastic \
    --chunk 20000 > "$run/task$r.out" 2>&1 &
  pids+=($!)
done
"$bin/examples/c_task/c_task" --job demo --rank 0 --name "pagerank-small" --nodes 50000 \
  --chunk 10000 > "$run/task0.small.out" 2>&1 &
pids+=($!)

start=$(date +%s)
svg="$bin/demo-timeline.svg"
drawn=0
while :; do
  alive=0
  for ((r = 1; r <= stages; r++)); do kill -0 "${pids[$r]}" 2>/dev/null && alive=1; done
  ((alive)) || break
  sleep 1
  now=$(($(date +%s) - start))
  ((now > duration + 30)) && { echo "trainers did not finish in time" >&2; exit 1; }
  if ((now % 5 == 0)); then
    line="$(tail -n 1 "$run/trainer0.err" 2>/dev/null || true)"
    [ -n "$line" ] && echo "   stage 0 $line"
  fi
  # Near the end, while the pipeline still runs, ask the agent for its view.
  if ((!drawn && now >= duration - 3)); then
    drawn=1
    echo "== the node agent's view (bubblectl status)"
    "$bin/daemon/bubblectl" status 2>&1 | sed 's/^/   /' || true
    "$bin/daemon/bubblectl" actions 2>&1 | tail -n 5 | sed 's/^/   /' || true
    "$bin/daemon/bubblectl" timeline --seconds 0.2 -o "$svg" > /dev/null 2>&1 &&
      echo "   timeline of the last 0.2 s (bubbles and side-task steps per hub): $svg"
  fi
done
for ((r = 1; r <= stages; r++)); do wait "${pids[$r]}"; done
sleep 0.3  # the side tasks notice their trainers closed and print their results

echo
echo "== side tasks"
cat "$run"/task*.out | sed 's/^/   /'
echo
"$py" - "$run" "$stages" <<'PY'
import json, os, sys
run, stages = sys.argv[1], int(sys.argv[2])
rows = []
for r in range(stages):
    with open(f"{run}/trainer{r}.out") as f:
        line = [l for l in f if l.startswith("SUMMARY ")][-1]
    rows.append(json.loads(line[len("SUMMARY "):]))
ms = lambda ns: ns / 1e6
us = lambda ns: ns / 1e3
print("== summary (per pipeline stage)")
print(f"{'stage':>5} {'bubbles':>8} {'bubble ms':>10} {'in bubbles':>11} {'outside':>9} "
      f"{'filled':>7} {'start p50/p99 us':>17} {'pause p50/p99 us':>17}")
tot = {k: 0 for k in ("bubbles", "bubble_ns", "task_ns_in_bubbles", "task_ns_outside")}
for s in rows:
    for k in tot: tot[k] += s[k]
    fill = 100.0 * s["task_ns_in_bubbles"] / s["bubble_ns"] if s["bubble_ns"] else 0
    print(f"{s['stage']:>5} {s['bubbles']:>8} {ms(s['bubble_ns']):>10.1f} "
          f"{ms(s['task_ns_in_bubbles']):>9.1f}ms {ms(s['task_ns_outside']):>7.1f}ms {fill:>6.1f}% "
          f"{us(s['start_latency_p50_ns']):>8.1f}/{us(s['start_latency_p99_ns']):<8.1f} "
          f"{us(s['pause_latency_p50_ns']):>8.1f}/{us(s['pause_latency_p99_ns']):<8.1f}")
fill = 100.0 * tot["task_ns_in_bubbles"] / tot["bubble_ns"] if tot["bubble_ns"] else 0
print(f"\nbubbles seen: {tot['bubbles']}, bubble time: {ms(tot['bubble_ns']):.0f} ms, "
      f"side-task time inside bubbles: {ms(tot['task_ns_in_bubbles']):.0f} ms ({fill:.1f}% of the "
      f"bubble time), outside bubbles: {ms(tot['task_ns_outside']):.0f} ms")
print("start latency = bubble begin to the task running; pause latency = bubble end to the task's "
      "ack, including the rest of the step it was in.")
print(f"The p99s count every start and pause, also those of a task that was not on a core when its "
      f"bubble began or ended: here {stages} trainers, 5 side tasks and the agent share "
      f"{os.cpu_count()} cores; where they outnumber the cores, a p99 of milliseconds is a task "
      f"waiting for a core (the medians show the usual case).")
if tot["bubbles"] == 0 or tot["task_ns_in_bubbles"] == 0:
    sys.exit("demo failed: no bubble was harvested")
PY
