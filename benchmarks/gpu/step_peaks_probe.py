"""Per-step peaks of keras_hub's Qwen3 (keras_hub_torch.py's config) on Keras' torch backend:
a fresh process's first fit against a second fit in the same process. argv: SIZE [FIRST_SIZE]."""
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tf_memguard
tf_memguard.install(max_bytes=int(os.environ.get("BUDGET", 8 << 30)), device="cuda:0")
import keras
import keras_hub_torch as k
model = k.build("qwen3"); x, y = k.data("qwen3")
class Peaks(keras.callbacks.Callback):
    def __init__(self): self.p = []
    def on_train_batch_begin(self, b, logs=None):
        self.start = tf_memguard.stats()["bytes_in_use"]; tf_memguard.reset_peak()
    def on_train_batch_end(self, b, logs=None):
        self.p.append((round(self.start / 2**20, 1), round(tf_memguard.stats()["peak_bytes_in_use"] / 2**20, 1)))
size = int(sys.argv[1])
if len(sys.argv) > 2:
    model.fit(x, y, batch_size=int(sys.argv[2]), epochs=1, verbose=0)
cb = Peaks(); model.fit(x, y, batch_size=size, epochs=1, verbose=0, callbacks=[cb])
print("PEAKS", json.dumps({"size": size, "after": sys.argv[2] if len(sys.argv) > 2 else None, "start_peak_mib": cb.p[:4] + cb.p[-2:]}))
