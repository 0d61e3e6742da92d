"""`make bench`'s options: the A/A part runs any number of copies of one configuration a page can hold."""
import pytest

from benchmarks import bench


@pytest.mark.parametrize("copies", [2, 7])
def test_an_a_a_run_holds_the_copies_asked_for_each_the_baseline_again(copies):
    experiment = bench.a_a_experiment(copies)
    assert len(experiment.variants) == copies
    assert all(knobs == {} for _, knobs in experiment.variants)
    assert bench.arguments(["--only", "a-a", "--copies", str(copies)]).copies == copies


@pytest.mark.parametrize("copies", ["1", "9", "0"])
def test_a_copy_count_a_page_cannot_hold_is_refused_with_the_limits(copies, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.arguments(["--copies", copies])
    assert exit_.value.code == 2
    assert f"--copies must be from 2 to {bench.MAX_COPIES}" in capsys.readouterr().err
