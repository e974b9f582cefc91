"""A zoo of small Keras models of different kinds, for the budget and advice checks.

Each entry builds (x, y, make_model): arrays of generated data (no downloads) and a
function that returns the model compiled, built after tf_memguard.install() as the README
has it. BUDGETS gives, per model, a budget under which the largest batch size that
trains lies between 100 and 2,000 samples (measured: benchmarks/results/advice_zoo.json).
Used by benchmarks/advice_zoo.py and tests/python (test_advice.py, test_over_budget_zoo.py).
"""
import numpy as np


def _images(n, size, channels=3, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, size, size, channels), dtype=np.float32), rng.integers(0, classes, n).astype("int32")


def _compile(m, loss="sparse_categorical_crossentropy", **kw):
    import keras
    m.compile(keras.optimizers.Adam(1e-3), loss, **kw)
    return m


def resnet(n=2048):
    """Convolutions with batch norm and residual adds."""
    import keras
    L = keras.layers
    x, y = _images(n, 32)

    def make():
        inp = keras.Input((32, 32, 3))
        h = L.Conv2D(32, 3, padding="same", use_bias=False)(inp)
        h = L.ReLU()(L.BatchNormalization()(h))
        for filters in (32, 64):
            s = L.Conv2D(filters, 3, padding="same", use_bias=False)(h)
            s = L.ReLU()(L.BatchNormalization()(s))
            s = L.Conv2D(filters, 3, padding="same", use_bias=False)(s)
            s = L.BatchNormalization()(s)
            if h.shape[-1] != filters:
                h = L.Conv2D(filters, 1, use_bias=False)(h)
            h = L.ReLU()(L.Add()([h, s]))
            h = L.MaxPooling2D()(h)
        out = L.Dense(10)(L.GlobalAveragePooling2D()(h))
        return _compile(keras.Model(inp, out), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, make


def separable(n=2048):
    """Depthwise and separable convolutions."""
    import keras
    L = keras.layers
    x, y = _images(n, 48)

    def make():
        return _compile(keras.Sequential([
            keras.Input((48, 48, 3)), L.Conv2D(16, 3, strides=2, activation="relu"),
            L.DepthwiseConv2D(3, padding="same", activation="relu"), L.Conv2D(32, 1, activation="relu"),
            L.SeparableConv2D(64, 3, padding="same", activation="relu"), L.MaxPooling2D(),
            L.SeparableConv2D(64, 3, padding="same", activation="relu"), L.GlobalAveragePooling2D(),
            L.Dense(10)]), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, make


def bilstm(n=4096):
    """An embedding and a bidirectional LSTM."""
    import keras
    L = keras.layers
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 2000, (n, 48)).astype("int32"), rng.integers(0, 4, n).astype("int32")

    def make():
        return _compile(keras.Sequential([keras.Input((48,), dtype="int32"), L.Embedding(2000, 32),
                                          L.Bidirectional(L.LSTM(48)), L.Dense(4)]),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, make


def gru(n=4096):
    """A 1-D convolution feeding a GRU over a signal."""
    import keras
    L = keras.layers
    rng = np.random.default_rng(0)
    x, y = rng.random((n, 64, 8), dtype=np.float32), rng.integers(0, 4, n).astype("int32")

    def make():
        return _compile(keras.Sequential([keras.Input((64, 8)), L.Conv1D(32, 5, activation="relu"),
                                          L.GRU(64), L.Dense(4)]),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, make


def transformer(n=2048):
    """Two attention blocks (multi-head attention, layer norm, feed-forward)."""
    import keras
    L = keras.layers
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 1000, (n, 64)).astype("int32"), rng.integers(0, 4, n).astype("int32")

    def make():
        inp = keras.Input((64,), dtype="int32")
        h = L.Embedding(1000, 64)(inp)
        for _ in range(2):
            a = L.MultiHeadAttention(4, 16)(h, h)
            h = L.LayerNormalization()(h + a)
            f = L.Dense(64)(L.Dense(128, activation="relu")(h))
            h = L.LayerNormalization()(h + f)
        out = L.Dense(4)(L.GlobalAveragePooling1D()(h))
        return _compile(keras.Model(inp, out), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, make


def wide_dense(n=8192):
    """A wide multilayer perceptron with dropout."""
    import keras
    L = keras.layers
    rng = np.random.default_rng(0)
    x, y = rng.random((n, 512), dtype=np.float32), rng.integers(0, 10, n).astype("int32")

    def make():
        return _compile(keras.Sequential([keras.Input((512,)), L.Dense(1024, activation="relu"), L.Dropout(0.3),
                                          L.Dense(1024, activation="relu"), L.Dropout(0.3), L.Dense(10)]),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, make


def embedding(n=8192):
    """A large embedding table, pooled (its gradient is sparse)."""
    import keras
    L = keras.layers
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50000, (n, 32)).astype("int32"), rng.integers(0, 2, n).astype("int32")

    def make():
        return _compile(keras.Sequential([keras.Input((32,), dtype="int32"), L.Embedding(50000, 64),
                                          L.GlobalAveragePooling1D(), L.Dense(64, activation="relu"), L.Dense(2)]),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, make


def autoencoder(n=2048):
    """A convolutional autoencoder (strided convolutions and transposed ones)."""
    import keras
    L = keras.layers
    x, _ = _images(n, 32)

    def make():
        return _compile(keras.Sequential([
            keras.Input((32, 32, 3)), L.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
            L.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
            L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu"),
            L.Conv2DTranspose(3, 3, strides=2, padding="same")]), "mse")
    return x, x, make


def multi_io(n=4096):
    """Two inputs (an image, a vector) and two outputs (a class, a value)."""
    import keras
    L = keras.layers
    rng = np.random.default_rng(0)
    img, cls = _images(n, 24)
    vec = rng.random((n, 32), dtype=np.float32)
    val = rng.random((n, 1), dtype=np.float32)

    def make():
        a = keras.Input((24, 24, 3), name="image")
        b = keras.Input((32,), name="vector")
        h = L.Flatten()(L.MaxPooling2D()(L.Conv2D(32, 3, activation="relu")(a)))
        h = L.Concatenate()([L.Dense(64, activation="relu")(h), L.Dense(64, activation="relu")(b)])
        m = keras.Model([a, b], [L.Dense(10, name="cls")(h), L.Dense(1, name="val")(h)])
        m.compile("adam", [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"])
        return m
    return [img, vec], [cls, val], make


def mobilenet(n=1536):
    """keras.applications.MobileNetV2 (weights=None) at 64x64."""
    import keras
    x, y = _images(n, 64)

    def make():
        m = keras.applications.MobileNetV2(input_shape=(64, 64, 3), weights=None, classes=10, alpha=0.35)
        return _compile(m, keras.losses.SparseCategoricalCrossentropy(from_logits=False))
    return x, y, make


def mixed_precision(n=2048):
    """A CNN under the mixed_float16 policy."""
    import keras
    L = keras.layers
    x, y = _images(n, 32)

    def make():
        keras.mixed_precision.set_global_policy("mixed_float16")
        m = keras.Sequential([keras.Input((32, 32, 3)), L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(),
                              L.Conv2D(64, 3, activation="relu"), L.Flatten(), L.Dense(10, dtype="float32")])
        return _compile(m, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, make


def text_cnn(n=6000):
    """keras.io's text classification from scratch (examples/nlp/text_classification_from_scratch):
    an embedding of 20,000 tokens, dropout, two strided 1-D convolutions, on reviews of 500
    tokens. Added on 2026-12-04 after the callback's advice on it, tried as a model from
    outside the repository, ran out (benchmarks/NOTES.md)."""
    import keras
    L = keras.layers
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20000, (n, 500)).astype("int64")
    y = rng.integers(0, 2, n).astype("float32")

    def make():
        inputs = keras.Input(shape=(None,), dtype="int64")
        h = L.Dropout(0.5)(L.Embedding(20000, 128)(inputs))
        h = L.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(h)
        h = L.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(h)
        h = L.Dropout(0.5)(L.Dense(128, activation="relu")(L.GlobalMaxPooling1D()(h)))
        return _compile(keras.Model(inputs, L.Dense(1, activation="sigmoid")(h)), "binary_crossentropy")
    return x, y, make


ZOO = {"resnet": resnet, "separable": separable, "bilstm": bilstm, "gru": gru, "transformer": transformer,
       "wide_dense": wide_dense, "embedding": embedding, "autoencoder": autoencoder, "multi_io": multi_io,
       "mobilenet": mobilenet, "mixed_precision": mixed_precision, "text_cnn": text_cnn}

# MiB: budgets under which each model's largest batch size that trains lies in 100-2,000
# (chosen from each model's need at 300 samples, by its memory model after two epochs at 64;
# the limits measured: benchmarks/results/advice_zoo.json).
BUDGETS = {"resnet": 420, "separable": 330, "bilstm": 48, "gru": 72, "transformer": 220, "wide_dense": 50,
           "embedding": 76, "autoencoder": 240, "multi_io": 128, "mobilenet": 780, "mixed_precision": 250,
           "text_cnn": 256}


def build(name):
    """(x, y, make_model) of the zoo's model `name`."""
    import keras
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("float32")
    return ZOO[name]()
