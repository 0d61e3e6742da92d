import multiprocessing
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10

from optlab.core import workload
from optlab.core.cifar import data
from optlab.core.knobs.config import RunConfig
from optlab.core.errors import OptlabError


@pytest.fixture(scope="module")
def train_set():
    return data.StandInCIFAR10(True, data.train_transform())


def test_standin_is_stored_like_cifar10(train_set):
    test_set = data.StandInCIFAR10(False, data.test_transform())
    assert (len(train_set), len(test_set)) == (50_000, 10_000)
    assert train_set.data.dtype == np.uint8 and train_set.data.shape == (50_000, 32, 32, 3)
    assert sorted(set(train_set.targets)) == list(range(10)) and len(train_set.classes) == 10
    image, label = train_set[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and isinstance(label, int)


def test_standin_uses_torchvisions_own_per_image_path():
    assert data.StandInCIFAR10.__getitem__ is CIFAR10.__getitem__


def test_standin_classes_carry_learnable_signal(train_set):
    # a nearest-class-mean classifier on raw pixels, fit on 5,000 images, must beat chance (10 %) by far
    pixels = train_set.data[:6000].reshape(6000, -1).astype(np.float32)
    labels = np.asarray(train_set.targets[:6000])
    means = np.stack([pixels[:5000][labels[:5000] == c].mean(axis=0) for c in range(10)])
    predicted = ((pixels[5000:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (predicted == labels[5000:]).mean() > 0.9


def test_train_and_test_splits_differ(train_set):
    test_set = data.StandInCIFAR10(False)
    assert not np.array_equal(train_set.data[:100], test_set.data[:100])


def test_source_is_the_standin_without_cifar(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTLAB_DATA", str(tmp_path))
    source = data.find_source()
    assert source.kind == "stand-in" and "$OPTLAB_DATA" in source.description and str(tmp_path) not in source.description
    assert workload.data_dir() == tmp_path


def _write_fake_cifar(root):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, count in [(f"data_batch_{i}", 10) for i in range(1, 6)] + [("test_batch", 10)]:
        batch = {"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8), "labels": list(range(10))}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [str(i) for i in range(10)]}))


def test_real_cifar_is_used_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTLAB_DATA", str(tmp_path))
    _write_fake_cifar(tmp_path)
    # our files are not the real ones, so torchvision's MD5 checks are switched off for this test
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *args: True)
    source = data.find_source()
    assert source.kind == "cifar10" and "real" in source.description
    train, test = data.datasets(source)
    assert isinstance(train, CIFAR10) and (len(train), len(test)) == (50, 10)
    assert train[0][0].shape == (3, 32, 32)


def test_corrupt_cifar_gets_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTLAB_DATA", str(tmp_path))
    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(OptlabError, match="could not be loaded"):
        data.datasets(data.find_source())


def test_loader_follows_the_knobs(train_set):
    loader = data.make_loader(train_set, RunConfig(batch_size=8, batch_offset=1, num_workers=0, pin_memory=False),
                              train=True)
    images, labels = next(iter(loader))
    assert images.shape == (9, 3, 32, 32) and labels.shape == (9,)
    assert loader.drop_last and loader.num_workers == 0


def test_the_training_order_is_shuffled_by_its_seed(train_set):
    config = RunConfig(batch_size=64, num_workers=0, pin_memory=False)

    def first_labels(seed: int, train: bool = True) -> torch.Tensor:
        return next(iter(data.make_loader(train_set, config, train=train, seed=seed)))[1]

    assert torch.equal(first_labels(3), first_labels(3)), "the same seed must give the same order"
    assert not torch.equal(first_labels(3), first_labels(4)), "another seed must give another order"
    in_storage_order = torch.as_tensor(train_set.targets[:64])
    assert not torch.equal(first_labels(3), in_storage_order), "the training order is not shuffled"
    assert torch.equal(first_labels(3, train=False), in_storage_order), "evaluation reads in storage order"


def test_standin_works_with_two_spawned_workers():
    small = data.StandInCIFAR10(False, data.test_transform())
    small.data, small.targets = small.data[:64], small.targets[:64]
    config = RunConfig(batch_size=16, num_workers=2, pin_memory=False)
    loader = data.make_loader(small, config, train=False, multiprocessing_context="spawn")
    batches = list(loader)
    assert len(batches) == 4 and all(b[0].shape == (16, 3, 32, 32) for b in batches)
    assert torch.equal(torch.cat([b[1] for b in batches]), torch.tensor(small.targets))


class Exploding(Dataset):
    """Raises a KeyError for one index, as a broken sample would."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 5:
            raise KeyError("sample 5 is broken")
        return torch.zeros(3), index


def new_children(before: set) -> list:
    return [child for child in multiprocessing.active_children() if child not in before]


@pytest.mark.parametrize("persistent", [False, True], ids=["workers per pass", "persistent workers"])
def test_a_workers_exception_reaches_the_caller_with_its_type_and_ends_the_workers_at_once(persistent):
    """The error, with its type; and the workers gone when it arrives, not at the next garbage collection (torch's
    iterator, held by the error's traceback, would then wait 5 s for each). A persistent loader's next pass starts
    workers anew and meets the same error."""
    before = set(multiprocessing.active_children())
    config = RunConfig(batch_size=2, num_workers=2, pin_memory=False, persistent_workers=persistent)
    loader = data.make_loader(Exploding(), config, train=False)
    for attempt in ("first pass", "second pass"):
        with pytest.raises(KeyError, match="sample 5 is broken"):
            list(loader)
        assert new_children(before) == [], f"{attempt}: workers still running after the error"
