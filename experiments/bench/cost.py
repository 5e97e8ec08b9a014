"""What a training step of each attention family costs against softmax's, and why: the
measured time ratio beside the arithmetic bound, at the zoo's task sizes.

    python experiments/bench/cost.py                       # brackets16, chars, nli; every family
    python experiments/bench/cost.py --tasks nli --families spin,boltzmann_mf
    python experiments/bench/cost.py --quick               # brackets16, a smoke test
    python experiments/bench/cost.py --families boltzmann_mf --set model.attention.adjoint=onestep
    python experiments/bench/cost.py --ratio-only --tasks brackets16,chars,nli,fmnist,\
        fmnist_masked --out experiments/results/cost/rates   # the zoo's step-rate columns

For each task of the zoo's grid (`configs/zoo/full.yaml`) and each family the grid runs on it,
built as the zoo builds the cell (its config changes, parameters matched to softmax's), with
the first learning-rate candidate and seed 0, after `--train-steps` training steps (200; at
initialisation the couplings are weak and the solves trivial), on the next batch:

- `ratio`: softmax's step time / the family's (the jitted training step, compile excluded;
  medians over rounds that alternate softmax and the family, `_compare.interleaved`).
- `bound`: softmax's FLOPs / the family's effective FLOPs per step: the ratio the family
  would reach if it ran its arithmetic at the FLOP rate softmax's step reaches. The
  effective FLOPs are the library's training-FLOP count (`spinformer.train.step_flops`, the
  count `train.count_flops` writes into every run's metrics): XLA's count of the lowered
  step, with every fixed-length scan written out and the solver's loop counted from
  straight-line variants as FLOPs per forward iteration and per backward product (a VJP of
  the map), times k_f and p_b, the mean forward iterations and backward products per solve
  that the family's real step reports (its metrics `solver_steps`, `backward_steps`; a
  phantom adjoint's `steps`). A loop that cannot be unrolled (the free-energy saddle's
  Newton iteration) is counted once and the bound marked `>=`.
- `at bound`: measured ratio / bound (1: the family runs its arithmetic as fast as softmax
  runs its own; 0.5: half the time is something else).
- `fwd`: the forward pass's share of the step's time (the loss alone, no gradient).
- `loop`: the forward pass with the solver's while loop over the forward pass with the same
  arithmetic as straight-line code (the solver unrolled to the iterations the batch's
  slowest example needs, the loop's own trip count under `vmap`): what loop control costs.
  Not measured (—) above 16 iterations, whose straight-line programs take minutes to
  compile.
- `k_f`, `max`, `p_b`: mean forward iterations per solve, the batch's most (the trip count a
  vmapped loop runs), mean backward products per solve.

Ratios are baseline / family (> 1: the family is faster). The numbers go to
`--out/cost.json` and `cost.md`, written after every family; rows already there from
earlier runs are kept unless measured again (a killed run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import spinformer as sf

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _compare import interleaved, malloc_line, ratio_header  # noqa: E402
from spinformer.train._flops import unrolled_config  # noqa: E402
from spinformer.grid import _grid as zoo  # noqa: E402 (the grid's cells)

ROOT = HERE.parents[1]
TASKS = ("brackets16", "chars", "nli")
MAX_UNROLL = 16  # the most iterations the `loop` column writes out as straight-line code


def cell(cfg, task):
    """`(state, step, batch, objective, opt)` of a config at initialisation (seed 0): the
    jitted training step, `batch(i)` the task's i-th training batch."""
    dataset = zoo._dataset(cfg, task)
    model = sf.train.build_model(cfg, dataset, key=jax.random.key(0))
    opt = sf.train.build_optimizer(cfg)
    objective = sf.train.build_objective(cfg)
    step = sf.train.jit_step(opt, accumulate=cfg.train.accumulate,
                             precision=cfg.train.precision, objective=objective)
    batch = lambda i: {k: jnp.asarray(v) for k, v in dataset.batch(i, "train").items()}  # noqa
    return sf.train.RunState.init(model, opt), step, batch, objective, opt


def _built(cfg, task, train_steps: int = 0):
    """`(batch, state, step, loss)` of a config: the jitted training step, the jitted
    forward loss (no gradient), and the state after `train_steps` training steps on the
    task's batches (the batch returned is the next one)."""
    state, step, batch, objective, _ = cell(cfg, task)
    for i in range(train_steps):
        state, _ = step(state, batch(i), jax.random.key(i))
    loss = eqx.filter_jit(lambda m, b, k: sf.train.loss_fn(m, b, k, objective=objective))
    return batch(train_steps), state, step, loss


def measure(cfg, task, ref, repeats: int, train_steps: int, ratio_only: bool = False) -> dict:
    """One family's row (see the module docstring); `ref` is softmax's `(step, fwd)` timing
    closures and FLOPs (`ratio_only`: the timings alone, no FLOPs and no `loop`)."""
    t0 = time.perf_counter()
    batch, state, step, loss = _built(cfg, task, train_steps)
    key = jax.random.key(1)
    _, metrics = step(state, batch, key)
    jax.block_until_ready(metrics)
    train_s = time.perf_counter() - t0
    k_f = float(metrics.get("solver_steps", math.nan))
    p_b = float(metrics.get("backward_steps", math.nan))
    section = cfg.model.attention
    adjoint = getattr(section, "adjoint", None)
    if isinstance(adjoint, sf.solvers.Phantom):
        p_b = float(adjoint.steps)
    k_max = _max_steps(state.model, batch)  # the slowest example: a vmapped loop's count
    timings = interleaved({"softmax": ref["step"], "family": lambda: step(state, batch, key),
                           "softmax_fwd": ref["fwd"],
                           "family_fwd": lambda: loss(state.model, batch, key)},
                          repeats=repeats)
    row = {"train_s": train_s, "k_f": k_f, "k_max": k_max, "p_b": p_b,
           "step_ms": 1e3 * timings.median("family"),
           "softmax_step_ms": 1e3 * timings.median("softmax"),
           "ratio": timings.ratio("softmax", "family"),
           "fwd_share": timings.median("family_fwd") / timings.median("family")}
    if ratio_only:
        return row
    row.update(effective_flops(cfg, task, k_f, p_b))
    if row.get("fwd_iteration_flops") is not None:
        # loop control: the real forward pass against the same iterations straight-line
        k = max(1, math.ceil(k_max if math.isfinite(k_max) else k_f))
        if k <= MAX_UNROLL:  # longer straight-line programs take minutes to compile
            _, st_u, _, loss_u = _built(unrolled_config(cfg, k, adjoint=False), task)
            model_u = _with_arrays(st_u.model, state.model)  # the trained parameters
            t = interleaved({"loop": lambda: loss(state.model, batch, key),
                             "straight": lambda: loss_u(model_u, batch, key)},
                            repeats=repeats)
            row["loop_overhead"] = t.ratio("loop", "straight")
    row["bound"] = ref["flops"] / row["flops"]
    row["at_bound"] = row["ratio"] / row["bound"]
    return row


def effective_flops(cfg, task, k_f: float, p_b: float) -> dict:
    """`flops` (the library's training-FLOP count, `train.step_flops`, at mean forward
    iterations `k_f` and backward products `p_b`), `bound_exact`, and for a solver that
    unrolls `fwd_iteration_flops` and `bwd_product_flops`."""
    model = sf.train.step_flops(cfg, zoo._dataset(cfg, task))
    if not math.isfinite(k_f):  # no solver
        return {"flops": model.base, "bound_exact": model.exact}
    return {"flops": model(k_f, p_b), "fwd_iteration_flops": model.forward_iteration or None,
            "bwd_product_flops": model.backward_product or None, "bound_exact": model.exact}


def _with_arrays(model, source):
    """`model` (its solver and other static choices) with the arrays of `source`, a model
    of the same architecture (the trained parameters)."""
    arrays, static = eqx.partition(model, eqx.is_array)
    leaves = jax.tree.leaves(eqx.filter(source, eqx.is_array))
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(arrays), leaves), static)


def _max_steps(model, batch) -> float:
    """The most forward iterations any example of the batch takes (over layers too)."""
    def diag(m, b):
        out = jax.vmap(lambda x: m(x, return_diagnostics=True))(b["inputs"])
        return out[1]
    try:
        d = eqx.filter_jit(diag)(model, batch)
    except Exception:  # a model whose call takes more (pairs, images): not reported
        return math.nan
    steps = [leaf.num_steps for leaf in jax.tree.leaves(
        d, is_leaf=lambda x: isinstance(x, sf.solvers.Solution) or hasattr(x, "num_steps"))
        if hasattr(leaf, "num_steps")]
    return float(max(jnp.max(s) for s in steps)) if steps else math.nan


def table(rows: dict) -> str:
    lines = ["| task | family | step (ms) | softmax (ms) | ratio | bound | at bound | fwd | "
             "loop | k_f | max | p_b |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {t: i for i, t in enumerate(TASKS)}  # rows by task, each task's in run order
    for key, r in sorted(rows.items(), key=lambda kv: order.get(kv[0].split("/")[0], 99)):
        task, fam = key.split("/")
        if "error" in r:
            lines.append(f"| {task} | {fam} | {r['error']} |" + " |" * 10)
            continue
        ge = "" if r.get("bound_exact", True) else "≥ "
        r = {"bound": None, "at_bound": None, **r}  # --ratio-only rows have no FLOPs
        f = lambda v, spec=".2f": "—" if v is None or (isinstance(v, float) and math.isnan(v)) \
            else format(v, spec)  # noqa: E731
        lines.append(f"| {task} | {fam} | {f(r['step_ms'], '.1f')} | "
                     f"{f(r['softmax_step_ms'], '.1f')} | {f(r['ratio'])} | {ge}{f(r['bound'])} | "
                     f"{f(r['at_bound'])} | {f(r['fwd_share'])} | {f(r.get('loop_overhead'))} | "
                     f"{f(r['k_f'], '.1f')} | {f(r['k_max'], '.0f')} | {f(r['p_b'], '.1f')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=None, help=f"comma-separated (default {','.join(TASKS)})")
    p.add_argument("--families", default=None, help="comma-separated (default: every family "
                   "the grid runs on the task)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=200, help="training steps before "
                   "measuring (at initialisation the couplings are weak and the solves "
                   "trivial: Boltzmann mean field converges in 0 steps)")
    p.add_argument("--quick", action="store_true", help="brackets16 only, 3 repeats")
    p.add_argument("--flops-only", action="store_true", help="recount the FLOPs (bound, "
                   "at bound) of the rows already in --out, keeping their timings")
    p.add_argument("--ratio-only", action="store_true", help="time ratios only (no FLOP "
                   "counts, no loop column): the zoo's step-rate columns, for every task of "
                   "the grid")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of every family's config (not softmax's), e.g. "
                   "--set model.attention.adjoint=onestep; its rows are named with it")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "cost"))
    args = p.parse_args()
    grid = zoo.load_grid(ROOT / "configs" / "zoo" / "full.yaml")
    tasks = ["brackets16"] if args.quick else (args.tasks.split(",") if args.tasks else TASKS)
    repeats = 3 if args.quick else args.repeats
    args.train_steps = 20 if args.quick else args.train_steps
    families = args.families.split(",") if args.families else list(grid["families"])
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(malloc_line())
    print(ratio_header("softmax", "family"))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    saved = out / "cost.json"  # rows measured before stay unless measured again
    rows: dict = json.loads(saved.read_text()) if saved.exists() else {}
    for task in tasks:
        cells = zoo.plan_cells(grid, [task], ["softmax", *families])
        ref_cfg = zoo.base_config(grid, task, "softmax", cells[task, "softmax"].changes)
        if cells[task, "softmax"].reason:
            print(f"{task}: {cells[task, 'softmax'].reason}")
            continue
        ref = {"flops": math.nan if args.ratio_only else
               sf.train.step_flops(ref_cfg, zoo._dataset(ref_cfg, task)).base}
        if not args.flops_only:
            batch, state, step, loss = _built(ref_cfg, task, args.train_steps)
            key = jax.random.key(1)
            ref.update(step=lambda: step(state, batch, key),
                       fwd=lambda: loss(state.model, batch, key))
        for fam in families:
            cell = cells[task, fam]
            name = f"{task}/{fam}" + (f" ({', '.join(args.set)})" if args.set else "")
            old = rows.get(name)
            if fam == "softmax" or cell.reason or (args.flops_only and (
                    old is None or "error" in old)):
                continue
            cfg = zoo.base_config(grid, task, fam, cell.changes)
            try:
                cfg = cfg.replace(sf.config.parse_overrides(args.set))
                if args.flops_only:  # the timings stay; the bound is recounted
                    r = {**old, **effective_flops(cfg, task, old["k_f"], old["p_b"])}
                    r.update(bound=ref["flops"] / r["flops"])
                    r.update(at_bound=r["ratio"] / r["bound"])
                else:
                    r = measure(cfg, task, ref, repeats, args.train_steps, args.ratio_only)
                rows[name] = r
            except Exception as e:  # noqa: BLE001 - a row that says why
                rows[name] = r = {"error": zoo.failure_message(e)[:120]}
            print(f"{task:12s} {fam:20s} " + json.dumps(
                {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
                flush=True)
            (out / "cost.json").write_text(json.dumps(rows, indent=1))
            (out / "cost.md").write_text(table(rows))
            sf_release()
    print(table(rows))


def sf_release() -> None:
    from _cli import release_compiled_code

    release_compiled_code()


if __name__ == "__main__":
    main()
