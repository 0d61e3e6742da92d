"""CIFAR-10 train and test loaders: the real data set when it is on disk, otherwise a stand-in stored the same way.

The stand-in (``standin``) keeps CIFAR-10's storage (``format``: uint8 HWC arrays, 50,000 + 10,000 images, 10
classes) and uses torchvision's own ``CIFAR10.__getitem__``, so every image takes the same path (PIL image, then the
transforms) and costs the same to load. Each class has its own colour pattern under noise, so a model can learn it.

torchvision is imported inside the functions that build data sets and transforms, not here: importing it costs about
a second (it pulls in torch._dynamo), which every process that imports optlab but loads no image would pay.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

from ..errors import OptlabError
from ..process.loader import WORKER_TIMEOUT_S, make_loader  # noqa: F401  (data.make_loader, as before)
from ..workload import DataSource, data_dir
from .format import CIFAR10_MEAN, CIFAR10_STD, TEST_SIZE, TRAIN_SIZE, standin_arrays  # noqa: F401  (data.X, as before)

if TYPE_CHECKING:
    from torchvision import transforms


def train_transform() -> transforms.Compose:
    from torchvision import transforms  # late import: see the module's docstring

    return transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
    ])


def test_transform() -> transforms.Compose:
    from torchvision import transforms  # late import: see the module's docstring

    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)])


def __getattr__(name: str) -> Any:
    """``data.StandInCIFAR10``, as before, imported on first use (its module imports torchvision)."""
    if name == "StandInCIFAR10":
        from .standin import StandInCIFAR10

        return StandInCIFAR10
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def find_source(download: bool = False) -> DataSource:
    """Real CIFAR-10 if it is under :func:`data_dir` (or ``download`` is asked for), else the stand-in."""
    root = data_dir()  # named by its variable below: records and pages show no machine's own path
    if download or (root / "cifar-10-batches-py").is_dir():
        return DataSource("cifar10", "CIFAR-10 (real) from $OPTLAB_DATA")
    return DataSource("stand-in", "stand-in (synthetic CIFAR-10 format; no CIFAR-10 under $OPTLAB_DATA)")


def datasets(source: DataSource, download: bool = False) -> tuple[Dataset, Dataset]:
    """The train and test data sets with the seed's transforms."""
    if source.kind == "stand-in":
        from .standin import StandInCIFAR10  # late import: see the module's docstring

        return StandInCIFAR10(True, train_transform()), StandInCIFAR10(False, test_transform())
    from torchvision.datasets import CIFAR10  # late import: see the module's docstring

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
