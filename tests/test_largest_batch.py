"""The largest-batch search: doubling then bisecting, out-of-memory caught, bounded; on a CPU one line instead."""
import pytest
import torch

from optlab.core.errors import OptlabError
from optlab.studies.transformer import largest_batch


@pytest.mark.parametrize("fits_up_to, limit, expected", [(37, 1024, 37), (37, 20, 20), (0, 8, 0), (1, 1, 1),
                                                         (64, 1000, 64), (999, 1000, 999)])
def test_the_search_finds_the_largest_batch_that_fits(fits_up_to, limit, expected):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= fits_up_to

    batch, tries = largest_batch.largest_fitting(fits, limit)
    assert batch == expected and tries == len(tried) and max(tried) <= limit
    assert tries <= 2 * limit.bit_length() + 1  # doubling then bisecting: logarithmic in the limit


@pytest.mark.parametrize("limit", [0, largest_batch.MAX_LIMIT + 1, 2.5, True])
def test_a_limit_out_of_bounds_is_refused_with_the_bounds(limit):
    with pytest.raises(OptlabError, match=f"from 1 to {largest_batch.MAX_LIMIT}, got"):
        largest_batch.largest_fitting(lambda batch: True, limit)


def test_an_out_of_memory_step_does_not_fit_and_other_errors_are_not_swallowed():
    def step(batch):
        if batch > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    device = torch.device("cpu")
    assert largest_batch.fits_in_memory(step, 4, device) and not largest_batch.fits_in_memory(step, 5, device)
    assert largest_batch.largest_fitting(lambda n: largest_batch.fits_in_memory(step, n, device), 100) == (4, 6)
    with pytest.raises(ZeroDivisionError):
        largest_batch.fits_in_memory(lambda batch: 1 / 0, 1, device)


def test_on_a_cpu_there_is_one_line_and_no_table():
    search = largest_batch.largest_batches("cpu")
    assert search.table is None and "needs a GPU's allocator" in search.note and "\n" not in search.note


def test_bad_settings_are_refused_before_anything_runs():
    with pytest.raises(OptlabError, match="unknown checkpointing 'some'"):
        largest_batch.largest_batches("cpu", settings=("none", "some"))
    with pytest.raises(OptlabError, match="unknown GPT size"):
        largest_batch.largest_batches("cpu", size="gpt3")
    with pytest.raises(OptlabError, match="from 1 to 65536, got 0"):
        largest_batch.largest_batches("cpu", limit=0)


@pytest.mark.cuda
def test_on_a_gpu_the_tiny_gpt_fits_the_limit_in_every_setting():
    search = largest_batch.largest_batches("cuda", size="gpt_tiny", limit=16)
    assert list(search.table["largest batch"]) == [16, 16, 16] and search.table["stopped at the limit"].all()
    assert (search.table["peak MiB at that batch"] > 0).all()


class RunsOutInBackward(torch.autograd.Function):
    """Passes its input on; its backward runs out of memory above ``most`` samples, as a GPU's would: the layers
    after it have their gradients by then."""

    @staticmethod
    def forward(ctx, x, most):
        ctx.too_many = len(x) > most
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.too_many:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return grad, None


class FailingModel(torch.nn.Module):
    def __init__(self, most: int) -> None:
        super().__init__()
        self.most, self.first, self.last = most, torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.last(RunsOutInBackward.apply(self.first(x), self.most))


def watch_the_frees(monkeypatch, model: torch.nn.Module, kept: list) -> list[str]:
    """At every free before the next try: what of the try is still held (gradients, the try's tensors)."""
    held = []

    def free(device):
        gc_free(device)
        grads = [name for name, p in model.named_parameters() if p.grad is not None]
        alive = [ref() for ref in kept if ref() is not None]
        held.append(f"gradients {grads}, {len(alive)} tensors of the try" if grads or alive else "")
        kept.clear()

    gc_free = largest_batch.free_memory
    monkeypatch.setattr(largest_batch, "free_memory", free)
    return held


def test_a_failed_try_leaves_no_gradients_for_the_next(monkeypatch):
    """A try that runs out of memory in its backward has the last layer's gradients by then: they are dropped before
    the next try, which would otherwise start with them held (and find a smaller batch than fits)."""
    model = FailingModel(most=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held = watch_the_frees(monkeypatch, model, [])

    def step(batch):
        model(torch.randn(batch, 8)).sum().backward()
        optimizer.step()

    device = torch.device("cpu")
    assert largest_batch.largest_fitting(lambda n: largest_batch.fits_in_memory(step, n, device, optimizer), 64) == \
        (5, 6)
    assert len(held) == 6 and not any(held), held


def test_the_memory_chapters_search_frees_each_failed_try(monkeypatch):
    from optlab.studies.memory import fixes

    models = []

    def build(checkpointing):
        models.append(FailingModel(most=12))
        return models[-1]

    subject = fixes.Subject("failing", build, lambda n, device: (torch.randn(n, 8), torch.randint(4, (n,))),
                            fixes.class_loss, 8, checkpointing=False)
    held = []
    gc_free = largest_batch.free_memory

    def free(device):
        gc_free(device)
        held.extend(name for name, p in models[-1].named_parameters() if p.grad is not None)

    monkeypatch.setattr(largest_batch, "free_memory", free)
    assert fixes.largest_batch_of(subject, fixes.Setting(), torch.device("cpu"), 64) == (12, 8)
    assert not held, held


def test_tune_memorys_search_frees_the_failed_tries_tensors(monkeypatch):
    """The batch, the outputs and autograd's graph of a failed try are gone before the allocator's cache is emptied
    (a GPU could not hand their blocks back otherwise)."""
    import weakref

    from optlab.core.machine.device import resolve_device
    from optlab.studies.tune.examples import examples_from
    from optlab.studies.tune.inputs import cross_entropy
    from optlab.studies.tune.memory import Measure, search_batch

    kept = []

    def loss(output, targets):
        kept.extend([weakref.ref(output), weakref.ref(targets)])
        return cross_entropy(output, targets)

    examples = examples_from(None, None, (8,), 4, 0)
    measure = Measure(lambda: FailingModel(most=40), examples.make(2, 0), loss, "sgd", resolve_device("cpu"), 0)
    model = FailingModel(most=40)
    monkeypatch.setattr(measure, "model", lambda setting: (model, torch.optim.SGD(model.parameters(), lr=0.1)))
    held = watch_the_frees(monkeypatch, model, kept)
    assert search_batch(measure, examples, 1000) == (40, 12)
    assert len(held) == 12 and not any(held), held
