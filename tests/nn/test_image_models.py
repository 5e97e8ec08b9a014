"""Free-energy attention against derivatives of the steepest-descent log Z, its failures;
the missing-data error of the command line. (The Fashion-MNIST configs run end to end on
the digits in tests/test_experiments.py.)"""

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import cli, nn, solvers
from spinformer.spins import free_energy as fe

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIM, N = 6, 5

call = eqx.filter_jit(lambda a, x, **kw: a(x, **kw))


def tokens(n=N, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, DIM))


@pytest.mark.parametrize("couplings", ["explicit", "input"])
def test_free_energy_output_is_the_derivative_of_log_z(couplings):
    """Per head, the output is β⁻¹ ∂ ln Z/∂h of the steepest-descent ln Z (normalised
    fields, unit spins: ln Z = D φ(t*) + const with the raw fields √D·h), computed here by
    differentiating `log_partition` — for input couplings the total derivative, through J(H).
    """
    a = nn.FreeEnergyAttention(DIM, 2, max_len=N, couplings=couplings, beta=1.5,
                               output_proj=False, key=jax.random.key(0))
    if couplings == "explicit":  # couplings stronger than the init
        a = eqx.tree_at(lambda t: t.J, a, 3.0 * a.J)
    x = tokens()
    out, d = call(a, x, return_diagnostics=True)
    assert np.all(np.asarray(d.solver.result) == solvers.RESULTS.successful)
    h = a.fields(x)  # (H, n, dh)
    dh = DIM // 2
    for k in range(2):
        if couplings == "explicit":
            J = a.couplings(h)[k]
        else:
            J = lambda hh, k=k: fe.tanh_couplings(hh, a.Q[k], a.K[k])  # noqa: E731

        def logz(hh, J=J):
            # the raw model: fields √D·h, spins of norm √D; ⟨σ⟩/√D = (1/(β√D)) ∂lnZ/∂(√D h)
            return fe.log_partition(hh, J, beta=1.5, normalized=True)

        grad = jax.grad(logz)(h[k]) / (1.5 * dh)
        np.testing.assert_allclose(out[:, k * dh:(k + 1) * dh], grad, rtol=2e-3, atol=2e-5)
    # couplings are symmetric with zero diagonal, also under a one-sided mask
    Jc = nn.FreeEnergyAttention(DIM, max_len=N, key=jax.random.key(0)).couplings(
        h, jnp.tril(jnp.ones((N, N), bool)))
    np.testing.assert_allclose(Jc, jnp.swapaxes(Jc, 1, 2))
    assert np.allclose(np.asarray(Jc)[:, np.arange(N), np.arange(N)], 0)


def test_free_energy_failures_are_zero_and_reported():
    a = nn.FreeEnergyAttention(DIM, max_len=N, beta=50.0, key=jax.random.key(0),
                               solver=fe.SaddleNewton(tol=1e-9, max_steps=1))
    x = tokens()
    out, d = call(a, x, return_diagnostics=True)
    assert np.all(np.asarray(d.solver.result) != solvers.RESULTS.successful)
    assert np.all(np.isfinite(np.asarray(out)))
    g = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(a)
    assert all(np.all(np.isfinite(np.asarray(z))) for z in jax.tree.leaves(g))
    loud = nn.FreeEnergyAttention(DIM, max_len=N, beta=50.0, key=jax.random.key(0),
                                  solver=fe.SaddleNewton(tol=1e-9, max_steps=1), throw=True)
    with pytest.raises(Exception, match="(?i)saddle|steps|converge"):
        jax.block_until_ready(loud(x))
    with pytest.raises(ValueError, match="couplings"):
        nn.FreeEnergyAttention(DIM, max_len=N, couplings="softmax", key=jax.random.key(0))
    with pytest.raises(ValueError, match="max_len"):
        nn.FreeEnergyAttention(DIM, max_len=N, key=jax.random.key(0))(tokens(N + 2))


def test_missing_fashion_mnist_is_one_line(tmp_path, capsys):
    rc = cli.main(["run", str(ROOT / "configs/fmnist_implicit.yaml"), "--set",
                   f"data.path={tmp_path / 'nowhere'}", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "dataset-fashion-mnist" in err and "data.path" in err


def test_data_commands_name_fashion_mnist(capsys):
    assert cli.main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "fashion-mnist" in out and "digits" in out
    assert "scikit-learn package: installed" in out  # the tests' environment has it
    rc = cli.main(["data", "fetch", "fashion-mnist"])
    both = "".join(capsys.readouterr())
    assert "dataset-fashion-mnist" in both or "installed in" in both
    assert rc in (0, 2)
    assert cli.main(["data", "fetch", "no-such-data"]) == 2
    assert "unknown dataset" in capsys.readouterr().err


def test_digits_without_scikit_learn_is_one_line(monkeypatch, capsys, tmp_path):
    """`pip install -e .` brings no scikit-learn: `data list` says it is missing, and a digits
    config fails in one line that says what to install."""
    import builtins
    import importlib.util

    from spinformer.data import _mnist

    real_import, real_find = builtins.__import__, importlib.util.find_spec

    def no_sklearn(name, *args, **kwargs):
        if name == "sklearn" or name.startswith("sklearn."):
            raise ImportError("No module named 'sklearn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sklearn" else real_find(name, *a))
    _mnist._digits_arrays.cache_clear()
    try:
        assert cli.main(["data", "list"]) == 0
        assert "not installed: `pip install scikit-learn`" in capsys.readouterr().out
        code = cli.main(["run", str(ROOT / "configs" / "fmnist_softmax.yaml"), "--set",
                         "data.task=digits", "--set", "model.embed=patch", "--out",
                         str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert code == 2 and "pip install scikit-learn" in err and len(err.splitlines()) <= 2
        assert not (tmp_path / "r").exists()
    finally:
        _mnist._digits_arrays.cache_clear()
