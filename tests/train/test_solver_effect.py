"""`train.solver_effect`: a model's loss with its solves cut to their starting point, to one
iteration, and converged; a solve that returns its start is flagged."""

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import spinformer as sf
from spinformer import nn, solvers
from spinformer.solvers._fixed_point import cut_solves

ROOT = pathlib.Path(__file__).resolve().parents[2]


class StartSolve(nn.SoftmaxAttention):
    """Softmax, then a solve whose map returns its start (a do-nothing solve)."""

    def __call__(self, x, *, return_diagnostics=False, **kw):
        y = super().__call__(x, **kw)
        sol = solvers.fixed_point(lambda m, c: c, y, y, solver=solvers.Anderson(tol=1e-5))
        if return_diagnostics:
            return sol.value, nn.Diagnostics(solver=nn.Stats.of(sol))
        return sol.value


class Relaxed(nn.SoftmaxAttention):
    """Tokens relaxed to m = tanh(x + A m / 2), A causal softmax couplings (a solve that
    matters)."""

    def __call__(self, x, *, return_diagnostics=False, **kw):
        n = x.shape[0]
        scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), x @ x.T, -jnp.inf)
        A = 0.5 * jax.nn.softmax(scores, axis=-1)
        sol = solvers.fixed_point(lambda m, _: jnp.tanh(x + A @ m), x, None,
                                  solver=solvers.Picard(tol=1e-5, max_steps=100))
        if return_diagnostics:
            return sol.value, nn.Diagnostics(solver=nn.Stats.of(sol))
        return sol.value


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The two test attentions, registered for this module only (the name table is global:
    another test's listing of attentions must not see them)."""
    names = {"test_start_solve": StartSolve, "test_relaxed": Relaxed}
    for name, cls in names.items():
        nn.register_attention(name, help=cls.__doc__.splitlines()[0])(cls)
    yield
    for name in names:
        sf._schema.unregister_attention(name)


def _model(attention):
    cfg = sf.config.load_config(ROOT / "configs" / "brackets_softmax.yaml").replace(
        {"model.attention": attention, "model.dim": 8, "model.ffn_hidden": 8,
         "data.seq_len": 6, "data.batch_size": 8})
    dataset = sf.train.build_dataset(cfg)
    model = sf.train.build_model(cfg, dataset, key=jax.random.key(0))
    return model, [dataset.batch(i, "val") for i in range(2)]


def test_a_solve_that_returns_its_start_is_flagged():
    model, batches = _model("test_start_solve")
    effect = sf.train.solver_effect(model, batches)
    assert effect["no_effect"]
    assert effect["start"] == pytest.approx(effect["converged"], rel=1e-6)
    assert effect["one_step"] == pytest.approx(effect["converged"], rel=1e-6)


def test_a_solve_that_matters_is_not_flagged_and_its_cuts_are_what_they_say():
    """The relaxed tokens' loss moves when the solve is cut; cut at the start the model is
    the same network with the solve's output replaced by its input (checked by hand), and
    one iteration is one Picard step."""
    model, batches = _model("test_relaxed")
    effect = sf.train.solver_effect(model, batches)
    assert not effect["no_effect"]
    # (at initialisation the outputs matter little to the loss, but enough)
    assert abs(effect["start"] - effect["converged"]) > 2e-3 * effect["converged"]
    assert effect["one_step"] != pytest.approx(effect["start"])
    # by hand: the layer's output with the solve cut at 0 and 1 steps, and converged
    x = jax.random.normal(jax.random.key(1), (6, 8))
    layer = Relaxed(8, causal=True, key=jax.random.key(2))
    n = x.shape[0]
    A = 0.5 * jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((n, n), bool)), x @ x.T, -jnp.inf),
                             axis=-1)
    for k, want in ((0, x), (1, jnp.tanh(x + A @ x))):
        with cut_solves(k):
            got = eqx.filter_jit(lambda lay, v: lay(v))(layer, x)  # traced under the cut
        assert jnp.allclose(got, want, atol=1e-6), k


def test_the_cuts_share_one_compiled_evaluation():
    """`evaluate(..., cut_solves=k)` passes k as a run-time value: every cut runs one compiled
    program (the converged evaluation keeps its own), with the same losses as a cut traced
    for that k alone."""
    import io
    import logging

    from spinformer.solvers._fixed_point import plain_loops
    from spinformer.train._objective import Objective, _batch_outputs

    model, batches = _model("test_relaxed")
    jax.clear_caches()  # (another test may have traced the cut program already)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles():
            cut = [sf.train.evaluate(model, batches, cut_solves=k)["loss"] for k in (0, 1, 3)]
    finally:
        logging.getLogger("jax").removeHandler(handler)
    # (traces, not compilations: a program read from the persistent cache is not compiled)
    assert log.getvalue().count("Finished tracing + transforming _eval_sums") == 1
    for k, loss in zip((0, 1, 3), cut):
        nll = count = 0.0
        for b in batches:
            b = {name: jnp.asarray(b[name]) for name in ("inputs", "targets", "mask")}
            with plain_loops(), cut_solves(k):
                sums = eqx.filter_jit(lambda m, v: _batch_outputs(m, v, None, None,
                                                                  Objective())[0])(model, b)
            nll, count = nll + float(sums["nll"]), count + float(sums["count"])
        assert loss == nll / count, k
    with pytest.raises(ValueError, match="must be an int >= 0 or None"):
        sf.train.evaluate(model, batches, cut_solves=-1)


def test_a_model_without_solves_has_no_solver_effect():
    model, batches = _model("softmax")
    assert sf.train.solver_effect(model, batches) is None
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        with cut_solves(-1):
            pass
