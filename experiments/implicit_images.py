"""Implicit attention on Fashion-MNIST: Deep Implicit Attention (one DEQ mean-field layer) and
free-energy attention (AFEM) against softmax attention of the same parameter count and
budget (M. Bal, "Deep Implicit Attention: A Mean-Field Theory Perspective on Attention
Mechanisms" (2021) and "Transformers from Spin Models: Approximate Free Energy Minimization"
(2021), mcbal.github.io).

    python experiments/implicit_images.py run      # train every run not yet finished
    python experiments/implicit_images.py report   # table, paired gaps, figures
    python experiments/implicit_images.py all      # both

Each variant is a `spinformer.train.run` of one shipped config (`VARIANTS`) with overrides,
written to `--runs` (default `runs/implicit_images/<variant>_s<seed>`); a run with a
`test.json` is skipped, so the sweep can be stopped and restarted (an interrupted run resumes
from its last checkpoint). Runs go seed by seed over all variants, so a partial sweep still
compares every variant on the same seeds. A run whose solver raised is recorded in
`failed.json` and the sweep goes on. Each run trains in a child process watched for
progress: one that stops writing metrics for `--stall` seconds is restarted from its last
checkpoint (see `train_watched`: an XLA:CPU deadlock seen with free-energy attention).

`report` writes `--results` (default `experiments/results/implicit`): `fmnist.md` (test
accuracy on the whole 10,000-image test set, mean ± std over seeds, paired gaps to softmax with
95% t-intervals, parameters, wall time, forward and backward solver steps early and late in
training, the fraction of failed solves at the end, the spectral radius of the trained
implicit layers), `curves.png` (validation accuracy and solver steps over training) and
`couplings.png` (the Frobenius norms ‖J_ij‖ of a trained implicit model). `--quick` runs a
smoke test on the scikit-learn digits (not a result).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import spinformer as sf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _cli import chosen, dispatch, make_parser, run_script  # noqa: E402
from spinformer.grid import mean_ci  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
# name -> (config, overrides, label)
VARIANTS = {
    "softmax": ("fmnist_softmax", {}, "softmax attention, 2 pre-norm blocks (width 32)"),
    "implicit": ("fmnist_implicit", {}, "Deep Implicit Attention (explicit J, MLP Onsager)"),
    "free_energy": ("fmnist_free_energy", {}, "free-energy attention (AFEM saddle)"),
    "implicit_naive": ("fmnist_implicit", {"model.attention.onsager": "none"},
                       "implicit, no Onsager term (naive mean field: a linear layer)"),
    "implicit_nojac": ("fmnist_implicit", {"model.attention.jacobian_penalty": 0.0},
                       "implicit without the Jacobian penalty"),
    "implicit_softmax_J": ("fmnist_implicit", {"model.attention.couplings": "softmax"},
                           "implicit, softmax-amortised couplings"),
}
MAIN = ("softmax", "implicit", "free_energy")

def config_for(variant: str, seed: int, quick: bool = False, steps=None):
    name, overrides, _ = VARIANTS[variant]
    cfg = sf.config.load_config(ROOT / "configs" / f"{name}.yaml")
    changes = {**overrides, "train.seed": seed, "data.seed": seed, "train.progress": False}
    if steps is not None:
        changes["train.steps"] = steps
    if quick:
        changes.update({"data.task": "digits", "model.embed": "patch", "model.patch": 4,
                        "train.steps": 6, "train.eval_every": 3, "train.log_every": 2,
                        "train.warmup_steps": 1, "train.checkpoint_every": 0,
                        "data.batch_size": 8, "data.eval_batches": 1})
    return cfg.replace(changes)


def _last_step(run_dir: pathlib.Path):
    records = sf.train.read_metrics(run_dir)
    return max((r["step"] for r in records), default=None)


def test_metrics(run_dir, quick: bool = False) -> dict:
    """Accuracy and loss on the whole test split, solver statistics of the trained model, and
    the spectral radius of its implicit layers (where it has some) on one test batch."""
    cfg, dataset, model = sf.train.load_run(run_dir)
    n = 1 if quick else dataset.num_batches("test")
    out = sf.train.evaluate(model, [dataset.batch(i, "test") for i in range(n)])
    if cfg.model.attention.name == "implicit":
        attn = jax.tree.map(lambda z: z[0] if eqx.is_array(z) else z, model.layers.attention)
        x = jnp.asarray(dataset.batch(0, "test")["inputs"][:32 if not quick else 4])
        rho = np.asarray(eqx.filter_jit(jax.vmap(
            lambda im: attn.spectral_radius(model.sites(im))))(x))
        out.update(spectral_radius_mean=float(rho.mean()), spectral_radius_max=float(rho.max()))
    return out


def _cpu_seconds(pid: int):
    """User + system CPU seconds of a process (Linux /proc), or None where unavailable."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _mtime_of(seen):
    return None if seen is None else seen[0]


def _busy(cpu, seen, min_cpu_s: float = 0.5) -> bool:
    """More than `min_cpu_s` CPU seconds since the last progress mark."""
    if cpu is None or seen is None or seen[1] is None:
        return seen is None
    return cpu - seen[1] > min_cpu_s


def train_watched(cfg, out: pathlib.Path, stall_s: float) -> dict:
    """Train `cfg` into `out` in a child process (`spinformer run ... --resume`), resumed from
    its last checkpoint whenever it neither writes a metrics line nor spends CPU time for
    `stall_s` seconds.

    Why: training free-energy attention on XLA:CPU (jaxlib 0.10.x) deadlocked inside one
    step — every thread idle, the step never returns — about once in 150 steps on jaxlib
    0.10.2 and at the first step every time on 0.10.1, also in a bare training loop. The
    cause is XLA:CPU's concurrency-optimised scheduler: with
    `--xla_cpu_enable_concurrency_optimized_scheduler=false` (which `import spinformer` now
    sets) 1,600 steps ran without a stall on 0.10.2 and 0.10.1 no longer hangs; neither
    single-threaded Eigen nor `EQX_ON_ERROR=nan` (no host callbacks) had helped. The watchdog
    stays as a safety net: it turns a hang into a restart that loses at most
    `train.checkpoint_every` steps; `restarts` counts them.
    """
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "sweep_config.yaml"
    sf.config.save_config(cfg, spec)
    metrics = out / "metrics.jsonl"
    restarts = 0
    while True:
        cmd = [sys.executable, "-m", "spinformer", "run", str(spec), "--out", str(out),
               "--no-progress"] + (["--resume"] if (out / "config.yaml").exists() else [])
        with open(out / "train.log", "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            last, seen = time.time(), None
            while proc.poll() is None:
                time.sleep(2.0)
                # progress: a new metrics line, or CPU time spent (compiling counts); a
                # deadlocked process spends none
                stamp = (metrics.stat().st_mtime if metrics.exists() else None,
                         _cpu_seconds(proc.pid))
                if stamp[0] != _mtime_of(seen) or _busy(stamp[1], seen):
                    last, seen = time.time(), stamp
                elif time.time() - last > stall_s:
                    proc.kill()
                    proc.wait()
                    break
        if proc.returncode == 0 and (out / "summary.json").exists():
            summary = json.loads((out / "summary.json").read_text())
            summary["restarts"] = restarts
            return summary
        if proc.returncode not in (None, -9):  # the run itself failed (not killed by us)
            tail = (out / "train.log").read_text().strip().splitlines()[-1:]
            raise RuntimeError(tail[0] if tail else f"exit code {proc.returncode}")
        restarts += 1
        print(f"{out.name}: no progress for {stall_s:.0f} s, restart {restarts} from the "
              "last checkpoint", flush=True)


def cmd_run(args):
    runs = pathlib.Path(args.runs)
    variants = chosen(args.variants, VARIANTS, MAIN)
    for seed in range(args.seeds):
        for variant in variants:
            cfg = config_for(variant, seed, args.quick, args.steps)
            out = runs / f"{variant}_s{seed}"
            if (out / "test.json").exists() or (out / "failed.json").exists():
                continue
            t0 = time.time()
            try:
                summary = train_watched(cfg, out, args.stall)
            except Exception as e:  # a run that raised ends this run, not the sweep
                lines = [x.strip() for x in str(e).splitlines() if x.strip()]
                msg = lines[-1] if lines else type(e).__name__
                (out / "failed.json").write_text(json.dumps(
                    {"error": type(e).__name__, "message": msg,
                     "last_logged_step": _last_step(out)}, indent=2))
                print(f"{variant} seed {seed}: FAILED: {msg}", flush=True)
                continue
            test = test_metrics(out, args.quick)
            test["wall_time_s"] = summary.get("wall_time_s")
            test["num_params"] = summary.get("num_params")
            test["restarts"] = summary.get("restarts", 0)
            (out / "test.json").write_text(json.dumps(test, indent=2))
            print(f"{variant} seed {seed}: val {summary['metrics']['accuracy']:.4f} test "
                  f"{test['accuracy']:.4f} ({time.time() - t0:.0f} s)", flush=True)


def _solver_trace(run_dir: pathlib.Path) -> dict:
    """Forward/backward solver steps over training (train records): the mean over the first
    and last 10% of the logged steps, the largest logged value, and the failure fraction in
    the last 10%."""
    rec = [r for r in sf.train.read_metrics(run_dir)
           if r.get("split") == "train" and "solver_steps" in r]
    if not rec:
        return {}
    k = max(1, len(rec) // 10)

    def mean(rows, key):
        vals = [r[key] for r in rows if key in r]
        return float(np.mean(vals)) if vals else float("nan")

    return {"fwd_early": mean(rec[:k], "solver_steps"), "fwd_late": mean(rec[-k:], "solver_steps"),
            "fwd_max": max(r["solver_steps"] for r in rec),
            "bwd_early": mean(rec[:k], "backward_steps"),
            "bwd_late": mean(rec[-k:], "backward_steps"),
            "fail_late": mean(rec[-k:], "solver_failures"),
            "fail_any": max(r.get("solver_failures", 0.0) for r in rec)}


def _load(runs: pathlib.Path):
    rows, failed = {}, {}
    for p in sorted(runs.glob("*_s*/test.json")):
        variant, seed = p.parent.name.rsplit("_s", 1)
        rows[(variant, int(seed))] = {"test": json.loads(p.read_text()),
                                      "trace": _solver_trace(p.parent), "dir": p.parent}
    for p in sorted(runs.glob("*_s*/failed.json")):
        variant, seed = p.parent.name.rsplit("_s", 1)
        failed.setdefault(variant, []).append((int(seed), json.loads(p.read_text())))
    return rows, failed


def _fmt(x, spec=".1f"):
    return "–" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


def cmd_report(args):
    runs, results = pathlib.Path(args.runs), pathlib.Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    rows, failed = _load(runs)
    if not rows:
        raise SystemExit(f"no finished runs under {runs}; run `implicit_images.py run` first.")
    lines = [
        "# Implicit attention on Fashion-MNIST",
        "",
        "Test accuracy on the 10,000 test images after the configured steps (the validation "
        "split is the last 5,000 training images). Gaps are paired by seed (same data order "
        "and initialisation seed) to softmax, with 95% t-intervals. Solver columns: mean "
        "forward Anderson steps (and backward linear-solve products) per solve in the first "
        "and last tenth of training, the most logged, and the fraction of failed forward "
        "solves in the last tenth and at its worst logged step; restarts: runs resumed after a "
        "stalled process (see `train_watched`), summed over seeds; wall time: 2 CPU cores "
        "shared with the other runs of the sweep; ρ: spectral radius of ∂F/∂m at the trained model's fixed "
        "points (mean / max over 32 test images; < 1 means the fixed point attracts).",
        "",
        "| variant | what | seeds | test acc. % (mean ± std) | gap to softmax [95% CI] | "
        "params | wall time (s) | fwd steps early → late (max) | bwd products early → "
        "late | failed: late / most | restarts | ρ mean / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {s: r["test"]["accuracy"] for (v, s), r in rows.items() if v == "softmax"}
    for variant, (_, _, label) in VARIANTS.items():
        got = {s: r for (v, s), r in rows.items() if v == variant}
        if not got and variant not in failed:
            continue
        acc = np.array([r["test"]["accuracy"] for r in got.values()]) * 100
        gaps = [(got[s]["test"]["accuracy"] - base[s]) * 100 for s in got if s in base]
        g, h = mean_ci(gaps)
        gap = "–" if variant == "softmax" or not gaps else f"{g:+.2f} [{g - h:+.2f}, {g + h:+.2f}]"
        tr = [r["trace"] for r in got.values() if r["trace"]]

        def avg(key):
            vals = [t[key] for t in tr if key in t and not np.isnan(t[key])]
            return float(np.mean(vals)) if vals else None

        solver = (f"{_fmt(avg('fwd_early'))} → {_fmt(avg('fwd_late'))} "
                  f"({_fmt(max((t['fwd_max'] for t in tr), default=None))})" if tr else "–")
        bwd = f"{_fmt(avg('bwd_early'))} → {_fmt(avg('bwd_late'))}" if tr else "–"
        fail = (f"{_fmt(avg('fail_late'), '.3f')} / "
                f"{_fmt(max((t['fail_any'] for t in tr), default=None), '.3f')}" if tr else "–")
        rho = [(r["test"]["spectral_radius_mean"], r["test"]["spectral_radius_max"])
               for r in got.values() if "spectral_radius_mean" in r["test"]]
        rho_s = (f"{np.mean([a for a, _ in rho]):.2f} / {max(b for _, b in rho):.2f}"
                 if rho else "–")
        params = next(iter(got.values()))["test"].get("num_params") if got else None
        wall = np.mean([r["test"]["wall_time_s"] or 0 for r in got.values()]) if got else None
        restarts = sum(r["test"].get("restarts", 0) for r in got.values()) if got else "–"
        nf = len(failed.get(variant, []))
        seeds = f"{len(got)}" + (f" (+{nf} failed)" if nf else "")
        mean_std = f"{acc.mean():.2f} ± {acc.std(ddof=1) if len(acc) > 1 else 0:.2f}" if got else "–"
        lines.append(f"| {variant} | {label} | {seeds} | {mean_std} | {gap} | "
                     f"{params or '–'} | {_fmt(wall, '.0f')} | {solver} | {bwd} | {fail} | "
                     f"{restarts} | {rho_s} |")
    for variant, items in failed.items():
        for seed, f in items:
            lines.append(f"\n- {variant} seed {seed} failed after step "
                         f"{f.get('last_logged_step')}: {f.get('message')}")
    text = "\n".join(lines) + "\n"
    (results / "fmnist.md").write_text(text)
    print(text)
    _plot_curves(rows, results / "curves.png")
    implicit = sorted((r["dir"] for (v, s), r in rows.items() if v == "implicit"))
    if implicit:
        _plot_couplings(implicit[0], results / "couplings.png")


def _plot_curves(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {}
    for (variant, seed), r in sorted(rows.items()):
        if variant not in MAIN:
            continue
        rec = sf.train.read_metrics(r["dir"])
        c = colors.setdefault(variant, f"C{len(colors)}")
        val = [(x["step"], x["accuracy"]) for x in rec if x.get("split") == "val"]
        if val:
            axes[0].plot(*zip(*val), color=c, alpha=0.8, label=variant if seed == 0 else None)
        fwd = [(x["step"], x["solver_steps"]) for x in rec
               if x.get("split") == "train" and "solver_steps" in x]
        if fwd:
            axes[1].plot(*zip(*fwd), color=c, alpha=0.6, label=variant if seed == 0 else None)
    axes[0].set(xlabel="step", ylabel="validation accuracy", title="Fashion-MNIST")
    axes[1].set(xlabel="step", ylabel="forward solver steps per solve",
                title="solver steps over training")
    for a in axes:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_couplings(run_dir, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, dataset, model = sf.train.load_run(run_dir)
    attn = jax.tree.map(lambda z: z[0] if eqx.is_array(z) else z, model.layers.attention)
    x = model.sites(jnp.asarray(dataset.batch(0, "test")["inputs"][0]))
    J = np.asarray(attn.coupling_blocks(x))
    norms = np.sqrt((J**2).sum(axis=(0, 3, 4)))
    fig, ax = plt.subplots(figsize=(5, 4.3))
    im = ax.imshow(norms, cmap="viridis")
    ax.set(title="‖J_ij‖ of a trained implicit layer\n(site 0: classification site)",
           xlabel="j", ylabel="i")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = make_parser(__doc__, runs="implicit_images", results="implicit")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, from {list(VARIANTS)} (default: {','.join(MAIN)})")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--quick", action="store_true", help="a smoke test on digits")
    p.add_argument("--stall", type=float, default=60.0,
                   help="restart a run from its last checkpoint after this many seconds "
                        "without a new metrics line or CPU time spent (a deadlock)")
    dispatch(p.parse_args(argv), run=cmd_run, report=cmd_report)


if __name__ == "__main__":
    run_script(main)
