"""install(): arguments, reconfiguration, and what predates the budget."""
import pytest

import tf_memguard
from tf_memguard._install import normalize_device
from tfproc import run

GiB = 1 << 30


@pytest.mark.parametrize("value,expected", [
    (1000, 1000),
    ("6GB", 6 * 10**9),
    ("512MiB", 512 << 20),
    ("1.5 GiB", 3 * (1 << 29)),
    ("2g", 2 * GiB),
    ("100", 100),
    (0.5, 8 * GiB),
    (1.0, 16 * GiB),
    ("25%", 4 * GiB),
])
def test_max_bytes_accepts_bytes_fractions_and_strings(value, expected):
    assert tf_memguard.parse_bytes(value, total=16 * GiB) == expected


@pytest.mark.parametrize("value", [0, -1, 0.0, 1.5, -0.2, True, "abc", "6 parsecs", "", "0GB", None, [1], "150%"])
def test_bad_max_bytes_raise_value_error_naming_the_value(value):
    with pytest.raises(ValueError, match=r"max_bytes=.*: must be"):
        tf_memguard.parse_bytes(value, total=16 * GiB)


def test_numpy_integers_and_floats_are_taken_and_bools_are_not():
    import numpy as np
    assert tf_memguard.parse_bytes(np.int64(1 << 20), total=16 * GiB) == 1 << 20
    assert tf_memguard.parse_bytes(np.float32(0.5), total=16 * GiB) == 8 * GiB
    for bad in (True, np.bool_(True)):
        with pytest.raises(ValueError, match="max_bytes="):
            tf_memguard.parse_bytes(bad, total=16 * GiB)


@pytest.mark.tf
def test_a_budget_beyond_the_address_space_is_refused_and_lowering_works_when_the_blocks_fit():
    r = run("""
        import tensorflow as tf, tf_memguard
        tf_memguard.install(max_bytes="1GiB")
        try:
            tf_memguard.install(max_bytes=2**63)
            huge = None
        except ValueError as e:
            huge = str(e)
        after_huge = tf_memguard.stats()["bytes_limit"]
        live = tf.zeros([32, 1024, 1024])        # 128 MiB live
        tmp = tf.ones([96, 1024, 1024]); del tmp  # 384 MiB backed, then free
        tf_memguard.install(max_bytes="200MiB")  # the free granules go back
        s = tf_memguard.stats()
        try:
            tf_memguard.install(max_bytes="64MiB")
            low = None
        except MemoryError as e:
            low = str(e)
        emit(huge=huge, after_huge=after_huge, limit=s["bytes_limit"], reserved=s["bytes_reserved"], low=low,
             limit2=tf_memguard.stats()["bytes_limit"], value=float(live[0, 0, 0]))
    """)
    assert r.returncode == 0, r
    d = r.data
    assert d["huge"] and "above the 32.0 TiB a pool can take" in d["huge"], d
    assert d["after_huge"] == GiB
    assert d["limit"] == 200 << 20 and d["reserved"] <= 200 << 20
    assert d["low"] and "128 MiB stays backed under blocks in use" in d["low"] and "the budget stays 200 MiB" in d["low"]
    assert d["limit2"] == 200 << 20 and d["value"] == 0.0


@pytest.mark.parametrize("device", ["CPU:0", "cpu", "CPU", "/device:CPU:0",
                                    "/job:localhost/replica:0/task:0/device:CPU:0"])
def test_cpu_device_names_normalize(device):
    assert normalize_device(device) == "CPU:0"


@pytest.mark.parametrize("device,match", [("CPU:1", "one CPU allocator"),
                                          ("TPU:0", "unknown device type"), (3, "must be a string")])
def test_unsupported_devices_say_what_to_use(device, match):
    with pytest.raises(ValueError, match=match):
        normalize_device(device)


@pytest.mark.parametrize("device", ["GPU:0", "gpu:1", "/device:GPU:0", "cuda:0"])
def test_gpu_device_names_normalize(device):
    assert normalize_device(device) == f"GPU:{device[-1]}"


def test_format_bytes_matches_the_core():
    assert tf_memguard.format_bytes(512) == "512 B"
    assert tf_memguard.format_bytes(1342177280) == "1.25 GiB"
    assert tf_memguard.format_bytes(180 << 20) == "180 MiB"
    assert tf_memguard.format_bytes(10 << 20) == "10.0 MiB"


@pytest.mark.tf
def test_install_reconfigures_and_reports_what_predates_the_budget():
    r = run("""
        import tensorflow as tf, tf_memguard
        early = tf.ones([256, 1024])          # 1 MiB before any budget
        try:
            tf_memguard.install(max_bytes=0)
        except ValueError as e:
            bad = str(e)
        cfg = tf_memguard.install(max_bytes=0.25)
        first = tf_memguard.stats()
        cfg2 = tf_memguard.install(max_bytes="64MiB")   # a second install changes the budget
        later = tf.zeros([1024, 1024])
        s = tf_memguard.stats()
        del early
        emit(bad=bad, limit1=first["bytes_limit"], total=cfg.total_memory, predating=cfg.predating_bytes,
             predating2=cfg2.predating_bytes, limit2=s["bytes_limit"], serving=cfg2.serving,
             passthrough_after_free=tf_memguard.stats()["passthrough_bytes_in_use"],
             config=str(tf_memguard.config()), reserved=s["bytes_reserved"])
    """)
    assert r.returncode == 0, r
    d = r.data
    assert d["bad"].startswith("max_bytes=0: must be a positive number of bytes")
    assert d["limit1"] == d["total"] // 4
    assert d["predating"] >= 1 << 20 and d["predating2"] == d["predating"]
    assert d["limit2"] == 64 << 20
    assert d["serving"] is True
    assert d["passthrough_after_free"] < d["predating"]   # freed correctly after install()
    assert d["config"].startswith("CPU:0: budget 64.0 MiB (67108864 bytes)")
    assert 0 < d["reserved"] <= 64 << 20


@pytest.mark.tf
def test_gpu_allocator_hook_serves_a_pool_on_the_cpu_wheel():
    # The hook is TensorFlow's GPUProcessState, replaced by the glue when TF_MEMGUARD_GPU=1;
    # a pool over host memory stands in for the device (tfmg_plugin_gpu_selftest in
    # cc/tf/glue.cc).
    r = run("""
        import ctypes, tensorflow as tf, tf_memguard
        from tf_memguard import _core, _backend
        lib = ctypes.CDLL(_backend.tf_glue_path())
        buf = ctypes.create_string_buffer(256)
        rc = lib.tfmg_plugin_gpu_selftest(buf, 256)
        try:
            tf_memguard.install(max_bytes=0.5, device="GPU:0")
            err = None
        except RuntimeError as e:
            err = str(e)
        emit(rc=rc, msg=buf.value.decode(), hook=bool(_core.plugin_state() & _core.PLUGIN_GPU_HOOK), err=err,
             cpu=float(tf.reduce_sum(tf.ones([4]))))
    """, env={"TF_MEMGUARD_GPU": "1"})
    assert r.returncode == 0, r
    assert r.data["hook"] is True
    assert r.data["rc"] == 0, r.data["msg"]
    # The CPU wheel sees no GPU: install() says so instead of pretending.
    assert r.data["err"] and "TensorFlow sees 0 GPU(s)" in r.data["err"]
    assert r.data["cpu"] == 4.0


@pytest.mark.tf
def test_the_gpu_hook_is_off_unless_asked_for_and_install_says_how():
    # A TensorFlow GPU user who does not budget the GPU keeps TensorFlow's own GPU allocator.
    r = run("""
        import ctypes, tensorflow as tf, tf_memguard
        from tf_memguard import _core, _backend
        rc = ctypes.CDLL(_backend.tf_glue_path()).tfmg_plugin_gpu_selftest(ctypes.create_string_buffer(256), 256)
        try:
            tf_memguard.install(max_bytes="1GiB", device="GPU:0")
            err = None
        except RuntimeError as e:
            err = str(e)
        emit(rc=rc, hook=bool(_core.plugin_state() & _core.PLUGIN_GPU_HOOK), err=err)
    """)
    assert r.returncode == 0, r
    assert r.data["hook"] is False and r.data["rc"] == 1  # "the glue did not install its GPUProcessState"
    assert "TF_MEMGUARD_GPU=1" in r.data["err"] and "before the first op" in r.data["err"]


@pytest.mark.tf
@pytest.mark.parametrize("upstream", [None, "checked", "plain"])
def test_the_cpu_pool_is_backed_on_demand_unless_told_otherwise(upstream):
    # By default TensorFlow's CPU tensors are in a pool whose budget bounds the bytes
    # backed, with twice the budget in address space; TF_MEMGUARD_HOST_UPSTREAM=plain
    # reserves the budget as one region.
    r = run("""
        import tensorflow as tf, tf_memguard
        tf_memguard.install(max_bytes=64 << 20)
        x = tf.ones((1000, 1000))
        y = x @ x
        s = tf_memguard.stats()
        emit(reserved=s["bytes_reserved"], in_use=s["bytes_in_use"], largest=s["largest_free_block_bytes"],
             ok=float(y[0, 0]) == 1000.0)
    """, env={"TF_MEMGUARD_HOST_UPSTREAM": upstream} if upstream else None)
    assert r.returncode == 0, r
    d = r.data
    assert d["ok"]
    if upstream == "plain":
        assert d["reserved"] == 64 << 20 and d["largest"] < 64 << 20
    else:
        assert d["in_use"] <= d["reserved"] < 16 << 20   # backed: what is used, in 64 KiB granules
        assert d["largest"] > 64 << 20                    # address space beyond the budget
