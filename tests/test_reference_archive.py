"""The reference run comes back whole: one archive however it ends, unpacked with checks, resumed from there; a full
disk stops it once; estimates learn from measured seconds; the GPU's state is in every part's row."""
import errno
import io
import json
import tarfile
from pathlib import Path

import pandas as pd
import pytest
import torch

from optlab.commands import reference
from optlab.commands.cli import main
from optlab.core import archive, experiments, gpu_sampler, store
from optlab.core.errors import OptlabError
from optlab.core.flops import step_flops
from optlab.core.profiles import get_profile
from tests.helpers import TINY
from tests.test_gpu_state import IDLE, counting_nvml

QUICK = get_profile("quick")


def _parts(names=("set_to_none", "no_grad", "non_blocking")):
    def plan(set_name, profile, measured=None):
        return [reference.Part("seed", f"{name} resnet18", 1, 1.0, technique=name, model="resnet18")
                for name in names]
    return plan


def _members(path):
    with tarfile.open(path) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar.getmembers()}


def test_an_archived_seed_run_unpacks_and_a_second_run_skips_every_part(monkeypatch, tmp_path, capsys):
    """The done-when check: the seed set in the smoke profile (its MobileNetV2 parts of three techniques, to stay
    short; the tables need CUDA and are skipped), archived, unpacked into an empty folder, then resumed there."""
    seed_plan = reference.plan
    monkeypatch.setattr(reference, "plan", lambda set_name, profile, measured=None: [
        part for part in seed_plan(set_name, profile, measured) if part.model == "mobilenet_v2"][:3])
    out, packed, unpacked = tmp_path / "run" / "h200", tmp_path / "h200.tar.gz", tmp_path / "empty" / "h200"
    common = ["reference", "--set", "seed", "--profile", "smoke", "--device", "cpu", "--quiet", "--repeats", "2",
              "--max-repeats", "2"]
    assert main([*common, "--out", str(out), "--archive", str(packed)]) == 0
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"reference-parts.csv", "reference.log"} < set(written) and len(written) == 5  # 3 records
    assert _members(packed) == {f"h200/{name}": content for name, content in written.items()}
    assert "archive: " in capsys.readouterr().out

    assert main(["reference", "--unpack", str(packed), "--out", str(unpacked)]) == 0
    assert {p.name: p.read_bytes() for p in unpacked.iterdir()} == written
    capsys.readouterr()
    assert main([*common, "--out", str(unpacked), "--budget", "600"]) == 0
    out_text = capsys.readouterr().out
    assert "skipped 3 part(s) already recorded" in out_text and "\npart " not in out_text
    assert all((unpacked / name).read_bytes() == content for name, content in written.items() if name.endswith(".json"))


def test_the_archive_is_written_when_a_part_fails_and_when_the_budget_stops_the_run(monkeypatch, tmp_path):
    monkeypatch.setattr(reference, "plan", _parts(("set_to_none", "no_grad")))
    real = experiments.run_experiment

    def no_grad_fails(name, **options):
        if name == "no_grad":
            raise RuntimeError("no_grad broke")
        return real(name, **options)

    monkeypatch.setattr(reference, "run_experiment", no_grad_fails)
    packed = tmp_path / "one.tar.gz"
    with pytest.raises(OptlabError, match="these parts failed"):
        list(reference.run_reference(tmp_path / "out", profile=TINY, device="cpu", progress=False, archive=packed))
    members = _members(packed)
    assert set(members) == {"out/set_to_none.json", "out/reference-parts.csv", "out/reference.log"}
    assert b"no_grad broke" in members["out/reference.log"] and b"stopped: OptlabError" in members["out/reference.log"]

    left = tmp_path / "left.tar.gz"
    assert list(reference.run_reference(tmp_path / "small", profile=TINY, device="cpu", progress=False,
                                        budget_s=0.5, archive=left)) == []
    assert set(_members(left)) == {"small/reference.log"}


def test_a_failed_archive_write_leaves_no_partial_file(monkeypatch, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.csv").write_text("x\n1\n")
    monkeypatch.setattr(tarfile.TarFile, "addfile", lambda *args, **kwargs: (_ for _ in ()).throw(OSError(
        errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError):
        archive.pack(tmp_path / "out", tmp_path / "a.tar.gz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _record(machine, schema=store.SCHEMA_VERSION):
    return json.dumps({"schema_version": schema, "technique": "x", "profile": {"name": "quick"},
                       "environment": {"device_name": machine}, "samples": [], "summary": []}).encode()


PART_ROW = {"part": "x resnet18", "status": "ok", "seconds": 1.0, "device_name": "NVIDIA H200", "torch": "2.9.0",
            "git_commit": "abc", "profile": "quick", "finished": "2026-01-01T00:00:00+00:00"}


def _parts_list(*rows):
    """A parts list of ``rows``, each filled out with the columns every row has."""
    return pd.DataFrame([{**PART_ROW, **row} for row in rows]).to_csv(index=False).encode()


def _tar(path, members, links=()):
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


@pytest.mark.parametrize("members, links", [
    ({"../evil.json": _record("H200")}, ()),
    ({"/etc/evil.json": _record("H200")}, ()),
    ({"h200/sub/deep.json": _record("H200")}, ()),
    ({"h200/run.sh": b"rm -rf /"}, ()),
    ({"h200/a.json": _record("H200")}, [("h200/b.json", "/etc/passwd")]),
])
def test_unsafe_members_are_refused_and_nothing_is_written(tmp_path, members, links, capsys):
    packed = _tar(tmp_path / "bad.tar.gz", members, links)
    destination = tmp_path / "dest"
    assert main(["reference", "--unpack", str(packed), "--out", str(destination)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("optlab: error: refused") and "unsafe or unexpected member" in err and err.count("\n") == 1
    assert not destination.exists()


def test_another_machine_or_schema_is_refused_and_nothing_is_written(tmp_path):
    destination = tmp_path / "h200"
    destination.mkdir()
    (destination / "x.json").write_bytes(_record("NVIDIA H200"))
    before = {p.name: p.read_bytes() for p in destination.iterdir()}
    other = _tar(tmp_path / "other.tar.gz", {"h200/y.json": _record("NVIDIA A100")})
    with pytest.raises(OptlabError, match="from NVIDIA A100, and .* holds results from NVIDIA H200.*nothing was written"):
        archive.unpack(other, destination)
    parts = _parts_list({"part": "p", "device_name": "NVIDIA A100"})
    mixed = _tar(tmp_path / "mixed.tar.gz", {"h200/y.json": _record("NVIDIA H200"), "h200/reference-parts.csv": parts})
    with pytest.raises(OptlabError, match="more than one machine"):
        archive.unpack(mixed, destination)
    old = _tar(tmp_path / "old.tar.gz", {"h200/y.json": _record("NVIDIA H200", schema=99)})
    with pytest.raises(OptlabError, match="schema version 99"):
        archive.unpack(old, destination)
    assert {p.name: p.read_bytes() for p in destination.iterdir()} == before


def test_unpacking_merges_with_what_is_there(tmp_path):
    destination = tmp_path / "h200"
    destination.mkdir()
    (destination / "x.json").write_bytes(_record("NVIDIA H200"))
    (destination / "reference-parts.csv").write_bytes(_parts_list({"part": "x resnet18"},
                                                                  {"part": "y resnet18", "status": "failed: OOM"}))
    (destination / "reference.log").write_text("first run\n")
    packed = _tar(tmp_path / "next.tar.gz", {"h200/y.json": _record("NVIDIA H200"), "h200/t.csv": b"a\n1\n",
                                             "h200/reference-parts.csv": _parts_list({"part": "y resnet18"}),
                                             "h200/reference.log": b"second run\n"})
    folder, names = archive.unpack(packed, destination)
    assert folder == destination and sorted(p.name for p in destination.iterdir()) == [
        "reference-parts.csv", "reference.log", "t.csv", "x.json", "y.json"]
    merged = pd.read_csv(destination / "reference-parts.csv").set_index("part")["status"].to_dict()
    assert merged == {"x resnet18": "ok", "y resnet18": "ok"}
    assert (destination / "reference.log").read_text() == "first run\nsecond run\n"


def _disk_fills_after(monkeypatch, writes, error=errno.ENOSPC):
    """store.atomic_write_text raises ``error`` after ``writes`` writes, as a full disk would."""
    real, count = store.atomic_write_text, {"n": 0}

    def write(path, text):
        count["n"] += 1
        if count["n"] > writes:
            raise OSError(error, "No space left on device", str(path))
        real(path, text)

    monkeypatch.setattr(store, "atomic_write_text", write)


def test_a_full_disk_stops_the_run_at_once_with_one_line_and_keeps_what_was_written(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(reference, "plan", _parts())
    ran = []
    real = experiments.run_experiment
    monkeypatch.setattr(reference, "run_experiment", lambda name, **options: ran.append(name) or real(name, **options))
    _disk_fills_after(monkeypatch, 2)  # the first record and its row in reference-parts.csv
    packed = tmp_path.parent / f"{tmp_path.name}-elsewhere" / "run.tar.gz"  # another disk, which has room
    assert main(["reference", "--profile", "smoke", "--device", "cpu", "--quiet", "--repeats", "2", "--max-repeats",
                 "2", "--out", str(tmp_path), "--archive", str(packed)]) == 2
    log = _members(packed)[f"{tmp_path.name}/reference.log"].decode()  # the folder could not take the log
    assert "stopped: OptlabError: cannot write results to" in log and not (tmp_path / "reference.log").exists()
    err = capsys.readouterr().err
    assert ran == ["set_to_none", "no_grad"]  # stopped in the second part, the third never started
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"optlab: error: cannot write results to {store.display_path(tmp_path)}: No space left "
                          "on device (")
    assert "stopped at part no_grad resnet18, and the 1 part(s) this run finished are kept there" in err
    assert "run the same command again: it skips every part already recorded" in err
    assert store.load_record(tmp_path / "set_to_none.json")["technique"] == "set_to_none"
    assert pd.read_csv(tmp_path / "reference-parts.csv")["part"].tolist() == ["set_to_none resnet18"]
    assert not (tmp_path / "no_grad.json").exists()


def test_what_counts_as_an_output_problem(monkeypatch, tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as error:
            raise OptlabError("output folder cannot be written") from error
    except OptlabError as wrapped:
        assert reference.output_problem(wrapped, tmp_path) is full
    denied = PermissionError(errno.EACCES, "Permission denied")
    assert reference.output_problem(denied, tmp_path) is None  # the folder is writable: the part's own failure
    assert reference.output_problem(RuntimeError("CUDA out of memory"), tmp_path) is None
    monkeypatch.setattr(reference, "_folder_writable", lambda folder: False)
    assert reference.output_problem(denied, tmp_path) is denied


def _manifest(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "reference-parts.csv").write_bytes(_parts_list(*rows))


def test_measured_seconds_replace_the_tables_estimate_for_the_same_gpu(tmp_path):
    row = {"part": "set_to_none resnet18", "status": "ok", "seconds": 30.0, "device_name": "NVIDIA H200",
           "profile": "quick", "repeats": 2, "finished": "2026-01-01T00:00:00+00:00"}
    _manifest(tmp_path / "h200", [row, {**row, "part": "no_grad resnet18", "status": "failed: x"},
                                  {**row, "part": "microbench tables", "seconds": 12.0}])
    _manifest(tmp_path / "a100", [{**row, "part": "no_grad resnet18", "device_name": "NVIDIA A100", "seconds": 1.0}])
    _manifest(tmp_path / "smoke", [{**row, "part": "no_grad resnet18", "profile": "smoke", "seconds": 2.0}])
    folders = [tmp_path / name for name in ("h200", "a100", "smoke")]
    measured = reference.measured_seconds(None, QUICK, folders)
    runs = reference.runs_per_variant(QUICK)
    assert measured == {"set_to_none resnet18": (30.0 * runs / 2, "h200"), "microbench tables": (12.0, "h200")}
    assert reference.measured_seconds("NVIDIA A100", QUICK, folders) == {"no_grad resnet18": (1.0 * runs / 2, "a100")}
    parts = {p.name: p for p in reference.plan("seed", QUICK, measured)}
    assert parts["set_to_none resnet18"].estimate_s == 30.0 * runs / 2
    assert parts["set_to_none resnet18"].estimate_from == "measured (h200)"
    assert parts["no_grad resnet18"].estimate_from == "table"
    table = reference.plan_table(list(parts.values()), set(), None, cuda=True).set_index("part")
    assert table.loc["microbench tables", "estimate from"] == "measured (h200)"
    assert table.loc["microbench tables", "est_s"] == 12.0


def test_the_plan_says_which_estimates_were_measured(monkeypatch, tmp_path):
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path)
    _manifest(tmp_path / "h200", [{"part": "set_to_none resnet18", "status": "ok", "seconds": 30.0,
                                   "device_name": "NVIDIA H200", "profile": "quick", "repeats": 12}])
    text = reference.describe_plan("seed", device="cpu")
    line = next(line for line in text.splitlines() if "set_to_none resnet18" in line)
    runs = reference.runs_per_variant(reference.reference_profile(None, True))
    assert f"{30.0 * runs / 12:.1f}" in line and "measured (h200)" in line  # 30 s at 12 repeats, scaled to the cap
    assert "estimates: 1 part(s) measured, 37 from the table" in text


def test_the_resnet_step_times_follow_their_flops_at_a_conservative_rate():
    """A CIFAR ResNet18 training step at batch 128 is 0.43 TFLOP: the table must put each ResNet at 40-120 TFLOP/s of
    TF32 work, conservative for an H200 and not the 2x-too-slow rate it once had."""
    for model in ("resnet18", "resnet50", "resnet101"):
        rate = step_flops(model, "base", 1.0, 128, True) / reference.TRAIN_STEP_S[model] / 1e12
        assert 40 <= rate <= 120, (model, rate)


def test_each_parts_row_keeps_what_the_gpu_did_during_it_and_the_repeats_it_ran(monkeypatch, tmp_path):
    """Each part watched on a fake GPU that is power-capped while set_to_none runs and calm while no_grad does."""
    monkeypatch.setattr(reference, "plan", _parts(("set_to_none", "no_grad")))
    gpu = dict(IDLE)
    monkeypatch.setattr(gpu_sampler, "gpu_id", lambda index: "GPU-1234")
    monkeypatch.setattr(reference, "PartWatch", lambda device: gpu_sampler.PartWatch(
        torch.device("cuda", 0), nvml=counting_nvml(gpu), interval_s=0.01))
    real = experiments.run_experiment

    def on_a_gpu(name, **options):
        gpu.update({"sm": 1755, "mask": 0x4} if name == "set_to_none" else {"sm": 1980, "mask": 0x0})
        gpu["energy_mj"] += 90_000
        result = real(name, **options)
        gpu.update(IDLE | {"energy_mj": gpu["energy_mj"]})
        return result

    monkeypatch.setattr(reference, "run_experiment", on_a_gpu)
    profile = TINY.with_sizes(repeats=2, max_repeats=12, time_budget_s=0.001)  # stops at 2, well below the cap
    list(reference.run_reference(tmp_path, profile=profile, device="cpu", progress=False))
    rows = pd.read_csv(tmp_path / "reference-parts.csv").set_index("part")
    capped, calm = rows.loc["set_to_none resnet18"], rows.loc["no_grad resnet18"]
    assert (capped["sm_clock_mhz_min"], capped["throttled"], capped["energy_j"]) == (1755, "yes", 90.0)
    assert (calm["sm_clock_mhz_min"], calm["throttled"]) == (1980, "no")
    for part in ("set_to_none", "no_grad"):
        ran = store.load_record(tmp_path / f"{part}.json")["rounds"]["resnet18"]["repeats"]
        assert rows.loc[f"{part} resnet18", "repeats"] == ran + profile.warmup_repeats  # what ran, not the cap
        assert ran < profile.max_repeats


def test_learned_estimates_scale_by_the_repeats_a_part_ran(tmp_path):
    row = {"part": "set_to_none resnet18", "status": "ok", "seconds": 20.0, "device_name": "NVIDIA H200",
           "profile": "quick", "repeats": 4}
    _manifest(tmp_path / "h200", [row])
    measured = reference.measured_seconds(None, QUICK, [tmp_path / "h200"])
    assert measured["set_to_none resnet18"][0] == 20.0 * reference.runs_per_variant(QUICK) / 4  # 60 s at the cap of 12


def test_on_the_cpu_a_parts_row_says_there_is_no_gpu_state(monkeypatch, tmp_path):
    monkeypatch.setattr(reference, "plan", _parts(("set_to_none",)))
    list(reference.run_reference(tmp_path, profile=TINY, device="cpu", progress=False))
    row = pd.read_csv(tmp_path / "reference-parts.csv").iloc[0]
    assert row["gpu_state"] == "no GPU state: this run is on the CPU" and "throttled" not in row
