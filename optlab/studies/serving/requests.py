"""A stream of requests arriving at a rate, and the latencies a server gave them.

The stream: arrivals are a Poisson process (exponential gaps at ``rate`` requests a second, on the server's clock),
each request with its own prompt and its own number of output tokens, drawn uniformly from the ranges given; the same
seed gives the same stream. The statistics are those vLLM's and SGLang's serving benchmarks report: time to first
token (TTFT: arrival to the first output token), time per output token (TPOT: the mean gap between a request's later
tokens), end-to-end latency (arrival to the last token) and inter-token latency (ITL: every gap between two
consecutive tokens of every request, pooled), each at p50, p90 and p99 (numpy's linear interpolation, as vLLM
computes them) over the requests of one run, with the number of values it rests on; output tokens a second; and
goodput, the requests a second that met a stated objective on both TTFT and TPOT, all from the first arrival.

Over several rounds of the same stream (``round_percentiles``) each percentile is taken over the requests of each
round, then its median over the rounds is given with the rounds' range (which holds the median of the rounds'
distribution with probability ``range_coverage(rounds)``), and beside it the pooled figure: the percentile over all
rounds' requests together. (A median of each request's rounds would remove exactly the tail a server is judged by.)
The range treats the rounds as independent draws, which a machine's drifting load makes them not quite.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from ...core.errors import OptlabError
from ...core.knobs.limits import check_count

MAX_REQUESTS = 10_000  # a stream's length: a CPU serves about a hundred in seconds of real compute
MAX_RATE = 1e6  # requests a second
MAX_TOKENS = 4096  # a prompt's or an output's length
PERCENTILES = (50, 90, 99)
METRICS = ("ttft_s", "tpot_s", "e2e_s")
ROUND_METRICS = ("TTFT", "TPOT", "E2E", "ITL")


@dataclass(frozen=True)
class Request:
    """One request: when it arrives (seconds on the server's clock), its prompt's tokens and how many to generate."""

    index: int
    arrival_s: float
    prompt: tuple[int, ...]
    output_len: int


@dataclass
class Served:
    """What the server did with one request: the tokens it generated and the clock time each one was ready."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.output_len

    def emit(self, token: int, now_s: float) -> None:
        """Record one more output token, ready at ``now_s``."""
        self.tokens.append(int(token))
        self.token_times_s.append(float(now_s))


def _length_range(name: str, lengths: tuple[int, int]) -> tuple[int, int]:
    if len(lengths) != 2:
        raise OptlabError(f"{name} must be a (shortest, longest) pair, got {lengths!r}")
    low = check_count(f"{name}[0]", lengths[0], 1, MAX_TOKENS, "a request's length")
    high = check_count(f"{name}[1]", lengths[1], low, MAX_TOKENS, "a request's length")
    return low, high


def poisson_stream(rate: float, count: int, prompt_lengths: tuple[int, int] = (8, 24),
                   output_lengths: tuple[int, int] = (4, 32), vocab_size: int = 65, seed: int = 0,
                   text: torch.Tensor | None = None) -> list[Request]:
    """``count`` requests arriving at ``rate`` a second (Poisson: exponential gaps, the first after one gap), with
    prompt and output lengths drawn uniformly from the inclusive ranges given. Prompts are windows of ``text`` (a 1-D
    tensor of token ids) where given, else uniform random tokens below ``vocab_size``. The arrivals are drawn first
    and scale with ``rate``, so the same ``seed`` gives the same requests at every rate, only sooner or later."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= MAX_RATE:
        raise OptlabError(f"rate must be a number of requests a second above 0 and at most {MAX_RATE:g}, got {rate!r}")
    count = check_count("count", count, 1, MAX_REQUESTS, "requests in one stream")
    prompt_low, prompt_high = _length_range("prompt_lengths", prompt_lengths)
    output_low, output_high = _length_range("output_lengths", output_lengths)
    vocab_size = check_count("vocab_size", vocab_size, 1, 2**20, "token ids")
    if text is not None and (text.dim() != 1 or text.numel() <= prompt_high):
        raise OptlabError(f"text must be a 1-D tensor of token ids longer than the longest prompt ({prompt_high}), "
                          f"got shape {tuple(text.shape)}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count))
    prompt_lens = rng.integers(prompt_low, prompt_high + 1, size=count)
    output_lens = rng.integers(output_low, output_high + 1, size=count)
    requests = []
    for index, (arrival, prompt_len, output_len) in enumerate(zip(arrivals, prompt_lens, output_lens)):
        if text is None:
            prompt = rng.integers(0, vocab_size, size=prompt_len)
        else:
            start = int(rng.integers(0, text.numel() - prompt_len))
            prompt = text[start:start + prompt_len].tolist()
        requests.append(Request(index, float(arrival), tuple(int(t) for t in prompt), int(output_len)))
    return requests


def latency_frame(served: list[Served]) -> pd.DataFrame:
    """One row per request: its arrival, lengths, TTFT, TPOT (NaN with one output token: no gap to average) and
    end-to-end latency, in seconds."""
    rows = []
    for item in served:
        if not item.done:
            raise OptlabError(f"request {item.request.index} has {len(item.tokens)} of its "
                              f"{item.request.output_len} output tokens: latencies need finished requests")
        times, arrival = item.token_times_s, item.request.arrival_s
        gaps = len(times) - 1
        rows.append({"request": item.request.index, "arrival_s": arrival, "prompt_len": len(item.request.prompt),
                     "output_len": len(item.tokens), "ttft_s": times[0] - arrival,
                     "tpot_s": (times[-1] - times[0]) / gaps if gaps else math.nan, "e2e_s": times[-1] - arrival})
    return pd.DataFrame(rows)


def inter_token_latencies(served: list[Served]) -> np.ndarray:
    """ITL: every gap between two consecutive tokens of every request, pooled (seconds), as vLLM reports it."""
    gaps = [np.diff(item.token_times_s) for item in served]
    return np.concatenate(gaps) if gaps else np.empty(0)


def range_coverage(rounds: int) -> float:
    """The probability that the lowest and highest of ``rounds`` independent values hold their distribution's median:
    1 - 2 x 0.5^rounds (87.5 % for 4 rounds, 97 % for 6)."""
    return 1.0 - 2.0 * 0.5 ** rounds


def _round_values(served: list[Served]) -> dict[str, np.ndarray]:
    frame = latency_frame(served)
    values = {metric.removesuffix("_s").upper(): frame[metric].dropna().to_numpy() for metric in METRICS}
    return values | {"ITL": inter_token_latencies(served)}


def round_percentiles(rounds: list[list[Served]], percentiles: tuple[int, ...] = PERCENTILES) -> pd.DataFrame:
    """Per metric (TTFT, TPOT, E2E, ITL), in milliseconds: each percentile over the requests of each round, its
    median over the rounds (``pQ ms``) with the rounds' lowest and highest (``pQ low``, ``pQ high``), and the pooled
    percentile over all rounds' values (``pooled pQ ms``); ``values`` is the count one round rests on (TPOT leaves out
    one-token requests; ITL counts gaps)."""
    if not rounds:
        raise OptlabError("round_percentiles needs at least one round of served requests")
    per_round = [_round_values(served) for served in rounds]
    rows = []
    for metric in ROUND_METRICS:
        samples = [values[metric] for values in per_round]
        row: dict[str, object] = {"metric": metric, "values": int(np.median([len(v) for v in samples])),
                                  "rounds": len(samples)}
        pooled = np.concatenate(samples)
        for q in percentiles:
            each = [1e3 * float(np.percentile(v, q)) if v.size else math.nan for v in samples]
            row |= {f"p{q} ms": float(np.median(each)), f"p{q} low": min(each), f"p{q} high": max(each),
                    f"pooled p{q} ms": 1e3 * float(np.percentile(pooled, q)) if pooled.size else math.nan}
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Objective:
    """A latency objective a request meets when its TTFT and its TPOT are both within the bounds (seconds)."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise OptlabError(f"Objective.{name} must be a positive number of seconds, got {value!r}")

    def met(self, latencies: pd.DataFrame) -> pd.Series:
        """Whether each request met the objective (a request with one token has no TPOT and is judged on TTFT)."""
        return (latencies["ttft_s"] <= self.ttft_s) & ~(latencies["tpot_s"] > self.tpot_s)


def throughput(latencies: pd.DataFrame, objective: Objective | None = None) -> dict[str, float]:
    """Over the span from the first arrival to the last token: output tokens a second, requests a second, and (with
    an ``objective``) goodput, the requests a second that met it, and the share that did."""
    if latencies.empty:
        raise OptlabError("throughput needs at least one served request")
    start = float(latencies["arrival_s"].min())
    span = float((latencies["arrival_s"] + latencies["e2e_s"]).max()) - start
    result = {"span_s": span, "tokens_per_s": float(latencies["output_len"].sum()) / span,
              "requests_per_s": len(latencies) / span}
    if objective is not None:
        met = objective.met(latencies)
        result |= {"goodput_per_s": float(met.sum()) / span, "met_share": float(met.mean())}
    return result
