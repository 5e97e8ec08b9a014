import hashlib
import io
import json
import pathlib
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import config as C
from spinformer import data, nn, solvers, train

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tiny_cfg(**over):
    base = {
        "model.attention": "softmax", "model.dim": "16", "model.ffn_hidden": "16",
        "data.seq_len": "8", "data.batch_size": "8", "data.eval_batches": "2",
        "train.steps": "12", "train.log_every": "2", "train.eval_every": "4",
        "train.warmup_steps": "2", "train.progress": "false",
    }
    base.update(over)
    return C.load_config(None, [f"{k}={v}" for k, v in base.items()])


def _leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def test_make_step_learns_and_groups():
    ds = data.BracketMatching(seq_len=8, batch_size=16, seed=0)
    model = nn.Tagger(ds.vocab_size, ds.num_classes, 16, 1, causal=True, ffn_hidden=16,
                      key=jax.random.key(0))
    labels = jax.tree.leaves(nn.param_labels(eqx.filter(model, eqx.is_inexact_array)))
    assert labels.count("couplings") == 2 and labels.count("default") > 2
    # couplings frozen (lr 0): only they stay put
    opt = train.make_optimizer(steps=20, lr=3e-2, coupling_lr=0.0)
    state = train.RunState.init(model, opt)
    batch = {k: jnp.asarray(v) for k, v in ds.batch(0).items()}
    first = None
    for _ in range(20):
        state, metrics = train.make_step(state, batch, optimizer=opt)
        first = float(metrics["loss"]) if first is None else first
    assert float(metrics["loss"]) < first - 0.3 and int(state.step) == 20
    m = state.model
    attn0 = model.transformer.blocks.attention
    attn1 = m.transformer.blocks.attention
    np.testing.assert_array_equal(attn0.to_q.weight, attn1.to_q.weight)
    assert not np.array_equal(attn0.to_v.weight, attn1.to_v.weight)
    ev = train.evaluate(m, [ds.batch(0)])
    assert set(ev) >= {"loss", "accuracy", "perplexity"} and 0 <= ev["accuracy"] <= 1


def test_step_key_is_explicit_and_compiles_once(tmp_path):
    traces = []  # one entry per trace of the model: was it called with a key?

    class Counted(eqx.Module):
        inner: eqx.Module

        def __call__(self, x, *, key=None, return_diagnostics=False):
            traces.append(key is not None)
            return self.inner(x, key=key, return_diagnostics=return_diagnostics)

    cfg = _tiny_cfg(**{"model.dropout": "0.5", "train.steps": "6", "train.eval_every": "3"})
    ds = train.build_dataset(cfg)
    model = Counted(train.build_model(cfg, ds, key=jax.random.key(0)))
    opt = train.build_optimizer(cfg)
    train.fit(model, ds, cfg.train, out_dir=tmp_path)
    assert traces.count(True) == 1  # six training steps, one trace
    # the key decides the dropout mask: same key, same step; another key, another step
    step = train.jit_step(opt)
    state = train.RunState.init(model, opt)
    batch = {k: jnp.asarray(v) for k, v in ds.batch(0).items()}
    k0, k1 = jax.random.key(1), jax.random.key(2)
    a, b, c = (float(step(state, batch, k)[1]["loss"]) for k in (k0, k0, k1))
    assert a == b and a != c
    assert traces.count(True) == 2


def test_divergence_skips_then_stops_naming_the_checkpoint(tmp_path):
    cfg = _tiny_cfg(**{"train.lr": "1e38", "train.warmup_steps": "0", "train.log_every": "1",
                       "train.checkpoint_every": "1", "train.steps": "8",
                       "train.max_bad_steps": "3"})
    with pytest.raises(FloatingPointError, match=r"diverged at step (\d+): 3 steps in a row.*"
                       r"ckpt-0000000\1.*skipped steps changed nothing.*Lower"):
        train.run(cfg, tmp_path)
    recs = [r for r in train.read_metrics(tmp_path) if r["split"] == "train"]
    bad = [r["bad_step"] for r in recs]
    assert bad[-3:] == [1.0, 1.0, 1.0] and recs[-1]["bad_steps"] == sum(bad)
    # the three kept checkpoints are those of the three skipped steps: the same finite state
    # (parameters and optimiser state unchanged by a skipped step)
    ds = train.build_dataset(cfg)
    like = train.build_model(cfg, ds, key=jax.random.key(0))
    like = train.RunState.init(like, train.build_optimizer(cfg))
    got = [train.read_checkpoint(p, like) for _, p in train.list_checkpoints(tmp_path)]
    assert len(got) == 3 and got[-1][1]["bad_steps"] == recs[-1]["bad_steps"]
    # (the step counts the skipped steps: the data position advanced)
    assert [int(s.step) for s, _ in got] == [s for s, _ in train.list_checkpoints(tmp_path)]
    states = [jax.tree.leaves(eqx.filter((s.model, s.opt_state), eqx.is_array))
              for s, _ in got]
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in states[-1] if x.dtype.kind == "f")
    for other in states[:-1]:
        assert all(bool(jnp.array_equal(a, b)) for a, b in zip(other, states[-1]))


def test_solver_statistics_per_layer(tmp_path):
    cfg = _tiny_cfg(**{"model.attention": "spin", "model.depth": "2", "model.attention.solver.max_steps": "8",
                       "train.steps": "2", "train.log_every": "1", "train.eval_every": "2"})
    s = train.run(cfg, tmp_path)
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    per_layer = {f"{name}/{i}" for name in ("solver_steps", "solver_failures") for i in (0, 1)}
    for r in records:
        assert set(r) >= per_layer | {"solver_steps", "solver_failures"}
        assert 0 <= r["solver_failures/1"] <= 1 and 1 <= r["solver_steps/0"] <= 8
        layers = (r["solver_steps/0"] + r["solver_steps/1"]) / 2
        assert abs(layers - r["solver_steps"]) < 1e-4 * r["solver_steps"]
    assert set(s["metrics"]) >= per_layer
    # the backward solves (recorded on the adjoint's probe) are logged, and kept out of the
    # update: the probe's cotangent never reaches the optimizer
    train_recs = [r for r in records if r["split"] == "train"]
    assert all({"backward_steps/0", "backward_steps/1"} <= set(r) for r in train_recs)
    ds = train.build_dataset(cfg)
    like = train.build_model(cfg, ds, key=jax.random.key(0))
    like = train.RunState.init(like, train.build_optimizer(cfg))
    trained = train.load_latest(tmp_path, like)[0].model
    is_implicit = lambda x: isinstance(x, solvers.Implicit)  # noqa: E731
    probes = [x.probe for x in jax.tree.leaves(trained, is_leaf=is_implicit) if is_implicit(x)]
    assert probes and all(not np.any(np.asarray(p)) for p in probes)
    assert (tmp_path / "solver_steps.png").exists()
    table = train.report([tmp_path])
    assert f"({s['metrics']['solver_steps/0']:.1f} / {s['metrics']['solver_steps/1']:.1f})" in table
    assert (tmp_path / "report_solver_steps.png").exists()


def test_schedule_warmup_cosine():
    s = train.make_schedule(1.0, steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert float(s(0)) == 0.0 and abs(float(s(10)) - 1.0) < 1e-6
    assert abs(float(s(100)) - 0.1) < 1e-6 and float(s(50)) < 1.0


def test_checkpoints_atomic_keep_and_corrupt(tmp_path):
    model = nn.SoftmaxAttention(8, 2, key=jax.random.key(0))
    opt = train.make_optimizer(steps=10, lr=1e-3)
    like = train.RunState.init(model, opt)
    for step in (2, 4, 6, 8):
        bumped = jax.tree.map(lambda x: x + step if eqx.is_inexact_array(x) else x, model)
        train.save_checkpoint(tmp_path, train.RunState(bumped, like.opt_state, step=step),
                              {"data_position": step}, keep=3)
    assert [s for s, _ in train.list_checkpoints(tmp_path)] == [4, 6, 8]
    got, meta = train.load_latest(tmp_path, like)
    assert int(got.step) == 8 and meta["data_position"] == 8
    np.testing.assert_allclose(got.model.to_q.weight, model.to_q.weight + 8)
    # truncate the newest: the previous one is used, with a warning
    p8 = train.list_checkpoints(tmp_path)[-1][1]
    p8.write_bytes(p8.read_bytes()[:-10])
    with pytest.warns(UserWarning, match="truncated"):
        got, _ = train.load_latest(tmp_path, like)
    assert int(got.step) == 6
    # flip one payload byte of the next: checksum mismatch
    p6 = train.list_checkpoints(tmp_path)[-2][1]
    raw = bytearray(p6.read_bytes())
    raw[-5] ^= 0xFF
    p6.write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got, _ = train.load_latest(tmp_path, like)
    assert int(got.step) == 4 and any("checksum" in str(x.message) for x in w)


def _write_v1_checkpoint(directory, step, payload_tree, meta):
    """A checkpoint file as version 1 wrote it: magic `SPINFORMER-CKPT 1`, a JSON header
    with the step, then `eqx.tree_serialise_leaves` of a tuple (no `RunState`)."""
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, payload_tree)
    payload = buf.getvalue()
    header = {"step": step, "meta": meta, "payload_bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest()}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{step:08d}.ckpt"
    path.write_bytes(b"SPINFORMER-CKPT 1\n" + json.dumps(header).encode() + b"\n" + payload)
    return path


def test_version_1_checkpoints_are_refused_saying_so(tmp_path):
    """The first format (a `(model, opt_state)` payload, the step in the header), written for
    a few days before the run state held the step, is no longer read: a clear refusal."""
    model = nn.SoftmaxAttention(8, 2, key=jax.random.key(0))
    like = train.RunState.init(model, train.make_optimizer(steps=10, lr=1e-3))
    path = _write_v1_checkpoint(tmp_path / "old", 5, (model, like.opt_state), {})
    with pytest.raises(train.CorruptCheckpoint, match="a version 1 checkpoint"):
        train.read_checkpoint(path, like)
    with pytest.raises(train.CorruptCheckpoint, match="no checkpoint there can be read"):
        train.load_latest(tmp_path / "old", like)

def test_kill_and_resume_equals_uninterrupted(tmp_path, monkeypatch):
    cfg = _tiny_cfg(**{"train.checkpoint_every": "4", "model.dropout": "0.1"})
    full = train.run(cfg, tmp_path / "full")

    class Killed(Exception):
        pass

    real_batch = data.BracketMatching.batch

    def dying_batch(self, index, split="train"):
        if split == "train" and index == 9:
            raise Killed()
        return real_batch(self, index, split)

    monkeypatch.setattr(data.BracketMatching, "batch", dying_batch)
    with pytest.raises(Killed):
        train.run(cfg, tmp_path / "cut")
    assert [s for s, _ in train.list_checkpoints(tmp_path / "cut")] == [4, 8]
    monkeypatch.setattr(data.BracketMatching, "batch", real_batch)
    resumed = train.run(cfg, tmp_path / "cut", resume=True)

    assert resumed["steps"] == full["steps"] == 12
    assert resumed["metrics"] == full["metrics"]
    ds = train.build_dataset(cfg)
    model = train.build_model(cfg, ds, key=jax.random.key(0))
    like = train.RunState.init(model, train.build_optimizer(cfg))
    a, _ = train.load_latest(tmp_path / "full", like)
    b, _ = train.load_latest(tmp_path / "cut", like)
    assert int(a.step) == int(b.step) == 12
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)  # bitwise

    def strip(path):
        return [{k: v for k, v in json.loads(l).items() if k != "time_s"}
                for l in path.read_text().splitlines()]

    assert strip(tmp_path / "full" / "metrics.jsonl") == strip(tmp_path / "cut" / "metrics.jsonl")
    # a changed config is refused by name
    with pytest.raises(C.ConfigError, match="train.lr"):
        train.run(cfg.replace({"train.lr": 0.5}), tmp_path / "cut", resume=True)


def test_early_stopping_and_outputs(tmp_path):
    cfg = _tiny_cfg(**{"train.lr": "1e-12", "train.patience": "1", "train.steps": "40"})
    s = train.run(cfg, tmp_path)
    assert s["stopped_early"] and s["steps"] == 8  # evals at 4 (best) and 8 (no better)
    assert set(s["metrics"]) >= {"loss", "accuracy"}
    assert set(s["baselines"]) == {"chance_accuracy", "nearest_open_accuracy"}
    for name in ("summary.json", "metrics.jsonl", "config.yaml", "loss.png", "accuracy.png"):
        assert (tmp_path / name).exists()
    assert C.load_config(tmp_path / "config.yaml") == cfg
    table = train.report([tmp_path])
    assert "accuracy" in table and (tmp_path / "report_loss.png").exists()


def test_report_names_each_attention_by_what_sets_it_apart():
    """The report's attention column: the attention's name, and where runs of the same
    attention differ, those settings (not the whole settings dict)."""
    from spinformer.train._report import attention_labels

    spin = {"name": "spin", "beta": 2.0, "adjoint": {"name": "implicit", "rtol": 1e-3}}
    runs = [{"model": {"attention": spin}},
            {"model": {"attention": {**spin, "adjoint": {"name": "onestep"}}}},
            {"model": {"attention": {**spin, "beta": 1.0, "solver": {"name": "picard"},
                                     "adjoint": {"name": "shine"}}}},
            {"model": {"attention": {"name": "softmax"}}}, {}]
    assert attention_labels(runs, most=2) == [
        "spin (adjoint.name: implicit, adjoint.rtol: 0.001, …)",
        "spin (adjoint.name: onestep, beta: 2.0)", "spin (adjoint.name: shine, beta: 1.0, …)",
        "softmax", "?"]
    assert attention_labels(runs[:2]) == ["spin (adjoint.name: implicit, adjoint.rtol: 0.001)",
                                          "spin (adjoint.name: onestep)"]
    assert attention_labels(runs[:1]) == ["spin"]


def test_solver_steps_figure_draws_counted_backward_products(tmp_path, monkeypatch):
    from spinformer.train import _figures

    figures = []
    real = _figures._Figures.subplots

    def spy(*args, **kwargs):  # keep every figure the run draws, to look at it
        fig, axes = real(*args, **kwargs)
        figures.append(fig)
        return fig, axes

    monkeypatch.setattr(_figures._Figures, "subplots", staticmethod(spy))
    recs = [{"step": s, "split": "train", "loss": 1.0, "accuracy": 0.5, "solver_steps/0": 8.0,
             "solver_steps/1": 9.0, "backward_steps/0": 12.0, "backward_steps/1": -1.0}
            for s in (10, 20)]
    paths = _figures.plot_run(recs, tmp_path)
    assert (tmp_path / "solver_steps.png") in paths
    drawn = [line.get_label() for fig in figures for ax in fig.axes for line in ax.get_lines()]
    # layer 0 counts its backward products, layer 1's linear solver does not (-1): not drawn
    assert "layer 0 backward products" in drawn
    assert not any(label.startswith("layer 1 backward") for label in drawn)
    assert "layer 1 train" in drawn


def test_run_figures_name_the_run_show_percent_and_baselines(tmp_path, monkeypatch):
    """The accuracy figure is in %, headed by the run's name, with the dataset's reference
    accuracies (chance, ...) as lines; skipped steps are marked."""
    from spinformer.train import _figures

    drawn = []
    monkeypatch.setattr(_figures._Figures, "close", staticmethod(drawn.append))
    recs = [{"step": 10, "split": "train", "loss": 2.0, "accuracy": 0.30, "bad_steps": 0},
            {"step": 20, "split": "train", "loss": 1.5, "accuracy": 0.50, "bad_steps": 2},
            {"step": 20, "split": "val", "loss": 1.6, "accuracy": 0.45}]
    _figures.plot_run(recs, tmp_path, title="my_run", baselines={"chance_accuracy": 0.25,
                                                                 "note": 3.0})
    acc = next(f.axes[0] for f in drawn if f.axes[0].get_ylabel() == "accuracy (%)")
    assert acc.get_title() == "my_run"
    ys = {round(float(y), 6) for line in acc.get_lines() for y in line.get_ydata()}
    assert {30.0, 50.0, 45.0, 25.0} <= ys  # the runs in %, chance at 25 %
    labels = [line.get_label() for line in acc.get_lines()]
    assert "chance" in labels and any("skipped" in lab for lab in labels)


def _tensorboard_events(log_dir):
    """`(scalars {(tag, step): value}, image tags)` of the event files in `log_dir`, read
    with the TFRecord framing (length, CRC, payload, CRC) and tensorboardX's protobufs."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars, images = {}, set()
    for path in sorted(pathlib.Path(log_dir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                if v.HasField("image"):
                    images.add(v.tag)
                else:
                    scalars[(v.tag, event.step)] = v.simple_value
    return scalars, images


def test_tensorboard_scalars_match_metrics_jsonl(tmp_path):
    """`train.tensorboard: true` writes every metric of every metrics.jsonl record as the
    scalar `<split>/<metric>` at its step, and the run's figures as images."""
    pytest.importorskip("tensorboardX")
    cfg = C.load_config(ROOT / "configs" / "brackets_hopfield.yaml", overrides=[
        "train.steps=4", "train.log_every=1", "train.eval_every=2", "train.warmup_steps=1",
        "train.progress=false", "train.tensorboard=true", "data.batch_size=4",
        "data.eval_batches=1", "data.seq_len=6", "model.dim=6", "model.ffn_hidden=8"])
    train.run(cfg, tmp_path / "run")
    scalars, images = _tensorboard_events(tmp_path / "run" / "tensorboard")
    records = train.read_metrics(tmp_path / "run")
    expected = {(f"{r['split']}/{k}", r["step"]): v for r in records for k, v in r.items()
                if k not in ("step", "split", "time_s") and isinstance(v, (int, float))}
    assert {"train/loss", "val/accuracy", "train/solver_steps/0",
            "val/solver_steps/0", "train/lr"} <= {t for t, _ in expected}
    assert set(scalars) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(scalars[key], value, rtol=1e-6, atol=1e-30, err_msg=key)
    assert {"figures/loss", "figures/accuracy", "figures/solver_steps"} <= images


def test_fit_takes_the_training_options_as_one_object(tmp_path):
    """`fit`'s training options are one `TrainConfig`, whose defaults are `fit`'s: no keyword
    of `fit` repeats one of its fields. Counting FLOPs needs the step's count, said before
    anything is written."""
    import dataclasses
    import inspect

    params = inspect.signature(train.fit).parameters
    assert params["options"].default == C.TrainConfig()
    assert not {f.name for f in dataclasses.fields(C.TrainConfig)} & (set(params) - {"options"})
    cfg = _tiny_cfg(**{"train.count_flops": "true"})
    with pytest.raises(ValueError, match="flops=step_flops"):
        train.fit(None, train.build_dataset(cfg), cfg.train, out_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
