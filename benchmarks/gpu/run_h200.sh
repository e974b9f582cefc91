#!/usr/bin/env bash
# The GPU proof, in one call on the lent H200 (Python 3.12, CUDA 13, PyTorch, no TensorFlow):
#   1. builds the core and the Python bindings (setup.py skips the TensorFlow plugin: no TF),
#      and checks from Python that a pool over CUDA memory serves and refuses;
#   2. builds benchmarks/gpu/gpu_proof.cu against the core and runs it on the traces of
#      benchmarks/alloc_latency.py; the JSON lands in $OUT (then benchmarks/results/gpu_h200.json).
# Run from the repository root:  bash benchmarks/gpu/run_h200.sh
# (TFMG_SKIP_PYTHON=1 skips step 1's Python build and check, for a run of the proof alone.
#  TFMG_SEEDS=1,2,...: then also the smallest budgets, the pool's and CNMeM's, of the churn
#  kinds made with those seeds: $OUT/gpu_h200_seeds.json.)
set -euo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT" /tmp/tfmg_build /tmp/tfmg_traces
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/nvidia_smi.txt"

echo "== core (CMake) and bindings (setup.py, no TensorFlow)"
cmake -S . -B /tmp/tfmg_build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build /tmp/tfmg_build -j 16 --target tfmg_core pool_test >/dev/null
/tmp/tfmg_build/pool_test | tail -1
if [ "${TFMG_SKIP_PYTHON:-0}" = 1 ]; then
  echo "(the Python build and check skipped: TFMG_SKIP_PYTHON=1)"
else
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; fi
python3 setup.py -q build_ext --inplace 2>&1 | grep -iE "warning: tf_memguard|error" || true
python3 - <<'PY'
import tf_memguard
p = tf_memguard.Pool(max_bytes=1 << 30, upstream="cuda")
a = p.allocate(100 << 20)
assert a % 256 == 0
try:
    p.allocate(2 << 30)
    raise SystemExit("over-budget request was not refused")
except tf_memguard.OutOfBudgetError as e:
    print("refused as expected:", e)
p.free(a)
print("python: CUDA pool ok;", p.describe(), "; total memory", tf_memguard.format_bytes(p.total_memory()))
PY
fi

echo "== gpu_proof"
python3 benchmarks/gpu/dump_traces.py /tmp/tfmg_traces ${TFMG_SEEDS:+--seeds "$TFMG_SEEDS"} >/dev/null
# CNMeM beside the pool when a snapshot of NVIDIA/cnmem is carried in .cnmem/ (cnmem.h,
# cnmem.cpp; never committed): its cudaMemPrefetchAsync call takes CUDA 13's form
# (a cudaMemLocation and flags) in a copy made here.
CNMEM=()
if [ -f .cnmem/cnmem.cpp ]; then
  mkdir -p /tmp/cnmem && cp .cnmem/cnmem.h .cnmem/cnmem.cpp /tmp/cnmem/
  sed -i 's/cudaMemPrefetchAsync(data, size, mDevice)/cudaMemPrefetchAsync(data, size, cudaMemLocation{cudaMemLocationTypeDevice, mDevice}, 0)/' /tmp/cnmem/cnmem.cpp
  CNMEM=(-DTFMG_WITH_CNMEM -I/tmp/cnmem -x cu /tmp/cnmem/cnmem.cpp)
  echo "with CNMeM ($(grep -c . /tmp/cnmem/cnmem.cpp) lines)"
fi
nvcc -O2 -std=c++17 -arch=sm_90 -I. "${CNMEM[@]}" -x cu benchmarks/gpu/gpu_proof.cu -L/tmp/tfmg_build -ltfmg_core \
  -Xlinker -rpath,/tmp/tfmg_build -lpthread -o /tmp/gpu_proof
/tmp/gpu_proof /tmp/tfmg_traces "$OUT/gpu_h200_raw.json" | tee "$OUT/gpu_proof.txt"
if [ -n "${TFMG_SEEDS:-}" ]; then
  echo "== smallest budgets on seeds $TFMG_SEEDS"
  /tmp/gpu_proof /tmp/tfmg_traces "$OUT/gpu_h200_seeds.json" seeds | tee "$OUT/gpu_proof_seeds.txt"
fi
