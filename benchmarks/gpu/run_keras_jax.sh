#!/usr/bin/env bash
# Keras on JAX under tf_memguard (XLA's cap), in one call on the lent H200 (Python 3.12,
# CUDA 13, JAX 0.11 with its CUDA 13 plugin, no TensorFlow, no Keras: keras, namex and
# optree travel as wheels in .whl).
#   1. builds the core and the bindings (setup.py; no TF plugin: no TF);
#   2. runs benchmarks/gpu/keras_jax.py; the JSON lands in $OUT
#      (then benchmarks/results/gpu_keras_jax.json).
# Run from the repository root:  bash benchmarks/gpu/run_keras_jax.sh
set -euo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | tee "$OUT/nvidia_smi.txt"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1
python3 -c "import jax, keras; print('jax', jax.__version__, 'keras', keras.__version__, jax.devices())"
python3 setup.py -q build_ext --inplace 2>&1 | grep -iE "tf_memguard:|error" || true
python3 benchmarks/gpu/keras_jax.py --out "$OUT" "$@" 2>&1 | tee "$OUT/keras_jax.txt"
