"""A results folder's checks on values that sit just outside what is allowed: a status that only starts with a valid
one, a number just below 0, a time that is not ISO, a name with a control character; and the values just inside."""
import json

import pytest

from optlab.core.results import checks, store

ROW = {"part": "set_to_none resnet18", "status": "ok", "seconds": "1.5", "device_name": "NVIDIA H200", "torch": "2.9.0",
       "git_commit": "abc", "profile": "quick", "finished": "2026-01-31T12:00:00+00:00", "repeats": "4"}


def parts_csv(*rows: dict) -> bytes:
    header = list(ROW)
    lines = [",".join(header)] + [",".join(str(row.get(key, "")) for key in header) for row in rows]
    return ("\n".join(lines) + "\n").encode()


@pytest.mark.parametrize("key, value", [
    ("status", "ok"), ("status", "interrupted"), ("status", "failed: out of memory"), ("seconds", "0"),
    ("seconds", "0.0"), ("repeats", ""), ("repeats", "0"), ("finished", "2026-01-31T12:00:00"), ("part", "a b"),
])
def test_values_just_inside_are_allowed(key, value):
    assert checks.parts_list_problem(parts_csv({**ROW, key: value})) is None


@pytest.mark.parametrize("key, value, said", [
    ("status", "okay", "has status 'okay' (allowed: ok, interrupted, failed: <why> or stopped: <why>)"),
    ("status", "oks", "has status 'oks'"),
    ("status", "interrupted later", "has status 'interrupted later'"),
    ("status", "not ok", "has status 'not ok'"),
    ("status", "failed:x", "has status 'failed:x'"),
    ("status", "Failed: x", "has status 'Failed: x'"),
    ("seconds", "-0.1", "has seconds '-0.1' (allowed: a number from 0)"),
    ("seconds", "inf", "has seconds 'inf'"),
    ("seconds", "nan", "has seconds nan"),
    ("seconds", "ten", "has seconds 'ten'"),
    ("repeats", "-1", "has repeats '-1' (allowed: a number from 0, or empty)"),
    ("repeats", "inf", "has repeats 'inf'"),
    ("finished", "yesterday", "has finished 'yesterday' (allowed: an ISO time"),
    ("torch", "", "has no torch (each row names"),
    ("part", " ", "has an empty part"),
    ("part", "a\x07b", "has part 'a\\x07b' (allowed: a name of printable characters)"),
])
def test_values_just_outside_are_refused_naming_the_line_and_the_value(key, value, said):
    problem = checks.parts_list_problem(parts_csv(ROW, {**ROW, "part": "second", key: value}))
    assert problem is not None and problem.startswith("line 3 ") and said in problem, problem


def test_the_first_bad_line_is_named_and_a_part_twice_is_refused():
    problem = checks.parts_list_problem(parts_csv({**ROW, "seconds": "-1"}, {**ROW, "part": "b", "status": "okay"}))
    assert problem.startswith("line 2 has seconds '-1'")
    assert checks.parts_list_problem(parts_csv(ROW, ROW)) == (
        "lists part 'set_to_none resnet18' twice, and each part has one row")


def test_a_parts_list_missing_columns_names_each():
    content = b"part,status,seconds\nx,ok,1\n"
    assert checks.parts_list_problem(content) == (
        "lacks the column(s) device_name, torch, git_commit, profile, finished; a parts list has "
        f"{', '.join(checks.PARTS_COLUMNS)}")


def test_a_row_with_another_field_count_names_its_line():
    assert checks.file_problem("t.csv", b"a,b\n1,2\n1,2,3\n") == (
        "has 3 fields on line 3 and 2 in its header; a table is UTF-8 CSV with a header and as many fields in each row")
    assert checks.file_problem("t.csv", b"a,b\n1,2\n\n") is None


def record(**changes) -> bytes:
    base = {"schema_version": store.SCHEMA_VERSION, "technique": "t", "profile": {"name": "quick"},
            "environment": {"device_name": "NVIDIA H200"}, "samples": [], "summary": []}
    return json.dumps({**base, **changes}).encode()


@pytest.mark.parametrize("changes, said", [
    ({}, None),
    ({"title": "A title"}, None),
    ({"schema_version": store.SCHEMA_VERSION + 1}, f"is a record of schema version {store.SCHEMA_VERSION + 1}"),
    ({"technique": 3}, "field 'technique' is a number, and a record's technique is a string"),
    ({"title": ["x"]}, "field 'title' is an array, and a record's title is a string"),
    ({"samples": {}}, "field 'samples' is an object, and a record's samples is an array"),
    ({"profile": {"name": 1}}, "field 'profile' has no string 'name'"),
    ({"environment": {"device_name": ""}}, "field 'environment' has no device_name string"),
    ({"summary": [{"model": "m", "variant": "v"}]}, "summary row 0 is an object without string model, variant, phase"),
    ({"samples": [{"model": "m", "variant": "v", "phase": "train"}, 3]}, "samples row 1 is a number without"),
])
def test_a_record_is_refused_for_the_first_field_the_book_cannot_read(changes, said):
    problem = checks.file_problem("r.json", record(**changes))
    assert problem == said if said is None else said in problem, problem


def test_a_record_missing_a_field_or_holding_nan_is_named():
    content = json.loads(record())
    del content["summary"]
    assert checks.record_problem(json.dumps(content).encode()) == (
        "field 'summary' is missing, and a record's summary is an array")
    assert "NaN is not a JSON value" in checks.record_problem(record().replace(b'"t"', b"NaN"))
    assert checks.record_problem(b"[1]") == "is an array, and a record is a JSON object"


@pytest.mark.parametrize("name, bad", [("ok.csv", False), ("a b.json", False), ("a\tb", True), ("a\\b", True),
                                       ("a\x00b", True)])
def test_a_name_with_a_control_character_or_a_backslash_is_refused(name, bad):
    assert (checks.name_problem(name) is not None) == bad


def test_a_log_must_be_utf8_text():
    assert checks.file_problem("run.log", "é".encode()) is None
    assert checks.file_problem("run.log", b"\xff").startswith("is not UTF-8 text")


ALLOWED_TABLE = "a table is UTF-8 CSV with a header and as many fields in each row"


@pytest.mark.parametrize("content, why", [
    (b'a,b\n"1"x,2\n', "',' expected after '\"'"),  # a quote inside a field: pandas alone would read 1x
    (b"", "No columns to parse from file"),
    (b'a,b\n1,"2\n', "unexpected end of data"),
])
def test_a_table_that_does_not_parse_says_why_in_one_line(content, why):
    assert checks.file_problem("t.csv", content) == f"does not parse as a CSV table ({why}); {ALLOWED_TABLE}"


def test_each_refusal_reads_as_written():
    """The exact words, so that a reader sees what is wrong and what is allowed."""
    line = "line 3 "
    assert checks.parts_list_problem(parts_csv(ROW, {**ROW, "part": "b", "status": ""})) == (
        line + "has no status (allowed: ok, interrupted, failed: <why> or stopped: <why>)")
    assert checks.parts_list_problem(parts_csv(ROW, {**ROW, "part": ""})) == (
        line + "has an empty part (each row names its part)")
    assert checks.parts_list_problem(parts_csv(ROW, {**ROW, "part": "b", "torch": "", "profile": ""})) == (
        line + "has no torch, profile (each row names the machine, torch, commit and profile it ran with)")
    assert checks.name_problem("a\tb") == (
        "has a control character or a backslash in its name (allowed: printable characters but a backslash)")
    assert checks.record_problem(record(profile={})) == (
        "field 'profile' has no string 'name', and a record's profile names itself")
    assert checks.record_problem(record(environment={"device_name": ""})) == (
        "field 'environment' has no device_name string, and a record's environment names its machine")
    assert checks.record_problem(record(samples=[[]])) == (
        "samples row 0 is an array without string model, variant, phase, and each samples row is an object with them")


def test_a_parts_list_is_checked_by_its_name_and_read_only_when_it_passes(tmp_path):
    bad = parts_csv({**ROW, "status": "okay"})
    assert checks.file_problem(checks.PARTS_LIST, bad) == (
        "line 2 has status 'okay' (allowed: ok, interrupted, failed: <why> or stopped: <why>)")
    assert checks.file_problem("other.csv", bad) is None  # any other table only has to parse
    path = tmp_path / checks.PARTS_LIST
    path.write_bytes(bad)
    with pytest.raises(checks.OptlabError) as refused:
        checks.read_parts_list(path)
    assert str(refused.value) == (f"{checks.store.display_path(path)} line 2 has status 'okay' (allowed: ok, "
                                  "interrupted, failed: <why> or stopped: <why>): fix it, or move it away and run again")
    path.write_bytes(parts_csv(ROW, {**ROW, "part": "b", "seconds": "2"}))
    assert checks.read_parts_list(path)[["part", "seconds"]].values.tolist() == [[ROW["part"], "1.5"], ["b", "2"]]
