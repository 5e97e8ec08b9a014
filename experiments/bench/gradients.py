"""How good each adjoint's gradient is, along real training, beside what its step costs.

For each family (default: spin TAP steady state, Boltzmann mean field, modern Hopfield, Deep
Implicit Attention) on a task of the zoo's grid, built as the zoo builds the cell (its config
changes, parameters matched to softmax's, seed 0), the model is trained with the family's own
adjoint, and at each of `--at` training steps the loss gradient of one fixed batch is taken
with every adjoint below and compared with a tight exact implicit gradient (`Implicit` with
GMRES(20) to a relative residual of 1e-6 and a dense or GMRES(50) fallback):

- `cos`: cosine similarity of the whole parameter gradient with the exact one;
- `rel`: ‖g − g_exact‖ / ‖g_exact‖;
- `p_b`: mean matrix–vector products per backward solve (`record_backward`; — where the
  adjoint solves nothing).

After the last point, the training step of every adjoint is timed against softmax's
(`ratio`: softmax's step time / the family's, medians of interleaved rounds; > 1: faster).

The adjoints: the family's default, the same with `precondition=True` (started at and
preconditioned by the forward solver's secant estimate), `GMRES → Anderson` (the backward
solve on the Richardson map, which stops at the first product that meets the tolerance)
with and without `precondition`, `Shine()`, `OneStep()` and `Phantom()`. Where the tight
reference does not converge (float32 and an ill-conditioned system), it is taken at rtol
1e-4 and the point says so; where neither converges the point has no comparison. Adjoints the
family's forward solver cannot take (a secant estimate needs Anderson or Broyden) are
skipped with a reason.

    python experiments/bench/gradients.py                     # brackets16, four families
    python experiments/bench/gradients.py --tasks chars,nli --at 0,200,400
    python experiments/bench/gradients.py --quick             # spin on brackets16, 20 steps

Rows go to `--out/gradients.json` and `gradients.md` after every family (rows measured
before stay unless measured again).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp

import spinformer as sf
from spinformer import solvers as S

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _compare import interleaved, malloc_line, ratio_header  # noqa: E402
import cost  # noqa: E402
from spinformer.grid import _grid as zoo  # noqa: E402 (the grid's cells)

ROOT = HERE.parents[1]
FAMILIES = ("spin", "boltzmann_mf", "hopfield", "implicit")
EXACT = S.Implicit(linear_solver=S.GMRES(restart=20), rtol=1e-6, max_steps=2000)


def _is_adjoint(x) -> bool:
    return isinstance(x, S.AbstractAdjoint)


def adjoints_of(model) -> list:
    """The adjoint objects in a model (one per attention module; stacked layers share one)."""
    return [x for x in jax.tree.leaves(model, is_leaf=_is_adjoint) if _is_adjoint(x)]


def with_adjoint(model, make):
    """`model` with every adjoint `a` replaced by `make(a)`; an implicit adjoint keeps the old
    one's probe (its backward solves stay recorded, one probe per stacked layer)."""
    def swap(a):
        if not _is_adjoint(a):
            return a
        new = make(a)
        probe = getattr(a, "probe", None)
        if isinstance(new, S.Implicit) and probe is not None:
            new = eqx.tree_at(lambda x: x.probe, new, probe, is_leaf=lambda v: v is None)
        return new

    return jax.tree.map(swap, model, is_leaf=_is_adjoint)


def variants() -> dict:
    """name -> `old adjoint -> new adjoint`, the adjoints compared (see the docstring)."""
    def implicit(**changes):
        def make(a):
            return dataclasses.replace(a if isinstance(a, S.Implicit) else S.Implicit(),
                                       **changes)
        return make

    anderson = S.Anderson(history=5, safeguard=False)
    return {
        "default": lambda a: a,
        "precondition": implicit(precondition=True),
        "anderson": implicit(linear_solver=anderson),
        "anderson+precondition": implicit(linear_solver=anderson, precondition=True),
        "shine": lambda a: S.Shine(),
        "onestep": lambda a: S.OneStep(),
        "phantom": lambda a: S.Phantom(),
    }


def _flat(grads):
    """The parameters' gradient as one vector (the adjoints' probes left out)."""
    grads = jax.tree.map(lambda x: None if _is_adjoint(x) else x, grads, is_leaf=_is_adjoint)
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(eqx.filter(grads,
                                                                              eqx.is_array))])


def exact_gradient(grad, model, batch, key):
    """`(gradient, rtol)`: the reference, `EXACT`'s solve at its rtol 1e-6, else at 1e-4
    where that does not converge (in float32 an ill-conditioned I − ∂g/∂x cannot reach
    1e-6: modern Hopfield's retrievals on the characters task after 400 steps), else
    `(None, None)`."""
    for rtol in (EXACT.rtol, 1e-4):
        exact = dataclasses.replace(EXACT, rtol=rtol)
        g = _flat(grad(with_adjoint(model, lambda a: exact), batch, key))
        if bool(jnp.all(jnp.isfinite(g))):
            return g, rtol
    return None, None


def compare(model, batch, key, grad, names, exact_flat):
    """name -> {cos, rel, p_b} for the adjoints `names` (name -> make) on `model`; `grad`
    the jitted gradient of the loss (one compilation per adjoint, reused at every step)."""
    out = {}
    for name, make in names.items():
        g = grad(with_adjoint(model, make), batch, key)
        _, records = S.backward_stats(g)
        flat = _flat(g)
        if records:
            solves = sum(float(jnp.sum(r[..., 0])) for r in records)
            products = sum(float(jnp.sum(r[..., 1])) for r in records)
            p_b = products / solves if solves else math.nan
        else:
            p_b = math.nan
        cos = float(flat @ exact_flat / (jnp.linalg.norm(flat) * jnp.linalg.norm(exact_flat)))
        rel = float(jnp.linalg.norm(flat - exact_flat) / jnp.linalg.norm(exact_flat))
        out[name] = {"cos": cos, "rel": rel, "p_b": p_b}
    return out


def usable(model, names) -> tuple[dict, dict]:
    """`(usable, skipped)`: the variants the model's forward solver can take, and why not
    for the others."""
    solvers_in = [x for x in jax.tree.leaves(
        model, is_leaf=lambda x: isinstance(x, S.AbstractSolver))
        if isinstance(x, S.AbstractSolver)]
    ok, skipped = {}, {}
    for name, make in names.items():
        try:
            for a, s in zip(adjoints_of(model), solvers_in):
                S.check_solver(s, make(a))
            ok[name] = make
        except ValueError as e:
            skipped[name] = str(e).split(":")[-1].strip()[:100]
    return ok, skipped


def measure(cfg, task, at: list[int], repeats: int, softmax_step) -> dict:
    state, step, batch, objective, opt = cost.cell(cfg, task)
    probe_batch, key = batch(10_000), jax.random.key(1)
    grad = eqx.filter_jit(eqx.filter_grad(
        lambda m, b, k: sf.train.loss_fn(m, b, k, objective=objective)[0]))
    names, skipped = usable(state.model, variants())
    row = {"skipped": skipped, "at": {}}
    done = 0
    for target in at:
        for i in range(done, target):
            state, _ = step(state, batch(i), jax.random.key(i))
        done = target
        exact, rtol = exact_gradient(grad, state.model, probe_batch, key)
        row.setdefault("reference_rtol", {})[str(target)] = rtol
        if exact is None:
            row["at"][str(target)] = {}
            print(f"  step {target}: no exact gradient (the implicit solve failed at rtol "
                  "1e-6 and 1e-4)", flush=True)
            continue
        row["at"][str(target)] = compare(state.model, probe_batch, key, grad, names, exact)
        print(f"  step {target} (exact at rtol {rtol:g}): " + "  ".join(
            f"{k} cos {v['cos']:.4f} p_b {v['p_b']:.1f}" for k, v in row["at"][str(target)].items()),
            flush=True)
    b = batch(done)
    calls = {"softmax": softmax_step}
    for name, make in names.items():
        st = sf.train.RunState.init(with_adjoint(state.model, make), opt)  # (timing only)
        calls[name] = lambda st=st: step(st, b, key)
    t = interleaved(calls, repeats)
    row["ratio"] = {name: t.ratio("softmax", name) for name in names}
    row["step_ms"] = {name: 1e3 * t.median(name) for name in calls}
    return row


def table(rows: dict) -> str:
    lines = ["| task / family | adjoint | step: cos / rel / p_b | step ratio |",
             "|---|---|---|---|"]
    for key, r in rows.items():
        if "error" in r:
            lines.append(f"| {key} | — | {r['error']} | — |")
            continue
        refs = r.get("reference_rtol", {})

        def point(s, v, name):
            if name not in v:
                return f"{s}: no exact gradient"
            p_b = v[name]["p_b"]
            tight = refs.get(s, EXACT.rtol) == EXACT.rtol
            return (f"{s}: {v[name]['cos']:.4f} / {v[name]['rel']:.1e} / "
                    + ("—" if not math.isfinite(p_b) else f"{p_b:.1f}")
                    + ("" if tight else f" (exact at rtol {refs[s]:g})"))

        for name, ratio in r["ratio"].items():
            cells = "; ".join(point(s, v, name) for s, v in r["at"].items())
            lines.append(f"| {key} | {name} | {cells} | {ratio:.2f} |")
        for name, why in r["skipped"].items():
            lines.append(f"| {key} | {name} | skipped: {why} | — |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="brackets16")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--at", default="0,100,300", help="training steps at which gradients are "
                   "compared (comma-separated, increasing)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="spin on brackets16, steps 0 and 20")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "gradients"))
    args = p.parse_args()
    if args.quick:
        args.tasks, args.families, args.at, args.repeats = "brackets16", "spin", "0,20", 3
    at = [int(s) for s in args.at.split(",")]
    grid = zoo.load_grid(ROOT / "configs" / "zoo" / "full.yaml")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(malloc_line())
    print(ratio_header("softmax", "family"))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    saved = out / "gradients.json"
    rows: dict = json.loads(saved.read_text()) if saved.exists() else {}
    families = args.families.split(",")
    for task in args.tasks.split(","):
        cells = zoo.plan_cells(grid, [task], ["softmax", *families])
        ref_cfg = zoo.base_config(grid, task, "softmax", cells[task, "softmax"].changes)
        ref, ref_step, ref_batch, _, _ = cost.cell(ref_cfg, task)
        b = ref_batch(0)
        softmax_step = lambda: ref_step(ref, b, jax.random.key(1))  # noqa: E731
        for fam in families:
            cell = cells[task, fam]
            if cell.reason:
                print(f"{task} {fam}: {cell.reason}")
                continue
            print(f"{task} {fam}", flush=True)
            cfg = zoo.base_config(grid, task, fam, cell.changes)
            try:
                rows[f"{task}/{fam}"] = measure(cfg, task, at, args.repeats, softmax_step)
            except Exception as e:  # noqa: BLE001 - a row that says why
                rows[f"{task}/{fam}"] = {"error": zoo.failure_message(e)[:160]}
                print("  " + rows[f"{task}/{fam}"]["error"])
            saved.write_text(json.dumps(rows, indent=1))
            (out / "gradients.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
