"""Writes the traces of benchmarks/alloc_latency.py as binary files for gpu_proof.cu:
NAME.bin (tfmg_replay_op records: u64 size, u32 slot, u32 is_free) and NAME.meta
("ops slots peak_live_bytes")."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import traces  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
for t in traces.standard_traces():
    ops = np.zeros(t.ops, dtype=[("size", "<u8"), ("slot", "<u4"), ("is_free", "<u4")])
    ops["size"], ops["slot"], ops["is_free"] = t.sizes, t.slots, t.is_free
    ops.tofile(os.path.join(out, t.name + ".bin"))
    with open(os.path.join(out, t.name + ".meta"), "w") as f:
        f.write(f"{t.ops} {t.nslots} {t.peak_live_bytes}\n")
    print(t.name, t.ops, t.peak_live_bytes)
