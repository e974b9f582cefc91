#!/usr/bin/env bash
# tf_memguard built against TensorFlow 2.21.0, then TensorFlow 2.20.0 installed over it in
# the same environment (as a user upgrading or downgrading TensorFlow without rebuilding):
# tests/python/test_tf_version.py checks that TensorFlow still imports and trains.
#
#   bash .ci/tf_version_mismatch.sh            a fresh environment, .venv-tf-mismatch
#   bash .ci/tf_version_mismatch.sh .venv      the environment given, where tf_memguard is
#                                              installed against 2.21.0 already (CI's last
#                                              step: the environment keeps TensorFlow 2.20.0)
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${1:-}
if [ -z "$ENV" ]; then
  ENV=.venv-tf-mismatch
  rm -rf "$ENV"
  python3 -m venv "$ENV"
  "$ENV"/bin/pip install -q tensorflow-cpu==2.21.0
  "$ENV"/bin/pip install -q --no-deps .
fi
# tf_memguard was built against the TensorFlow there now: it must be 2.21.0.
have=$("$ENV"/bin/pip show tensorflow-cpu 2>/dev/null | sed -n 's/^Version: //p')
if [ "$have" != "2.21.0" ]; then
  echo "tf_version_mismatch.sh: $ENV has tensorflow-cpu ${have:-(none)}, not the 2.21.0 tf_memguard was built for" >&2
  exit 1
fi
"$ENV"/bin/pip install -q tensorflow-cpu==2.20.0
TF_MEMGUARD_MISMATCH_PYTHON="$ENV"/bin/python "$ENV"/bin/python -m pytest -q tests/python/test_tf_version.py
