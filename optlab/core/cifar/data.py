"""CIFAR-10 train and test loaders: the real data set when it is on disk, otherwise a stand-in stored the same way.

The stand-in keeps CIFAR-10's storage (uint8 HWC arrays, 50,000 + 10,000 images, 10 classes) and uses
torchvision's own ``CIFAR10.__getitem__``, so every image takes the same path (PIL image, then the transforms)
and costs the same to load. Each class has its own colour pattern under noise, so a model can learn it.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from torch.utils.data import Dataset
from torchvision import transforms
from torchvision.datasets import CIFAR10, VisionDataset

from ..errors import OptlabError
from ..process.loader import WORKER_TIMEOUT_S, make_loader  # noqa: F401  (data.make_loader, as before)
from ..workload import DataSource, data_dir

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
TRAIN_SIZE, TEST_SIZE = 50_000, 10_000


def train_transform() -> transforms.Compose:
    return transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
    ])


def test_transform() -> transforms.Compose:
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)])


class StandInCIFAR10(VisionDataset):
    """Synthetic images in CIFAR-10's exact storage format, loaded through CIFAR10's own ``__getitem__``."""

    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    __getitem__ = CIFAR10.__getitem__  # PIL image, then transform: the real per-image path

    def __init__(self, train: bool = True, transform=None, target_transform=None, seed: int = 0) -> None:
        super().__init__(root="stand-in", transform=transform, target_transform=target_transform)
        self.train = train
        self.data, labels = standin_arrays(TRAIN_SIZE if train else TEST_SIZE, seed + (0 if train else 1))
        self.targets = labels.tolist()

    def __len__(self) -> int:
        return len(self.data)


@lru_cache(maxsize=4)
def standin_arrays(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` uint8 images (N, 32, 32, 3) and int64 labels: half a blocky class pattern, half uniform noise."""
    patterns = np.random.default_rng(1234).integers(0, 128, size=(10, 4, 4, 3), dtype=np.uint8)
    patterns = patterns.repeat(8, axis=1).repeat(8, axis=2)  # 10 blocky 32x32 class patterns in [0, 128)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=count)
    # random bytes halved: uniform in [0, 128) as integers(0, 128) draws them, four times faster (every process of a
    # run, each DataLoader rank included, builds its own)
    images = np.frombuffer(rng.bytes(count * 32 * 32 * 3), dtype=np.uint8).reshape(count, 32, 32, 3) >> 1
    images += patterns[labels]
    return images, labels


def find_source(download: bool = False) -> DataSource:
    """Real CIFAR-10 if it is under :func:`data_dir` (or ``download`` is asked for), else the stand-in."""
    root = data_dir()  # named by its variable below: records and pages show no machine's own path
    if download or (root / "cifar-10-batches-py").is_dir():
        return DataSource("cifar10", "CIFAR-10 (real) from $OPTLAB_DATA")
    return DataSource("stand-in", "stand-in (synthetic CIFAR-10 format; no CIFAR-10 under $OPTLAB_DATA)")


def datasets(source: DataSource, download: bool = False) -> tuple[Dataset, Dataset]:
    """The train and test data sets with the seed's transforms."""
    if source.kind == "stand-in":
        return StandInCIFAR10(True, train_transform()), StandInCIFAR10(False, test_transform())
    root = data_dir()
    try:
        return (
            CIFAR10(str(root), train=True, transform=train_transform(), download=download),
            CIFAR10(str(root), train=False, transform=test_transform(), download=download),
        )
    except RuntimeError as error:
        raise OptlabError(
            f"CIFAR-10 under {root} could not be loaded ({error}); remove that folder to use the stand-in, "
            "or fix it with --download"
        ) from error
