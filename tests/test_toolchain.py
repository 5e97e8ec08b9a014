"""The installed toolchain, where a known upstream bug would hurt this library.

jaxlib 0.10.0–0.10.2 split every batched LAPACK call on the CPU (Cholesky, LU, triangular
solves, eigh) over XLA's intra-op thread pool and wait for the parts there. When as many
such calls run at once as the pool has threads, every thread waits for parts queued behind
the others and the program never returns. Free-energy attention (batched Cholesky),
adaptive TAP and Deep Implicit attention (batched solves) call them in every step; the zoo
hung this way on 2 cores. `pyproject.toml` excludes those releases; this test keeps a
release with the same bug from coming back unnoticed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Six independent batched factorisations in one program, in a process restricted to two
# CPUs so that XLA's pool has two threads (it sizes the pool from the CPU affinity): with
# jaxlib 0.10.2 this hangs on its first call, every time (measured for Cholesky, LU solve,
# triangular solve, eigh and inverse; QR does not hang); jaxlib 0.9.2 runs it in ~3 s.
_PROGRAM = textwrap.dedent(
    """
    import os, sys
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, set(cpus[:2]))
    import jax, jax.numpy as jnp
    op = {"cholesky": jnp.linalg.cholesky,
          "solve": lambda a: jnp.linalg.solve(a, a[..., :1])}[sys.argv[1]]

    @jax.jit
    def f(xs):
        return sum(op(x).sum() for x in xs)

    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    xs = [x @ jnp.swapaxes(x, -1, -2) + 32 * jnp.eye(32)
          for x in (jax.random.normal(k, (64, 32, 32)) for k in keys)]
    for i in range(20):
        f([x + 1e-3 * i for x in xs]).block_until_ready()
    print("done")
    """
)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
@pytest.mark.parametrize("op", ["cholesky", "solve"])
def test_concurrent_batched_lapack_calls_return(op):
    import jaxlib

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    try:
        out = subprocess.run([sys.executable, "-c", _PROGRAM, op], env=env, timeout=120,
                             capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"six concurrent batched {op} calls did not return in 120 s with jaxlib "
            f"{jaxlib.__version__} on a 2-thread pool: this jaxlib deadlocks batched LAPACK "
            "calls (see docs/guides/installing.md, 'Known problem'); install a jaxlib the "
            "bounds in pyproject.toml allow (pip install -e .)."
        )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("done")


@pytest.mark.parametrize("version, cpus, warns", [
    ("0.10.2", 2, True), ("0.10.0", 16, True), ("0.10.2", 1, False), ("0.9.2", 2, False),
])
def test_training_warns_about_a_deadlocking_jaxlib(monkeypatch, version, cpus, warns):
    import warnings

    import jax
    import jaxlib

    from spinformer import _toolchain

    monkeypatch.setattr(jaxlib, "__version__", version)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    _toolchain.check_jaxlib.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _toolchain.check_jaxlib() is warns
            assert _toolchain.check_jaxlib() is warns  # cached: warns once per process
        msgs = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(msgs) == int(warns)
        if warns:
            assert version in msgs[0] and "jaxlib!=0.10.*" in msgs[0] and "taskset" in msgs[0]
    finally:
        _toolchain.check_jaxlib.cache_clear()
