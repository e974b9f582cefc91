#!/usr/bin/env bash
# The proof (run_h200.sh, without the Python check), then the pool's timing passes
# (gpu_proof ... timing: one untimed replay and three timed per trace, a fresh process per
# pass) alternately pinned to one CPU (taskset) and free to move, PAIRS of each. Asks
# whether the 1.5-2x spread between passes on the lent machines' hosts is the process
# moving between CPUs, and gives the best and median figures of each kind of pass.
# Writes $OUT/gpu_h200_pinned.json. Run from the repository root:
#   bash benchmarks/gpu/run_h200_pinned.sh [PAIRS]
set -euo pipefail
PAIRS=${1:-8}
OUT=${OUT:-/tmp/gpu_out}
TFMG_SKIP_PYTHON=1 bash benchmarks/gpu/run_h200.sh
CPU=$(( $(nproc) / 2 ))
echo "== $PAIRS pairs of timing passes: pinned to CPU $CPU, and free"
for i in $(seq 1 "$PAIRS"); do
  taskset -c "$CPU" /tmp/gpu_proof /tmp/tfmg_traces "$OUT/pin_$i.json" timing > /dev/null
  /tmp/gpu_proof /tmp/tfmg_traces "$OUT/free_$i.json" timing > /dev/null
done
python3 - "$OUT" "$PAIRS" "$CPU" <<'PY'
import json, os, platform, statistics, sys
out, pairs, cpu_index = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pin = [json.load(open(f"{out}/pin_{i}.json")) for i in range(1, pairs + 1)]
free = [json.load(open(f"{out}/free_{i}.json")) for i in range(1, pairs + 1)]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
summary = {"pairs": pairs, "pinned_to_cpu": cpu_index, "cpu": cpu, "nproc": os.cpu_count(),
           "loadavg": open("/proc/loadavg").read().split()[:3], "traces": {}}
print(f"{'trace':<12} {'pinned: best':>13} {'median':>8} {'free: best':>11} {'median':>8}   (ns/op, {pairs} passes each)")
for k in pin[0]:
    p, f = [r[k] for r in pin], [r[k] for r in free]
    summary["traces"][k] = {"pinned_ns_per_op": p, "free_ns_per_op": f,
                            "pinned_best": min(p), "pinned_median": statistics.median(p),
                            "free_best": min(f), "free_median": statistics.median(f)}
    print(f"{k:<12} {min(p):13.1f} {statistics.median(p):8.1f} {min(f):11.1f} {statistics.median(f):8.1f}")
json.dump(summary, open(f"{out}/gpu_h200_pinned.json", "w"), indent=1)
for i in range(1, pairs + 1):
    os.remove(f"{out}/pin_{i}.json")
    os.remove(f"{out}/free_{i}.json")
print("cpu:", cpu, "nproc:", os.cpu_count(), "load:", summary["loadavg"])
PY
