"""Checks that need several devices, run in a child process by tests/train/test_sharding.py.

The parent starts this with `XLA_FLAGS=--xla_force_host_platform_device_count=4` (the device
count is fixed when JAX starts, so it cannot be changed inside the pytest process). Each
check prints one JSON line; the parent asserts on them.

    python tests/train/sharding_worker.py CHECK [ARGS]
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import spinformer as sf
from spinformer import train
from spinformer.train import _mesh


def tiny_cfg(**changes):
    base = {
        "data.task": "brackets", "data.seq_len": 8, "data.batch_size": 8,
        "data.eval_batches": 2,
        "model.attention": "softmax", "model.dim": 16, "model.depth": 1, "model.num_heads": 2,
        "model.ffn_hidden": 32,
        "train.steps": 6, "train.warmup_steps": 2, "train.log_every": 1, "train.eval_every": 3,
        "train.checkpoint_every": 3, "train.progress": False,
    }
    base.update(changes)
    return sf.config.load_config(None, overrides=base)


def setup(cfg):
    """`(dataset, model, optimizer, state)`, `state` the `RunState` before the first step."""
    ds = train.build_dataset(cfg)
    model = train.build_model(cfg, ds, key=jax.random.key(0))
    opt = train.build_optimizer(cfg)
    return ds, model, opt, train.RunState.init(model, opt)


def max_diff(a, b) -> float:
    la = jax.tree.leaves(eqx.filter(a, eqx.is_inexact_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_inexact_array))
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(la, lb))


def check_step(mesh_spec, accumulate=1):
    """One sharded step vs the same step on one device: parameters, metrics, shardings."""
    cfg = tiny_cfg(**{"model.dim": 64, "model.ffn_hidden": 128, "train.warmup_steps": 0})
    ds, model, opt, state = setup(cfg)
    batch = ds.batch(0)
    key = jax.random.key(3)
    r1, met1 = train.jit_step(opt)(state, {k: jnp.asarray(v) for k, v in batch.items()}, key)
    mesh = _mesh.make_mesh(mesh_spec)
    r2, met2 = train.jit_step(opt, mesh=mesh)(_mesh.place_state(state, mesh),
                                              _mesh.shard_batch(batch, mesh), key)
    (m1, s1), (m2, s2) = (r1.model, r1.opt_state), (r2.model, r2.opt_state)
    assert int(r1.step) == int(r2.step) == 1
    moved = max_diff(model, m1)
    specs = sorted({str(x.sharding.spec) for x in jax.tree.leaves(eqx.filter(m2, eqx.is_array))})
    ndev = {len(x.sharding.device_set) for x in jax.tree.leaves(eqx.filter(m2, eqx.is_array))}
    print(json.dumps({
        "check": "step", "mesh": dict(mesh.shape), "param_diff": max_diff(m1, m2),
        "moved": moved,
        "opt_diff": max_diff(s1, s2),
        "loss": [float(met1["loss"]), float(met2["loss"])],
        "grad_norm": [float(met1["grad_norm"]), float(met2["grad_norm"])],
        "param_specs": specs, "devices_per_param": sorted(ndev),
    }))


def check_eval():
    """Evaluation over sharded batches equals the one-device evaluation (global metrics)."""
    cfg = tiny_cfg()
    ds, model, _, _ = setup(cfg)
    batches = [ds.batch(i, "val") for i in range(3)]
    single = train.evaluate(model, batches)
    mesh = _mesh.make_mesh({"data": 4})
    sharded = train.evaluate(_mesh.place_state(model, mesh),
                             [_mesh.shard_batch(b, mesh) for b in batches])
    print(json.dumps({"check": "eval", "single": single, "sharded": sharded}))


def check_resume(root):
    """A sharded run, and the same run resumed from its step-3 checkpoint: the step-6
    checkpoints must be byte-identical."""
    root = pathlib.Path(root)
    cfg = tiny_cfg(**{"train.mesh": {"data": 4}})
    train.run(cfg, root / "full")
    # the same run, cut back to its step-3 checkpoint, resumed
    shutil.copytree(root / "full", root / "cut")
    (root / "cut" / "ckpt-00000006.ckpt").unlink()
    (root / "cut" / "summary.json").unlink()
    train.run(cfg, root / "cut", resume=True)
    a = (root / "full" / "ckpt-00000006.ckpt").read_bytes()
    b = (root / "cut" / "ckpt-00000006.ckpt").read_bytes()
    header = lambda d: json.loads(d.split(b"\n")[1])  # noqa: E731
    # resumed on another mesh (2 devices instead of 4): allowed, equal to float tolerance
    shutil.copytree(root / "full", root / "remeshed")
    (root / "remeshed" / "ckpt-00000006.ckpt").unlink()
    (root / "remeshed" / "summary.json").unlink()
    train.run(cfg.replace({"train.mesh": {"data": 2}}), root / "remeshed", resume=True)
    _, model, _, state = setup(cfg)
    got = [train.read_checkpoint(root / d / "ckpt-00000006.ckpt", state)[0].model
           for d in ("full", "remeshed")]
    print(json.dumps({"check": "resume", "same_payload": header(a)["sha256"] ==
                      header(b)["sha256"], "sha": header(a)["sha256"][:12],
                      "remeshed_diff": max_diff(got[0], got[1]),
                      "moved": max_diff(model, got[0])}))


def check_accumulate():
    """accumulate=2 on batches of 4 equals one step on the batch of 8 (digits: every example
    has mask 1, so the mean over two micro-batches is the mean over the batch)."""
    cfg = tiny_cfg(**{"data.task": "digits", "data.batch_size": 8, "model.embed": "patch",
                      "model.patch": 2, "train.warmup_steps": 0})
    ds, model, opt, state = setup(cfg)
    full = ds.batch(0)
    halves = {k: np.stack([v[:4], v[4:]]) for k, v in full.items()}
    one = train.jit_step(opt)(state, {k: jnp.asarray(v) for k, v in full.items()})
    two = train.jit_step(opt, accumulate=2)(state,
                                            {k: jnp.asarray(v) for k, v in halves.items()})
    print(json.dumps({"check": "accumulate", "param_diff": max_diff(one[0].model, two[0].model),
                      "moved": max_diff(model, one[0].model),
                      "loss": [float(one[1]["loss"]), float(two[1]["loss"])]}))


def check_bfloat16():
    cfg = tiny_cfg(**{"model.dim": 32, "train.warmup_steps": 0})
    ds, model, opt, state = setup(cfg)
    batch = {k: jnp.asarray(v) for k, v in ds.batch(0).items()}
    (r32, met32), (r16, met16) = (train.jit_step(opt, precision=p)(state, batch)
                                  for p in ("float32", "bfloat16"))
    m32, m16 = r32.model, r16.model
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(eqx.filter(m16, eqx.is_inexact_array))})
    print(json.dumps({"check": "bfloat16", "loss": [float(met32["loss"]), float(met16["loss"])],
                      "param_diff": max_diff(m32, m16), "moved": max_diff(model, m32),
                      "dtypes": dtypes}))


def model_axis_cfg(checkpointer):
    return tiny_cfg(**{"model.dim": 64, "model.ffn_hidden": 128,
                       "train.mesh": {"data": 2, "model": 2},
                       "train.checkpointer": checkpointer})


def read_orbax(run_dir):
    """The initial model and `(step, state, meta)` of the newest orbax checkpoint of a
    `model_axis_cfg` run, on one device."""
    from spinformer.train import _orbax

    cfg = model_axis_cfg("orbax")
    _, model, _, state = setup(cfg)
    got, meta = _orbax.OrbaxCheckpoints(run_dir).restore_latest(state)
    return model, (int(got.step), got, meta)


def check_orbax(root):
    """A run with the large matrices split over a `model` axis, checkpointed by orbax, and the
    same run resumed from its step-3 checkpoint: identical at step 6; `load_run` reads it."""
    root = pathlib.Path(root)
    cfg = model_axis_cfg("orbax")
    train.run(cfg, root / "orbax_full")
    shutil.copytree(root / "orbax_full", root / "orbax_cut")
    shutil.rmtree(root / "orbax_cut" / "orbax" / "6")
    (root / "orbax_cut" / "summary.json").unlink()
    train.run(cfg, root / "orbax_cut", resume=True)
    init, (s_a, r_a, meta_a) = read_orbax(root / "orbax_full")
    _, (s_b, r_b, meta_b) = read_orbax(root / "orbax_cut")
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(
        jax.tree.leaves(eqx.filter(r_a, eqx.is_array)),
        jax.tree.leaves(eqx.filter(r_b, eqx.is_array))))
    m_a = r_a.model
    _, _, loaded = train.load_run(root / "orbax_full")
    print(json.dumps({"check": "orbax", "steps": [s_a, s_b], "identical": same,
                      "moved": max_diff(init, m_a), "load_run_diff": max_diff(loaded, m_a),
                      "kept": sorted(p.name for p in (root / "orbax_full" / "orbax").iterdir()
                                     if p.name.isdigit()),
                      "native_files": sorted(p.name for p in (root / "orbax_full").glob(
                          "ckpt-*"))}))


def check_multiprocess(rank, port, root, variant="data"):
    """One of two processes (2 devices each) training over a 4-device mesh that spans both;
    process 0 writes the run directory. `variant` "data": the `resume` check's config,
    replicated parameters (`root/mp`); "model": the large matrices split over a model axis
    that spans both processes, checkpointed by orbax (`root/mp_model`)."""
    _mesh.initialize_distributed(f"127.0.0.1:{port}", 2, int(rank))
    if variant == "data":
        cfg, out = tiny_cfg(**{"train.mesh": {"data": 4}}), pathlib.Path(root) / "mp"
    else:
        cfg, out = model_axis_cfg("auto"), pathlib.Path(root) / "mp_model"
    summary = train.run(cfg, out)
    print(json.dumps({"check": "multiprocess", "rank": int(rank), "devices": jax.device_count(),
                      "local": jax.local_device_count(), "val_loss": summary["metrics"]["loss"],
                      "wrote": (out / "summary.json").exists()}))


def compare_orbax(a, b):
    init, got_a = read_orbax(a)
    _, got_b = read_orbax(b)
    print(json.dumps({"check": "compare_orbax", "steps": [got_a[0], got_b[0]],
                      "param_diff": max_diff(got_a[1].model, got_b[1].model),
                      "moved": max_diff(init, got_a[1].model)}))


def compare(a, b):
    """Largest parameter difference between the step-6 checkpoints of two run directories."""
    cfg = tiny_cfg()
    _, model, opt, state = setup(cfg)
    got = [train.read_checkpoint(pathlib.Path(d) / "ckpt-00000006.ckpt", state)[0].model
           for d in (a, b)]
    print(json.dumps({"check": "compare", "param_diff": max_diff(got[0], got[1]),
                      "moved": max_diff(model, got[0])}))


if __name__ == "__main__":
    name, *rest = sys.argv[1:]
    if name == "local":  # every single-process check, sharing one JAX start
        check_step({"data": 4})
        check_step({"data": 2, "model": 2})
        check_eval()
        check_accumulate()
        check_bfloat16()
    elif name == "step":
        check_step(json.loads(rest[0]))
    elif name == "eval":
        check_eval()
    elif name == "resume":
        check_resume(rest[0])
    elif name == "accumulate":
        check_accumulate()
    elif name == "bfloat16":
        check_bfloat16()
    elif name == "multiprocess":
        check_multiprocess(*rest)
    elif name == "compare":
        compare(*rest)
    elif name == "orbax":
        check_orbax(rest[0])
    elif name == "compare_orbax":
        compare_orbax(*rest)
    else:
        raise SystemExit(f"unknown check {name!r}")
