"""The CIFAR-10 workload: the seed's four CNNs (``models``) on 32x32 images (``data``; CIFAR-10's storage in ``format``,
the stand-in data set in ``standin``), throughput in images."""
from __future__ import annotations

import torch.nn.functional as F

from . import data, models
from .device_data import DeviceResidentLoader
from ..workload import Workload, register_workload

CIFAR = register_workload(Workload(
    name="cifar",
    description="CIFAR-10 image classification with the seed's CNNs",
    unit="images",
    sample_name="images",
    model_names=models.MODEL_NAMES,
    build_model=models.build_model,
    example_input=models.example_input,
    find_source=data.find_source,
    datasets=data.datasets,
    train_size=data.TRAIN_SIZE,
    test_size=data.TEST_SIZE,
    loss=F.cross_entropy,
    device_loader=DeviceResidentLoader,
    module=__name__,
))
