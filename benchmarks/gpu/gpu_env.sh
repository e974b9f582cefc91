# Sourced by the run_*.sh scripts on the lent H200 (Python 3.12, CUDA 13; no TensorFlow, no
# Keras: keras, namex and optree travel as wheels in .whl): $OUT made, the card's state
# recorded, the wheels unpacked onto PYTHONPATH, the bindings (and, with PyTorch present,
# its glue) built in place by setup.py (no TF plugin: no TF).
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | tee "$OUT/nvidia_smi.txt"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace 2>&1 | grep -iE "tf_memguard:|error" || true
