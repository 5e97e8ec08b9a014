import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spinformer._schema
from spinformer import config as C
from spinformer import nn, solvers, train
from spinformer._schema import option
from spinformer.nn._transformer import _unroll_call
from spinformer.spins import vector

TIGHT = dict(solver=solvers.Anderson(tol=1e-6, max_steps=200))


@eqx.filter_jit
def call(module, x, **kwargs):
    """Jitted module call (eager solver loops are slow to run op by op)."""
    return module(x, **kwargs)


def _spin(dim, heads, key, **kw):
    # the physics' β = 1, no output map and a tight backward solve, as these tests were
    # written for (the module's defaults are the config's: β = 2, an output map, GMRES(5))
    kw = {"beta": 1.0, "output_proj": False, "adjoint": solvers.Implicit(), **kw}
    return nn.SpinAttention(dim, heads, key=key, **kw)


def test_softmax_shapes_and_weights(getkey):
    attn = nn.SoftmaxAttention(16, 4, causal=True, key=getkey())
    x = jax.random.normal(getkey(), (7, 16))
    y, diag = call(attn, x, return_diagnostics=True)
    assert y.shape == x.shape and diag.weights.shape == (4, 7, 7)
    np.testing.assert_allclose(diag.weights.sum(-1), 1.0, rtol=1e-6)
    assert float(jnp.abs(jnp.triu(diag.weights, 1)).max()) == 0.0
    assert diag.couplings is None and diag.solver is None
    ctx = jax.random.normal(getkey(), (3, 16))
    assert call(attn, x, context=ctx).shape == (7, 16)
    with pytest.raises(ValueError, match="divisible"):
        nn.SoftmaxAttention(10, 4, key=getkey())
    with pytest.raises(ValueError, match="one\nexample|one example"):
        attn(jnp.zeros((2, 7, 16)))


@pytest.mark.parametrize(
    "kw",
    [
        dict(update="mean_field", mode="fixed_point", **TIGHT),
        dict(update="mean_field", mode="steps", num_steps=3),
        dict(update="tap", mode="steps", num_steps=2, init="learned", **TIGHT),
    ],
    ids=["mf-ness", "mf-steps", "tap-steps-learned"],
)
def test_spin_shapes_and_causal_no_leak(kw, getkey, x64):
    attn = _spin(16, 2, getkey(), causal=True, **kw)
    x = jax.random.normal(getkey(), (6, 16))
    y, diag = attn(x, return_diagnostics=True)
    assert y.shape == x.shape
    assert diag.couplings.shape == (2, 6, 6) and diag.magnetizations.shape == (2, 6, 8)
    assert diag.solver.num_steps.shape == diag.solver.result.shape == (2,)
    assert (diag.solver.result == solvers.RESULTS.successful).all()
    assert float(jnp.abs(jnp.triu(diag.couplings, 1)).max()) == 0.0
    # magnetizations live inside the ball of radius R
    assert float(jnp.linalg.norm(diag.magnetizations, axis=-1).max()) < attn.radius
    # changing the future leaves the past unchanged (up to the solver tolerance)
    x2 = x.at[4:].set(jax.random.normal(getkey(), (2, 16)) * 3)
    y2 = call(attn, x2)
    np.testing.assert_allclose(y2[:4], y[:4], atol=1e-5)
    assert float(jnp.abs(y2[4:] - y[4:]).max()) > 1e-3


def _block_diag_qk(multi, singles):
    """Give the H-head module q/k maps that read head h's subspace only, copied from the
    single-head modules."""
    d, h = multi.dim, multi.num_heads
    dh = d // h
    wq = jnp.zeros((d, d))
    wk = jnp.zeros((d, d))
    for i, s in enumerate(singles):
        sl = slice(i * dh, (i + 1) * dh)
        wq = wq.at[sl, sl].set(s.to_q.weight)
        wk = wk.at[sl, sl].set(s.to_k.weight)
    multi = eqx.tree_at(lambda a: a.to_q.weight, multi, wq)
    return eqx.tree_at(lambda a: a.to_k.weight, multi, wk)


@pytest.mark.parametrize(
    "kw",
    [dict(update="tap", mode="fixed_point", **TIGHT),
     dict(update="mean_field", mode="steps", num_steps=2)],
    ids=["tap-ness", "mf-steps"],
)
def test_multi_head_equals_single_heads(kw, getkey, x64):
    H, dh, n = 3, 8, 5
    singles = [_spin(dh, 1, getkey(), causal=True, **kw) for _ in range(H)]
    multi = _block_diag_qk(_spin(H * dh, H, getkey(), causal=True, **kw), singles)
    x = jax.random.normal(getkey(), (n, H * dh))
    y, diag = call(multi, x, return_diagnostics=True)
    assert (diag.solver.result == solvers.RESULTS.successful).all()
    for i, s in enumerate(singles):
        sl = slice(i * dh, (i + 1) * dh)
        np.testing.assert_allclose(y[:, sl], call(s, x[:, sl]), rtol=1e-7, atol=1e-9)
    # causal: changing the future leaves the past unchanged (up to the solver tolerance)
    x2 = x.at[3:].set(jax.random.normal(getkey(), (n - 3, H * dh)) * 3)
    y2 = call(multi, x2)
    np.testing.assert_allclose(y2[:3], y[:3], atol=1e-5)
    assert float(jnp.abs(y2[3:] - y[3:]).max()) > 1e-3


def test_spin_matches_the_physics(getkey, x64):
    attn = _spin(16, 2, getkey(), update="mean_field", mode="steps", num_steps=1)
    x = jax.random.normal(getkey(), (5, 16))
    y, diag = call(attn, x, return_diagnostics=True)
    xh = attn.fields(x)
    R = attn.radius
    np.testing.assert_allclose(R, np.sqrt(8 / 2 - 1), rtol=1e-6)
    np.testing.assert_allclose(jnp.linalg.norm(xh, axis=-1), R, rtol=1e-6)
    for h in range(2):
        m0 = vector.magnetization(xh[h], beta=1.0, R=R)
        want = vector.mean_field_step(m0, xh[h], diag.couplings[h], beta=1.0, R=R)
        np.testing.assert_allclose(diag.magnetizations[h], want, rtol=1e-10)
    # the steady state is a fixed point of the time step
    ness = _spin(16, 2, getkey(), update="mean_field", mode="fixed_point", **TIGHT)
    _, d = call(ness, x, return_diagnostics=True)
    xh = ness.fields(x)
    for h in range(2):
        again = vector.mean_field_step(d.magnetizations[h], xh[h], d.couplings[h], beta=1.0, R=R)
        np.testing.assert_allclose(again, d.magnetizations[h], atol=1e-6)


def test_carried_state_and_cross_attention(getkey, x64):
    k = getkey()
    kw = dict(update="mean_field", mode="steps", init="carried")
    attn = _spin(16, 2, k, num_steps=1, **kw)
    x = jax.random.normal(getkey(), (5, 16))
    y1, d1 = call(attn, x, return_diagnostics=True)
    y2, d2 = call(attn, x, state=d1.state, return_diagnostics=True)
    assert d1.state.shape == x.shape and not np.allclose(y1, y2)
    # two one-step calls with the carried state equal one two-step call
    two = _spin(16, 2, k, num_steps=2, **kw)
    np.testing.assert_allclose(y2, call(two, x), rtol=1e-10)
    with pytest.raises(ValueError, match="state must have shape"):
        attn(x, state=jnp.zeros((4, 16)))
    # cross-attention: the context acts as the previous magnetizations
    cross = _spin(16, 2, getkey(), update="mean_field")
    c = jax.random.normal(getkey(), (5, 16))
    y, d = call(cross, x, context=c, return_diagnostics=True)
    assert y.shape == x.shape and d.couplings.shape == (2, 5, 5)
    xh, ch = cross.fields(x), cross.fields(c)
    R = cross.radius
    for h in range(2):
        want = vector.mean_field_step(vector.magnetization(ch[h], beta=1.0, R=R), xh[h],
                                 d.couplings[h], beta=1.0, R=R)
        np.testing.assert_allclose(d.magnetizations[h], want, rtol=1e-10)
    ctx3 = jax.random.normal(getkey(), (3, 16))
    tap_cross = _spin(16, 2, getkey(), update="tap", **TIGHT)
    assert call(tap_cross, x, context=ctx3).shape == (5, 16)


@pytest.mark.parametrize(
    "update", ["mean_field", pytest.param("tap", marks=pytest.mark.slow)]
)
def test_spin_gradients_implicit_vs_unrolled_vs_fd(update, getkey, x64):
    x = jax.random.normal(getkey(), (4, 8))
    base = _spin(8, 1, getkey(), causal=True, update=update,
                 solver=solvers.Anderson(tol=1e-10, max_steps=40))

    @eqx.filter_jit
    def loss(a):
        return jnp.sum(jnp.sin(a(x)))

    grads = {}
    for name, adj in (("implicit", solvers.Implicit(rtol=1e-10)), ("unrolled", solvers.Unrolled())):
        a = eqx.tree_at(lambda m: m.adjoint, base, adj)
        grads[name] = eqx.filter_jit(eqx.filter_grad(loss))(a).to_q.weight
    np.testing.assert_allclose(grads["implicit"], grads["unrolled"], rtol=1e-5, atol=1e-9)
    # and a central finite difference along one direction
    v = jax.random.normal(getkey(), base.to_q.weight.shape)
    eps = 1e-5
    shift = lambda s: eqx.tree_at(lambda m: m.to_q.weight, base, base.to_q.weight + s * v)  # noqa
    fd = (loss(shift(eps)) - loss(shift(-eps))) / (2 * eps)
    np.testing.assert_allclose(jnp.sum(grads["implicit"] * v), fd, rtol=1e-5)


def test_spin_temperature_coupling_and_value_options(getkey, x64):
    """A learned per-head β equals the fixed-β model (TAP steady state: the whole Plefka
    expansion, not one formula against itself), `coupling_scale` multiplies the couplings of
    the physics, `value_proj` / `normalize_fields` shape the fields, and the gradient of the
    learned temperatures matches a finite difference."""
    x = jax.random.normal(getkey(), (5, 16))
    k = getkey()
    gains = jnp.array([1.7, 0.6])
    learned = _spin(16, 2, k, causal=True, learn_beta=True, **TIGHT)
    learned = eqx.tree_at(lambda m: m.log_beta, learned, jnp.log(gains))
    np.testing.assert_allclose(learned.head_betas(), gains, rtol=1e-12)
    y = call(learned, x)
    for h, g in enumerate(gains):
        fixed = _spin(16, 2, k, causal=True, beta=float(g), **TIGHT)
        sl = slice(8 * h, 8 * h + 8)
        # out_proj is off: head h's output columns are head h's magnetizations
        np.testing.assert_allclose(y[:, sl], call(fixed, x)[:, sl], atol=1e-6)

    attn = _spin(16, 2, k, update="mean_field", mode="steps", num_steps=1, beta=1.5,
                 coupling_scale=2.5)
    _, diag = call(attn, x, return_diagnostics=True)
    np.testing.assert_allclose(diag.couplings.sum(-1), 1.0, rtol=1e-10)  # reported: softmax
    xh, R = attn.fields(x), attn.radius
    for h in range(2):
        m0 = vector.magnetization(xh[h], beta=1.5, R=R)
        want = vector.mean_field_step(m0, xh[h], 2.5 * diag.couplings[h], beta=1.5, R=R)
        np.testing.assert_allclose(diag.magnetizations[h], want, rtol=1e-10)

    valued = _spin(16, 2, k, value_proj=True)
    v = jax.vmap(valued.to_v)(x).reshape(5, 2, 8).transpose(1, 0, 2)
    np.testing.assert_allclose(valued.fields(x),
                               valued.radius * v / jnp.linalg.norm(v, axis=-1, keepdims=True),
                               rtol=1e-10)
    raw = _spin(16, 2, k, normalize_fields=False)
    np.testing.assert_allclose(raw.fields(x), x.reshape(5, 2, 8).transpose(1, 0, 2))

    mf = _spin(16, 2, k, causal=True, update="mean_field", learn_beta=True, value_proj=True,
               solver=solvers.Anderson(tol=1e-10, max_steps=200),
               adjoint=solvers.Implicit(rtol=1e-10))

    @eqx.filter_jit
    def loss(a):
        return jnp.sum(jnp.sin(a(x)))

    g = eqx.filter_jit(eqx.filter_grad(loss))(mf).log_beta
    eps = 1e-5
    for h in range(2):
        shift = lambda s: eqx.tree_at(lambda m: m.log_beta, mf, mf.log_beta.at[h].add(s))  # noqa
        fd = (loss(shift(eps)) - loss(shift(-eps))) / (2 * eps)
        np.testing.assert_allclose(g[h], fd, rtol=1e-5)
        assert abs(float(g[h])) > 1e-3
    # output="response": the magnetizations less the decoupled response φ(x)
    resp = _spin(16, 2, k, causal=True, output="response", beta=2.0, **TIGHT)
    mag = _spin(16, 2, k, causal=True, beta=2.0, **TIGHT)
    phi = vector.magnetization(mag.fields(x), beta=2.0, R=mag.radius)
    np.testing.assert_allclose(call(resp, x),
                               call(mag, x) - phi.transpose(1, 0, 2).reshape(5, 16), atol=1e-9)
    assert float(jnp.abs(call(resp, x)).max()) > 1e-2
    with pytest.raises(ValueError, match="coupling_scale"):
        _spin(16, 2, k, coupling_scale=0.0)
    with pytest.raises(ValueError, match="output"):
        _spin(16, 2, k, output="delta")


def test_spin_errors(getkey):
    with pytest.raises(ValueError, match="must be > 2"):
        nn.SpinAttention(8, 4, key=getkey())
    with pytest.raises(ValueError, match="update"):
        nn.SpinAttention(8, 1, update="exact", key=getkey())
    with pytest.raises(ValueError, match="mode"):
        nn.SpinAttention(8, 1, mode="ode", key=getkey())


@pytest.mark.parametrize("attention", ["softmax", "spin"])
def test_scan_stack_equals_loop_and_heads(attention, getkey):
    kw = {"update": "mean_field", "mode": "steps", "num_steps": 2} if attention == "spin" else {}
    model = nn.Transformer(12, 16, 3, num_heads=2, max_len=10, attention=attention,
                           attention_kwargs=kw, causal=True, ffn_hidden=8, key=getkey())
    tokens = jax.random.randint(getkey(), (9,), 0, 12)
    h, diag = call(model, tokens, return_diagnostics=True)
    loop = eqx.filter_jit(_unroll_call)(model, tokens)
    np.testing.assert_allclose(h, loop, rtol=1e-5, atol=1e-6)
    pattern = diag.weights if attention == "softmax" else diag.couplings
    assert pattern.shape == (3, 2, 9, 9)
    with pytest.raises(ValueError, match="max_len"):
        call(model, jnp.zeros(11, jnp.int32))


def test_heads_and_dropout(getkey):
    common = dict(dim=16, depth=2, num_heads=2, max_len=10, key=getkey())
    tokens = jax.random.randint(getkey(), (9,), 0, 12)

    def shape(cls, *args):  # abstract evaluation: no compilation
        model = eqx.filter_eval_shape(cls, 12, *args, **common)
        return eqx.filter_eval_shape(model, tokens).shape

    assert shape(nn.CausalLM) == (9, 12)
    assert shape(nn.Tagger, 5) == (9, 5)
    assert shape(nn.Classifier, 3) == (3,)
    # dropout only with a key
    drop = nn.Tagger(12, 5, dropout=0.5, **common)
    a, b = call(drop, tokens, key=getkey()), call(drop, tokens, key=getkey())
    assert not np.allclose(a, b) and np.allclose(call(drop, tokens), call(drop, tokens))


def test_compile_size_does_not_grow_with_depth(getkey):
    tokens = jnp.zeros(8, jnp.int32)

    def n_eqns(depth):
        m = eqx.filter_eval_shape(nn.CausalLM, 12, 16, depth, num_heads=2, max_len=8,
                                  attention="spin", key=jax.random.key(0))
        params, static = eqx.partition(m, lambda x: isinstance(x, jax.ShapeDtypeStruct))
        jaxpr = jax.make_jaxpr(lambda p, t: eqx.combine(p, static)(t))(params, tokens)
        return len(jaxpr.jaxpr.eqns)

    assert n_eqns(2) == n_eqns(12)


def test_unknown_attention(getkey):
    with pytest.raises(ValueError, match="is not one of"):
        nn.Transformer(12, 16, 1, attention="no_such_attention", key=getkey())


def test_sequence_model_pool(getkey):
    common = dict(dim=16, depth=1, num_heads=2, max_len=10, key=getkey())
    tagger, clf = nn.Tagger(12, 5, **common), nn.Classifier(12, 5, **common)
    lm = nn.CausalLM(12, **common)
    assert all(isinstance(m, nn.SequenceModel) for m in (tagger, clf, lm))
    assert (tagger.pool, clf.pool, lm.pool) == ("none", "mean", "none")
    assert lm.transformer.causal and lm.readout.out_features == 12
    tokens = jax.random.randint(getkey(), (9,), 0, 12)
    # the same key builds the same transformer and readout: only the pooling differs
    h = call(tagger.transformer, tokens)
    np.testing.assert_allclose(call(tagger, tokens), jax.vmap(tagger.readout)(h), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(call(clf, tokens), clf.readout(h.mean(0)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pool='max'"):
        nn.SequenceModel(tagger.transformer, 5, pool="max", key=getkey())


def test_carried_state_through_transformer(getkey):
    kw = dict(update="mean_field", mode="steps", init="carried")
    k, tokens = getkey(), jax.random.randint(getkey(), (8,), 0, 12)

    def lm(steps, depth=1, key=k):
        return nn.CausalLM(12, 16, depth, num_heads=2, max_len=8, attention="spin",
                           attention_kwargs=dict(num_steps=steps, **kw), key=key)

    y1, d1 = call(lm(1), tokens, return_diagnostics=True)
    assert d1.state.shape == (1, 8, 16)
    y2, d2 = call(lm(1), tokens, state=d1.state, return_diagnostics=True)
    assert not np.allclose(y1, y2, atol=1e-4)
    # one layer: a one-step call continued from the carried state equals one two-step call
    np.testing.assert_allclose(y2, call(lm(2), tokens), rtol=1e-5, atol=1e-5)
    # several layers: each block gets its own slice, and the scan equals a loop over blocks
    deep = lm(1, depth=2, key=getkey()).transformer
    h1, e1 = call(deep, tokens, return_diagnostics=True)
    h2, e2 = call(deep, tokens, state=e1.state, return_diagnostics=True)
    assert e1.state.shape == e2.state.shape == (2, 8, 16)
    assert not np.allclose(h1, h2, atol=1e-4)
    x = jax.vmap(deep.embed)(tokens) + deep.pos_embed[:8]
    dynamic, static = eqx.partition(deep.blocks, eqx.is_array)
    for i in range(2):
        block = eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static)
        x, d = block(x, state=e1.state[i], return_diagnostics=True)
        np.testing.assert_allclose(d.state, e2.state[i], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.vmap(deep.norm)(x), h2, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="state must have shape"):
        deep(tokens, state=jnp.zeros((1, 8, 16)))


@dataclasses.dataclass(frozen=True)
class GainConfig:
    gain: float = option(2.0, "output gain")


class GainAttention(eqx.Module):
    """A toy attention for the registry test: every token's values, times a gain."""

    to_v: eqx.nn.Linear
    gain: float

    def __init__(self, dim, num_heads=1, causal=False, *, max_len, gain=1.0, key):
        del num_heads, causal, max_len
        self.to_v = eqx.nn.Linear(dim, dim, key=key)
        self.gain = gain

    @classmethod
    def from_config(cls, section):
        return dict(gain=section.gain)

    def __call__(self, x, *, context=None, mask=None, state=None, key=None,
                 return_diagnostics=False):
        y = self.gain * jax.vmap(self.to_v)(x)
        return (y, nn.Diagnostics(state=y)) if return_diagnostics else y


@pytest.fixture
def gain_attention():
    nn.register_attention("gain", config=GainConfig, help="a toy", takes_max_len=True,
                          min_head_dim=4)(GainAttention)
    yield
    spinformer._schema.unregister_attention("gain")


def test_registered_attention_from_yaml(gain_attention, tmp_path):
    assert nn.attention_names()[-1] == "gain" and nn.get_attention("gain").cls is GainAttention
    p = tmp_path / "gain.yaml"
    p.write_text("description: toy\nmodel:\n  attention:\n    name: gain\n    gain: 3.0\n"
                 "  num_heads: 2\n  dim: 8\ndata:\n  seq_len: 6\n")
    cfg = C.load_config(p)
    assert cfg.model.attention.name == "gain" and cfg.model.attention.gain == 3.0
    assert "model.attention.gain = 3.0  # output gain" in C.describe(cfg)
    assert "gain (a toy)" in C.describe()
    with pytest.raises(C.ConfigError, match="Did you mean 'model.attention.gain'"):
        C.load_config(p, ["model.attention.gian=1"])
    with pytest.raises(C.ConfigError, match="head width dim/num_heads >= 4; got 2"):
        C.load_config(p, {"model.num_heads": 4})
    ds = train.build_dataset(cfg)
    model = train.build_model(cfg, ds, key=jax.random.key(0))
    attn = model.transformer.blocks.attention
    assert isinstance(attn, GainAttention) and attn.gain == 3.0
    assert eqx.filter_eval_shape(model, jnp.zeros(6, jnp.int32)).shape == (6, ds.num_classes)
    # also by name, without a config
    nn.Transformer(10, 8, 1, max_len=6, attention="gain", key=jax.random.key(0))


def test_registry_errors(gain_attention):
    with pytest.raises(ValueError, match="already registered"):
        nn.register_attention("gain", config=GainConfig)(nn.SoftmaxAttention)
    with pytest.raises(TypeError, match="no argument 'gain'"):
        nn.register_attention("other", config=GainConfig)(nn.SoftmaxAttention)
    with pytest.raises(TypeError, match="frozen dataclass"):
        nn.register_attention("other", config=dict)
    assert "other" not in nn.attention_names()
    assert "gain" in C.keys(C.ModelConfig)["attention"].choices


@pytest.mark.parametrize("name", nn.attention_names())
def test_default_config_builds_the_default_module(name):
    """One source of defaults: for every registered attention, the module built from a
    default config section equals the module its constructor builds with no options (so the
    same layer built in Python and from YAML cannot drift apart)."""
    reg = nn.get_attention(name)
    kw = dict(max_len=6) if reg.takes_max_len else {}
    plain = reg.cls(8, 2, False, key=jax.random.key(0), **kw)
    settings = reg.config()
    built = reg.cls(8, 2, False, key=jax.random.key(0), **kw, **reg.kwargs_from(settings))
    assert bool(eqx.tree_equal(plain, built))
    # and the config machinery reads the same settings
    assert C.load_config(None, [f"model.attention={name}", "model.dim=8",
                                "model.num_heads=2"]).model.attention == settings


def test_every_family_takes_the_shared_solver_sections():
    """`solver`/`adjoint` are solver objects in every family that solves something, each
    accepting what fits its problem, with one error naming both keys and what fits."""
    for name in ("spin", "boltzmann", "neurogame", "implicit"):
        cfg = C.load_config(None, [f"model.attention={name}", "model.attention.solver.name=picard",
                                   "model.attention.solver.damping=0.5",
                                   "model.attention.adjoint.name=phantom"])
        section, default = cfg.model.attention, nn.get_attention(name).config()
        assert section.solver == solvers.Picard(damping=0.5, tol=default.solver.tol,
                                                max_steps=default.solver.max_steps)
        assert section.adjoint == solvers.Phantom()
    # the saddle is a root: fixed-point-only solvers and adjoints do not fit
    with pytest.raises(C.ConfigError, match=r"model.attention.solver.name='picard' with "
                       r"adjoint.name='saddle_implicit': Picard iterates a map x = g\(x\), not "
                       r"a root"):
        C.load_config(None, ["model.attention=free_energy",
                             "model.attention.solver.name=picard"])
    with pytest.raises(C.ConfigError, match=r"adjoint.name='phantom': Phantom\(\) "
                       r"differentiates fixed points only"):
        C.load_config(None, ["model.attention=free_energy",
                             "model.attention.adjoint.name=phantom"])
    cfg = C.load_config(None, ["model.attention=free_energy",
                               "model.attention.solver.name=newton"])
    assert cfg.model.attention.solver == solvers.Newton(tol=1e-5, max_steps=50)
    with pytest.raises(C.ConfigError, match="Did you mean 'anderson'"):
        C.load_config(None, ["model.attention.solver.name=andersen"])
