"""How long the training and evaluation steps take to compile, family by family, beside
softmax's in the same process, and softmax's beside a minimal pure-JAX step of its shape.

    python experiments/bench/compile.py                     # quickstart and the zoo's cells
    python experiments/bench/compile.py --configs quickstart,brackets_spin --tasks none
    python experiments/bench/compile.py --tasks nli --families spin,boltzmann_mf
    python experiments/bench/compile.py --quick             # quickstart and softmax only
    python experiments/bench/compile.py --configs brackets_spin --tasks none --fallbacks

For every shipped config named by `--configs` (its own sizes; softmax is the same config with
`model.attention=softmax`) and every cell of the zoo's grid (`configs/zoo/full.yaml`: the task
sizes, parameters matched to softmax's, as `cost.py` builds them), the jitted training step
(`spinformer.train.jit_step`'s program: gradient, clipping, AdamW, the skipped-step check;
without the backward solves' fallbacks, as the training loop compiles it first, unless
`--fallbacks`)
and the evaluation step (`train.evaluate`'s per-batch program) are taken apart as JAX runs
them on their first call:

- `trace`: seconds turning the Python step into a jaxpr (`jax.jit(...).trace`);
- `lower`: seconds lowering it to StableHLO;
- `xla`: seconds of XLA's compilation (what `JAX_LOG_COMPILES` reports as compiling);
- `hlo`: lines of the optimised HLO, and `loops`: its while loops;
- `x softmax`: the family's total (trace + lower + xla) over softmax's on the same cell;
- for softmax, `x minimal`: its training step's total over a minimal pure-JAX step of the
  same shape (the model's own parameters: token and position embeddings, pre-LN blocks of
  the same width with separate query, key, value and output weights, heads and biased
  feed-forward layers, LayerNorms with biases, the final norm, the biased readout; masked
  cross-entropy, optax's AdamW with clipping), the cost of the trainer's own work
  (per-example calls, metrics, the skipped-step check, the coupling parameters' group).

Nothing is read from or written to JAX's persistent compilation cache here (it is switched
off in this process), so every figure is a fresh compilation. Ratios are family / baseline
(above 1: the family takes longer). Results go to `--out/compile.json` and `compile.md`,
written after every row.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import spinformer as sf
from spinformer.cli import find_config

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from spinformer.grid import _grid as zoo  # noqa: E402 (the grid's cells)

ROOT = HERE.parents[1]
CONFIGS = ("quickstart",)
TASKS = ("brackets16", "chars", "nli")


def _clock(fn, *args) -> dict:
    """Trace, lower and compile `jax.jit(fn)` at `args`: seconds of each, and the optimised
    HLO's lines and while loops."""
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    text = compiled.as_text()
    return {"trace": t1 - t0, "lower": t2 - t1, "xla": t3 - t2, "total": t3 - t0,
            "hlo": text.count("\n"), "loops": text.count(" while(")}


def programs(cfg, dataset, fallbacks: bool = False) -> dict:
    """`{"train": (fn, args), "eval": (fn, args)}`: the training step (with the backward
    solves' fallbacks compiled in if `fallbacks`) and the evaluation step of a config as
    functions of arrays alone (the model's static parts closed over)."""
    from spinformer.solvers._fixed_point import plain_loops
    from spinformer.train._objective import _eval_sums
    from spinformer.train._step import _step

    model = sf.train.build_model(cfg, dataset, key=jax.random.key(0))
    opt = sf.train.build_optimizer(cfg)
    objective = sf.train.build_objective(cfg)
    state = sf.train.RunState.init(model, opt)
    batch = {k: jnp.asarray(v) for k, v in dataset.batch(0, "train").items()}
    val = {k: jnp.asarray(v) for k, v in dataset.batch(0, "val").items()
           if k in ("inputs", "targets", "mask")}
    dyn, static = eqx.partition(state, eqx.is_array)
    mdyn, mstatic = eqx.partition(model, eqx.is_array)

    def train(dyn, batch, key):
        out = _step(eqx.combine(dyn, static), batch, key, optimizer=opt,
                    accumulate=cfg.train.accumulate, precision=cfg.train.precision,
                    objective=objective, backward_fallback=fallbacks)
        return eqx.filter(out, eqx.is_array)

    def evaluate(mdyn, batch):  # traced as `train.evaluate` traces it: no lane compaction
        with plain_loops():
            return _eval_sums.__wrapped__(eqx.combine(mdyn, mstatic), batch, None, objective)

    return {"train": (train, (dyn, batch, jax.random.key(1))), "eval": (evaluate, (mdyn, val))}


def minimal_step(cfg, dataset):
    """`(fn, args)`: a minimal pure-JAX training step of the config's shape (see the module
    docstring), on the same batch."""
    m, t = cfg.model, cfg.train
    batch = {k: jnp.asarray(v) for k, v in dataset.batch(0, "train").items()}
    vocab = int(dataset.vocab_size)
    classes = int(getattr(dataset, "num_classes", vocab))
    d, h, f, seq = m.dim, m.num_heads, m.ffn_hidden, batch["inputs"].shape[-1]
    keys = iter(jax.random.split(jax.random.key(0), 8 * m.depth + 4))

    def dense(a, b):
        return jax.random.normal(next(keys), (a, b)) / jnp.sqrt(a)

    def ln():
        return {"w": jnp.ones(d), "b": jnp.zeros(d)}

    # the model's own parameter list: separate query, key, value and output weights,
    # LayerNorms with biases, biased feed-forward layers, the final norm, a biased readout
    params = {"embed": dense(vocab, d), "pos": dense(seq, d), "norm": ln(),
              "out": dense(d, classes), "out_b": jnp.zeros(classes),
              "blocks": [{"q": dense(d, d), "k": dense(d, d), "v": dense(d, d),
                          "o": dense(d, d), "up": dense(d, max(f, 1)),
                          "up_b": jnp.zeros(max(f, 1)), "down": dense(max(f, 1), d),
                          "down_b": jnp.zeros(d), "ln1": ln(), "ln2": ln()}
                         for _ in range(m.depth)]}

    def norm(x, g):
        x = x - x.mean(-1, keepdims=True)
        return g["w"] * x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) + g["b"]

    def loss(p, b):
        x = p["embed"][b["inputs"]] + p["pos"]
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        for blk in p["blocks"]:
            y = norm(x, blk["ln1"])
            q, k, v = (y @ blk[n] for n in "qkv")
            q, k, v = (z.reshape(*z.shape[:-1], h, d // h) for z in (q, k, v))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h)
            a = jax.nn.softmax(jnp.where(causal, s, -1e9), -1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape) @ blk["o"]
            if f:
                up = jax.nn.gelu(norm(x, blk["ln2"]) @ blk["up"] + blk["up_b"])
                x = x + up @ blk["down"] + blk["down_b"]
        logits = norm(x, p["norm"]) @ p["out"] + p["out_b"]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])
        return jnp.sum(nll * b["mask"]) / jnp.maximum(jnp.sum(b["mask"]), 1.0)

    opt = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                      optax.adamw(t.lr, weight_decay=t.weight_decay))

    def step(p, s, b):
        value, g = jax.value_and_grad(loss)(p, b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    return step, (params, opt.init(params), batch)


def measure(cfg, dataset, minimal: bool = False, fallbacks: bool = False) -> dict:
    """One config's row: its training and evaluation steps clocked (and, `minimal`, the
    pure-JAX reference step)."""
    progs = programs(cfg, dataset, fallbacks)
    row = {name: _clock(fn, *args) for name, (fn, args) in progs.items()}
    if minimal and dataset.kind not in ("image_classification", "reconstruction",
                                        "pair_classification"):  # a sequence model
        fn, args = minimal_step(cfg, dataset)
        row["minimal"] = _clock(fn, *args)
    release()
    return row


def table(rows: dict) -> str:
    lines = ["| cell | step | trace s | lower s | XLA s | total s | x softmax | HLO lines "
             "| loops |", "|---|---|---|---|---|---|---|---|---|"]
    for cell, row in rows.items():
        if "error" in row:
            lines.append(f"| {cell} | {row['error']} |||||||")
            continue
        for step in ("train", "eval", "minimal"):
            r = row.get(step)
            if r is None:
                continue
            ratio = r.get("x_minimal", r.get("x_softmax"))
            label = "x minimal" if "x_minimal" in r else ""
            rel = "" if ratio is None else f"{ratio:.2f}{' (' + label + ')' if label else ''}"
            lines.append(f"| {cell} | {step} | {r['trace']:.1f} | {r['lower']:.1f} | "
                         f"{r['xla']:.1f} | {r['total']:.1f} | {rel} | {r['hlo']} | "
                         f"{r['loops']} |")
    return "\n".join(lines) + "\n"


def release() -> None:
    from _cli import release_compiled_code

    release_compiled_code()


def _compare(row: dict, ref: dict) -> None:
    for step in ("train", "eval"):
        if step in row and step in ref:
            row[step]["x_softmax"] = row[step]["total"] / ref[step]["total"]
    if "minimal" in row:
        row["train"]["x_minimal"] = row["train"]["total"] / row["minimal"]["total"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated shipped configs ('none': none)")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help="comma-separated zoo tasks ('none': none)")
    p.add_argument("--families", default=None, help="comma-separated (default: every family "
                   "the grid runs on the task)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a change to every config measured (repeatable)")
    p.add_argument("--quick", action="store_true", help="the quickstart and its softmax only")
    p.add_argument("--fallbacks", action="store_true", help="compile the backward solves' "
                   "fallbacks into the training step (the training loop does so only once a "
                   "step needs them)")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "compile"))
    args = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)  # fresh compilations only
    configs = [] if args.configs == "none" else args.configs.split(",")
    tasks = [] if args.quick or args.tasks == "none" else args.tasks.split(",")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; ratios are family / softmax "
          "(above 1: slower to compile)", flush=True)
    rows: dict = {}

    def record(name, row):
        rows[name] = row
        print(f"{name:28s} " + "  ".join(
            f"{s}: {r['total']:.1f} s ({r['xla']:.1f} XLA, {r['hlo']} lines, {r['loops']} loops"
            + (f", x{r['x_softmax']:.2f}" if "x_softmax" in r else "")
            + (f", x{r['x_minimal']:.2f} minimal" if "x_minimal" in r else "") + ")"
            for s, r in row.items() if s != "minimal"), flush=True)
        (out / "compile.json").write_text(json.dumps(rows, indent=1))
        (out / "compile.md").write_text(table(rows))

    for name in configs:
        path = find_config(name)
        cfg = sf.config.load_config(path, overrides=args.set)
        soft = cfg.replace({"model.attention": "softmax"})
        dataset = sf.train.build_dataset(cfg)
        ref = measure(soft, dataset, minimal=True)
        _compare(ref, ref)
        record(f"{name} (softmax)", ref)
        if cfg.model.attention.name != "softmax":
            row = measure(cfg, dataset, fallbacks=args.fallbacks)
            _compare(row, ref)
            record(name, row)
    if tasks:
        grid = zoo.load_grid(ROOT / "configs" / "zoo" / "full.yaml")
        families = args.families.split(",") if args.families else list(grid["families"])
    for task in tasks:
        cells = zoo.plan_cells(grid, [task], ["softmax", *families])
        ref_cfg = zoo.base_config(grid, task, "softmax", cells[task, "softmax"].changes)
        ref_cfg = ref_cfg.replace(sf.config.parse_overrides(args.set))
        ref = measure(ref_cfg, zoo._dataset(ref_cfg, task), minimal=True)
        _compare(ref, ref)
        record(f"{task}/softmax", ref)
        for fam in families:
            cell = cells[task, fam]
            if fam == "softmax" or cell.reason:
                continue
            cfg = zoo.base_config(grid, task, fam, cell.changes)
            cfg = cfg.replace(sf.config.parse_overrides(args.set))
            try:
                row = measure(cfg, zoo._dataset(cfg, task), fallbacks=args.fallbacks)
                _compare(row, ref)
            except Exception as e:  # noqa: BLE001 - a row that says why
                row = {"error": zoo.failure_message(e)[:120]}
            record(f"{task}/{fam}", row)
    print(table(rows))


if __name__ == "__main__":
    main()
