"""Generated training data with structure a small CNN can learn (no downloads)."""
import numpy as np


def pattern_images(n, size=32, classes=4, seed=0):
    """Images of noise with a bright 8x8 patch whose quadrant is the class."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n).astype("int32")
    x = rng.normal(0.0, 0.3, (n, size, size, 3)).astype("float32")
    half = size // 2
    for k in range(classes):
        rows, cols = (k // 2) * half, (k % 2) * half
        idx = np.where(y == k)[0]
        r = rng.integers(rows, rows + half - 8, len(idx))
        c = rng.integers(cols, cols + half - 8, len(idx))
        for i, (rr, cc) in zip(idx, zip(r, c)):
            x[i, rr:rr + 8, cc:cc + 8, :] += 1.0
    return x, y


def small_cnn(classes=4, size=32):
    import keras
    return keras.Sequential([
        keras.Input((size, size, 3)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(classes),
    ])
