"""Keras' torch backend: what can be checked without a GPU.

The pool under PyTorch's CUDA allocator runs on the lent H200
(benchmarks/gpu/keras_torch.py; results in benchmarks/results/gpu_keras_torch.json).
Here: the PyTorch glue's contract (serve; refuse by throwing c10::OutOfMemoryError, never
a null pointer; keep serving), install()'s errors, and that the callback stays off
TensorFlow on the torch backend. Skipped where PyTorch is not installed (CI installs the
CPU build of torch for these; see .ci/run).
"""
import os
import subprocess

import pytest

from tfproc import run

torch = pytest.importorskip("torch")

from tf_memguard import _backend  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLUE = _backend.torch_glue_path()
TORCH = {"KERAS_BACKEND": "torch"}

pytestmark = pytest.mark.skipif(not os.path.exists(GLUE), reason="tf_memguard was built without PyTorch")


def test_the_glue_serves_refuses_with_an_explanation_and_goes_on():
    # In a fresh process: the glue's pools are process-wide.
    r = run("""
        import ctypes
        from tf_memguard import _backend, _core
        pool = _core.configure_device_pool("GPU:0", "host", 0)  # host memory standing in for the GPU
        pool.set_limit(8 << 20)
        lib = ctypes.CDLL(_backend.torch_glue_path())
        f = lib.tfmg_torch_try_malloc
        f.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                      ctypes.c_char_p, ctypes.c_uint64]
        lib.tfmg_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
        out, msg = ctypes.c_void_p(), ctypes.create_string_buffer(2048)
        ok = f(3 << 20, 0, None, ctypes.byref(out), msg, 2048)
        served = out.value
        in_use = pool.stats()["bytes_in_use"]
        refused = f(16 << 20, 0, None, ctypes.byref(out), msg, 2048)
        refused_ptr, message = out.value, msg.value.decode()
        again = f(4 << 20, 0, None, ctypes.byref(out), msg, 2048)
        lib.tfmg_torch_free(out.value, 4 << 20, 0, None)
        lib.tfmg_torch_free(served, 3 << 20, 0, None)
        lib.tfmg_torch_free(served, 3 << 20, 0, None)  # a double free: reported, not fatal
        emit(ok=ok, served=served, in_use=in_use, refused=refused, refused_ptr=refused_ptr,
             message=message, again=again, after=pool.stats()["bytes_in_use"],
             refusals=pool.stats()["num_refusals"], valid=pool.check())
    """)
    d = r.data
    assert d is not None, r
    assert d["ok"] == 0 and d["served"] and d["served"] % 64 == 0 and d["in_use"] == 3 << 20
    assert d["refused"] == 2  # TFMG_ERROR_OUT_OF_MEMORY
    assert not d["refused_ptr"]
    assert "CUDA out of memory on GPU:0" in d["message"] and "16.0 MiB" in d["message"]
    assert "budget in use" in d["message"] and "largest free block" in d["message"]
    assert d["again"] == 0 and d["after"] == 0 and d["refusals"] == 1 and d["valid"]
    assert "does not hold" in r.stderr


def test_a_refusal_throws_torchs_out_of_memory_error_not_a_null_pointer(tmp_path):
    # PyTorch's pluggable allocator does not check for null: a null block would fault the
    # first kernel and break the CUDA context. The glue throws c10::OutOfMemoryError,
    # which PyTorch raises as torch.OutOfMemoryError. A C++ caller checks that here.
    from torch.utils import cpp_extension

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    pkg = os.path.dirname(GLUE)
    exe = str(tmp_path / "torch_glue_check")
    cmd = (["g++", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-I", ROOT]
           + [f"-I{p}" for p in cpp_extension.include_paths()]
           + [os.path.join(ROOT, "tests", "cc", "torch_glue_check.cc"), "-o", exe,
              f"-L{pkg}", "-l:libtfmg_torch.so", "-l:libtfmg_core.so", f"-L{lib}", "-lc10",
              f"-Wl,-rpath,{pkg}", f"-Wl,-rpath,{lib}"])
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    proc = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OutOfMemoryError: tf_memguard: CUDA out of memory on GPU:0" in proc.stdout
    assert "in use after frees: 0, refusals: 1" in proc.stdout


def test_on_the_torch_backend_the_callback_never_imports_tensorflow():
    r = run("""
        import sys, keras, torch, tf_memguard
        cb = tf_memguard.MemGuardCallback(device="cuda:0")
        err = tf_memguard.BudgetExceededError
        emit(backend=keras.config.backend(), tf="tensorflow" in sys.modules, device=cb.device,
             is_torch_oom=issubclass(err, torch.OutOfMemoryError), default=tf_memguard._install.resolve_device(None))
    """, env=TORCH)
    assert r.data == {"backend": "torch", "tf": False, "device": "GPU:0", "is_torch_oom": True,
                      "default": "GPU:0"}, r


def test_the_callback_without_install_warns_and_fit_trains():
    # Found by the shared-GPU benchmark's dry run: fit() raised "no pool yet" from the callback.
    r = run("""
        import warnings, numpy as np, keras, tf_memguard
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            h = model.fit(np.ones((32, 4), "float32"), np.ones((32, 2), "float32"), epochs=2, verbose=0,
                          callbacks=[tf_memguard.MemGuardCallback()])
        emit(epochs=len(h.history["loss"]), said=[str(w.message) for w in seen if "tf_memguard" in str(w.message)])
    """, env=TORCH)
    assert r.data is not None, r
    assert r.data["epochs"] == 2
    assert len(r.data["said"]) == 1 and "install(max_bytes, device='GPU:0')" in r.data["said"][0], r.data


def test_install_on_the_torch_backend_says_what_is_wrong_without_a_gpu():
    r = run("""
        import tf_memguard, torch
        out = {}
        for device in ("cpu", "cuda:0"):
            try:
                tf_memguard.install(max_bytes="1GiB", device=device)
                out[device] = "installed"
            except (ValueError, RuntimeError) as e:
                out[device] = f"{type(e).__name__}: {e}"
        try:
            tf_memguard.install(max_bytes="lots", device="cuda:0")
        except ValueError as e:
            out["bad"] = str(e)
        x = torch.ones(3) * 2  # the process goes on
        emit(cuda=torch.cuda.is_available(), sum=float(x.sum()), **out)
    """, env=TORCH)
    d = r.data
    assert d is not None, r
    assert d["cpu"].startswith("ValueError") and "cuda:0" in d["cpu"]
    assert "lots" in d["bad"] and d["sum"] == 6.0
    assert "KERAS_BACKEND=tensorflow" in d["cpu"], d   # what to do for a budget on the CPU
    if not d["cuda"]:
        assert d["cuda:0"].startswith("RuntimeError") and "sees 0 CUDA device(s)" in d["cuda:0"]
        assert "KERAS_BACKEND=tensorflow" in d["cuda:0"], d


def test_the_tensorflow_backend_is_unchanged_by_an_installed_torch():
    r = run("""
        import tf_memguard
        cfg = tf_memguard.install(max_bytes="64MiB")
        import tensorflow as tf
        x = tf.ones([1024, 1024])
        emit(device=cfg.device, framework=cfg.framework, serving=cfg.serving,
             in_pool=tf_memguard.stats()["bytes_in_use"] >= x.numpy().nbytes)
    """, env={"KERAS_BACKEND": "tensorflow", "TF_ENABLE_ONEDNN_OPTS": "0"})
    assert r.data == {"device": "CPU:0", "framework": "tensorflow", "serving": True, "in_pool": True}, r
