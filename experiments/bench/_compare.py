"""Side-by-side timing shared by the benchmark scripts.

Absolute times drift on a shared machine, so contenders are timed in one process, one call
of each per round (interleaved, so drift hits them alike), after a warm-up call that
compiles. Every ratio printed is **baseline time / ours time**: above 1, ours is faster.

    t = interleaved({"ours": lambda: f(x), "jaxopt": lambda: g(x)}, repeats=7)
    print(ratio_header("jaxopt", "ours"))
    print(t.median("ours"), t.median("jaxopt"), t.ratio("jaxopt", "ours"))
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import equinox as eqx
import jax


def time_call(fn: Callable[..., Any], *args) -> float:
    """Seconds for one call of `fn(*args)`, waiting for its arrays."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t


@dataclass(frozen=True)
class Timings:
    """The seconds of every round of every contender (`rounds[name][i]`)."""

    rounds: dict[str, list[float]]

    def median(self, name: str) -> float:
        """Median seconds of one call of `name`."""
        return statistics.median(self.rounds[name])

    def ratio(self, baseline: str, ours: str) -> float:
        """Median over rounds of `baseline time / ours time` (> 1: ours is faster)."""
        return statistics.median(
            b / o for b, o in zip(self.rounds[baseline], self.rounds[ours])
        )


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, *,
                warmup: bool = True) -> Timings:
    """Time zero-argument functions side by side: `repeats` rounds, each calling every
    function once in order; with `warmup`, one untimed call each first (compilation)."""
    if warmup:
        for f in fns.values():
            jax.block_until_ready(f())
    rounds: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            rounds[k].append(time_call(f))
    return Timings(rounds)


def ratio_header(baseline: str, ours: str) -> str:
    """The line that states a benchmark's ratio direction."""
    return (f"ratios are {baseline} time / {ours} time, medians over interleaved rounds "
            f"(> 1: {ours} is faster)")


def malloc_line() -> str:
    """Whether glibc's malloc backs large buffers with transparent huge pages in this process
    (the `spinformer` command and the experiment scripts turn it on; benchmarks do not, unless
    GLIBC_TUNABLES says so): it changes absolute CPU times by up to 1.5x, so every figure
    should say which."""
    from spinformer._toolchain import HUGEPAGE_TUNABLE, hugepages_on

    on = hugepages_on()
    return (f"malloc: transparent huge pages {'on' if on else 'off'} (GLIBC_TUNABLES="
            f"{HUGEPAGE_TUNABLE} {'set' if on else 'not set'}; the spinformer command sets it)")


@dataclass(frozen=True)
class Cost:
    """What XLA's cost model counts in one compiled program: floating-point operations,
    transcendental calls (exp, tanh, sqrt, ...) and bytes read and written. The counts are
    static: a `while_loop` or `lax.scan` body is counted **once**, whatever its trip count,
    so compare programs with the same loops, or count the body alone and scale it."""

    flops: float
    transcendentals: float
    bytes: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.transcendentals + other.transcendentals,
                    self.bytes + other.bytes)

    def __mul__(self, k: float) -> "Cost":
        return Cost(self.flops * k, self.transcendentals * k, self.bytes * k)


def xla_cost(fn: Callable[..., Any], *args) -> Cost:
    """XLA's cost analysis of `fn(*args)` compiled with `eqx.filter_jit` for this backend
    (arguments may be any pytrees, e.g. modules; compiles, runs nothing)."""
    compiled = eqx.filter_jit(fn).lower(*args).compile().compiled
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca  # one entry per device in old jax
    return Cost(float(ca.get("flops", 0.0)), float(ca.get("transcendentals", 0.0)),
                float(ca.get("bytes accessed", 0.0)))
