"""Fixed-point diagnostics: spectral radius, distinct fixed points, per-layer analysis and
`spinformer diagnose`."""

import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import cli, nn, train
from spinformer import config as C
from spinformer.spins import vector

ROOT = pathlib.Path(__file__).parents[2]
analyse = eqx.filter_jit(nn.steady_state_analysis)


def _system(key, n=3, dh=4, scale=0.6):
    """Fields of norm R and non-symmetric couplings `scale × row-stochastic`."""
    R = (dh / 2 - 1) ** 0.5
    kx, kj = jax.random.split(key)
    x = jax.random.normal(kx, (n, dh))
    x = R * x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    J = scale * jax.nn.softmax(2.0 * jax.random.normal(kj, (n, n)), axis=-1)
    return x, J, R


def _fd_radius(fn, m, eps=1e-6):
    """max |eig| of the central finite-difference Jacobian of `fn` at `m` (numpy, float64)."""
    m = np.asarray(m, np.float64)
    flat = m.ravel()
    cols = []
    for k in range(flat.size):
        e = np.zeros_like(flat)
        e[k] = eps
        hi = np.asarray(fn(jnp.asarray((flat + e).reshape(m.shape))))
        lo = np.asarray(fn(jnp.asarray((flat - e).reshape(m.shape))))
        cols.append((hi - lo).ravel() / (2 * eps))
    return np.max(np.abs(np.linalg.eigvals(np.stack(cols, axis=1))))


@pytest.mark.parametrize("update", ["tap", "mean_field"])
def test_spectral_radius_matches_finite_differences(update, getkey, x64):
    x, J, R = _system(getkey())
    beta = 1.5
    a = analyse(x, J, beta=beta, R=R, update=update, key=getkey(), num_starts=2)
    assert a.method == "eigenvalues" and a.magnetizations.dtype == jnp.float64
    if update == "tap":
        fn = jax.jit(lambda m: vector.ness_update(m, x, J, beta=beta, R=R))
    else:
        fn = jax.jit(lambda m: vector.magnetization(x + J @ m, beta=beta, R=R))
    rho = _fd_radius(fn, a.magnetizations)
    assert 0.05 < rho < 1.0
    np.testing.assert_allclose(float(a.spectral_radius), rho, rtol=1e-6)
    # causal couplings: the radius from the Jacobian's diagonal blocks is the whole
    # finite-difference Jacobian's
    L = jnp.tril(J)
    c = analyse(x, J, beta=beta, R=R, update=update, key=jax.random.key(7), num_starts=2,
                causal=True)
    if update == "tap":
        fn = jax.jit(lambda m: vector.ness_update(m, x, L, beta=beta, R=R))
    else:
        fn = jax.jit(lambda m: vector.magnetization(x + L @ m, beta=beta, R=R))
    rho = _fd_radius(fn, c.magnetizations)
    assert 0.05 < rho < 1.0 and c.method == "eigenvalues"
    np.testing.assert_allclose(float(c.spectral_radius), rho, rtol=1e-6)
    # above exact_max the radius is estimated by power iteration on Jacobian-vector products
    b = analyse(x, J, beta=beta, R=R, update=update, key=getkey(), num_starts=2, exact_max=0)
    assert b.method == "power iteration"
    np.testing.assert_allclose(float(b.spectral_radius), rho, rtol=0.1)


def test_weak_couplings_contract_to_one_fixed_point(getkey):
    x, J, R = _system(getkey(), n=4, dh=6, scale=0.3)
    a = analyse(x, J, beta=1.0, R=R, key=getkey(), num_starts=6)
    assert float(a.spectral_radius) < 1.0
    assert int(a.num_fixed_points) == 1 and float(a.converged) == 1.0
    assert a.start_steps.shape == (7,) and int(a.solver.num_steps) == int(a.start_steps[0])
    # the default start's solution is the steady state vector.tap_ness finds
    ref = vector.tap_ness(x, J, beta=1.0, R=R).value
    np.testing.assert_allclose(a.magnetizations, ref, atol=1e-6)


def test_ferromagnet_has_several_fixed_points(getkey):
    # zero fields and strong symmetric couplings: m = 0 is a fixed point with Jacobian
    # φ'(0) J ⊗ 1 = (β/2) J ⊗ 1, unstable (ρ = β/2 · λ_max(J) = 4), and the ferromagnetic
    # states may point in any direction: the random starts reach several of them
    n, dh, beta = 3, 4, 4.0
    R = (dh / 2 - 1) ** 0.5
    J = jnp.ones((n, n)) - jnp.eye(n)
    a = analyse(jnp.zeros((n, dh)), J, beta=beta, R=R, update="mean_field", key=getkey(),
                num_starts=6)
    np.testing.assert_allclose(float(a.spectral_radius), beta / 2 * 2.0, rtol=1e-5)
    np.testing.assert_allclose(a.magnetizations, 0.0, atol=1e-7)
    assert float(a.converged) == 1.0
    assert int(a.num_fixed_points) > 1
    # with a tolerance larger than any distance every solve is one fixed point
    b = analyse(jnp.zeros((n, dh)), J, beta=beta, R=R, update="mean_field", key=getkey(),
                num_starts=6, cluster_tol=10.0)
    assert int(b.num_fixed_points) == 1


def test_analysis_refuses_what_it_cannot_analyse(getkey):
    x = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="SpinAttention"):
        nn.fixed_point_analysis(nn.SoftmaxAttention(8, 2, key=getkey()), x, key=getkey())
    steps = nn.SpinAttention(8, 2, mode="steps", key=getkey())
    with pytest.raises(ValueError, match="mode='fixed_point'"):
        nn.fixed_point_analysis(steps, x, key=getkey())
    with pytest.raises(ValueError, match="update"):
        nn.steady_state_analysis(x, jnp.eye(4), update="naive", key=getkey())
    with pytest.raises(ValueError, match="num_starts"):
        nn.steady_state_analysis(x, jnp.eye(4), num_starts=-1, key=getkey())
    with pytest.raises(ValueError, match="SequenceModel"):
        nn.model_analysis(steps, jnp.arange(4), key=getkey())


def test_model_analysis_per_layer(getkey):
    tokens = jnp.arange(6) % 5
    spin = nn.Tagger(5, 5, dim=8, depth=2, num_heads=2, attention="spin", causal=True,
                     attention_kwargs={"update": "mean_field"}, key=getkey())
    a = eqx.filter_jit(lambda m, t, k: nn.model_analysis(m, t, key=k, num_starts=3))(
        spin, tokens, getkey())
    _, diag = spin(tokens, return_diagnostics=True)
    fp = a.fixed_points
    assert fp.spectral_radius.shape == (2, 2) and fp.start_steps.shape == (2, 2, 4)
    # the rebuilt attention inputs give back the model's own steady states, layer by layer
    np.testing.assert_allclose(fp.magnetizations, diag.magnetizations, atol=1e-5)
    np.testing.assert_array_equal(fp.solver.num_steps, diag.solver.num_steps)
    # float32, two programs (XLA may round them differently)
    np.testing.assert_allclose(a.entropy_production, diag.entropy_production, rtol=1e-5)
    assert a.solver_failures.shape == (2,) and list(a.num_solves) == [2, 2]
    assert np.all(np.asarray(a.entropy_production) >= 0)  # causal couplings: σ ≥ 0
    # softmax attention solves nothing: nothing applies, nothing fails
    soft = nn.Tagger(5, 5, dim=8, depth=2, num_heads=2, causal=True, key=getkey())
    b = nn.model_analysis(soft, tokens, key=getkey())
    assert b.fixed_points is None and b.solver_steps is None and b.entropy_production is None


def test_diagnose_command(tmp_path, capsys):
    cfg = C.load_config(ROOT / "configs" / "quickstart.yaml", overrides=[
        "train.steps=3", "train.log_every=1", "train.eval_every=3", "train.checkpoint_every=3",
        "train.warmup_steps=1", "train.progress=false", "data.batch_size=3",
        "data.eval_batches=1", "data.seq_len=8", "model.dim=8", "model.num_heads=2",
        "model.depth=2", "model.ffn_hidden=8", "model.attention.solver.max_steps=8",
    ])
    run = tmp_path / "run"
    train.run(cfg, run, progress=False)
    out = tmp_path / "diag"
    assert cli.main(["diagnose", str(run), "--starts", "3", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    table = captured.out
    # progress while it works: loading, the batch (with the compile), the summary
    assert "diagnose: loading" in captured.err and "compiling" in captured.err
    assert "compilation cache" in captured.err  # what makes the next one quicker, named
    assert "diagnose: summarising" in captured.err
    summary = json.loads((out / "diagnostics.json").read_text())
    assert summary["examples"] == 3 and summary["starts"] == 3
    assert summary["spectral_radius_method"] == "eigenvalues"
    assert [r["layer"] for r in summary["layers"]] == [0, 1]
    for r in summary["layers"]:
        assert r["spectral_radius"]["max"] >= r["spectral_radius"]["mean"] > 0
        assert r["fixed_points"]["mean"] >= 1 and 0 <= r["converged"] <= 1
        assert r["solves"] == 3 * 2 and r["entropy_production"]["mean"] >= 0
    # 2 layers, then the solver effect: the loss with the solves cut to their start, to one
    # iteration, and converged (these solves start from zero magnetizations: they matter)
    assert "spectral radius" in table and len(table.strip().splitlines()) == 6
    effect = summary["solver_effect"]
    assert effect["start"] != effect["converged"] and not effect["no_effect"]
    assert table.strip().splitlines()[-1].startswith("Solver effect: loss ")
    assert "is the solver doing anything?" in captured.err
    for unit in ("contracting (fraction ρ < 1)", "converged starts (fraction)",
                 "solver steps (mean per solve)", "failed solves"):
        assert unit in table
    assert (out / "diagnostics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a missing directory, and one that holds no run
    assert cli.main(["diagnose", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not a run")
    assert cli.main(["diagnose", str(tmp_path / "notes")]) == 2
    assert "config.yaml" in capsys.readouterr().err
    assert cli.main(["diagnose", str(run), "--batches", "0"]) == 2
    assert "batches" in capsys.readouterr().err
