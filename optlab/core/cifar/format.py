"""CIFAR-10's storage and statistics: the split sizes, the per-channel mean and std, and the stand-in's synthetic
arrays in that storage (uint8 HWC images, 10 classes). Imports numpy only."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
TRAIN_SIZE, TEST_SIZE = 50_000, 10_000


@lru_cache(maxsize=4)
def standin_arrays(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` uint8 images (N, 32, 32, 3) and int64 labels: half a blocky class pattern, half uniform noise."""
    patterns = np.random.default_rng(1234).integers(0, 128, size=(10, 4, 4, 3), dtype=np.uint8)
    patterns = patterns.repeat(8, axis=1).repeat(8, axis=2)  # 10 blocky 32x32 class patterns in [0, 128)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=count)
    # the generator's raw 64-bit words as bytes, halved in place: uniform in [0, 128) as integers(0, 128) would draw
    # them, in a seventh of its time and with no copy (every process of a run, each DataLoader rank included, builds
    # its own)
    images = rng.bit_generator.random_raw(count * 32 * 32 * 3 // 8).view(np.uint8).reshape(count, 32, 32, 3)
    images >>= 1
    images += patterns[labels]
    return images, labels
