"""The products with an explicit-transpose reverse pass (`spins._common.matmul_rt`,
`matmul_nt_rt`): every derivative equals the plain product's, batched and unbatched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer.spins._common import matmul_nt_rt, matmul_rt

_PLAIN = {
    "rt": (matmul_rt, lambda a, b: a @ b, (5, 4), (4, 3)),
    "nt_rt": (matmul_nt_rt, lambda a, b: jnp.einsum("...nd,...sd->...ns", a, b), (5, 3),
              (6, 3)),
}


@pytest.mark.parametrize("name", sorted(_PLAIN))
def test_derivatives_equal_the_plain_product(name):
    ours, plain, sa, sb = _PLAIN[name]
    batch = (2,)
    ka, kb = jax.random.split(jax.random.key(0))
    A = jax.random.normal(ka, batch + sa)
    B = jax.random.normal(kb, batch + sb)

    def loss(f):
        return lambda A, B: jnp.sum(jnp.sin(f(A, B)) * jnp.cos(A).sum())

    np.testing.assert_array_equal(ours(A, B), plain(A, B))
    for d in (jax.grad, jax.jacfwd):
        for got, want in zip(d(loss(ours), (0, 1))(A, B), d(loss(plain), (0, 1))(A, B)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.hessian(loss(ours), 1)(A, B),
                               jax.hessian(loss(plain), 1)(A, B), rtol=1e-4, atol=1e-5)
    vm = jax.vmap(jax.grad(loss(ours), 1))(A[None], B[None])[0]
    np.testing.assert_allclose(vm, jax.grad(loss(plain), 1)(A, B), rtol=1e-5, atol=1e-6)
