"""Workload traces for the simulator: per-second rate traces and timestamped request logs.

Two shapes of input (seed 004 §6, "Traces"):

* a :class:`RateTrace` — requests per second, one value per second (the thesis's Twitter and
  Azure Functions traces are used this way; how it turned them into requests is NOT
  SPECIFIED, so :func:`requests_from_rates` draws Poisson arrivals inside each second, the
  arrival process its analytical model assumes);
* a :class:`RequestLog` — one timestamp per request, e.g. the real Azure LLM trace in
  ``flashpoint/sim/data/azure_llm_conv_2023.csv`` (:func:`load_azure_llm_csv`).

The Twitter (2018-04 stream) and Azure Functions 2019 traces themselves are not in the
project, so :func:`twitter_like` and :func:`azure_functions_like` synthesise seeded traces
with the statistics the thesis states: 1 h, median 57 req/s and peak/median 4.68 (Twitter),
median 18 req/s and peak/median 2.54 (Azure Functions). Both statistics hold *exactly* for
the generated rate trace (a monotone transform fixes them after the random shape is drawn);
the Poisson request log drawn from it matches them within sampling noise. "Scaling" a trace
(100%, 15%, up to 2.5× in the thesis) multiplies every rate (also NOT SPECIFIED there).

Pure and deterministic: numpy's PCG64 seeded per call, no global random state.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

__all__ = [
    "RateTrace", "RequestLog", "load_azure_llm_csv", "requests_from_rates",
    "synthetic_rates", "twitter_like", "azure_functions_like", "TWITTER", "AZURE_FUNCTIONS",
]


@dataclass(frozen=True)
class RateTrace:
    """Requests per second: ``rates[i]`` is the mean rate during second ``i``."""

    name: str
    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if any(not (r >= 0.0 and math.isfinite(r)) for r in self.rates):
            raise ValueError(f"trace {self.name!r}: rates must be finite and >= 0")

    @property
    def duration_s(self) -> int:
        return len(self.rates)

    @property
    def median(self) -> float:
        return float(np.median(self.rates)) if self.rates else 0.0

    @property
    def peak(self) -> float:
        return max(self.rates, default=0.0)

    @property
    def peak_to_median(self) -> float:
        med = self.median
        return self.peak / med if med > 0 else math.inf

    def scaled(self, factor: float) -> RateTrace:
        """Every rate times ``factor`` (the thesis's 15% / 100% / 2.5× workload scales)."""
        if not (factor >= 0 and math.isfinite(factor)):
            raise ValueError(f"scale factor must be finite and >= 0, got {factor!r}")
        return RateTrace(f"{self.name}x{factor:g}", tuple(r * factor for r in self.rates))

    def head(self, duration_s: int) -> RateTrace:
        """The first ``duration_s`` seconds (short runs for tests)."""
        return RateTrace(self.name, self.rates[:duration_s])


@dataclass(frozen=True)
class RequestLog:
    """Request arrival times in seconds from the start of the trace, sorted ascending.

    ``work`` optionally scales each request's service time (1.0 = the profiled mean); the
    Azure LLM trace's token counts can feed it. Empty = every request is 1.0.
    """

    name: str
    arrivals_s: tuple[float, ...]
    work: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        a = self.arrivals_s
        if any(a[i] > a[i + 1] for i in range(len(a) - 1)):
            raise ValueError(f"log {self.name!r}: arrivals must be sorted")
        if a and a[0] < 0:
            raise ValueError(f"log {self.name!r}: arrivals must be >= 0")
        if self.work and len(self.work) != len(a):
            raise ValueError(f"log {self.name!r}: work must have one value per arrival")

    def __len__(self) -> int:
        return len(self.arrivals_s)

    @property
    def duration_s(self) -> float:
        return self.arrivals_s[-1] if self.arrivals_s else 0.0

    def per_second(self, duration_s: int | None = None) -> RateTrace:
        """Counts per whole second, as a rate trace."""
        n = int(math.ceil(self.duration_s)) + 1 if duration_s is None else duration_s
        counts = np.bincount(np.floor(np.asarray(self.arrivals_s, dtype=float)).astype(np.int64),
                             minlength=n)[:n]
        return RateTrace(self.name, tuple(float(c) for c in counts))

    def scaled(self, factor: float, seed: int = 0) -> RequestLog:
        """A log with about ``factor`` times the requests, in the same time pattern.

        Factors <= 1 keep each request with probability ``factor`` (thinning); larger ones
        keep every request ``floor(factor)`` times plus one more with probability of the
        fraction, jittered within ±0.5 s so copies do not arrive at the same instant.
        """
        if not (factor >= 0 and math.isfinite(factor)):
            raise ValueError(f"scale factor must be finite and >= 0, got {factor!r}")
        rng = np.random.Generator(np.random.PCG64(seed))
        a = np.asarray(self.arrivals_s, dtype=float)
        whole, frac = int(factor), factor - int(factor)
        parts = [a] * whole if whole else []
        if frac > 0:
            parts.append(a[rng.random(len(a)) < frac])
        if not parts:
            return RequestLog(f"{self.name}x{factor:g}", ())
        out = np.concatenate(parts)
        if whole >= 1 and len(parts) > 1:
            out[len(a):] += rng.uniform(-0.5, 0.5, len(out) - len(a))
        out = np.sort(np.clip(out, 0.0, None))
        return RequestLog(f"{self.name}x{factor:g}", tuple(out.tolist()))


def load_azure_llm_csv(path: str | Path, limit: int | None = None) -> RequestLog:
    """The Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Times are made relative to the first request. ``work`` is the total tokens of each
    request over the trace's mean, so a caller may scale service times by it.
    """
    path = Path(path)
    stamps: list[float] = []
    tokens: list[float] = []
    with path.open(newline="") as f:
        rows = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(rows.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure LLM trace, missing columns {sorted(missing)}")
        for i, row in enumerate(rows):
            if limit is not None and i >= limit:
                break
            # Seven fractional digits: fromisoformat (3.11+) truncates beyond microseconds.
            stamps.append(datetime.fromisoformat(row["TIMESTAMP"]).timestamp())
            tokens.append(float(row["ContextTokens"]) + float(row["GeneratedTokens"]))
    if not stamps:
        return RequestLog(path.stem, ())
    order = sorted(range(len(stamps)), key=stamps.__getitem__)
    t0 = stamps[order[0]]
    mean_tokens = sum(tokens) / len(tokens) or 1.0
    return RequestLog(path.stem, tuple(stamps[i] - t0 for i in order),
                      tuple(tokens[i] / mean_tokens for i in order))


def requests_from_rates(trace: RateTrace, seed: int) -> RequestLog:
    """Poisson arrivals at each second's rate, uniformly spread inside that second."""
    rng = np.random.Generator(np.random.PCG64(seed))
    rates = np.asarray(trace.rates, dtype=float)
    counts = rng.poisson(rates)
    seconds = np.repeat(np.arange(len(rates), dtype=float), counts)
    arrivals = np.sort(seconds + rng.random(len(seconds)))
    return RequestLog(trace.name, tuple(arrivals.tolist()))


@dataclass(frozen=True)
class TraceShape:
    """How a synthetic trace looks: its target statistics and the random shape's knobs."""

    name: str
    median: float  # req/s
    peak_to_median: float
    noise: float  # lognormal sigma of the per-second noise
    smoothing_s: float  # AR(1) time constant of the noise
    bursts_per_hour: float  # Poisson number of bursts
    burst_decay_s: float  # exponential decay of a burst


#: Twitter 2018-04 stream, 1 h window (thesis §3.1, §8.4): median 57 req/s, peak/median 4.68.
TWITTER = TraceShape("twitter", 57.0, 4.68, noise=0.25, smoothing_s=20.0,
                     bursts_per_hour=6.0, burst_decay_s=60.0)
#: Azure Functions 2019, 1 h (thesis §8.4): median 18 req/s, peak/median 2.54; smoother.
AZURE_FUNCTIONS = TraceShape("azure_functions", 18.0, 2.54, noise=0.2, smoothing_s=60.0,
                             bursts_per_hour=2.0, burst_decay_s=180.0)


def synthetic_rates(shape: TraceShape, seed: int, duration_s: int = 3600) -> RateTrace:
    """A seeded rate trace with ``shape``'s median and peak/median, exactly.

    The random shape is AR(1) lognormal noise plus exponentially decaying bursts at Poisson
    times. It is then normalised to median 1, and values above the median are raised to the
    power ``a`` that puts the maximum at ``peak_to_median`` (a monotone map, so the median
    stays where it is), and scaled to ``median``.
    """
    if duration_s < 1:
        raise ValueError("duration_s must be >= 1")
    if shape.peak_to_median < 1:
        raise ValueError("peak_to_median must be >= 1")
    rng = np.random.Generator(np.random.PCG64(seed))
    phi = math.exp(-1.0 / shape.smoothing_s)
    eps = rng.normal(0.0, shape.noise * math.sqrt(1 - phi * phi), duration_s)
    log_noise = np.empty(duration_s)
    x = rng.normal(0.0, shape.noise)
    for t in range(duration_s):  # bounded: one pass over the trace
        x = phi * x + eps[t]
        log_noise[t] = x
    level = np.exp(log_noise)
    n_bursts = rng.poisson(shape.bursts_per_hour * duration_s / 3600.0)
    t_idx = np.arange(duration_s, dtype=float)
    for _ in range(max(1, n_bursts)):  # at least one burst: the peak must be a burst
        start = rng.uniform(0, duration_s)
        height = rng.uniform(0.5, 2.0)
        after = t_idx - start
        level = level + np.where(after >= 0, height * np.exp(-np.clip(after, 0, None)
                                                            / shape.burst_decay_s), 0.0)
    u = level / np.median(level)
    # np.median of an even count averages the two middle values: stretch only what lies
    # above the upper one (``hi``), so both middle values, hence the median, stay put.
    hi = float(np.sort(u)[len(u) // 2])
    top = float(u.max())
    if top > hi and shape.peak_to_median > hi:
        a = math.log(shape.peak_to_median / hi) / math.log(top / hi)
        u = np.where(u > hi, hi * (u / hi) ** a, u)
    else:  # flat trace: nothing above the median to stretch
        u = np.ones_like(u)
    return RateTrace(shape.name, tuple((u * shape.median).tolist()))


def twitter_like(seed: int, duration_s: int = 3600, scale: float = 1.0) -> RateTrace:
    """Twitter-like 1 h trace: median 57 req/s × ``scale``, peak/median 4.68."""
    trace = synthetic_rates(TWITTER, seed, duration_s)
    return trace if scale == 1.0 else trace.scaled(scale)


def azure_functions_like(seed: int, duration_s: int = 3600, scale: float = 1.0) -> RateTrace:
    """Azure-Functions-like 1 h trace: median 18 req/s × ``scale``, peak/median 2.54."""
    trace = synthetic_rates(AZURE_FUNCTIONS, seed, duration_s)
    return trace if scale == 1.0 else trace.scaled(scale)


def concat(logs: Iterable[RequestLog], name: str) -> RequestLog:
    """Merge logs (e.g. several functions' requests) into one sorted log (no work values)."""
    merged: Sequence[float] = sorted(t for log in logs for t in log.arrivals_s)
    return RequestLog(name, tuple(merged))
