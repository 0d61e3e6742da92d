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
