"""The whole data set resident on the device, with random crop and flip done there, a batch at a time.

This is what cifar10-airbench does: no worker processes, no per-image PIL work, no host-to-device copies.
The batched crop gathers over an NHWC view, so augmented batches come out channels-last strided; the training
step's ``loops.to_device`` gives every batch the layout its config asks for, as it does for a DataLoader's.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from .format import CIFAR10_MEAN, CIFAR10_STD


class DeviceResidentLoader:
    """Yields ``(images, labels)`` batches already on ``device``; shuffled by its own generator, like a DataLoader."""

    def __init__(self, dataset, batch_size: int, device: torch.device, train: bool, drop_last: bool = True,
                 seed: int = 0) -> None:
        images = torch.as_tensor(dataset.data).to(device).permute(0, 3, 1, 2)  # uint8 NCHW, 150 MB for CIFAR-10
        mean = torch.tensor(CIFAR10_MEAN, device=device).view(1, 3, 1, 1) * 255
        std = torch.tensor(CIFAR10_STD, device=device).view(1, 3, 1, 1) * 255
        self.images = ((images.float() - mean) / std).contiguous()
        self.labels = torch.as_tensor(dataset.targets, device=device)
        self.batch_size, self.train, self.drop_last = batch_size, train, drop_last
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __len__(self) -> int:
        full, rest = divmod(len(self.labels), self.batch_size)
        return full + (0 if self.drop_last or rest == 0 else 1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        count = len(self.labels)
        order = (torch.randperm(count, device=self.labels.device, generator=self.generator) if self.train
                 else torch.arange(count, device=self.labels.device))
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start:start + self.batch_size]
            images = self.images[index]
            yield (augment(images, self.generator) if self.train else images), self.labels[index]


def augment(images: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """RandomCrop(32, padding=4) and RandomHorizontalFlip for a whole batch at once (zero padding, as torchvision)."""
    n, _, height, width = images.shape
    padded = F.pad(images, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (n, 1, 1), device=images.device, generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n, 1, 1), device=images.device, generator=generator)
    rows = (torch.arange(height, device=images.device).view(1, height, 1) + dy).expand(n, height, width)
    cols = (torch.arange(width, device=images.device).view(1, 1, width) + dx).expand(n, height, width)
    batch = torch.arange(n, device=images.device).view(n, 1, 1).expand(n, height, width)
    cropped = padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)
    flip = torch.rand(n, device=images.device, generator=generator) < 0.5
    return torch.where(flip.view(n, 1, 1, 1), cropped.flip(3), cropped)
