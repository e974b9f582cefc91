#!/usr/bin/env bash
# One budget per GPU on nvidia-h200-x2 (issue 18; not yet lent, so not yet run): Keras on JAX
# with DataParallel over both GPUs, two Keras-on-PyTorch processes (one per GPU, each its
# own budget), and one process with a pool on each GPU: benchmarks/gpu/multi_gpu.py; the
# JSON lands in $OUT (then benchmarks/results/gpu_multi.json). NVLink multicast stays off
# (the device README): nothing here asks for it.
# Run from the repository root:  bash benchmarks/gpu/run_multi_gpu.sh
set -euo pipefail
source benchmarks/gpu/gpu_env.sh
python3 -c "import torch, jax, keras; print('torch', torch.__version__, 'jax', jax.__version__, 'keras', keras.__version__, 'gpus', torch.cuda.device_count())"
python3 benchmarks/gpu/multi_gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/multi_gpu.txt"
