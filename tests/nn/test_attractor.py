"""The attractor network (spins.attractor, nn.AttractorNetwork, nn.PatchReconstructor,
data.mask_images / noisy_images, experiments/attractor.py): energies against autodiff and brute
force, the sphere normaliser against scipy and numerical integration, the embedding's round
trip, the norm constraint during training, shapes, and bad input."""

import importlib.util
import math
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spinformer as sf
from spinformer.spins import attractor as A

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _system(N=5, d=4, seed=0, scale=0.7):
    k1, k2 = jax.random.split(jax.random.key(seed))
    J = A.zero_diagonal(scale * jax.random.normal(k1, (N, N, d, d)))
    x = A.normalize(jax.random.normal(k2, (N, d)))
    return x, J


def test_local_energy_matches_brute_force_loop():
    x, J = _system()
    xn, Jn = np.asarray(x, np.float64), np.asarray(J, np.float64)
    lam = 2.5
    N = len(xn)
    e = [-np.log(sum(np.exp(lam * xn[i] @ Jn[i, j] @ xn[j]) for j in range(N) if j != i))
         for i in range(N)]
    np.testing.assert_allclose(A.local_energies(x, J, lam=lam), e, rtol=1e-5, atol=1e-5)
    a = np.asarray(A.attention_weights(x, J, lam=lam))
    np.testing.assert_allclose(a.sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.diag(a) == 0.0)


def test_update_is_minus_own_gradient_plus_gamma_x():
    """eq. 3: x_i(t+1) = −∂e_i/∂x_i + γ x_i (the gradient of token i's own energy only)."""
    x, J = _system(N=6, d=3, seed=1)
    lam, gamma = 1.7, 0.8
    N = x.shape[0]

    def own_grad(i):  # ∂e_i/∂x_i with every other token held fixed
        return jax.grad(lambda xi: A.local_energies(x.at[i].set(xi), J, lam=lam)[i])(x[i])

    expect = -jax.jit(jax.vmap(own_grad))(jnp.arange(N)) + gamma * x
    np.testing.assert_allclose(A.field(x, J, lam=lam) + gamma * x, expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(A.step(x, J, lam=lam, gamma=gamma),
                               expect / jnp.linalg.norm(expect, axis=-1, keepdims=True),
                               rtol=1e-5, atol=1e-6)
    # and it is NOT the gradient of the total energy (the other tokens' terms differ)
    total = jax.grad(lambda z: A.energy(z, J, lam=lam))(x)
    assert float(jnp.max(jnp.abs(total + A.field(x, J, lam=lam)))) > 1e-2


def test_normalize_kinds():
    z = jax.random.normal(jax.random.key(3), (7, 5)) + 2.0
    s = A.normalize(z, "sphere")
    np.testing.assert_allclose(jnp.linalg.norm(s, axis=-1), 1.0, rtol=1e-6)
    ln = A.normalize(z, "layernorm")
    np.testing.assert_allclose(jnp.linalg.norm(ln, axis=-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(ln.mean(-1), 0.0, atol=1e-6)  # the mean component is gone
    with pytest.raises(ValueError, match="kind must be one of"):
        A.normalize(z, "batchnorm")


def test_trajectory_shapes_and_first_state():
    x, J = _system(N=4, d=3)
    xs = A.trajectory(x, J, 7, lam=1.0)
    assert xs.shape == (8, 4, 3)
    np.testing.assert_array_equal(xs[0], x)
    np.testing.assert_allclose(xs[1], A.step(x, J), rtol=1e-6)
    np.testing.assert_allclose(jnp.linalg.norm(xs, axis=-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("bad", [((4, 3), (4, 4, 3, 2)), ((4,), (4, 4, 1, 1)),
                                 ((1, 3), (1, 1, 3, 3))])
def test_shape_errors(bad):
    xs, Js = bad
    with pytest.raises(ValueError):
        A.energy(jnp.ones(xs), jnp.ones(Js))


def test_log_sphere_partition_against_scipy_and_closed_forms(x64):
    scipy_special = pytest.importorskip("scipy.special")
    if True:  # float64 (the x64 fixture)
        for d in (2, 3, 8, 33, 64):
            nu = d / 2 - 1
            k = np.array([1e-3, 0.5, 3.0, 10.0, 14.9, 15.1, 20.0, 50.0, 200.0, 1000.0])
            ref = (0.5 * d * np.log(2 * np.pi) - nu * np.log(k)
                   + np.log(scipy_special.ive(nu, k)) + k)
            got = np.asarray(A.log_sphere_partition(jnp.asarray(k), d))
            np.testing.assert_allclose(got, ref, rtol=2e-7, atol=2e-7, err_msg=f"d={d}")
            area = np.log(2 * np.pi ** (d / 2) / math.gamma(d / 2))
            np.testing.assert_allclose(float(A.log_sphere_partition(np.zeros((), np.float64), d)), area,
                                       rtol=1e-7)
        # d = 3: 4π sinh κ / κ
        k = np.array([0.3, 2.0, 30.0])
        np.testing.assert_allclose(np.asarray(A.log_sphere_partition(jnp.asarray(k), 3)),
                                   np.log(4 * np.pi * np.sinh(k) / k), rtol=1e-7)
        # d/dκ log Z_d(κ) = I_{ν+1}(κ)/I_ν(κ) (the series' derivative is a custom JVP)
        for d in (3, 40):
            nu = d / 2 - 1
            k = np.array([0.1, 2.0, 9.0, 14.5, 16.0, 80.0])
            g = np.asarray(jax.vmap(jax.grad(lambda t: A.log_sphere_partition(t, d)))(
                jnp.asarray(k)))
            np.testing.assert_allclose(g, scipy_special.ive(nu + 1, k) / scipy_special.ive(nu, k),
                                       rtol=1e-6, err_msg=f"d={d}")
    # finite gradient at κ = 0 and across the switch to the Debye expansion
    g = jax.vmap(jax.grad(lambda k: A.log_sphere_partition(k, 8)))(jnp.array([0.0, 14.7, 14.8]))
    assert np.all(np.isfinite(np.asarray(g)))
    assert abs(float(g[1] - g[2])) < 1e-2


def test_pseudo_likelihood_is_a_normalised_density_on_the_sphere():
    """∫_{S^2} p(x_i | rest) dx_i = 1 by Monte Carlo on the sphere (d = 3), and the density
    at the data point matches exp(−pseudo_likelihood)."""
    x, J = _system(N=4, d=3, seed=5, scale=1.5)
    lam = 1.3
    i = 2
    u = A.normalize(jax.random.normal(jax.random.key(9), (200_000, 3)))
    xs = jnp.broadcast_to(x, (u.shape[0],) + x.shape).at[:, i].set(u)
    nll = jax.vmap(lambda z: A.pseudo_likelihood(z, J, lam=lam)[i])(xs)
    integral = 4 * np.pi * float(jnp.mean(jnp.exp(-nll)))
    assert abs(integral - 1.0) < 0.01, integral
    # the energy alone is not normalised
    e = jax.vmap(lambda z: A.local_energies(z, J, lam=lam)[i])(xs)
    assert abs(4 * np.pi * float(jnp.mean(jnp.exp(-e))) - 1.0) > 0.1


# --- the network -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def images():
    from spinformer.data._mnist import _digits_arrays

    pytest.importorskip("sklearn")
    return (_digits_arrays()[0][:64] / 16.0).astype(np.float32)


def test_embedding_round_trip_and_unit_norm(images):
    emb = sf.nn.PixelSpinEmbedding((8, 8), 2, 12, key=jax.random.key(0))
    np.testing.assert_allclose(emb.F.T @ emb.F, np.eye(8) / 4, atol=1e-6)
    x = jax.vmap(emb.embed)(images)
    assert x.shape == (64, 16, 12)
    np.testing.assert_allclose(jnp.linalg.norm(x, axis=-1), 1.0, rtol=1e-5)
    back = jax.vmap(emb.decode)(x)
    np.testing.assert_allclose(back, images, atol=2e-6)
    # off the image: any tokens decode to pixels in [0, 1]
    z = jax.random.normal(jax.random.key(1), (16, 12))
    out = emb.decode(z)
    assert out.shape == (8, 8) and float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    with pytest.raises(ValueError, match="dim must be >="):
        sf.nn.PixelSpinEmbedding((8, 8), 2, 7, key=jax.random.key(0))
    with pytest.raises(ValueError, match="must divide"):
        sf.nn.PixelSpinEmbedding((8, 8), 3, 18, key=jax.random.key(0))


def test_decode_maps_outside_directions_to_the_nearer_end():
    emb = sf.nn.PixelSpinEmbedding((2, 2), 2, 8, key=jax.random.key(0))
    a = 4

    def pix(u, w):  # tokens whose every (u, w) pair is the given one
        s = jnp.tile(jnp.array([u, w], jnp.float32), a)
        return float(emb.decode((s @ emb.F.T)[None] / 1.0)[0, 0])

    np.testing.assert_allclose(pix(1.0, 1.0), 0.5, rtol=0, atol=1e-5)
    np.testing.assert_allclose(pix(-0.2, 1.0), 0.0, rtol=0, atol=1e-6)  # beyond (0, 1): black
    np.testing.assert_allclose(pix(1.0, -0.2), 1.0, rtol=0, atol=1e-6)  # beyond (1, 0): white
    np.testing.assert_allclose(pix(-1.0, -0.3), 0.0, rtol=0, atol=1e-6)  # nearer (0, 1) going around
    np.testing.assert_allclose(pix(-0.3, -1.0), 1.0, rtol=0, atol=1e-6)


def test_training_holds_the_norm_and_lowers_the_energy(images):
    net = sf.nn.AttractorNetwork((8, 8), 2, 8, constraint="global", key=jax.random.key(0))
    step = eqx.filter_jit(sf.nn.attractor_sgd_step)
    norm0 = float(net.coupling_norm())
    x = jax.vmap(net.embedding.embed)(images)
    e0 = float(jnp.mean(jax.vmap(net.energy)(x)))
    for i in range(30):
        net, m = step(net, images[(i % 2) * 32:(i % 2) * 32 + 32], lr=5.0, clip=1.0)
        np.testing.assert_allclose(float(net.coupling_norm()), norm0, rtol=1e-5)
        assert float(jnp.max(jnp.abs(net.couplings[jnp.arange(16), jnp.arange(16)]))) == 0.0
    assert float(m["grad_norm"]) > 0
    e1 = float(jnp.mean(jax.vmap(net.energy)(x)))
    assert e1 < e0 - 1.0, (e0, e1)
    # the block constraint holds every block's norm
    netb = sf.nn.AttractorNetwork((8, 8), 2, 8, constraint="block", key=jax.random.key(1))
    netb, _ = step(netb, images[:32], lr=5.0, clip=1.0, objective="pseudo_likelihood")
    nb = np.asarray(netb.coupling_norm())
    off = ~np.eye(16, dtype=bool)
    np.testing.assert_allclose(nb[off], netb.norm_value, rtol=1e-5)
    assert np.all(nb[~off] == 0)


def test_network_run_reconstruct_and_call(images):
    net = sf.nn.AttractorNetwork((8, 8), 2, 8, key=jax.random.key(0))
    frames = net.reconstruct(images[0], 5)
    assert frames.shape == (6, 8, 8)
    np.testing.assert_allclose(frames[0], images[0], atol=2e-6)
    x = net.embedding.embed(images[0])
    np.testing.assert_allclose(net(x), net.run(x, 1)[1], rtol=1e-6)
    out, diag = net(x, return_diagnostics=True)
    assert diag.weights.shape == (1, 16, 16)
    with pytest.raises(ValueError, match="context and mask"):
        net(x, mask=jnp.ones((16, 16), bool))


@pytest.mark.parametrize("bad, match", [
    (np.full((8, 8), np.nan, np.float32), "NaN"),
    (np.full((8, 8), 2.0, np.float32), r"\[0, 1\]"),
    (np.zeros((8, 8), np.uint8), "floats"),
    (np.zeros((7, 8), np.float32), "shape"),
])
def test_corrupt_input_is_refused(bad, match):
    net = sf.nn.AttractorNetwork((8, 8), 2, 8, key=jax.random.key(0))
    before = np.asarray(net.couplings).copy()
    with pytest.raises(ValueError, match=match):
        net.reconstruct(bad, 3)
    with pytest.raises(ValueError, match=match):
        sf.nn.attractor_sgd_step(net, bad[None], lr=1.0, clip=1.0)
    np.testing.assert_array_equal(np.asarray(net.couplings), before)


def test_corruptions():
    rng = np.random.default_rng(0)
    img = rng.random((50, 8, 8)).astype(np.float32)
    out, m = sf.data.mask_images(img, 0.3, rng=np.random.default_rng(1))
    assert abs(m.mean() - 0.3) < 0.03 and np.all(out[m] == 0) and np.all(out[~m] == img[~m])
    out, m = sf.data.mask_images(img, 0.5, rng=np.random.default_rng(1), mode="tokens",
                                 patch=4)
    blocks = m.reshape(50, 2, 4, 2, 4).transpose(0, 1, 3, 2, 4).reshape(50, 4, 16)
    assert np.all(blocks.all(-1) | ~blocks.any(-1))  # whole patches
    y = sf.data.noisy_images(img, 0.7, rng=np.random.default_rng(2), clip=False)
    np.testing.assert_allclose(y.var(axis=(1, 2)), img.var(axis=(1, 2)), rtol=1e-4)
    np.testing.assert_allclose(y.mean(axis=(1, 2)), img.mean(axis=(1, 2)), atol=1e-5)
    yc = sf.data.noisy_images(img, 0.7, rng=np.random.default_rng(2))
    assert yc.min() >= 0 and yc.max() <= 1
    with pytest.raises(ValueError, match="fraction"):
        sf.data.mask_images(img, 1.5, rng=rng)
    with pytest.raises(ValueError, match="NaN"):
        sf.data.noisy_images(np.full((1, 2, 2), np.nan, np.float32), 0.1, rng=rng)


def test_patch_reconstructor_shapes_and_iterations():
    m = sf.nn.PatchReconstructor(4, 16, 16, depth=1, num_heads=2, key=jax.random.key(0))
    p = jax.random.uniform(jax.random.key(1), (4, 16))
    assert m(p, 3).shape == (4, 16)
    tr = m.trajectory(p, 5)
    assert tr.shape == (6, 4, 16)
    np.testing.assert_array_equal(tr[0], p)
    np.testing.assert_allclose(tr[3], m(p, 3), rtol=1e-5, atol=1e-6)
    # a traced iteration count masks a fixed-length scan: same as the Python-int call
    f = jax.jit(lambda t: m(p, t, max_iterations=7))
    np.testing.assert_allclose(f(jnp.asarray(4)), m(p, 4), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="patches must be"):
        m(jnp.ones((5, 16)), 1)


def test_energy_transformer_reconstructor_continues_one_descent():
    """One Energy Transformer block without pre-norm or MLP is x <- x_T, so k iterations are
    one descent of k*T steps (spins.energy_transformer.descent), read out through the final
    layer norm."""
    T = 3
    m = sf.nn.PatchReconstructor(4, 16, 16, 1, 2, 0, attention="energy_transformer",
                                 attention_kwargs=dict(steps=T, alpha=0.05), norm=False,
                                 final_norm=True, key=jax.random.key(0))
    assert m.blocks.norm1 is None and m.blocks.ffn is None
    p = jax.random.uniform(jax.random.key(1), (4, 16))
    attn = m.block(0).attention
    run = sf.spins.energy_transformer.descent(m.encode(p), attn.params(), steps=2 * T,
                                              alpha=0.05)
    ln = m.final_norm
    want = jax.vmap(lambda t: m.unembed(ln(t)))(run.x)
    np.testing.assert_allclose(m(p, 2), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(m.trajectory(p, 2)[2], want, rtol=1e-4, atol=1e-5)
    assert np.all(np.diff(np.asarray(run.energies)) <= 1e-5)


# --- the experiment --------------------------------------------------------------------------

def _load_experiment():
    spec = importlib.util.spec_from_file_location("attractor_exp",
                                                  ROOT / "experiments" / "attractor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_experiment_quick_config_runs_resumes_and_reports(tmp_path):
    pytest.importorskip("sklearn")
    exp = _load_experiment()
    cfg_path = ROOT / "configs" / "attractor" / "quick.yaml"
    runs, res = tmp_path / "runs", tmp_path / "res"
    over = ["attractor.epochs=1", "block.epochs=1", "vit.epochs=1", "et.epochs=1"]
    # five of the nine models (compiles are the cost); the others are built the same way
    assert exp.main(["run", "--config", str(cfg_path), "--runs", str(runs), "--quiet",
                     "--only", "attractor", "attractor_p4", "block_mask", "vit_noise",
                     "et_mask", "--set", *over]) == 0
    def state():  # the run's state, stored as its newest checkpoint's metadata
        path = sf.train.list_checkpoints(runs / "attractor")[-1][1]
        return sf.train.read_checkpoint(path, sf.train.RunState.init(
            exp.build(exp.load_config(cfg_path), "attractor", (8, 8)), None))[1]

    s0 = state()
    # asking for more epochs resumes from the saved one rather than starting over
    assert exp.main(["run", "--config", str(cfg_path), "--runs", str(runs), "--quiet",
                     "--only", "attractor", "--set", "attractor.epochs=2"]) == 0
    import json

    s1 = state()
    assert s1["epoch"] == 2 and s1["step"] == 2 * s0["step"] and len(s1["loss"]) == 2
    assert exp.main(["report", "--config", str(cfg_path), "--runs", str(runs), "--results",
                     str(res), "--quiet", "--set", *over]) == 0
    for f in ("results.json", "attractor.md", "mse_vs_t.png", "reconstructions.png",
              "patch_variance.png", "global_attractor.png", "et_energy.png"):
        assert (res / f).exists(), f
    r = json.loads((res / "results.json").read_text())
    for k in ("attractor[sphere]/mask", "attractor[sphere]/noise", "block/mask", "vit/noise",
              "attractor_p4/mask", "et/mask"):
        assert len(r["curves"][k]["mean"]) == (2 if k.startswith("vit") else 7)
    # the energy along the Energy Transformer's descent, continued to 6 blocks of 4 steps
    en = r["et_energy"]["mask"]
    assert len(en["mean"]) == 6 * en["steps_per_block"] + 1 and en["steps_per_block"] == 4
    assert 0.0 <= en["images_rising"] <= 1.0 and "et" in r["patch_var_median"]
    assert "block/noise" not in r["curves"]  # not trained: skipped, not invented
    assert 0.0 <= r["blend"]["mask"]["a"] <= 1.0
    # t = 0 is the corrupted input: the same for every model of a task
    np.testing.assert_allclose(r["curves"]["block/mask"]["mean"][0],
                               r["curves"]["attractor[sphere]/mask"]["mean"][0], rtol=1e-5)


def test_experiment_config_errors(tmp_path):
    exp = _load_experiment()
    cfg_path = ROOT / "configs" / "attractor" / "fmnist.yaml"
    with pytest.raises(ValueError, match="unknown key"):
        exp.load_config(cfg_path, ["attractor.lrr=3"])
    with pytest.raises(ValueError, match="unknown section"):
        exp.load_config(cfg_path, ["atractor.lr=3"])
    with pytest.raises(ValueError, match="et.et_options.*known"):  # checked by the section
        exp.load_config(cfg_path, ["et.et_options={step: 3}"])
    other = tmp_path / "x.yaml"
    other.write_text("model: {dim: 3}\n")
    with pytest.raises(ValueError, match="not an attractor experiment"):
        exp.load_config(other)


def test_spinformer_run_points_experiment_configs_to_their_script():
    from spinformer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="experiments/attractor.py all --config"):
        load_config(ROOT / "configs" / "attractor" / "fmnist.yaml")
