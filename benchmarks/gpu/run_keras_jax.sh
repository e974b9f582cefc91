#!/usr/bin/env bash
# Keras on JAX under tf_memguard (XLA's cap), in one call on the lent H200 (Python 3.12,
# CUDA 13, JAX 0.11 with its CUDA 13 plugin, no TensorFlow, no Keras: keras, namex and
# optree travel as wheels in .whl).
#   1. builds the core and the bindings (setup.py; no TF plugin: no TF);
#   2. runs benchmarks/gpu/keras_jax.py; the JSON lands in $OUT
#      (then benchmarks/results/gpu_keras_jax.json).
# Run from the repository root:  bash benchmarks/gpu/run_keras_jax.sh
set -euo pipefail
source benchmarks/gpu/gpu_env.sh
export KERAS_BACKEND=jax
python3 -c "import jax, keras; print('jax', jax.__version__, 'keras', keras.__version__, jax.devices())"
python3 benchmarks/gpu/keras_jax.py --out "$OUT" "$@" 2>&1 | tee "$OUT/keras_jax.txt"
