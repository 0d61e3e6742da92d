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
from optlab.commands.reference import costs, outputs, parts_list, planning, running
from optlab.commands.cli import main
from optlab.core.results import archive, store
from optlab.core.run import experiments
from optlab.core.machine import gpu_sampler
from optlab.core.errors import OptlabError
from optlab.core.measuring.flops import step_flops
from optlab.core.knobs.profiles import get_profile
from tests.helpers import TINY
from tests.test_gpu_state import IDLE, counting_nvml

QUICK = get_profile("quick")


def _parts(names=("set_to_none", "no_grad", "non_blocking")):
    def plan(set_name, profile, measured=None):
        return [parts_list.Part("seed", f"{name} resnet18", 1, 1.0, technique=name, model="resnet18")
                for name in names]
    return plan


def _members(path):
    with tarfile.open(path) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar.getmembers()}


@pytest.mark.slow  # among the suite's slowest (processes of its own or a long simulation): not in make check
def test_an_archived_seed_run_unpacks_and_a_second_run_skips_every_part(monkeypatch, tmp_path, capsys):
    """The done-when check: the seed set in the smoke profile (three of its ResNet18 parts, short ones without loader
    workers; the tables need CUDA and are skipped), archived, unpacked into an empty folder, then resumed there."""
    seed_plan = reference.plan
    monkeypatch.setattr(running, "plan", lambda set_name, profile, measured=None: [
        part for part in seed_plan(set_name, profile, measured)
        if part.model == "resnet18" and part.technique in ("non_blocking", "set_to_none", "no_grad")])
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
    monkeypatch.setattr(running, "plan", _parts(("set_to_none", "no_grad")))
    real = experiments.run_experiment

    def no_grad_fails(name, **options):
        if name == "no_grad":
            raise RuntimeError("no_grad broke")
        return real(name, **options)

    monkeypatch.setattr(running, "run_experiment", no_grad_fails)
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


def _tar(path, members, specials=()):
    """``members`` (name: bytes, or (name, bytes) pairs, a name twice included) as a tar.gz, then ``specials``: (name,
    tar type, link target) members with no content."""
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items() if isinstance(members, dict) else members:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        for name, kind, target in specials:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)
    return path


@pytest.mark.parametrize("members, links", [
    ({"../evil.json": _record("H200")}, ()),
    ({"/etc/evil.json": _record("H200")}, ()),
    ({"h200/sub/deep.json": _record("H200")}, ()),
    ({"h200/run.sh": b"rm -rf /"}, ()),
    ({"h200/a.json": _record("H200")}, [("h200/b.json", tarfile.SYMTYPE, "/etc/passwd")]),
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
    monkeypatch.setattr(running, "plan", _parts())
    ran = []
    real = experiments.run_experiment
    monkeypatch.setattr(running, "run_experiment", lambda name, **options: ran.append(name) or real(name, **options))
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
        assert outputs.output_problem(wrapped, tmp_path) is full
    denied = PermissionError(errno.EACCES, "Permission denied")
    assert outputs.output_problem(denied, tmp_path) is None  # the folder is writable: the part's own failure
    assert outputs.output_problem(RuntimeError("CUDA out of memory"), tmp_path) is None
    monkeypatch.setattr(outputs, "folder_writable", lambda folder: False)
    assert outputs.output_problem(denied, tmp_path) is denied


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
    measured = planning.measured_seconds(None, QUICK, folders)
    runs = costs.runs_per_variant(QUICK)
    assert measured == {"set_to_none resnet18": (30.0 * runs / 2, "h200"), "microbench tables": (12.0, "h200")}
    assert planning.measured_seconds("NVIDIA A100", QUICK, folders) == {"no_grad resnet18": (1.0 * runs / 2, "a100")}
    parts = {p.name: p for p in reference.plan("seed", QUICK, measured)}
    assert parts["set_to_none resnet18"].estimate_s == 30.0 * runs / 2
    assert parts["set_to_none resnet18"].estimate_from == "measured (h200)"
    assert parts["no_grad resnet18"].estimate_from == "table"
    table = planning.plan_table(list(parts.values()), set(), None, cuda=True).set_index("part")
    assert table.loc["microbench tables", "estimate from"] == "measured (h200)"
    assert table.loc["microbench tables", "est_s"] == 12.0


def test_the_plan_says_which_estimates_were_measured(monkeypatch, tmp_path):
    monkeypatch.setattr(store, "REFERENCE_DIR", tmp_path)
    _manifest(tmp_path / "h200", [{"part": "set_to_none resnet18", "status": "ok", "seconds": 30.0,
                                   "device_name": "NVIDIA H200", "profile": "quick", "repeats": 12}])
    text = reference.describe_plan("seed", device="cpu")
    line = next(line for line in text.splitlines() if "set_to_none resnet18" in line)
    runs = costs.runs_per_variant(planning.reference_profile(None, True))
    assert f"{30.0 * runs / 12:.1f}" in line and "measured (h200)" in line  # 30 s at 12 repeats, scaled to the cap
    assert "estimates: 1 part(s) measured, 38 from the table" in text  # the seed set: 39 parts, the ceilings first


def test_the_resnet_step_times_follow_their_flops_at_a_conservative_rate():
    """A CIFAR ResNet18 training step at batch 128 is 0.43 TFLOP: the table must put each ResNet at 40-120 TFLOP/s of
    TF32 work, conservative for an H200 and not the 2x-too-slow rate it once had."""
    for model in ("resnet18", "resnet50", "resnet101"):
        rate = step_flops(model, "base", 1.0, 128, True) / costs.TRAIN_STEP_S[model] / 1e12
        assert 40 <= rate <= 120, (model, rate)


def test_each_parts_row_keeps_what_the_gpu_did_during_it_and_the_repeats_it_ran(monkeypatch, tmp_path):
    """Each part watched on a fake GPU that is power-capped while set_to_none runs and calm while no_grad does."""
    monkeypatch.setattr(running, "plan", _parts(("set_to_none", "no_grad")))
    gpu = dict(IDLE)
    monkeypatch.setattr(gpu_sampler, "gpu_id", lambda index: "GPU-1234")
    monkeypatch.setattr(running, "PartWatch", lambda device: gpu_sampler.PartWatch(
        torch.device("cuda", 0), nvml=counting_nvml(gpu), interval_s=0.01))
    real = experiments.run_experiment

    def on_a_gpu(name, **options):
        gpu.update({"sm": 1755, "mask": 0x4} if name == "set_to_none" else {"sm": 1980, "mask": 0x0})
        gpu["energy_mj"] += 90_000
        result = real(name, **options)
        gpu.update(IDLE | {"energy_mj": gpu["energy_mj"]})
        return result

    monkeypatch.setattr(running, "run_experiment", on_a_gpu)
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
    measured = planning.measured_seconds(None, QUICK, [tmp_path / "h200"])
    assert measured["set_to_none resnet18"][0] == 20.0 * costs.runs_per_variant(QUICK) / 4  # 60 s at the cap of 12


def test_on_the_cpu_a_parts_row_says_there_is_no_gpu_state(real_run):
    row = pd.read_csv(io.BytesIO(real_run[PARTS])).iloc[0]
    assert row["gpu_state"] == "no GPU state: this run is on the CPU" and "throttled" not in row


# Every archive that is not a well-formed results folder is refused in one line, exit 2, writing nothing: each case
# damages one member of an archive packed from a real run's folder (a record, a study's table, the parts list, the log).
FOLDER = "h200"
PARTS = f"{FOLDER}/reference-parts.csv"
RECORD = f"{FOLDER}/set_to_none.json"
TABLE = f"{FOLDER}/microbench.csv"
LOG = f"{FOLDER}/reference.log"


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """The members of an archive packed from a real run's folder: one part's record, its parts list and log, and a
    table as a study saves it."""
    folder = tmp_path_factory.mktemp("real") / FOLDER
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(running, "plan", _parts(("set_to_none",)))
        list(reference.run_reference(folder, profile=TINY.with_sizes(repeats=2, max_repeats=2), device="cpu",
                                     progress=False))
    store.save_table(pd.DataFrame({"size_mb": [1, 4], "GB/s": [2.5, 9.0]}), folder, "microbench")
    path, _ = archive.pack(folder, folder.parent / "good.tar.gz")
    return _members(path)


def _edit_parts(change):
    def damage(members):
        parts = pd.read_csv(io.BytesIO(members[PARTS]), dtype=str)
        members[PARTS] = change(parts).to_csv(index=False).encode()
    return damage


def _edit_record(change):
    def damage(members):
        record = json.loads(members[RECORD])
        change(record)
        members[RECORD] = json.dumps(record).encode()
    return damage


def _set(name, value):
    return lambda frame: frame.assign(**{name: value})


def _replace(member, content):
    return lambda members: members.update({member: content})


def _rename(old, new):
    return lambda members: members.update({new: members.pop(old)})


def _append(member, extra):
    return lambda members: members.update({member: members[member] + extra})


DAMAGES = {  # name: (what it does to the members, who the line names, what it says is wrong)
    "parts list that does not parse": (_append(PARTS, b"x,y\n"), PARTS, "fields on line 3"),
    "parts list not UTF-8": (_replace(PARTS, b"part,status\n\xff\xfe\n"), PARTS, "does not parse"),
    "parts list empty": (_replace(PARTS, b""), PARTS, "does not parse"),
    **{f"parts list without {column}": (_edit_parts(lambda frame, c=column: frame.drop(columns=c)), PARTS,
                                        f"lacks the column(s) {column};")
       for column in ("part", "status", "seconds", "device_name", "torch", "git_commit", "profile", "finished")},
    "empty part name": (_edit_parts(_set("part", "")), PARTS, "line 2 has an empty part"),
    "part name with a control character": (_edit_parts(_set("part", "set_to_none\x1b resnet18")), PARTS,
                                           "line 2 has part"),
    "part listed twice": (_edit_parts(lambda frame: pd.concat([frame, frame])), PARTS, "twice"),
    "non-numeric seconds": (_edit_parts(_set("seconds", "fast")), PARTS, "has seconds 'fast'"),
    "negative seconds": (_edit_parts(_set("seconds", "-3")), PARTS, "has seconds '-3'"),
    "infinite seconds": (_edit_parts(_set("seconds", "inf")), PARTS, "has seconds 'inf'"),
    "unknown status": (_edit_parts(_set("status", "done")), PARTS, "has status 'done'"),
    "failed with no reason": (_edit_parts(_set("status", "failed:")), PARTS, "has status 'failed:'"),
    "empty status": (_edit_parts(_set("status", "")), PARTS,
                     "line 2 has no status (allowed: ok, interrupted, failed: <why> or stopped: <why>)"),
    "empty device name": (_edit_parts(_set("device_name", "")), PARTS, "has no device_name"),
    "empty commit": (_edit_parts(_set("git_commit", "")), PARTS, "has no git_commit"),
    "finished not a time": (_edit_parts(_set("finished", "yesterday")), PARTS, "has finished 'yesterday'"),
    "repeats not a number": (_edit_parts(_set("repeats", "two")), PARTS, "has repeats 'two'"),
    "record that does not parse": (_replace(RECORD, b'{"schema_version": 2,'), RECORD, "is not valid JSON"),
    "record with NaN": (_edit_record(lambda r: r["samples"][0].update(wall_s=float("nan"))), RECORD, "NaN"),
    "record that is an array": (_replace(RECORD, b"[]"), RECORD, "is an array, and a record is a JSON object"),
    "record of another schema": (_edit_record(lambda r: r.update(schema_version=1)), RECORD, "schema version 1"),
    "environment not an object": (_edit_record(lambda r: r.update(environment="NVIDIA H200")), RECORD,
                                  "field 'environment' is a string, and a record's environment is an object"),
    "environment without device_name": (_edit_record(lambda r: r["environment"].pop("device_name")), RECORD,
                                        "no device_name"),
    "samples not a list": (_edit_record(lambda r: r.update(samples={"model": "resnet18"})), RECORD,
                           "field 'samples' is an object"),
    "samples not objects": (_edit_record(lambda r: r.update(samples=[1, 2])), RECORD, "samples row 0 is a number"),
    "sample without its model": (_edit_record(lambda r: r["samples"][1].pop("model")), RECORD, "samples row 1"),
    "summary missing": (_edit_record(lambda r: r.pop("summary")), RECORD, "field 'summary' is missing"),
    "summary row without its variant": (_edit_record(lambda r: r["summary"][0].update(variant=None)), RECORD,
                                        "summary row 0"),
    "technique not a string": (_edit_record(lambda r: r.update(technique=3)), RECORD, "field 'technique' is a number"),
    "profile without a name": (_edit_record(lambda r: r["profile"].pop("name")), RECORD, "'profile' has no string"),
    "phases not a list": (_edit_record(lambda r: r.update(phases="train")), RECORD, "field 'phases' is a string"),
    "table that does not parse": (_append(TABLE, b"1,2,3\n"), TABLE, "fields on line 4"),
    "table with an open quote": (_append(TABLE, b'"1,2\n'), TABLE, "does not parse"),
    "log not UTF-8": (_append(LOG, b"\xff\n"), LOG, "is not UTF-8 text"),
    "name with an escape": (_rename(TABLE, f"{FOLDER}/micro\x1b[2Jbench.csv"), "micro\\x1b[2Jbench.csv",
                            "control character"),
    "name with a newline": (_rename(TABLE, f"{FOLDER}/micro\nbench.csv"), "micro\\nbench.csv", "control character"),
    "name with a backslash": (_rename(TABLE, f"{FOLDER}/..\\bench.csv"), "..\\\\bench.csv", "backslash"),
    "folder with a control character": (_rename(TABLE, f"h2\x0700/microbench.csv"), "h2\\x0700", "control character"),
    "absolute name": (_rename(TABLE, f"/{FOLDER}/microbench.csv"), f"'/{FOLDER}/microbench.csv'", "unsafe"),
    "name that leaves the folder": (_rename(TABLE, f"{FOLDER}/../microbench.csv"), "../microbench.csv", "unsafe"),
}
SPECIALS = {  # members no results folder holds: (tar type, link target)
    "symbolic link": (tarfile.SYMTYPE, "/etc/passwd"),
    "hard link": (tarfile.LNKTYPE, RECORD),
    "character device": (tarfile.CHRTYPE, ""),
    "block device": (tarfile.BLKTYPE, ""),
    "fifo": (tarfile.FIFOTYPE, ""),
}


def _destinations(tmp_path, members):
    """A destination that does not exist, and one holding an earlier run of the same machine, which a good archive
    would change (its log gains the archive's lines)."""
    absent, present = tmp_path / "absent" / FOLDER, tmp_path / "present" / FOLDER
    present.mkdir(parents=True)
    for name in (PARTS, RECORD):
        (present / name.split("/")[1]).write_bytes(members[name])
    (present / "reference.log").write_text("an earlier run\n")
    return absent, present


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _unpack_refused(packed, destination, capsys):
    """Unpack through the command line, expecting the one-line refusal; the line."""
    assert main(["reference", "--unpack", str(packed), "--out", str(destination)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith(f"optlab: error: refused {str(packed)!r}: ")
    assert captured.err.endswith("; nothing was written\n")
    return captured.err


def test_the_real_archive_unpacks_where_each_damaged_one_is_refused(real_run, tmp_path, capsys):
    """The control for the cases below: undamaged, the same archive unpacks into both destinations."""
    absent, present = _destinations(tmp_path, real_run)
    for destination in (absent, present):
        assert main(["reference", "--unpack", str(_tar(tmp_path / "good.tar.gz", real_run)), "--out",
                     str(destination)]) == 0
    assert _snapshot(absent) == {name.split("/")[1]: content for name, content in real_run.items()}
    assert _snapshot(present)["reference.log"] == b"an earlier run\n" + real_run[LOG]


@pytest.mark.parametrize("case", DAMAGES)
def test_a_damaged_archive_is_refused_in_one_line_naming_the_member_and_writes_nothing(real_run, tmp_path, capsys,
                                                                                       case):
    damage, named, wrong = DAMAGES[case]
    members = dict(real_run)
    damage(members)
    packed = _tar(tmp_path / "damaged.tar.gz", members)
    absent, present = _destinations(tmp_path, real_run)
    before = _snapshot(present)
    for destination in (absent, present):
        line = _unpack_refused(packed, destination, capsys)
        assert named in line and wrong in line, line
    assert not absent.exists() and not absent.parent.exists()
    assert _snapshot(present) == before


@pytest.mark.parametrize("kind", SPECIALS)
def test_links_and_devices_are_refused_and_nothing_is_written(real_run, tmp_path, capsys, kind):
    packed = _tar(tmp_path / "special.tar.gz", real_run, [(f"{FOLDER}/extra.json", *SPECIALS[kind])])
    absent, present = _destinations(tmp_path, real_run)
    before = _snapshot(present)
    for destination in (absent, present):
        line = _unpack_refused(packed, destination, capsys)
        assert f"unsafe or unexpected member '{FOLDER}/extra.json'" in line
    assert not absent.parent.exists() and _snapshot(present) == before


def test_a_member_twice_or_a_cut_archive_is_refused_and_nothing_is_written(real_run, tmp_path, capsys):
    absent, present = _destinations(tmp_path, real_run)
    before = _snapshot(present)
    twice = _tar(tmp_path / "twice.tar.gz", [*real_run.items(), (TABLE, b"size_mb\n1\n")])
    good = _tar(tmp_path / "good.tar.gz", real_run).read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good[:len(good) * 2 // 3])
    for packed, says in ((twice, f"member {TABLE!r} appears twice"), (cut, "it is damaged (")):
        for destination in (absent, present):
            assert says in _unpack_refused(packed, destination, capsys)
    assert not absent.parent.exists() and _snapshot(present) == before


def test_a_malformed_file_already_in_the_folder_is_named_and_nothing_is_written(real_run, tmp_path, capsys):
    _, present = _destinations(tmp_path, real_run)
    (present / "reference-parts.csv").write_bytes(_parts_list({"part": ""}))
    before = _snapshot(present)
    line = _unpack_refused(_tar(tmp_path / "good.tar.gz", real_run), present, capsys)
    assert f"{store.display_path(present / 'reference-parts.csv')}, already there, line 2 has an empty part" in line
    assert _snapshot(present) == before


def test_a_parts_list_missing_a_column_is_named_by_the_plan_and_the_run_in_one_line(tmp_path, capsys):
    """A parts list that did not come through --unpack (edited by hand, say): --plan and a run stop in one line that
    names it, before any part runs, and leave it as it was (the run's log says why it stopped)."""
    folder = tmp_path / "h200"
    folder.mkdir()
    parts = pd.read_csv(io.BytesIO(_parts_list({"part": "microbench tables"}))).drop(columns="part")
    parts.to_csv(folder / "reference-parts.csv", index=False)
    before = _snapshot(folder)
    for command in (["--plan"], ["--profile", "smoke", "--quiet"]):
        assert main(["reference", *command, "--set", "seed", "--device", "cpu", "--out", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith(f"optlab: error: {store.display_path(folder / 'reference-parts.csv')} lacks the "
                              "column(s) part; a parts list has part, status, seconds")
    assert (folder / "reference-parts.csv").read_bytes() == before["reference-parts.csv"]
    assert not list(folder.glob("*.json"))
