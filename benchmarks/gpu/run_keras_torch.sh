#!/usr/bin/env bash
# Keras on PyTorch under tf_memguard, in one call on the lent H200 (Python 3.12, CUDA 13,
# PyTorch 2.11, no TensorFlow, no Keras: keras, namex and optree travel as wheels in .whl).
#   1. builds the core, the bindings and the PyTorch glue (setup.py; no TF plugin: no TF);
#   2. runs benchmarks/gpu/keras_torch.py; the JSON lands in $OUT
#      (then benchmarks/results/gpu_keras_torch.json).
# Run from the repository root:  bash benchmarks/gpu/run_keras_torch.sh
set -euo pipefail
source benchmarks/gpu/gpu_env.sh
export KERAS_BACKEND=torch
python3 -c "import torch, keras; print('torch', torch.__version__, 'keras', keras.__version__, 'gpus', torch.cuda.device_count())"
ls tf_memguard/*.so
python3 benchmarks/gpu/keras_torch.py --out "$OUT" "$@" 2>&1 | tee "$OUT/keras_torch.txt"
