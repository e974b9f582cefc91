#!/usr/bin/env bash
# keras_hub's Qwen3 and Swin Transformer backbones on Keras' torch backend under
# tf_memguard, on the lent GPU: the budget and the advice on models not in this repository
# (benchmarks/gpu/keras_hub_torch.py). keras_hub and its pure-Python dependencies travel
# as wheels in .whl with keras (gpu_env.sh puts them on PYTHONPATH).
# Run from the repository root:  bash benchmarks/gpu/run_keras_hub_torch.sh [qwen3|swin|qwen3,swin]
set -euo pipefail
source benchmarks/gpu/gpu_env.sh
export KERAS_BACKEND=torch
python3 -c "import torch, keras, keras_hub; print('torch', torch.__version__, 'keras', keras.__version__, 'keras_hub', keras_hub.__version__)"
python3 benchmarks/gpu/keras_hub_torch.py --out "$OUT" --models "${1:-qwen3,swin}" 2>&1 | tee "$OUT/keras_hub_torch_${1:-all}.txt"
