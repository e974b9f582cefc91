#!/usr/bin/env bash
# Three Keras-on-PyTorch trainings at once on the one lent H200, each in a 2 GiB slice of
# its own (tf_memguard.install(max_bytes=2GiB, device="cuda:0")), one with a batch too
# large for its slice: benchmarks/gpu/shared_gpu.py; the JSON lands in $OUT
# (then benchmarks/results/gpu_shared.json).
# Run from the repository root:  bash benchmarks/gpu/run_shared_gpu.sh
set -euo pipefail
source benchmarks/gpu/gpu_env.sh
export KERAS_BACKEND=torch
python3 -c "import torch, keras; print('torch', torch.__version__, 'keras', keras.__version__, 'gpus', torch.cuda.device_count())"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv || true
python3 benchmarks/gpu/shared_gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/shared_gpu.txt"
