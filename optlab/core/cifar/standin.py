"""The stand-in CIFAR-10 data set: synthetic images in CIFAR-10's exact storage, loaded through torchvision's own
``CIFAR10.__getitem__`` so that every image takes the real per-image path (PIL image, then the transforms).

Its own module because it subclasses torchvision's ``VisionDataset``: importing torchvision costs about a second (it
pulls in torch._dynamo), so only a process that builds a CIFAR-10 data set imports this (``data.datasets``).
"""
from __future__ import annotations

from torchvision.datasets import CIFAR10, VisionDataset

from .format import TEST_SIZE, TRAIN_SIZE, standin_arrays


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
