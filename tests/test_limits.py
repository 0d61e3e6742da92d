"""Every size or count a user can type is bounded by the machine and the data set, and refused at once."""
import time

import pytest

from optlab.commands.cli import main
from optlab.core.knobs import limits
from optlab.core.errors import OptlabError
from optlab.core.knobs.profiles import get_profile
from optlab.studies.distributed.group import check_world_size
from optlab.studies.distributed.parity import parity

ABSURD = [10**5 + 1, 10**7, 10**12]


@pytest.mark.parametrize("value", ABSURD)
@pytest.mark.parametrize("flag, limit", [
    ("--num-workers", "at most 8 (4 per CPU core, 2 cores here)"),
    ("--batch-size", "at most 10000 (the test set holds 10,000 images)"),
    ("--steps", "at most 100000 ("),
    ("--repeats", "at most 100 ("),
    ("--max-repeats", "at most 100 ("),
])
def test_absurd_sizes_end_at_once_with_the_limit(flag, limit, value, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(limits, "cpu_cores", lambda: 2)
    start = time.perf_counter()
    assert main(["run", "set_to_none", "--profile", "smoke", flag, str(value), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optlab: error: ") and "\n" not in err and limit in err, err
    assert time.perf_counter() - start < 10
    assert not list(tmp_path.iterdir()), "nothing is written for a refused run"


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "abc"], "argument --batch-size: expected a whole number, got 'abc'"),
    (["--num-workers", "1.5"], "argument --num-workers: expected a whole number, got '1.5'"),
    (["--steps", "0"], "steps must be at least 1, got 0"),
    (["--repeats", "-3"], "repeats must be at least 2, got -3"),
    (["--batch-size", "0"], "batch_size must be at least 1, got 0"),
    (["--num-workers", "-2"], "num_workers must be at least 0, got -2"),
    (["--colour", "red"], "unrecognized arguments: --colour red"),
])
def test_mistyped_arguments_are_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = main(["run", "set_to_none", *argv, "--out", str(tmp_path)])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("optlab: error: ") and "\n" not in err and message in err, err


def test_a_batch_that_the_phase_cannot_feed_names_the_most_it_can(capsys, tmp_path):
    # 3,000 images a batch: within the test set's 10,000, but 1 warm-up + 4 timed steps need 15,000
    assert main(["run", "set_to_none", "--profile", "smoke", "--batch-size", "3000", "--steps", "4",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "too large for the test phase" in err and "at most 2000 images a batch" in err


@pytest.mark.parametrize("cuda, devices, size, ok", [(False, 0, 2, True), (False, 0, 3, False), (False, 0, 1000, False),
                                                     (True, 4, 4, True), (True, 4, 5, False)])
def test_processes_per_node_are_bounded_by_cores_or_gpus(monkeypatch, cuda, devices, size, ok):
    monkeypatch.setattr(limits, "cpu_cores", lambda: 2)
    monkeypatch.setattr("optlab.studies.distributed.group.cpu_cores", lambda: 2)
    monkeypatch.setattr("torch.cuda.device_count", lambda: devices)
    if ok:
        check_world_size(size, cuda)
    else:
        with pytest.raises(OptlabError, match=r"processes per node \d+ is more than this run can use: at most"):
            check_world_size(size, cuda)


@pytest.mark.parametrize("options, message", [
    ({"nproc": 10**6}, "nproc 1000000 is more than this run can use"),
    ({"steps": 10**9}, "steps 1000000000 is more than this run can use"),
    ({"accumulation_steps": 10**9}, "accumulation_steps 1000000000 is more than this run can use"),
])
def test_parity_check_sizes_are_bounded(options, message):
    with pytest.raises(OptlabError, match=message):
        parity(**options)


def test_profiles_refuse_absurd_sizes_from_the_python_api():
    with pytest.raises(OptlabError, match=r"repeats 1000000 is more than this run can use: at most 100 \("):
        get_profile("smoke").with_sizes(repeats=10**6)


@pytest.mark.parametrize("field", ["repeats", "max_repeats"])
def test_the_repeat_limit_is_exact(field):
    """100 is allowed and 101 is not: the boundary itself, not a prefix of a longer number."""
    assert getattr(get_profile("smoke").with_sizes(**{field: 100}), field) == 100
    with pytest.raises(OptlabError, match=r"101 is more than this run can use: at most 100 \("):
        get_profile("smoke").with_sizes(**{field: 101})


def test_a_cap_below_the_minimum_and_a_bad_time_budget_are_refused():
    with pytest.raises(OptlabError, match="maximum repeats must be at least 6, got 4"):
        get_profile("smoke").with_sizes(repeats=6, max_repeats=4)
    for budget in (0, -1.0, 10**6):
        with pytest.raises(OptlabError, match="time budget must be between 0 and 86,400 seconds"):
            get_profile("smoke").with_sizes(time_budget_s=budget)
