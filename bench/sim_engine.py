"""Events per second through the simulator's engine, and through SimPy where installed.

Why this bench exists: ``flashpoint/sim/engine.py`` is our own heap instead of SimPy (the
thesis's stack, seed 004 §6). The choice rests on cancellation and determinism, but it
should not cost speed; this measures it. Two workloads, ``--events`` events each:

* ``bulk``: every event scheduled up front at a random time, then run (heap-heavy);
* ``timers``: ``--timers`` concurrent timers, each rescheduling itself after a random
  delay until the budget is spent (SimPy: one process per timer, ``yield env.timeout``).

Each is run ``--repeats`` times and the best is reported. SimPy is measured only when it
is importable; nothing is installed. The last line is one JSON object.

    .venv/bin/python bench/sim_engine.py [--events 1000000] [--timers 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Callable

from flashpoint.sim import Engine


def ours_bulk(n: int, seed: int) -> int:
    rng = random.Random(seed)
    e = Engine(max_events=n + 1)

    def noop() -> None:
        pass

    for _ in range(n):
        e.schedule(rng.random() * 1000.0, noop)
    return e.run()


def ours_timers(n: int, timers: int, seed: int) -> int:
    rng = random.Random(seed)
    e = Engine(max_events=n + 1)
    left = [n]

    def tick() -> None:
        left[0] -= 1
        if left[0] >= timers:  # keep exactly n events in total
            e.schedule_in(rng.random(), tick)

    for _ in range(min(timers, n)):
        e.schedule_in(rng.random(), tick)
    return e.run()


def simpy_bulk(n: int, seed: int) -> int:
    import simpy

    rng = random.Random(seed)
    env = simpy.Environment()
    for _ in range(n):
        env.timeout(rng.random() * 1000.0)
    env.run()
    return n


def simpy_timers(n: int, timers: int, seed: int) -> int:
    import simpy

    rng = random.Random(seed)
    env = simpy.Environment()
    left = [n]

    def proc(env: simpy.Environment):
        yield env.timeout(rng.random())
        while True:
            left[0] -= 1
            if left[0] < timers:
                return
            yield env.timeout(rng.random())

    for _ in range(min(timers, n)):
        env.process(proc(env))
    env.run()
    return n


def best_rate(fn: Callable[[], int], repeats: int) -> tuple[float, int]:
    best = 0.0
    count = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        count = fn()
        dt = time.perf_counter() - t0
        best = max(best, count / dt)
    return best, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--timers", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n, k, r, s = args.events, args.timers, args.repeats, args.seed

    try:
        import simpy

        simpy_version: str | None = simpy.__version__
    except ImportError:
        simpy_version = None

    result: dict[str, object] = {
        "bench": "sim_engine", "events": n, "n_timers": k, "repeats": r,
        "python": platform.python_version(), "simpy": simpy_version,
    }
    workloads: dict[str, tuple[Callable[[], int], Callable[[], int]]] = {
        "bulk": (lambda: ours_bulk(n, s), lambda: simpy_bulk(n, s)),
        "timers": (lambda: ours_timers(n, k, s), lambda: simpy_timers(n, k, s)),
    }
    print(f"{'workload':<8} {'ours ev/s':>12} {'simpy ev/s':>12} {'ratio':>6}")
    for name, (ours, theirs) in workloads.items():
        ours_eps, count = best_rate(ours, r)
        assert count == n, (name, count)
        row = {"ours_events_per_s": round(ours_eps)}
        simpy_col, ratio_col = "n/a", ""
        if simpy_version is not None:
            simpy_eps, _ = best_rate(theirs, r)
            row["simpy_events_per_s"] = round(simpy_eps)
            row["speedup"] = round(ours_eps / simpy_eps, 2)
            simpy_col, ratio_col = f"{simpy_eps:,.0f}", f"{ours_eps / simpy_eps:.2f}x"
        result[name] = row
        print(f"{name:<8} {ours_eps:>12,.0f} {simpy_col:>12} {ratio_col:>6}")
    if simpy_version is None:
        print("simpy is not installed: only our engine was measured (nothing was installed).")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
