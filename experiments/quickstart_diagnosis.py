"""What a quickstart run that ends below the others does differently: its training record,
its trained model's fixed points, solver effort, gradients and mistakes, side by side with
runs that reached ~99.6 %.

    python experiments/spin_lm.py run --variants spin --seeds 0-4 --data-seeds 0
    python experiments/quickstart_diagnosis.py --runs runs/spin_lm/quickstart \\
        spin_s0 spin_s2_d0 softmax_s2_d0

For each run directory (names under `--runs`) it writes one row of
`--results/quickstart_diagnosis.{json,md}`:

- from `metrics.jsonl`: forward solver steps (mean, max), failed solves, backward solver
  steps, fallbacks and residuals, skipped steps, the first step at which validation accuracy
  reached 95 % and 99 %;
- the trained model (newest checkpoint) on `--batches` test batches (not the validation
  split the run reported): accuracy, accuracy by nesting depth and where the nearest opening
  bracket is already matched (the match lies further back), what the wrong answers point
  at, and there the coupling weight of the closing bracket on its match, on the nearest
  opening bracket and on itself; failed forward solves; and the accuracy again with every fixed
  point solved to 1e-6 (whether the trained solver's tolerance matters at test time);
- for spin runs, `spinformer.train.diagnose` (spectral radius of the steady-state map at the
  fixed point, distinct fixed points from random starts), and at every kept checkpoint the
  cosine between the gradient the run used (its own adjoint and tolerances) and the gradient
  with forward and backward solves to 1e-6, on `--grad-batches` training batches.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import spinformer as sf
from spinformer.data._brackets import OPEN

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _cli import ROOT, run_script  # noqa: E402

TIGHT = {"model.attention.solver.tol": 1e-6, "model.attention.solver.max_steps": 300,
         "model.attention.adjoint.rtol": 1e-6}


def load(run_dir: pathlib.Path, changes=None, step=None):
    """`(cfg, dataset, model)` of a run at its newest checkpoint (or at `step`), the model
    built from the run's config with `changes` (e.g. `TIGHT`)."""
    cfg = sf.config.load_config(run_dir / "config.yaml")
    if changes and cfg.model.attention.name == "spin":
        cfg = cfg.replace(changes)
    dataset = sf.train.build_dataset(cfg)
    model = sf.train.build_model(cfg, dataset, key=jax.random.key(cfg.train.seed))
    like = sf.train.RunState.init(model, sf.train.build_optimizer(cfg))
    ckpts = dict(sf.train.list_checkpoints(run_dir))
    path = ckpts[max(ckpts) if step is None else step]
    return cfg, dataset, sf.train.read_checkpoint(path, like)[0].model


def training_record(run_dir: pathlib.Path) -> dict:
    recs = sf.train.read_metrics(run_dir)
    tr = [r for r in recs if r["split"] == "train"]
    val = [r for r in recs if r["split"] == "val"]
    out = {"val_accuracy": [[r["step"], r["accuracy"]] for r in val],
           "bad_steps": tr[-1].get("bad_steps", 0)}
    for level in (0.95, 0.99):
        out[f"first_step_{round(level * 100)}"] = next(
            (r["step"] for r in val if r["accuracy"] >= level), None)
    for k in ("solver_steps", "solver_failures", "backward_steps", "backward_fallbacks",
              "backward_residual", "entropy_production"):
        v = [r[k] for r in tr if k in r]
        if v:
            out[k] = {"mean": float(np.mean(v)), "max": float(np.max(v)),
                      # (None: a run shorter than 100 steps)
                      "at_100": next((r[k] for r in tr if r["step"] >= 100 and k in r),
                                     None)}
    return out


def _bracket_facts(tokens, mask):
    """Per closing bracket: its nesting depth (open brackets unmatched just before it), the
    position of the nearest opening bracket before it, and the set of still-unmatched ones."""
    depth = np.zeros(tokens.shape, int)
    nearest = np.full(tokens.shape, -1)
    unmatched = np.zeros(tokens.shape + (tokens.shape[1],), bool)
    for b in range(tokens.shape[0]):
        stack, last = [], -1
        for t in range(tokens.shape[1]):
            if mask[b, t]:
                depth[b, t], nearest[b, t] = len(stack), last
                unmatched[b, t, stack] = True
                stack.pop()
            elif tokens[b, t] == OPEN:
                stack.append(t)
            if tokens[b, t] == OPEN:
                last = t
    return depth, nearest, unmatched


def behaviour_on_test(model, tight, dataset, batches: int) -> dict:
    """Accuracy, its breakdown and the coupling weights on `batches` test batches."""

    @eqx.filter_jit
    def forward(m, tokens):
        logits, diag = jax.vmap(lambda t: m(t, return_diagnostics=True))(tokens)
        fails = (None if diag.solver is None else
                 jnp.sum(diag.solver.result != sf.solvers.RESULTS.successful))
        J = diag.couplings if diag.couplings is not None else diag.weights
        return jnp.argmax(logits, -1), fails, None if J is None else J[:, 0].mean(1)

    n = ok = ok_tight = fails = 0
    by_depth: dict[int, list[int]] = {}
    skip = []  # correct or not, where the nearest opening bracket is not the match
    wrong = {"nearest_open": 0, "other_unmatched_open": 0, "elsewhere": 0}
    weight = {"match": [], "nearest_open": [], "self": []}
    for i in range(batches):
        b = dataset.batch(i, "test")
        tokens, targets, mask = b["inputs"], b["targets"], b["mask"] > 0
        pred, f, J = forward(model, jnp.asarray(tokens))
        pred_tight = np.asarray(forward(tight, jnp.asarray(tokens))[0])
        pred, J = np.asarray(pred), None if J is None else np.asarray(J)
        fails += 0 if f is None else int(f)
        depth, nearest, unmatched = _bracket_facts(tokens, mask)
        for bb, t in zip(*np.nonzero(mask)):
            good = pred[bb, t] == targets[bb, t]
            n, ok, ok_tight = n + 1, ok + good, ok_tight + (pred_tight[bb, t] == targets[bb, t])
            by_depth.setdefault(min(depth[bb, t], 3), []).append(int(good))
            hard = nearest[bb, t] != targets[bb, t]
            if hard:
                skip.append(int(good))
            if not good:
                p = pred[bb, t]
                kind = ("nearest_open" if p == nearest[bb, t] else "other_unmatched_open"
                        if unmatched[bb, t, p] else "elsewhere")
                wrong[kind] += 1
            if J is not None and hard:
                weight["match"].append(J[bb, t, targets[bb, t]])
                weight["nearest_open"].append(J[bb, t, nearest[bb, t]])
                weight["self"].append(J[bb, t, t])
    return {"closing_brackets": n, "accuracy": ok / n, "accuracy_tight_solve": ok_tight / n,
            "failed_solves": fails,
            "accuracy_skipping_nearest": [float(np.mean(skip)), len(skip)],
            "accuracy_by_depth": {f"{d}{'+' if d == 3 else ''}": [float(np.mean(v)), len(v)]
                                  for d, v in sorted(by_depth.items())},
            "wrong_answers": {k: v / max(n - ok, 1) for k, v in wrong.items()},
            "coupling_on": {k: float(np.mean(v)) for k, v in weight.items() if v}}


@eqx.filter_jit
def _gradient(model, batch):
    """The training gradient of `model` on `batch`, flat, without the backward records."""
    g = eqx.filter_grad(lambda m: sf.train.loss_fn(m, batch)[0])(model)
    g = eqx.filter(sf.solvers.backward_stats(g)[0], eqx.is_array)
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])


def gradient_agreement(run_dir: pathlib.Path, batches: int) -> dict:
    """Cosine and relative difference between the run's gradient and the 1e-6 one, at each
    kept checkpoint, on the training batches that step would see next."""
    out = {}
    for step, _ in sf.train.list_checkpoints(run_dir):
        _, dataset, model = load(run_dir, step=step)
        _, _, ref = load(run_dir, TIGHT, step=step)
        cos, rel = [], []
        for i in range(batches):
            batch = {k: jnp.asarray(v) for k, v in dataset.batch(step + i, "train").items()}
            g = [_gradient(m, batch) for m in (model, ref)]
            cos.append(float(g[0] @ g[1] / (jnp.linalg.norm(g[0]) * jnp.linalg.norm(g[1]))))
            rel.append(float(jnp.linalg.norm(g[0] - g[1]) / jnp.linalg.norm(g[1])))
        out[str(step)] = {"cosine_min": min(cos), "relative_difference_max": max(rel)}
    return out


def diagnose_run(run_dir: pathlib.Path, args) -> dict:
    cfg, dataset, model = load(run_dir)
    tight = load(run_dir, TIGHT)[2]
    row = {"run": run_dir.name, "attention": cfg.model.attention.name,
           "train_seed": cfg.train.seed, "data_seed": cfg.data.seed,
           "val_accuracy": json.loads((run_dir / "summary.json").read_text())
           ["metrics"]["accuracy"],
           "training": training_record(run_dir),
           "test": behaviour_on_test(model, tight, dataset, args.batches)}
    if cfg.model.attention.name == "spin":
        d = sf.train.diagnose(run_dir, batches=args.fp_batches, starts=8)
        row["fixed_points"] = d["layers"][0]
        row["gradients"] = gradient_agreement(run_dir, args.grad_batches)
    return row


def _table(rows) -> list[str]:
    def pct(x):
        return "—" if x is None else f"{100 * x:.2f}"

    lines = ["| run | val acc | test acc | test acc, solves to 1e-6 | depth 1 / 2 / 3+ | "
             "match not the nearest `(` | "
             "wrong → nearest `(` / other open `(` / elsewhere | J on match / nearest `(` / "
             "self | fwd steps mean (max) | failed solves (train max, test) | bwd steps "
             "mean (max) | fallbacks | ρ max | several fixed points | gradient cosine min "
             "(checkpoints) | 95 % / 99 % at step |", "|" + "---|" * 16]
    for r in rows:
        t, tr = r["test"], r["training"]
        fp, g = r.get("fixed_points", {}), r.get("gradients", {})
        ss, bs = tr.get("solver_steps"), tr.get("backward_steps")
        lines.append(
            f"| {r['run']} | {pct(r['val_accuracy'])} | {pct(t['accuracy'])} | "
            f"{pct(t['accuracy_tight_solve'])} | "
            + " / ".join(pct(v[0]) for v in t["accuracy_by_depth"].values()) + " | "
            + pct(t["accuracy_skipping_nearest"][0]) + " | "
            + " / ".join(f"{100 * v:.0f} %" for v in t["wrong_answers"].values()) + " | "
            + (" / ".join(f"{v:.2f}" for v in t["coupling_on"].values()) or "—") + " | "
            + (f"{ss['mean']:.2f} ({ss['max']:.2f})" if ss else "—") + " | "
            + (f"{tr['solver_failures']['max']:.3f}, {t['failed_solves']}" if ss else "—")
            + " | " + (f"{bs['mean']:.2f} ({bs['max']:.2f})" if bs else "—") + " | "
            + (f"{tr['backward_fallbacks']['max']:.0f}" if bs else "—") + " | "
            + (f"{fp['spectral_radius']['max']:.3f}" if fp else "—") + " | "
            + (f"{fp['several_fixed_points']:.3f}" if fp else "—") + " | "
            + (", ".join(f"{v['cosine_min']:.4f} ({k})" for k, v in g.items()) or "—")
            + f" | {tr['first_step_95']} / {tr['first_step_99']} |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs_named", nargs="+", metavar="RUN", help="run directory names")
    p.add_argument("--runs", default=str(ROOT / "runs" / "spin_lm" / "quickstart"))
    p.add_argument("--results", default=str(ROOT / "experiments" / "results" / "spin_lm"))
    p.add_argument("--batches", type=int, default=64, help="test batches")
    p.add_argument("--fp-batches", type=int, default=2, help="validation batches to diagnose")
    p.add_argument("--grad-batches", type=int, default=4)
    args = p.parse_args(argv)
    out = pathlib.Path(args.results)
    path = out / "quickstart_diagnosis.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    for name in args.runs_named:
        done[name] = diagnose_run(pathlib.Path(args.runs) / name, args)
        print(json.dumps(done[name]["test"]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(done, indent=2))
    lines = ["# Quickstart runs side by side", "",
             "Made by `experiments/quickstart_diagnosis.py` (what each column is: its "
             "docstring). Accuracies in %; depth: open brackets unmatched before the "
             "closing one; J: the mean coupling (spin) or attention weight (softmax) of a "
             "closing bracket whose match is not the nearest `(` on that position; ρ: "
             "spectral radius of the steady-state map at the fixed point.", "",
             *_table(done.values())]
    (out / "quickstart_diagnosis.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    run_script(main)
