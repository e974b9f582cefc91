#!/usr/bin/env bash
# tf_memguard built against TensorFlow 2.21.0, then TensorFlow 2.20.0 installed over it in
# the same environment (as a user upgrading or downgrading TensorFlow without rebuilding):
# tests/python/test_tf_version.py checks that TensorFlow still imports and trains.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv-tf-mismatch
python3 -m venv .venv-tf-mismatch
.venv-tf-mismatch/bin/pip install -q tensorflow-cpu==2.21.0
.venv-tf-mismatch/bin/pip install -q --no-deps .
.venv-tf-mismatch/bin/pip install -q tensorflow-cpu==2.20.0
TF_MEMGUARD_MISMATCH_PYTHON=.venv-tf-mismatch/bin/python .venv/bin/python -m pytest -q tests/python/test_tf_version.py
