#!/usr/bin/env bash
# Keras on PyTorch under tf_memguard, in one call on the lent H200 (Python 3.12, CUDA 13,
# PyTorch 2.11, no TensorFlow, no Keras: keras, namex and optree travel as wheels in .whl).
#   1. builds the core, the bindings and the PyTorch glue (setup.py; no TF plugin: no TF);
#   2. runs benchmarks/gpu/keras_torch.py; the JSON lands in $OUT
#      (then benchmarks/results/gpu_keras_torch.json).
# Run from the repository root:  bash benchmarks/gpu/run_keras_torch.sh
set -euo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | tee "$OUT/nvidia_smi.txt"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export KERAS_BACKEND=torch PYTHONUNBUFFERED=1
python3 -c "import torch, keras; print('torch', torch.__version__, 'keras', keras.__version__, 'gpus', torch.cuda.device_count())"
python3 setup.py -q build_ext --inplace 2>&1 | grep -iE "tf_memguard:|error" || true
ls tf_memguard/*.so
python3 benchmarks/gpu/keras_torch.py --out "$OUT" "$@" 2>&1 | tee "$OUT/keras_torch.txt"
