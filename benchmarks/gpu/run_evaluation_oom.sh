#!/usr/bin/env bash
# Out-of-memory errors in validation, evaluate() and predict() under Keras' torch backend
# on the lent GPU (benchmarks/gpu/evaluation_oom.py); keras and its pure-Python
# dependencies travel as wheels in .whl. The JSON lands in $OUT (then
# benchmarks/results/gpu_evaluation_oom.json).  Run from the repository root.
set -euo pipefail
source benchmarks/gpu/gpu_env.sh
export KERAS_BACKEND=torch
python3 -c "import torch, keras; print('torch', torch.__version__, 'keras', keras.__version__)"
python3 benchmarks/gpu/evaluation_oom.py --out "$OUT" "$@" 2>&1 | tee "$OUT/evaluation_oom.txt"
