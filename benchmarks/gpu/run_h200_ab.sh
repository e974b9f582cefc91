#!/usr/bin/env bash
# Two builds of the core timed alternately on the lent H200, after the full proof of this
# one (run_h200.sh): `bash benchmarks/gpu/run_h200_ab.sh OLD_SRC [PAIRS]`, where OLD_SRC
# holds the other core's CMakeLists.txt, cc/ and tests/cc (a copy of an earlier commit's,
# carried with the call, never committed). gpu_proof's `timing` mode runs the pool's
# traces only (a few seconds); PAIRS (default 9) times this core, then the other, each
# pass a fresh process. The host's timings move 1.5-2x from pass to pass on this machine
# (benchmarks/NOTES.md), so a figure is the median of many alternated passes, and the
# comparison is their ratio. Writes $OUT/gpu_h200_ab.json: every pass's figures, the
# medians, their ratios, the host's processor and load.
set -euo pipefail
OLD=${1:?usage: run_h200_ab.sh OLD_SRC [PAIRS]}
PAIRS=${2:-9}
OUT=${OUT:-/tmp/gpu_out}
TFMG_SKIP_PYTHON=1 bash benchmarks/gpu/run_h200.sh
echo "== the other core ($OLD)"
cmake -S "$OLD" -B /tmp/tfmg_old_build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build /tmp/tfmg_old_build -j 16 --target tfmg_core >/dev/null
nvcc -O2 -std=c++17 -arch=sm_90 -I. -x cu benchmarks/gpu/gpu_proof.cu -L/tmp/tfmg_old_build -ltfmg_core \
  -Xlinker -rpath,/tmp/tfmg_old_build -lpthread -o /tmp/gpu_proof_old
nvcc -O2 -std=c++17 -arch=sm_90 -I. -x cu benchmarks/gpu/gpu_proof.cu -L/tmp/tfmg_build -ltfmg_core \
  -Xlinker -rpath,/tmp/tfmg_build -lpthread -o /tmp/gpu_proof_new
for i in $(seq 1 "$PAIRS"); do
  /tmp/gpu_proof_new /tmp/tfmg_traces "$OUT/ab_new_$i.json" timing > /dev/null
  /tmp/gpu_proof_old /tmp/tfmg_traces "$OUT/ab_old_$i.json" timing > /dev/null
done
python3 - "$OUT" "$PAIRS" <<'PY'
import json, os, platform, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
new = [json.load(open(f"{out}/ab_new_{i}.json")) for i in range(1, pairs + 1)]
old = [json.load(open(f"{out}/ab_old_{i}.json")) for i in range(1, pairs + 1)]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
summary = {"pairs": pairs, "cpu": cpu, "loadavg": open("/proc/loadavg").read().split()[:3], "traces": {}}
print(f"{'trace':<12} {'this core':>10} {'other':>10} {'ratio':>7}  (median ns/op of {pairs} alternated passes)")
for k in new[0]:
    n, o = statistics.median(r[k] for r in new), statistics.median(r[k] for r in old)
    summary["traces"][k] = {"this_core_ns_per_op": [r[k] for r in new], "other_core_ns_per_op": [r[k] for r in old],
                            "this_core_median": n, "other_core_median": o, "ratio": round(n / o, 3)}
    print(f"{k:<12} {n:10.1f} {o:10.1f} {n / o:7.3f}")
json.dump(summary, open(f"{out}/gpu_h200_ab.json", "w"), indent=1)
for i in range(1, pairs + 1):
    os.remove(f"{out}/ab_new_{i}.json")
    os.remove(f"{out}/ab_old_{i}.json")
print("cpu:", cpu, "load:", summary["loadavg"])
PY
