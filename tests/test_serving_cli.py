"""``python -m optlab serve``: each serving study runs on a reader's GPT on the CPU and prints its table with verdicts;
bad input is one line and exit 2, with the limit or the choices in it."""
import pytest

from optlab.commands.cli import main
from optlab.core.measuring.timing import VERDICTS

GPT = ["--model", "tests.gpt_fixture:tiny_gpt", "--device", "cpu", "--rounds", "2"]


def cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def verdicts_in(text: str) -> set[str]:
    return {verdict for verdict in VERDICTS if verdict in text}


@pytest.mark.parametrize("argv, columns", [
    (["decode", "--caches", "none,dynamic,static", "--prompt-len", "16", "--new-tokens", "6", "--batch", "2"],
     ["TPOT ms", "median step ms", "dynamic cache", "static cache", "MBU %", "no MBU: a step's"]),
    (["quantized", "--prompt-len", "8", "--new-tokens", "4"],
     ["int8 weight-only", "largest error (steps)", "speed-up"]),
    (["speculative", "--prompt-len", "12", "--new-tokens", "8", "--ks", "2"],
     ["prompt lookup, k=2", "acceptance rate"]),
    (["stream", "--requests", "6", "--rates", "50,500", "--slots", "2"],
     ["objective (fixed before the streams)", "ITL", "pooled p99 ms", "goodput_per_s", "continuous mean E2E ms"]),
])
def test_each_study_prints_its_table_with_verdicts(argv, columns, capsys):
    assert cli(["serve", *argv, *GPT]) == 0
    out = capsys.readouterr().out
    assert all(column in out for column in columns), [column for column in columns if column not in out]
    assert verdicts_in(out), out


def test_the_draft_model_is_the_readers_own_when_named(capsys):
    argv = ["serve", "speculative", *GPT, "--draft", "tests.gpt_fixture:tiny_gpt", "--prompt-len", "12",
            "--new-tokens", "6", "--ks", "1"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert "draft model, k=1" in out and "prompt lookup, k=1" in out


@pytest.mark.parametrize("argv, words", [
    (["decode", "--model", "tests.lm_fixture:TinyCausalLM"], "built a TinyCausalLM; serve needs the book's GPT"),
    (["decode", "--model", "tests.gpt_fixture:no_such"], "has no attribute 'no_such'"),
    (["decode", "--caches", "none,paged"], "--caches takes names of none, dynamic, static, compiled; got paged"),
    (["decode", "--rounds", "1"], "--rounds must be at least 2"),
    (["decode", "--rounds", "500"], "at most 64"),
    (["decode", "--prompt-len", "500"], "--prompt-len 500 is more than this run can use: at most 63"),
    (["decode", "--batch", "100"], "--batch 100 is more than this run can use: at most 64"),
    (["stream", "--rates", "1,2,3,4,5,6,7,8,9"], "--rates takes 1 to 8 rates, got 9"),
    (["stream", "--requests", "20000"], "at most 10000"),
    (["stream", "--rates", "0"], "rate must be a number of requests a second above 0"),
    (["stream", "--ttft-ms", "-1"], "--ttft-ms must be a positive number of milliseconds"),
    (["speculative", "--ks", "0"], "ks must be draft lengths from 1 to 32"),
    (["stream", "--rates", "fast"], "expected comma-separated numbers"),
    (["serving"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    study = [] if argv[0] == "serving" else [argv[0]]
    model = [] if "--model" in argv else ["--model", "tests.gpt_fixture:tiny_gpt"]
    assert cli(["serve", *study, *model, "--device", "cpu", *argv[1:]] if study else ["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("optlab: error:") and err.count("\n") == 1 and words in err, err
