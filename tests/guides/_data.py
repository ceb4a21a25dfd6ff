"""MNIST-shaped data made here, so no guide downloads anything.

``load_data()`` has the signature and return value of ``keras.datasets.mnist.load_data``: uint8
images of shape (n, 28, 28) in [0, 255] and uint8 labels 0-9. Each class is a fixed random stroke
pattern (the same in train and test), drawn with dropped pixels and background noise, so a model
learns it in a few hundred steps and accuracy well above chance (0.1) means it trained.
"""

import numpy as np

TRAIN_EXAMPLES = 11000  # > 10000: the keras.io guide keeps its own 10000-example validation split
TEST_EXAMPLES = 1000


def _prototypes():
    rng = np.random.default_rng(1234)
    return (rng.random((10, 28, 28)) < 0.25).astype(np.float32)


def mnist_like(n, seed):
    """``n`` images and labels, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype(np.uint8)
    kept = rng.random((n, 28, 28)) < 0.5
    images = _prototypes()[labels] * kept * 200 + rng.integers(0, 120, size=(n, 28, 28))
    return images.astype(np.uint8), labels


def load_data(path="mnist.npz"):
    """Stands in for ``keras.datasets.mnist.load_data`` (``path`` is ignored: nothing is read)."""
    return mnist_like(TRAIN_EXAMPLES, seed=0), mnist_like(TEST_EXAMPLES, seed=1)
