"""Diagnostics of a trained run: `nn.model_analysis` on validation examples, summarised per
layer as a table, `diagnostics.json` and `diagnostics.png`."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import config as _config
from .. import nn as _nn
from ._build import build_objective
from ._experiment import load_run
from ._figures import _plt
from ._objective import solver_effect


def _analyse_batch(model, tokens, keys, *, num_starts):
    """`nn.model_analysis` of every example of a batch, one after the other (`lax.map`: the
    memory of one example's analysis)."""
    return jax.lax.map(
        lambda tk: _nn.model_analysis(model, tk[0], key=tk[1], num_starts=num_starts),
        (tokens, keys))


_analyse_batch_jit = eqx.filter_jit(_analyse_batch)


def _stats(values) -> Optional[dict]:
    """`{"mean", "max"}` of an array, or None for an empty or missing one."""
    if values is None or np.size(values) == 0:
        return None
    a = np.asarray(values, np.float64)
    return {"mean": float(a.mean()), "max": float(a.max())}


def _layer_summary(i: int, res) -> dict:
    """One layer's summary over all analysed examples (`res` holds arrays with a leading
    example axis, already sliced to layer `i`)."""
    out: dict = {"layer": i}
    if res["solver_steps"] is not None:
        out["solver_steps"] = float(np.mean(res["solver_steps"]))
        out["solver_failures"] = int(np.sum(res["solver_failures"]))
        out["solves"] = int(np.sum(res["num_solves"]))
    out["entropy_production"] = _stats(res["entropy_production"])
    fp = res["fixed_points"]
    if fp is not None:
        rho = np.asarray(fp.spectral_radius)
        out["spectral_radius"] = _stats(rho)
        out["contracting"] = float(np.mean(rho < 1.0))
        out["fixed_points"] = _stats(fp.num_fixed_points)
        out["several_fixed_points"] = float(np.mean(np.asarray(fp.num_fixed_points) > 1))
        out["converged"] = float(np.mean(fp.converged))
    return out


def _per_layer(analyses, depth: int) -> list[dict]:
    """Concatenate the batches' analyses and slice them per layer."""
    cat = jax.tree.map(lambda *a: np.concatenate([np.asarray(x) for x in a]), *analyses)
    layers = []
    for i in range(depth):
        def at(a, i=i):
            return None if a is None else jax.tree.map(lambda v: v[:, i], a)

        res = {name: at(getattr(cat, name)) for name in (
            "solver_steps", "solver_failures", "num_solves", "entropy_production",
            "fixed_points")}
        layers.append((res, _layer_summary(i, res)))
    return layers


def diagnostics_table(summary: dict) -> str:
    """The per-layer table of a `diagnose` summary (Markdown)."""

    def stat(s, p=3):
        return "-" if s is None else f"{s['mean']:.{p}g} / {s['max']:.{p}g}"

    def num(v, p=3):
        return "-" if v is None else f"{v:.{p}g}"

    head = ("| layer | spectral radius (mean / max) | contracting (fraction ρ < 1) "
            "| fixed points per head (mean / max) | converged starts (fraction) "
            "| solver steps (mean per solve) | failed solves | entropy production (mean / max) |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in summary["layers"]:
        fails = (f"{r['solver_failures']}/{r['solves']}" if "solves" in r else "-")
        lines.append(
            f"| {r['layer']} | {stat(r.get('spectral_radius'))} | {num(r.get('contracting'))} "
            f"| {stat(r.get('fixed_points'))} | {num(r.get('converged'))} "
            f"| {num(r.get('solver_steps'))} | {fails} "
            f"| {stat(r.get('entropy_production'))} |")
    if summary.get("solver_effect"):
        lines += ["", solver_effect_line(summary["solver_effect"])]
    return "\n".join(lines)


def solver_effect_line(effect: dict) -> str:
    """One line of a `solver_effect` result: the loss (and accuracy) with the solves cut to
    their start, to one iteration, and converged, and the verdict."""
    def at(k):
        acc = effect.get(f"{k}_accuracy")
        return f"{effect[k]:.4f}" + (f" ({100 * acc:.1f} %)" if acc is not None else "")

    verdict = ("the solves do nothing: cut to their starting points the model scores the "
               "same (a model without them would do)" if effect["no_effect"] else
               "the solves matter")
    return (f"Solver effect: loss {at('start')} with every solve cut to its start, "
            f"{at('one_step')} after one iteration, {at('converged')} converged: {verdict}.")


def _plot(layers, path: pathlib.Path, title: str) -> None:
    """`diagnostics.png`: per layer the spectral radii, the numbers of distinct fixed points
    and the entropy production over the analysed examples and heads."""
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    panels = [
        ("spectral radius of ∂F/∂m", lambda r: None if r["fixed_points"] is None
         else r["fixed_points"].spectral_radius),
        ("distinct fixed points", lambda r: None if r["fixed_points"] is None
         else r["fixed_points"].num_fixed_points),
        ("entropy production σ", lambda r: r["entropy_production"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    rng = np.random.default_rng(0)
    for ax, (label, get) in zip(axes[0], panels):
        drawn = False
        for i, (res, _) in enumerate(layers):
            v = get(res)
            if v is None:
                continue
            v = np.asarray(v, np.float64).ravel()
            jitter = 0.15 * rng.uniform(-1, 1, v.shape)
            ax.scatter(i + jitter, v, s=8, alpha=0.4, color=f"C{i}")
            ax.plot([i - 0.3, i + 0.3], [v.mean()] * 2, color="k", lw=2)
            drawn = True
        if drawn and label.startswith("spectral"):
            ax.axhline(1.0, color="gray", ls="--", lw=1)
        if drawn and label.startswith("distinct"):
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylim(bottom=0)
        if not drawn:
            ax.text(0.5, 0.5, "not reported by this attention", ha="center", va="center",
                    transform=ax.transAxes, fontsize="small")
        ax.set_xticks(range(len(layers)))
        ax.set_xlabel("layer")
        ax.set_title(label, fontsize="small")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def diagnose(run_dir, *, batches: int = 1, starts: int = 8, seed: int = 0,
             out_dir=None, progress: bool = False) -> dict:
    """Diagnose a trained run: `nn.model_analysis` on every example of `batches` validation
    batches (the newest checkpoint of `run_dir`, `load_run`).

    Per layer: the spectral radius of the steady-state map at the fixed point (mean, max and
    the fraction below 1), the number of distinct fixed points reached from the default
    start and `starts` random ones (mean, max, the fraction of heads with several), the
    fraction of starts that converged — for spin attention in `mode="fixed_point"` —, and
    for every attention that reports them the forward solver steps and failures and the
    entropy production σ_t.

    Writes `diagnostics.json` (the returned summary) and `diagnostics.png` into `out_dir`
    (default: the run directory).

    **Arguments:** `run_dir` a run directory; `batches` ≥ 1 validation batches; `starts` ≥ 0
    random starts per fixed point; `seed` for the starts; `out_dir` where to write;
    `progress`: a line on stderr when each stage starts, and one with how long it took when it
    ends (the first batch compiles the analysis, which takes tens of seconds).

    **Returns:** the summary dict: `run_dir`, `examples`, `starts`, `seed`, `attention`,
    `spectral_radius_method`, `layers` (one dict per layer; absent keys do not apply) and
    `solver_effect` (`train.solver_effect` on the same batches: the loss with every solve
    cut to its start, to one iteration, and converged; None for a model without solves).
    Raises `FileNotFoundError` for a missing directory, one without a run or without a
    checkpoint, and `ConfigError` for a model other than a sequence model.
    """
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory.")
    if not (isinstance(batches, int) and batches >= 1 and isinstance(starts, int)
            and starts >= 0):
        raise ValueError(f"diagnose: batches={batches!r} must be >= 1 and starts={starts!r} "
                         ">= 0.")
    started = []  # (stage, start time) of the stage under way

    def say(msg=None):
        """End the stage under way (its own duration), then start `msg` (None: the last)."""
        now = time.perf_counter()
        if started:
            stage, t = started.pop()
            if progress:
                print(f"diagnose: {stage}: done in {now - t:.1f} s", file=sys.stderr,
                      flush=True)
        if msg is not None:
            started.append((msg.split(":")[0], now))
            if progress:
                print(f"diagnose: {msg}", file=sys.stderr, flush=True)

    say(f"loading {run_dir}")
    cfg, dataset, model = load_run(run_dir)
    if not isinstance(model, _nn.SequenceModel):
        raise _config.ConfigError(
            f"{run_dir}: diagnose analyses sequence models (data.task brackets, chars); this "
            f"run trained a {type(model).__name__} (data.task {cfg.data.task}).")
    key = jax.random.key(seed)
    analyses, examples = [], 0
    for b in range(batches):
        first = "" if b else (" (compiling the analysis first; a second diagnosis reads it "
                              "from the compilation cache)")
        say(f"batch {b + 1}/{batches}: every example's fixed points from 1 + {starts} starts"
            + first)
        tokens = jnp.asarray(dataset.batch(b, "val")["inputs"])
        examples += int(tokens.shape[0])
        keys = jax.random.split(jax.random.fold_in(key, b), tokens.shape[0])
        analyses.append(_analyse_batch_jit(model, tokens, keys, num_starts=starts))
    say("the loss with every solve cut to its start, to one iteration, and converged (is "
        "the solver doing anything?)")
    effect = solver_effect(model, [dataset.batch(b, "val") for b in range(batches)],
                           objective=build_objective(cfg), stream=cfg.data.stream)
    say("summarising and drawing")
    depth = model.transformer.depth
    layers = _per_layer(analyses, depth)
    fp = analyses[0].fixed_points
    summary = {
        "run_dir": str(run_dir),
        "attention": cfg.model.attention.name,
        "examples": examples,
        "starts": starts,
        "seed": seed,
        "spectral_radius_method": None if fp is None else fp.method,
        "layers": [s for _, s in layers],
        "solver_effect": effect,
    }
    out = pathlib.Path(out_dir) if out_dir is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnostics.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(layers, out / "diagnostics.png",
          f"{run_dir.name}: {cfg.model.attention.name} attention, {summary['examples']} "
          "validation examples")
    say()
    return summary
