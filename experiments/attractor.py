"""Self-attention as an attractor network: transient memories without backpropagation
(F. D'Amico, M. Negri, arXiv:2409.16112), reproduced on Fashion-MNIST.

    python experiments/attractor.py run      # train every model not yet finished (resumable)
    python experiments/attractor.py report   # curves, reconstructions, patch variances, figures
    python experiments/attractor.py all      # both
    python experiments/attractor.py all --config configs/attractor/quick.yaml   # smoke test

One config (`configs/attractor/fmnist.yaml`) describes every model. The bare self-attention net
(`nn.AttractorNetwork`, 2×2 patches) is trained once, without backpropagation, by SGD on the
local energies of clean training images (`nn.attractor_sgd_step`) and serves both tasks; a
second one on 4×4 patches is trained for the patch-variance figure. The baselines
(`nn.PatchReconstructor`: one pre-LN block iterated τ ~ U{3..7} times, and a 5-layer ViT, 4×4
patches) are trained by backpropagation on each task separately (MSE to the clean image).
With an `et` section the Energy Transformer (B. Hoover et al., arXiv:2302.07253; its paper's
own task is masked-image reconstruction) is trained the same way: `nn.PatchReconstructor` with
one Energy Transformer block (T descent steps of one energy, no MLP, no pre-norm), so t blocks
continue the same descent to t·T steps; `et_energy.png` shows the energy along that descent.

Runs go to `--runs` (default `runs/attractor_<config>/<model>`): a checksummed checkpoint
(`train.save_checkpoint`: the `train.RunState` (model, optimiser state, step), and the run's
state dict as metadata) written after every epoch (and on SIGINT/SIGTERM), so a killed run
resumes at its last epoch; a finished run (`done: true`) is skipped. `report` writes `--results` (default
`experiments/results/attractor`): `results.json` (every curve), `attractor.md` (tables) and the
figures `mse_vs_t.png` (the paper's Fig. 1), `reconstructions.png`, `patch_variance.png`
(Fig. 2) and `global_attractor.png`.

Corruptions are drawn from a generator seeded by (config seed, split, batch index), so every
model sees the same corrupted test images. All pixels are in [0, 1]; the noisy images are
clipped to [0, 1] after the paper's variance rescaling (`data.noisy_images`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

import spinformer as sf
from spinformer.data import mask_images, noisy_images, patchify, unpatchify

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _cli import dispatch, make_parser, run_script  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "attractor" / "fmnist.yaml"
TASKS = ("mask", "noise")
MODELS = ("attractor", "attractor_p4", "block_mask", "block_noise", "vit_mask", "vit_noise",
          "attractor_pl", "et_mask", "et_noise")  # the last three only when the config has
# an attractor_pl / et section
OPTIONAL = {"attractor_pl": "attractor_pl", "et_mask": "et", "et_noise": "et"}
ATTRACTOR_KEYS = {"patch", "dim", "lam_train", "lam_test", "gamma", "norm", "constraint",
                  "objective", "epochs", "batch_size", "lr", "clip"}
BASELINE_KEYS = {"patch", "dim", "depth", "num_heads", "ffn_hidden", "iterations", "epochs",
                 "batch_size", "lr"}
# the Energy Transformer: `et_options` are its settings (model.attention's keys: steps, alpha,
# head_dim, memories, hopfield, beta_hn)
ET_KEYS = {"patch", "dim", "num_heads", "et_options", "iterations", "epochs", "batch_size", "lr"}
SECTIONS = {"description", "experiment", "seed", "data", "tasks", "eval", "attractor",
            "attractor_p4", "attractor_pl", "block", "vit", "et"}


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------

def _et_config():
    """The Energy Transformer's settings class (`EnergyTransformerConfig`)."""
    return sf.nn.get_attention("energy_transformer").config


def load_config(path, overrides=()) -> dict:
    """The experiment config with `attractor_p4` filled from `attractor`; `overrides` are
    `section.key=value` strings (YAML values). Unknown keys are errors that name them."""
    cfg = yaml.safe_load(pathlib.Path(path).read_text()) or {}
    if cfg.get("experiment") != "attractor":
        raise ValueError(f"{path}: not an attractor experiment config (experiment: attractor).")
    for item in overrides:
        key, _, value = item.partition("=")
        if not _:
            raise ValueError(f"--set {item!r}: expected section.key=value.")
        sec, _, k = key.partition(".")
        cfg.setdefault(sec, {})
        cfg[sec][k] = yaml.safe_load(value)
    unknown = set(cfg) - SECTIONS
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {sorted(unknown)}; known: "
                         f"{sorted(SECTIONS)}.")
    cfg["attractor_p4"] = {**cfg["attractor"], **(cfg.get("attractor_p4") or {})}
    if "attractor_pl" in cfg:
        cfg["attractor_pl"] = {**cfg["attractor"], **(cfg.get("attractor_pl") or {})}
    for sec, keys in (("attractor", ATTRACTOR_KEYS), ("attractor_p4", ATTRACTOR_KEYS),
                      ("attractor_pl", ATTRACTOR_KEYS), ("block", BASELINE_KEYS),
                      ("vit", BASELINE_KEYS), ("et", ET_KEYS)):
        if sec not in cfg:
            continue
        bad = set(cfg[sec]) - keys
        if bad:
            raise ValueError(f"{path}: unknown key(s) {sorted(bad)} in {sec}; known: "
                             f"{sorted(keys)}.")
    if "et" in cfg:  # checked (and defaults filled) by the attention's own config section
        EnergyTransformerConfig = _et_config()
        try:
            opts = EnergyTransformerConfig(**(cfg["et"].get("et_options") or {}))
        except TypeError as e:
            raise ValueError(f"{path}: et.et_options: {e}; known: "
                             f"{[f.name for f in dataclasses.fields(EnergyTransformerConfig)]}.")
        cfg["et"]["et_options"] = dataclasses.asdict(opts)
    return cfg


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------

def load_images(cfg) -> dict[str, np.ndarray]:
    """`{"train": (n, H, W), "test": (m, H, W)}` float32 in [0, 1]."""
    d = cfg["data"]
    if d["dataset"] == "fashion_mnist":
        raw = sf.data.load_mnist(d.get("path"))
        train, test = raw["train_images"] / 255.0, raw["test_images"] / 255.0
    elif d["dataset"] == "digits":
        from spinformer.data._images import _digits_arrays

        x = _digits_arrays()[0] / 16.0
        perm = np.random.default_rng(0).permutation(len(x))
        train, test = x[perm[:1500]], x[perm[1500:]]
    else:
        raise ValueError(f"data.dataset must be fashion_mnist or digits; got {d['dataset']!r}.")
    train = train[: int(d["train_size"])].astype(np.float32)
    test = test[: int(d["eval_size"])].astype(np.float32)
    return {"train": train, "test": test}


def corrupt(cfg, images, task, *, split, index):
    """The corrupted batch for (task, split, batch index): same seed → same corruption."""
    t = cfg["tasks"]
    rng = np.random.default_rng([int(cfg["seed"]), {"train": 0, "test": 1}[split], int(index),
                                 TASKS.index(task)])
    if task == "mask":
        return mask_images(images, t["mask_fraction"], rng=rng, mode=t["mask_mode"],
                           patch=cfg["attractor"]["patch"])[0]
    return noisy_images(images, t["noise_variance"], rng=rng)


# --------------------------------------------------------------------------------------------
# models and training
# --------------------------------------------------------------------------------------------

def models(cfg) -> tuple[str, ...]:
    """The models this config trains (`attractor_pl`, `et_*` only when it has their section)."""
    return tuple(m for m in MODELS if m not in OPTIONAL or OPTIONAL[m] in cfg)


def build(cfg, name, image_shape):
    key = jax.random.key(int(cfg["seed"]) + MODELS.index(name))
    if name.startswith("attractor"):
        c = cfg[name]
        return sf.nn.AttractorNetwork(image_shape, c["patch"], c["dim"], lam_train=c["lam_train"],
                                      lam_test=c["lam_test"], gamma=c["gamma"], norm=c["norm"],
                                      constraint=c["constraint"], key=key)
    c = cfg[name.split("_")[0]]
    H, W = image_shape
    P = c["patch"]
    if name.startswith("et"):  # one Energy Transformer block: x <- x_T, no MLP, no pre-norm,
        # read out through a layer norm (the paper's; see nn.PatchReconstructor)
        return sf.nn.PatchReconstructor(
            (H // P) * (W // P), P * P, c["dim"], 1, c["num_heads"], 0,
            attention="energy_transformer", norm=False, final_norm=True, key=key,
            attention_kwargs=sf.nn.get_attention("energy_transformer").kwargs_from(
                _et_config()(**c["et_options"])))
    return sf.nn.PatchReconstructor((H // P) * (W // P), P * P, c["dim"], c["depth"],
                                    c["num_heads"], c["ffn_hidden"], key=key)


def _steps_per_epoch(n, batch):
    return max(1, n // batch)


def _batch(train, step, batch, seed):
    """Deterministic batch `step` of an epoch-wise shuffled stream (resume sees the same)."""
    n = len(train)
    per = _steps_per_epoch(n, batch)
    epoch, k = divmod(step, per)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return train[perm[k * batch:(k + 1) * batch]]


def _trained(runs, name) -> bool:
    return bool(sf.train.list_checkpoints(pathlib.Path(runs) / name))


def _optimizer(cfg, name, total):
    """The optax optimizer of a baseline run, its cosine schedule `total` steps long; None for
    the attractor nets (trained by `nn.attractor_sgd_step`)."""
    if name.startswith("attractor"):
        return None
    c = cfg[name.split("_")[0]]
    sched = optax.cosine_decay_schedule(float(c["lr"]), total, alpha=0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))


def _initial_state(model, opt):
    """The `train.RunState` before the first step (the optimiser state over every array)."""
    opt_state = None if opt is None else opt.init(eqx.filter(model, eqx.is_array))
    return sf.train.RunState(model, opt_state, step=0)


def load_model(cfg, name, image_shape, runs):
    """The trained model of run `name` (its newest checkpoint) and its state dict."""
    model = build(cfg, name, image_shape)
    # (the schedule's length does not change the optimiser state's structure)
    like = _initial_state(model, _optimizer(cfg, name, total=1))
    got = sf.train.load_latest(pathlib.Path(runs) / name, like)
    if got is None:
        raise FileNotFoundError(f"{name}: no checkpoint in {pathlib.Path(runs) / name}; "
                                f"train it first (`run --only {name}`).")
    run, state = got
    return run.model, state


def train_model(cfg, name, images, runs, *, progress=True):
    """Trains run `name` to its configured epochs, resuming from `runs/name` if it exists.
    Returns the state dict (`done`, `epoch`, `step`, `wall_s`, per-epoch `loss`)."""
    run_dir = pathlib.Path(runs) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    train = images["train"]
    image_shape = train.shape[1:]
    is_attr = name.startswith("attractor")
    c = cfg[name] if is_attr else cfg[name.split("_")[0]]
    task = None if is_attr else name.split("_")[1]
    model = build(cfg, name, image_shape)
    per = _steps_per_epoch(len(train), int(c["batch_size"]))
    total = per * int(c["epochs"])
    seed = int(cfg["seed"]) * 1000 + MODELS.index(name)
    opt = _optimizer(cfg, name, total)

    # each step maps the run state (model, optimiser state, step) to the next
    if is_attr:
        @eqx.filter_jit
        def step_fn(run, b):
            m, metrics = sf.nn.attractor_sgd_step(run.model, b, lr=float(c["lr"]),
                                                  clip=float(c["clip"]),
                                                  objective=c["objective"])
            return sf.train.RunState(m, None, step=run.step + 1), metrics
    else:
        lo, hi = (int(v) for v in c["iterations"])
        P = int(c["patch"])

        @eqx.filter_jit
        def step_fn(run, inp, tgt, tau):
            def loss(m):
                out = jax.vmap(lambda p: m(p, tau, max_iterations=hi))(inp)
                return jnp.mean((out - tgt) ** 2)

            m = run.model
            value, g = eqx.filter_value_and_grad(loss)(m)
            upd, s = opt.update(g, run.opt_state, eqx.filter(m, eqx.is_array))
            return sf.train.RunState(eqx.apply_updates(m, upd), s, step=run.step + 1), \
                {"loss": value}

    # `run` is the run state; `state` the run's metadata (saved with it in every checkpoint)
    run = _initial_state(model, opt)
    state = {"name": name, "done": False, "epoch": 0, "step": 0, "wall_s": 0.0, "loss": [],
             "steps_per_epoch": per, "epochs": int(c["epochs"])}
    got = sf.train.load_latest(run_dir, run)
    if got is not None:
        run, state = got
        state["epochs"] = int(c["epochs"])
        state["done"] = state["step"] >= total
    if state["done"]:
        return state
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=state["step"], desc=name, unit="step", leave=False,
                   mininterval=5.0)
    t0 = time.time()
    wall0 = state["wall_s"]
    running = []
    with sf.train.StopSignals() as stop:
        while state["step"] < total:
            step = state["step"]
            clean = _batch(train, step, int(c["batch_size"]), seed)
            if is_attr:
                run, m = step_fn(run, clean)
            else:
                rng = np.random.default_rng([seed, step])
                tau = int(rng.integers(lo, hi + 1))
                inp = corrupt(cfg, clean, task, split="train", index=step)
                run, m = step_fn(run, patchify(inp, P, batch_dims=1),
                                 patchify(clean, P, batch_dims=1), jnp.asarray(tau))
            running.append(m["loss"])
            state["step"] = step + 1
            if bar is not None:
                bar.update(1)
            end_epoch = state["step"] % per == 0 or state["step"] == total
            if end_epoch or stop.received is not None:
                loss = float(np.mean(np.asarray(jax.device_get(running)))) if running else None
                if not np.isfinite(loss if loss is not None else 0.0):
                    raise FloatingPointError(f"{name}: non-finite training loss at step "
                                             f"{state['step']}; the last saved epoch is kept.")
                if end_epoch:
                    state["epoch"] = state["step"] // per
                    state["loss"].append(loss)
                    running = []
                state["wall_s"] = wall0 + time.time() - t0
                state["done"] = state["step"] >= total
                sf.train.save_checkpoint(run_dir, run, state)  # step: run.step
                if bar is not None and end_epoch:
                    bar.set_postfix(epoch=state["epoch"], loss=f"{loss:.4g}")
                if stop.received is not None:
                    if bar is not None:
                        bar.close()
                    print(f"{name}: stopped by signal {stop.received} at step {state['step']}; "
                          f"saved, run again to resume.", file=sys.stderr)
                    raise SystemExit(128 + stop.received)
    if bar is not None:
        bar.close()
    return state


# --------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------

def _attractor_frames(steps, norm):
    return eqx.filter_jit(lambda n, x: jax.vmap(lambda im: n.reconstruct(im, steps,
                                                                         norm=norm))(x))


def _baseline_frames(model, P, image_shape, steps, single):
    @eqx.filter_jit
    def f(m, x):
        p = patchify(x, P, batch_dims=1)
        if single:
            out = jax.vmap(lambda q: m(q, 1))(p)[:, None]
            traj = jnp.concatenate([p[:, None], out], axis=1)
        else:
            traj = jax.vmap(lambda q: m.trajectory(q, steps))(p)
        return unpatchify(traj, image_shape, batch_dims=2)

    return lambda x: f(model, x)


def frames_fn(cfg, name, model, image_shape, steps, norm=None):
    """`f(images (B, H, W)) -> (B, T, H, W)`: the decoded states along the dynamics (T =
    steps + 1, index 0 the input; for the ViT T = 2: input and its one output)."""
    if name.startswith("attractor"):
        f = _attractor_frames(steps, norm)
        return lambda x: f(model, x)
    c = cfg[name.split("_")[0]]
    return _baseline_frames(model, int(c["patch"]), image_shape, steps, name.startswith("vit"))


def mse_curves(cfg, frames, images, task, batch_size):
    """Per-image MSE at every t, `(n_images, T)`, in batches (corruption fixed by the batch
    index), and the frames of the first batch."""
    out, first = [], None
    for i in range(0, len(images), batch_size):
        clean = images[i:i + batch_size]
        x = corrupt(cfg, clean, task, split="test", index=i // batch_size)
        fr = np.asarray(frames(x))
        if first is None:
            first = (clean, x, fr)
        out.append(((fr - clean[:, None]) ** 2).mean(axis=(2, 3)))
    return np.concatenate(out, axis=0), first


def blend_baseline(cfg, images, task, batch_size):
    """The trivial reference a relaxation towards one global attractor should be compared
    with: a·(corrupted input) + (1 − a)·(mean training image), with a fitted on corrupted
    *training* images (grid of 101 values), scored on the test images. Returns
    `{"a", "mse", "sem"}`."""
    mean_img = images["train"].mean(axis=0)
    grid = np.linspace(0.0, 1.0, 101)
    fit = images["train"][: len(images["test"])]
    sse = np.zeros_like(grid)
    for i in range(0, len(fit), batch_size):
        clean = fit[i:i + batch_size]
        x = corrupt(cfg, clean, task, split="train", index=10**6 + i // batch_size)
        for k, a in enumerate(grid):
            sse[k] += np.sum((a * x + (1 - a) * mean_img - clean) ** 2)
    a = float(grid[int(np.argmin(sse))])
    per = []
    for i in range(0, len(images["test"]), batch_size):
        clean = images["test"][i:i + batch_size]
        x = corrupt(cfg, clean, task, split="test", index=i // batch_size)
        per.append(((a * x + (1 - a) * mean_img - clean) ** 2).mean(axis=(1, 2)))
    per = np.concatenate(per)
    return {"a": a, "mse": float(per.mean()),
            "sem": float(per.std(ddof=1) / math.sqrt(len(per)))}


def patch_variances(frames_at_t, patch=4):
    """Within-patch variance of the predicted pixels, one value per patch: `(B·N,)`."""
    p = patchify(np.asarray(frames_at_t), patch, batch_dims=1)
    return p.var(axis=-1).reshape(-1)


def et_energy(cfg, model, clean, task, iterations):
    """The energy along the descent of a trained Energy Transformer reconstructor, on the
    corrupted test batch 0: `iterations` blocks of T steps each (the block is trained for one).
    Returns `{"mean", "sem"}` per token, `(iterations·T + 1,)`, over the images of `clean`."""
    P = int(cfg["et"]["patch"])
    x = corrupt(cfg, clean, task, split="test", index=0)
    patches = jnp.asarray(patchify(x, P, batch_dims=1))

    @eqx.filter_jit
    def run(m, p):
        block = m.block(0)  # the only one

        def one(q):
            def body(h, _):
                out, d = block.attention(block.attention_input(h), return_diagnostics=True)
                return h + out, d.fields

            _, e = jax.lax.scan(body, m.encode(q), None, length=int(iterations))
            return jnp.concatenate([e[0, :1], e[:, 1:].reshape(-1)])

        return jax.vmap(one)(p) / p.shape[1]

    e = np.asarray(run(model, patches))
    rise = np.diff(e, axis=1) / np.maximum(np.abs(e[:, :-1]), 1e-12)
    return {"mean": e.mean(axis=0).tolist(),
            "sem": (e.std(axis=0, ddof=1) / math.sqrt(len(e))).tolist(),
            "steps_per_block": int(cfg["et"]["et_options"]["steps"]),
            # images whose energy rose at some step by more than float32 round-off
            "images_rising": float(np.mean((rise > 1e-5).any(axis=1))),
            "max_relative_rise": float(rise.max())}


def global_attractor(cfg, net, images, steps, starts, key):
    """Where the dynamics go from random starts: random unit tokens, uniform-noise images, and
    test images; distance of the decoded state to the mean training image along the way."""
    mean_img = images["train"].mean(axis=0)
    N, d = net.embedding.num_tokens, net.embedding.dim
    k1, k2 = jax.random.split(key)
    x_rand = sf.spins.attractor.normalize(jax.random.normal(k1, (starts, N, d)))
    img_rand = np.asarray(jax.random.uniform(k2, (starts,) + mean_img.shape))
    x_img = jax.vmap(net.embedding.embed)(jnp.asarray(img_rand))
    x_test = jax.vmap(net.embedding.embed)(jnp.asarray(images["test"][:starts]))

    @eqx.filter_jit
    def go(n, x0):
        xs = jax.vmap(lambda x: n.run(x, steps))(x0)  # (B, T, N, d)
        return jax.vmap(jax.vmap(n.embedding.decode))(xs)

    out = {}
    for label, x0 in (("random tokens", x_rand), ("noise images", x_img), ("test images", x_test)):
        fr = np.asarray(go(net, x0))
        dist = ((fr - mean_img) ** 2).mean(axis=(2, 3))  # (B, T)
        final = fr[:, -1]
        spread = float(((final - final.mean(axis=0)) ** 2).mean())
        out[label] = {"mse_to_mean": dist.mean(axis=0).tolist(), "final_spread": spread,
                      "final": final[:8]}
    return out, mean_img


def evaluate(cfg, images, runs, *, progress=True) -> dict[str, Any]:
    e = cfg["eval"]
    steps, bs = int(e["steps"]), int(e["batch_size"])
    test = images["test"]
    shape = test.shape[1:]
    res: dict[str, Any] = {"curves": {}, "examples": {}, "patch_var": {}}
    curves = res["curves"]
    jobs = []
    for task in TASKS:
        for norm in ("sphere", "layernorm"):
            jobs.append((f"attractor[{norm}]", "attractor", task, norm))
        if "attractor_pl" in cfg:
            jobs.append(("attractor_pl", "attractor_pl", task, None))
        jobs.append(("block", f"block_{task}", task, None))
        jobs.append(("vit", f"vit_{task}", task, None))
        if "et" in cfg:
            jobs.append(("et", f"et_{task}", task, None))
    jobs.append(("attractor_p4", "attractor_p4", "mask", None))
    for label, name, task, norm in jobs:
        if not _trained(runs, name):
            print(f"report: {name} has not been trained; skipped", file=sys.stderr)
            continue
        model, state = load_model(cfg, name, shape, runs)
        t0 = time.time()
        f = frames_fn(cfg, name, model, shape, steps, norm)
        per_img, (clean, x, fr) = mse_curves(cfg, f, test, task, bs)
        mean = per_img.mean(axis=0)
        sem = per_img.std(axis=0, ddof=1) / math.sqrt(len(per_img))
        best = int(np.argmin(mean[1:]) + 1) if len(mean) > 1 else 0
        curves[f"{label}/{task}"] = {"mean": mean.tolist(), "sem": sem.tolist(), "best_t": best,
                                     "epochs": state["epoch"], "done": state["done"],
                                     "train_wall_s": state["wall_s"]}
        res["examples"][f"{label}/{task}"] = {"clean": clean[:6], "input": x[:6],
                                              "best": fr[:6, best]}
        if task == "mask" and (name.split("_")[0] in ("block", "vit", "et")
                               or name == "attractor_p4"):
            res["patch_var"][label] = patch_variances(fr[:, best], 4)
        if progress:
            print(f"  {label:22s} {task:5s}: MSE t=0 {mean[0]:.4f}  best t={best} "
                  f"{mean[best]:.4f}  t={len(mean) - 1} {mean[-1]:.4f}  ({time.time() - t0:.0f} s)",
                  flush=True)
    res["patch_var"]["clean images"] = patch_variances(test[:bs], 4)  # same images as above
    for task in TASKS:
        if "et" in cfg and _trained(runs, f"et_{task}"):
            model, _ = load_model(cfg, f"et_{task}", shape, runs)
            res.setdefault("et_energy", {})[task] = et_energy(cfg, model, test[:bs], task,
                                                              steps)
    for task in TASKS:  # a trivial reference: the best blend of the input and the mean image
        res["blend"] = res.get("blend", {})
        res["blend"][task] = blend_baseline(cfg, images, task, bs)
    if _trained(runs, "attractor"):
        net, _ = load_model(cfg, "attractor", shape, runs)
        res["global"], res["mean_image"] = global_attractor(
            cfg, net, images, int(e["global_steps"]), int(e["global_starts"]),
            jax.random.key(int(cfg["seed"]) + 99))
    return res


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def observations(res) -> list[tuple[str, str]]:
    """The paper's observations, each with what this run measured (pass/fail is decided by the
    numbers, the wording states the criterion)."""
    c = res["curves"]
    out = []

    def get(k):
        return c.get(k)

    for task, paper_t in (("mask", "≈ 1"), ("noise", "≈ 10")):
        a = get(f"attractor[sphere]/{task}")
        if a is None:
            continue
        m = np.asarray(a["mean"])
        nonmono = m[a["best_t"]] < m[0] and m[-1] > m[a["best_t"]]
        out.append((f"attractor, {task}: MSE non-monotonic in t (falls, then rises)",
                    f"{'yes' if nonmono else 'no'}: t=0 {m[0]:.4f}, best t={a['best_t']} "
                    f"{m[a['best_t']]:.4f}, t={len(m) - 1} {m[-1]:.4f}"))
        out.append((f"attractor, {task}: optimum at t {paper_t}", f"best t = {a['best_t']}"))
        bl = res.get("blend", {}).get(task)
        if bl is not None:
            out.append((f"(ours) attractor's best transient vs the best blend of input and "
                        f"mean training image, {task}",
                        f"{m[a['best_t']]:.4f} vs {bl['mse']:.4f} ± {2 * bl['sem']:.4f} "
                        f"(blend weight on the input {bl['a']:.2f})"))
    for task in TASKS:
        b = get(f"block/{task}")
        if b is not None:
            m = np.asarray(b["mean"])
            inside = [t for t in range(3, 8) if t < len(m)]
            good = 3 <= b["best_t"] <= 7
            out.append((f"block, {task}: best at 3–7 iterations (its training range)",
                        f"{'yes' if good else 'no'}: best t = {b['best_t']} ({m[b['best_t']]:.4f}); "
                        f"t=3..7: {', '.join(f'{m[t]:.4f}' for t in inside)}"))
        v, a = get(f"vit/{task}"), get(f"attractor[sphere]/{task}")
        if v is not None:
            others = {k: min(get(k)["mean"][1:]) for k in (f"block/{task}",
                                                         f"attractor[sphere]/{task}") if get(k)}
            vb = v["mean"][1]
            best = all(vb < o for o in others.values())
            out.append((f"ViT best overall, {task}",
                        f"{'yes' if best else 'no'}: ViT {vb:.4f} vs best of others " +
                        ", ".join(f"{k.split('/')[0]} {o:.4f}" for k, o in others.items())))
        pl = get(f"attractor_pl/{task}")
        if pl is not None and a is not None:
            mp, ma = np.asarray(pl["mean"]), np.asarray(a["mean"])
            out.append((f"(ours) exact pseudo-likelihood training vs the paper's energy, {task}",
                        f"best MSE {mp[pl['best_t']]:.4f} at t={pl['best_t']} vs "
                        f"{ma[a['best_t']]:.4f} at t={a['best_t']}"))
    for task in TASKS:
        e, b, v = get(f"et/{task}"), get(f"block/{task}"), get(f"vit/{task}")
        if e is None:
            continue
        m = np.asarray(e["mean"])
        ref = ", ".join(f"{k} {val:.4f}" for k, val in (("block best", b and min(b["mean"][1:])),
                                                          ("ViT", v and v["mean"][1])) if val)
        out.append((f"(ours) Energy Transformer, {task}: its trained descent (t=1) against the "
                    f"backprop baselines", f"ET {m[1]:.4f} ± {2 * e['sem'][1]:.4f}; {ref}"))
        en = res.get("et_energy", {}).get(task)
        if en is not None:
            T = en["steps_per_block"]
            out.append((f"(ours) Energy Transformer, {task}: the energy never rises along the "
                        f"descent, continued past training to {len(m) - 1} blocks "
                        f"({(len(m) - 1) * T} steps)",
                        f"{'yes' if en['images_rising'] == 0 else 'no'}: images whose energy "
                        f"rose at some step {en['images_rising']:.0%} (largest relative rise "
                        f"{en['max_relative_rise']:.1e}); energy/token {en['mean'][0]:.3f} → "
                        f"{en['mean'][T]:.3f} (t=1) → {en['mean'][-1]:.3f}; MSE t=1 "
                        f"{m[1]:.4f}, best t={e['best_t']} {m[e['best_t']]:.4f}, "
                        f"t={len(m) - 1} {m[-1]:.4f}"))
    pv = res.get("patch_var", {})
    if all(k in pv for k in ("vit", "block", "attractor_p4")):
        keys = ("vit", "block", "attractor_p4", "clean images")
        med = {k: float(np.median(pv[k])) for k in keys}
        flat = {k: float(np.mean(pv[k] < 1e-4)) for k in keys}
        order = med["vit"] > med["block"] > med["attractor_p4"]
        out.append(("within-patch variance: ViT > block > attractor (more uniform patches)",
                    f"{'yes' if order else 'no'}: medians " +
                    ", ".join(f"{k} {v:.2e}" for k, v in med.items()) +
                    "; patches with variance < 1e-4: " +
                    ", ".join(f"{k} {v:.0%}" for k, v in flat.items())))
    g = res.get("global")
    if g:
        out.append(("a global attractor near the mean training image",
                    "; ".join(f"{k}: MSE to mean image {v['mse_to_mean'][-1]:.4f} after "
                              f"{len(v['mse_to_mean']) - 1} steps (from {v['mse_to_mean'][0]:.4f}),"
                              f" spread of final states {v['final_spread']:.4f}"
                              for k, v in g.items())))
    return out


def write_report(cfg, res, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = res["curves"]
    js = {"curves": c, "observations": observations(res), "blend": res.get("blend", {}),
          "global": {k: {kk: vv for kk, vv in v.items() if kk != "final"}
                     for k, v in res.get("global", {}).items()},
          "patch_var_median": {k: float(np.median(v)) for k, v in res["patch_var"].items()},
          "et_energy": res.get("et_energy", {}),
          "config": {k: v for k, v in cfg.items()}}
    (out / "results.json").write_text(json.dumps(js, indent=1))

    styles = {"attractor[sphere]": ("C1", "-"), "attractor[layernorm]": ("C1", ":"),
              "attractor_pl": ("C3", "-."),
              "block": ("C0", "-"), "vit": ("C2", "--"), "et": ("C4", "-")}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, task in zip(axes, TASKS):
        for label, (col, ls) in styles.items():
            r = c.get(f"{label}/{task}")
            if r is None:
                continue
            m, s = np.asarray(r["mean"]), np.asarray(r["sem"])
            if label == "vit":
                ax.axhline(m[1], color=col, ls=ls, label="ViT, 5 layers (one pass)")
                continue
            t = np.arange(len(m))
            ax.plot(t, m, color=col, ls=ls, label={
                "attractor[sphere]": "bare self-attention (no backprop)",
                "attractor[layernorm]": "same, literal layer norm",
                "attractor_pl": "same, trained on the exact pseudo-likelihood",
                "block": "recurrent block (backprop)",
                "et": "Energy Transformer (backprop; t blocks of T steps)"}.get(label, label))
            ax.fill_between(t, m - 2 * s, m + 2 * s, color=col, alpha=0.15)
        bl = res.get("blend", {}).get(task)
        if bl is not None:
            ax.axhline(bl["mse"], color="0.5", ls=(0, (1, 2)),
                       label=f"blend {bl['a']:.2f}·input + {1 - bl['a']:.2f}·mean image")
        ax.set_title({"mask": f"masked prediction ({cfg['tasks']['mask_fraction']:.0%} "
                              f"{cfg['tasks']['mask_mode']})",
                      "noise": f"denoising (noise variance {cfg['tasks']['noise_variance']})"}[task])
        ax.set_xlabel("iteration t (t = 0: corrupted input)")
        ax.set_ylabel("test MSE per pixel")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "mse_vs_t.png", dpi=120)
    plt.close(fig)

    ex = res["examples"]
    rows = [k for k in ("attractor[sphere]/mask", "block/mask", "vit/mask", "et/mask",
                        "attractor[sphere]/noise", "block/noise", "vit/noise", "et/noise")
            if k in ex]
    if rows:
        k0 = rows[0]
        n = len(ex[k0]["clean"])
        fig, axes = plt.subplots(len(rows) * 2 + 1, n, figsize=(1.4 * n, 1.4 * (2 * len(rows) + 1)))
        for j in range(n):
            axes[0, j].imshow(ex[k0]["clean"][j], cmap="gray", vmin=0, vmax=1)
        axes[0, 0].set_ylabel("clean", fontsize=7)
        for r, k in enumerate(rows):
            for j in range(n):
                axes[1 + 2 * r, j].imshow(ex[k]["input"][j], cmap="gray", vmin=0, vmax=1)
                axes[2 + 2 * r, j].imshow(ex[k]["best"][j], cmap="gray", vmin=0, vmax=1)
            axes[1 + 2 * r, 0].set_ylabel(f"{k.split('/')[1]} input", fontsize=7)
            axes[2 + 2 * r, 0].set_ylabel(f"{k.split('/')[0]}\nt={c[k]['best_t']}", fontsize=7)
        for ax in axes.ravel():
            ax.set_xticks([])
            ax.set_yticks([])
        fig.tight_layout()
        fig.savefig(out / "reconstructions.png", dpi=120)
        plt.close(fig)

    pv = res["patch_var"]
    if pv:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        bins = np.linspace(-8, 0, 49)
        for k, v in pv.items():
            lv = np.log10(np.maximum(v, 1e-8))
            ax.hist(lv, bins=bins, histtype="step", weights=np.full(len(lv), 1.0 / len(lv)),
                    label=f"{k} (median {np.median(v):.1e}, "
                          f"{np.mean(v < 1e-4):.0%} below 1e-4)")
        ax.set_xlabel("log10 variance of the pixels within a 4×4 patch (masked task; "
                      "variances < 1e-8 in the first bin)", fontsize=8)
        ax.set_ylabel("fraction of patches")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "patch_variance.png", dpi=120)
        plt.close(fig)

    g = res.get("global")
    if g:
        fig = plt.figure(figsize=(12, 4.5))
        ax = fig.add_subplot(1, 3, 1)
        for k, v in g.items():
            ax.plot(v["mse_to_mean"], label=k)
        ax.set_xlabel("step t")
        ax.set_ylabel("MSE to the mean training image")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax2 = fig.add_subplot(1, 3, 2)
        ax2.imshow(res["mean_image"], cmap="gray", vmin=0, vmax=1)
        ax2.set_title("mean training image")
        ax2.axis("off")
        finals = np.concatenate([v["final"][:4] for v in g.values()], axis=0)
        grid = np.concatenate([np.concatenate(list(finals[i:i + 4]), axis=1)
                               for i in range(0, len(finals), 4)], axis=0)
        ax3 = fig.add_subplot(1, 3, 3)
        ax3.imshow(grid, cmap="gray", vmin=0, vmax=1)
        ax3.set_title("final states (rows: " + ", ".join(g) + ")", fontsize=8)
        ax3.axis("off")
        fig.tight_layout()
        fig.savefig(out / "global_attractor.png", dpi=120)
        plt.close(fig)

    ee = res.get("et_energy", {})
    if ee:
        fig, axes = plt.subplots(1, len(ee), figsize=(5.5 * len(ee), 4), squeeze=False)
        for ax, (task, en) in zip(axes[0], ee.items()):
            T = en["steps_per_block"]
            m, s = np.asarray(en["mean"]), np.asarray(en["sem"])
            k = np.arange(len(m))
            ax.plot(k, m, color="C4")
            ax.fill_between(k, m - 2 * s, m + 2 * s, color="C4", alpha=0.2)
            ax.axvline(T, color="0.5", ls=":", label=f"end of the trained descent ({T} steps)")
            ax.set_xlabel("descent step")
            ax.set_ylabel("energy per token", color="C4")
            ax.set_xscale("symlog", linthresh=T)
            r = c.get(f"et/{task}")
            if r is not None:
                ax2 = ax.twinx()
                mm = np.asarray(r["mean"])
                ax2.plot(np.arange(len(mm)) * T, mm, "o-", color="C0", ms=3)
                ax2.set_ylabel("test MSE per pixel (at each block's end)", color="C0")
            ax.set_title(f"Energy Transformer, {task}: images whose energy rose "
                         f"{en['images_rising']:.0%}", fontsize=9)
            ax.legend(fontsize=7, loc="upper center")
        fig.tight_layout()
        fig.savefig(out / "et_energy.png", dpi=120)
        plt.close(fig)

    ts = [0, 1, 2, 3, 5, 7, 10, 15, 20, 30]
    lines = [f"# {cfg.get('description', 'attractor experiment')}", "",
             "Test MSE per pixel (mean over "
             f"{cfg['data']['eval_size']} test images; ± is 2 standard errors over images) after t "
             "iterations; t = 0 is the corrupted input. `attractor[sphere]` is the bare "
             "self-attention net with x/‖x‖ after each step, `attractor[layernorm]` the same "
             "trained couplings with the paper's literal layer normalisation.", ""]
    for task in TASKS:
        lines += [f"## {task}", "",
                  "| model | epochs | " + " | ".join(f"t={t}" for t in ts) + " | best t | best MSE |",
                  "|---|---|" + "---|" * (len(ts) + 2)]
        for k, r in c.items():
            if not k.endswith("/" + task):
                continue
            m, s = r["mean"], r["sem"]
            cells = [f"{m[t]:.4f}" if t < len(m) else "" for t in ts]
            lines.append(f"| {k.split('/')[0]} | {r['epochs']} | " + " | ".join(cells)
                         + f" | {r['best_t']} | {m[r['best_t']]:.4f} ± {2 * s[r['best_t']]:.4f} |")
        lines.append("")
    lines += ["## The paper's observations", "", "| observation | measured |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in js["observations"]]
    lines.append("")
    (out / "attractor.md").write_text("\n".join(lines))
    return out


def main(argv=None):
    p = make_parser(__doc__, runs=None, results="attractor")
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--only", nargs="*", default=None, choices=MODELS,
                   help="train only these models")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.set)
    name = pathlib.Path(a.config).stem
    runs = pathlib.Path(a.runs or f"runs/attractor_{name}")
    results = pathlib.Path(a.results)
    images = load_images(cfg)

    def run(_):
        for m in a.only or models(cfg):
            st = train_model(cfg, m, images, runs, progress=not a.quiet)
            print(f"{m}: epoch {st['epoch']}/{st['epochs']}, {st['wall_s']:.0f} s, "
                  f"loss {st['loss'][-1] if st['loss'] else float('nan'):.5g}", flush=True)

    def report(_):
        out = write_report(cfg, evaluate(cfg, images, runs, progress=not a.quiet), results)
        print(f"report written to {out}")

    dispatch(a, run=run, report=report)
    return 0


if __name__ == "__main__":
    run_script(main)
