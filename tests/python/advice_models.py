"""Three small, different models for the advice tests: an MLP, a CNN, an LSTM."""


def build(kind):
    """(x, y, make_model) for `kind`; make_model() returns a compiled model."""
    import numpy as np
    import keras
    rng = np.random.default_rng(0)
    if kind == "mlp":
        x = rng.random((8192, 256), dtype=np.float32)
        y = rng.integers(0, 10, 8192)
        layers = [keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)]
    elif kind == "cnn":
        x = rng.random((1024, 32, 32, 3), dtype=np.float32)
        y = rng.integers(0, 10, 1024)
        layers = [keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                  keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                  keras.layers.Flatten(), keras.layers.Dense(10)]
    elif kind == "lstm":
        x = rng.integers(0, 1000, (4096, 64))
        y = rng.integers(0, 10, 4096)
        layers = [keras.Input((64,)), keras.layers.Embedding(1000, 64), keras.layers.LSTM(128),
                  keras.layers.Dense(10)]
    else:
        raise ValueError(kind)

    def make_model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential(layers=[l if i == 0 else l.__class__.from_config(l.get_config())
                                     for i, l in enumerate(layers)])
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    return x, y, make_model
