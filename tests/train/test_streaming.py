"""Streaming (the attention's state carried across consecutive chunks of a text, truncated
history), entropy production as a loss term, and per-layer local losses with detached blocks."""

import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import config as C
from spinformer import data, nn, train
from spinformer.train import _figures, _loop

ROOT = pathlib.Path(__file__).parents[2]
TEXT = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 40
T, B, DIM, DEPTH = 8, 4, 16, 2
SPIN = dict(update="mean_field", mode="steps", num_steps=1, init="carried")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


@pytest.fixture(scope="module")
def stream():
    return data.CharText(TEXT, seq_len=T, batch_size=B, stream=True)


@pytest.fixture(scope="module")
def model(stream):
    return nn.CausalLM(stream.vocab_size, DIM, DEPTH, num_heads=2, max_len=T, ffn_hidden=16,
                       attention="spin", attention_kwargs=SPIN, key=jax.random.key(0))


def _device(batch):
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _ce(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# ------------------------------------------------------------------------------- the data


def test_stream_batches_are_contiguous_and_wrap_with_a_reset():
    ds = data.CharText(TEXT, seq_len=T, batch_size=B, stream=True)
    for split, text in (("train", ds.train_data), ("val", ds.val_data)):
        n = ds.chunks(split)
        length = len(text) // B
        assert n == (length - 1) // T >= 2
        batches = [ds.batch(i, split) for i in range(n + 2)]
        # row b of consecutive batches reads stream b in order, targets one character on
        rows = np.concatenate([b["inputs"] for b in batches[:n]], axis=1)
        targets = np.concatenate([b["targets"] for b in batches[:n]], axis=1)
        for b in range(B):
            np.testing.assert_array_equal(rows[b], text[b * length: b * length + n * T])
            np.testing.assert_array_equal(targets[b], text[b * length + 1: b * length + n * T + 1])
        # after the last chunk every stream starts again, flagged so the state is reset
        assert [bool(b["start"].all()) for b in batches] == [True] + [False] * (n - 1) + [True, False]
        assert all(b["start"].any() == b["start"].all() for b in batches)
        np.testing.assert_array_equal(batches[n]["inputs"], batches[0]["inputs"])
        np.testing.assert_array_equal(batches[n + 1]["targets"], batches[1]["targets"])
    # deterministic, and the same data as the windows of a non-streaming dataset
    again = data.CharText(TEXT, seq_len=T, batch_size=B, stream=True, seed=5)
    np.testing.assert_array_equal(again.batch(3)["inputs"], ds.batch(3)["inputs"])
    assert "start" not in data.CharText(TEXT, seq_len=T, batch_size=B).batch(0)
    with pytest.raises(ValueError, match=r"batch_size \* \(seq_len \+ 1\).*smaller batch_size"):
        data.CharText(TEXT[:400], seq_len=T, batch_size=16, stream=True)


# ------------------------------------------------------------------------ the carried state


@eqx.filter_jit
def _manual(model, tokens, state):
    """Logits and next state of a batch through `Transformer(state=...)` and the readout."""
    def one(x, s):
        h, diag = model.transformer(x, state=s, return_diagnostics=True)
        return jax.vmap(model.readout)(h), diag.state

    return jax.vmap(one)(tokens, state)


def test_state_reaches_the_attention_and_no_gradient_flows_back(stream, model):
    b0, b1 = _device(stream.batch(0)), _device(stream.batch(1))
    zeros = train.init_stream_state(model, b0)
    assert zeros.shape == (B, DEPTH, T, DIM) and not np.any(zeros)
    # the training step carries diagnostics.state out; it equals two calls by hand
    opt = train.make_optimizer(steps=10, lr=1e-2)
    step = train.jit_step(opt)
    r1, met0 = step(train.RunState.init(model, opt, stream=zeros), b0)
    m1, s1 = r1.model, r1.stream
    logits0, want_s1 = _manual(model, b0["inputs"], zeros)
    np.testing.assert_allclose(s1, want_s1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(met0["loss"], _ce(logits0, b0["targets"]), rtol=1e-5)
    r2, met1 = step(r1, b1)
    s2 = r2.stream
    logits1, want_s2 = _manual(m1, b1["inputs"], s1)
    np.testing.assert_allclose(met1["loss"], _ce(logits1, b1["targets"]), rtol=1e-5)
    np.testing.assert_allclose(s2, want_s2, rtol=1e-5, atol=1e-6)
    # the state matters: chunk 1 from zeros gives other logits
    fresh, _ = _manual(m1, b1["inputs"], zeros)
    assert float(jnp.max(jnp.abs(fresh - logits1))) > 1e-3
    # ... and a batch that starts its streams resets it to zeros ("no history")
    restart = {**b1, "start": jnp.ones((B,), bool)}
    s_restart = step(train.RunState.init(model, opt, stream=s1), restart)[0].stream
    np.testing.assert_allclose(s_restart, _manual(model, b1["inputs"], zeros)[1], rtol=1e-5,
                               atol=1e-6)

    # truncated history: the state handed on carries no gradient into the previous chunk
    def chained(m):  # chunk 1's loss, its state taken from loss_fn on chunk 0 in the graph
        _, (_, s) = train.loss_fn(m, b0, state=zeros)
        return train.loss_fn(m, b1, state=s)[0]

    def constant(m):  # chunk 1's loss from the state of chunk 0 as a constant
        return train.loss_fn(m, b1, state=want_s1)[0]

    def through(m):  # full backpropagation through both chunks (what streaming does not do)
        logits, _ = _manual(m, b1["inputs"], _manual(m, b0["inputs"], zeros)[1])
        return _ce(logits, b1["targets"])

    grads = eqx.filter_jit(lambda m: [eqx.filter_grad(f)(m) for f in (chained, constant,
                                                                      through)])(model)
    g_chained, g_constant, g_through = (_leaves(g) for g in grads)
    for a, b in zip(g_chained, g_constant):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(g_chained, g_through)) > 1e-4

    # validation carries its own state through consecutive chunks, from zeros
    got = train.evaluate(model, [stream.batch(i, "val") for i in range(2)], stream=True)
    v0, v1 = _device(stream.batch(0, "val")), _device(stream.batch(1, "val"))
    l0, s = _manual(model, v0["inputs"], zeros)
    l1, _ = _manual(model, v1["inputs"], s)
    want = (_ce(l0, v0["targets"]) + _ce(l1, v1["targets"])) / 2
    np.testing.assert_allclose(got["loss"], float(want), rtol=1e-5)
    assert set(got) >= {"entropy_production", "entropy_production/0", "entropy_production/1"}


def test_step_maps_a_run_state_to_the_next_in_both_modes(stream, model):
    """`jit_step` returns `(state, metrics)` with or without a carried stream state, and
    counts the step; a skipped (non-finite) step counts too."""
    opt = train.make_optimizer(steps=10, lr=1e-2)
    step = train.jit_step(opt)
    b0 = _device(stream.batch(0))
    for carried in (None, train.init_stream_state(model, b0)):
        out = step(train.RunState.init(model, opt, stream=carried), b0)
        assert len(out) == 2
        state, metrics = out
        assert isinstance(state, train.RunState) and "loss" in metrics
        assert state.step.dtype == jnp.int32 and int(state.step) == 1
        assert (state.stream is None) == (carried is None)
        if carried is not None:
            assert state.stream.shape == carried.shape
        state, _ = step(state, b0)
        assert int(state.step) == 2
    # make_step likewise
    state, metrics = train.make_step(train.RunState.init(model, opt), b0, optimizer=opt)
    assert int(state.step) == 1 and "loss" in metrics
    # a skipped step leaves model and optimiser state, and advances the step
    broken = jax.tree.map(lambda x: x * jnp.inf if eqx.is_inexact_array(x) else x, model)
    start = train.RunState.init(broken, opt)
    skipped, metrics = step(start, b0)
    assert float(metrics["bad_step"]) == 1.0 and int(skipped.step) == 1
    for x, y in zip(_leaves((start.model, start.opt_state)),
                    _leaves((skipped.model, skipped.opt_state))):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------- entropy production and local


def test_entropy_weight_adds_its_term_with_the_sign_given(stream, model):
    batch = _device(data.CharText(TEXT, seq_len=T, batch_size=B).batch(0))
    w = 0.5
    objectives = [train.Objective(entropy_weight=x) for x in (0.0, w, -w)]

    @eqx.filter_jit
    def all_grads(m):
        return [eqx.filter_value_and_grad(
            lambda m, o=o: train.loss_fn(m, batch, objective=o), has_aux=True)(m)
            for o in objectives]

    ((l0, met0), g0), ((lp, metp), gp), ((lm, metm), gm) = all_grads(model)
    sigma = float(met0["entropy_production"])
    per_layer = [float(met0[f"entropy_production/{i}"]) for i in range(DEPTH)]
    assert sigma != 0
    np.testing.assert_allclose(sigma, sum(per_layer), rtol=1e-6)
    # the loss is the cross-entropy plus w * sigma; `loss` in the metrics stays the CE
    assert float(l0) == float(met0["loss"]) == float(metp["loss"])
    np.testing.assert_allclose(float(lp), float(met0["loss"]) + w * sigma, rtol=1e-6)
    np.testing.assert_allclose(float(lm), float(met0["loss"]) - w * sigma, rtol=1e-6)
    # the entropy term's gradient flips with the sign of the weight
    plus = [p - z for p, z in zip(_leaves(gp), _leaves(g0))]
    minus = [m - z for m, z in zip(_leaves(gm), _leaves(g0))]
    assert max(float(np.max(np.abs(p))) for p in plus) > 1e-4
    for p, m in zip(plus, minus):
        np.testing.assert_allclose(p, -m, rtol=1e-3, atol=1e-6)


def test_local_losses_train_each_block_from_its_own_readout(stream):
    batch = _device(data.CharText(TEXT, seq_len=T, batch_size=B).batch(0))
    objective = train.Objective(local_losses=True)
    detached, attached = (
        nn.CausalLM(stream.vocab_size, DIM, DEPTH, num_heads=2, max_len=T, ffn_hidden=16,
                    attention="spin", attention_kwargs=SPIN, detach_layers=d,
                    key=jax.random.key(1))
        for d in (True, False))

    def layer_loss(i):
        return lambda m: train.loss_fn(m, batch, objective=objective)[1][f"local_loss/{i}"]

    @eqx.filter_jit
    def grads(a, b):
        return ([eqx.filter_grad(layer_loss(i))(a) for i in range(DEPTH)],
                eqx.filter_grad(layer_loss(1))(b),
                train.loss_fn(a, batch, objective=objective))

    per_layer, through_stack, (value, metrics) = grads(detached, attached)

    def block(g, i):  # block i's gradients (the blocks' parameters are stacked)
        return [x[i] for x in _leaves(g.transformer.blocks)]

    for i in range(DEPTH):
        for j in range(DEPTH):
            size = max(float(np.max(np.abs(x))) for x in block(per_layer[i], j))
            if i == j:
                assert size > 1e-4, f"layer {i}'s loss does not move block {i}"
            else:
                assert size == 0.0, f"layer {i}'s loss reaches block {j}"
    # layer 1's loss reaches the embeddings only through block 0: not at all once detached
    assert not np.any(_leaves(per_layer[1].transformer.embed)[0])
    assert np.any(_leaves(per_layer[0].transformer.embed)[0])
    # without detaching, the last layer's loss trains the first block too
    assert max(float(np.max(np.abs(x))) for x in block(through_stack, 0)) > 1e-4
    # the objective is the sum of the layers' losses; loss and accuracy are the last layer's
    local = [float(metrics[f"local_loss/{i}"]) for i in range(DEPTH)]
    np.testing.assert_allclose(float(value), sum(local), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["loss"]), local[-1], rtol=1e-5)
    assert float(metrics["accuracy"]) == float(metrics[f"local_accuracy/{DEPTH - 1}"])


# ------------------------------------------------------------------- runs, resume, figures


def _cfg(path, **changes) -> C.Config:
    """configs/shakespeare_stream.yaml shrunk to seconds, on a small text file."""
    base = {
        "data.path": str(path), "data.batch_size": B, "data.seq_len": T,
        "data.eval_batches": 2, "model.dim": DIM, "model.num_heads": 2, "model.depth": DEPTH,
        "model.ffn_hidden": 16, "model.dropout": 0.1, "train.steps": 6, "train.log_every": 1,
        "train.eval_every": 3, "train.checkpoint_every": 2, "train.warmup_steps": 1,
        "train.progress": False, "train.entropy_weight": 0.01, "train.local_losses": True,
    }
    if changes.get("data.task", "chars") != "chars":
        del base["data.path"]  # another task reads no text file
    return C.load_config(ROOT / "configs" / "shakespeare_stream.yaml", {**base, **changes})


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


def test_stream_run_resumes_bit_identically_with_per_layer_metrics(tmp_path, text_file,
                                                                   monkeypatch):
    cfg = _cfg(text_file)
    steps, real_jit_step = {}, _loop.jit_step

    def shared_jit_step(optimizer, **kwargs):  # one compiled step for the three runs
        key = tuple(sorted(kwargs.items()))
        return steps.setdefault(key, real_jit_step(optimizer, **kwargs))

    monkeypatch.setattr(_loop, "jit_step", shared_jit_step)
    full = train.run(cfg, tmp_path / "full")

    class Killed(Exception):
        pass

    real_batch = data.CharText.batch

    def dying_batch(self, index, split="train"):
        if split == "train" and index == 5:
            raise Killed()
        return real_batch(self, index, split)

    monkeypatch.setattr(data.CharText, "batch", dying_batch)
    with pytest.raises(Killed):
        train.run(cfg, tmp_path / "cut")
    assert [s for s, _ in train.list_checkpoints(tmp_path / "cut")] == [2, 4]
    monkeypatch.setattr(data.CharText, "batch", real_batch)
    resumed = train.run(cfg, tmp_path / "cut", resume=True)
    assert resumed["metrics"] == full["metrics"] and resumed["steps"] == 6
    assert len(steps) == 1

    # the checkpoints hold the run state: model, optimiser state, carried state and step,
    # bitwise equal
    ds = train.build_dataset(cfg)
    model = train.build_model(cfg, ds, key=jax.random.key(0))
    plain = train.RunState.init(model, train.build_optimizer(cfg))
    like = train.RunState.init(model, train.build_optimizer(cfg),
                               stream=train.init_stream_state(model, ds.batch(0)))
    a, _ = train.load_latest(tmp_path / "full", like)
    b, _ = train.load_latest(tmp_path / "cut", like)
    assert np.any(np.asarray(a.stream)) and int(a.step) == int(b.step) == 6
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)
    # load_run reads it, and so do readers whose `like` has no stream state (the file's
    # carried state comes back with the rest)
    _, _, loaded = train.load_run(tmp_path / "cut")
    got, _ = train.load_latest(tmp_path / "cut", plain)
    for x, y in zip(_leaves((loaded, got)), _leaves((a.model, a))):
        np.testing.assert_array_equal(x, y)

    def strip(path):
        return [{k: v for k, v in json.loads(line).items() if k != "time_s"}
                for line in path.read_text().splitlines()]

    records = strip(tmp_path / "full" / "metrics.jsonl")
    assert records == strip(tmp_path / "cut" / "metrics.jsonl")
    per_layer = {f"{name}/{i}" for name in ("local_loss", "local_accuracy",
                                            "entropy_production") for i in range(DEPTH)}
    for split in ("train", "val"):
        recs = [r for r in records if r["split"] == split]
        assert recs and all(set(r) >= per_layer | {"entropy_production", "loss"} for r in recs)
    for name in ("local_loss.png", "entropy_production.png", "loss.png"):
        assert (tmp_path / "full" / name).exists()


def test_per_layer_figures_only_for_logged_metrics(tmp_path):
    recs = [{"step": s, "split": "train", "loss": 1.0, "entropy_production/0": 0.1 * s}
            for s in (1, 2)]
    assert (tmp_path / "entropy_production.png") in _figures.plot_run(recs, tmp_path)
    assert not (tmp_path / "local_loss.png").exists()


@pytest.mark.parametrize("changes, fragments", [
    ({"data.task": "brackets", "data.stream": True}, ["data.stream", "task=chars"]),
    ({"model.attention": "softmax"}, ["data.stream", "model.attention=spin",
                                      "model.attention.mode=steps", "model.attention.init=carried"]),
    ({"model.attention.mode": "fixed_point"}, ["data.stream", "model.attention.mode=fixed_point"]),
    ({"model.attention.init": "reset"}, ["data.stream", "model.attention.init=reset"]),
    ({"data.stream": False, "data.task": "nli", "data.seq_len": 13},
     ["train.local_losses", "data.task=nli"]),
])
def test_invalid_combinations_are_named(tmp_path, changes, fragments):
    with pytest.raises(C.ConfigError) as e:
        _cfg(tmp_path / "text.txt", **changes)
    for f in fragments:
        assert f in str(e.value)


def test_entropy_weight_without_entropy_production_is_refused_before_training(tmp_path,
                                                                               text_file):
    cfg = _cfg(text_file, **{"data.stream": False, "train.local_losses": False,
                             "model.attention": "softmax"})
    with pytest.raises(C.ConfigError, match=r"train.entropy_weight=0.01: .*softmax reports no "
                       r"entropy production"):
        train.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    short = tmp_path / "short.txt"
    short.write_text(TEXT[:300])
    with pytest.raises(C.ConfigError, match=r"data.path: .*batch_size \* \(seq_len \+ 1\)"):
        train.build_dataset(_cfg(short))
