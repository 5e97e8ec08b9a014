"""Mixed precision: matrix products in bfloat16 with float32 parameters."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp


class _MixedLinear(eqx.Module):
    """An `eqx.nn.Linear` whose product runs in bfloat16 with float32 accumulation and
    output; its parameters (`weight`, `bias`, read through) stay float32."""

    inner: eqx.nn.Linear

    @property
    def weight(self):
        return self.inner.weight

    @property
    def bias(self):
        return self.inner.bias

    def __getattr__(self, name):  # in_features, out_features, use_bias, ...
        return getattr(self.inner, name)

    def __call__(self, x, *, key=None):
        w = self.inner.weight
        y = jnp.matmul(w.astype(jnp.bfloat16), x.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32).astype(x.dtype)
        if self.inner.bias is not None:
            y = y + self.inner.bias
        return y


def mixed_precision(model):
    """`model` with every `eqx.nn.Linear` computing in bfloat16 (float32 accumulation and
    output). Parameters, their gradients and everything else — the attention's fixed-point
    solves, LayerNorm, softmax, the loss — stay float32: a solve's tolerance (1e-4 .. 1e-6)
    is below bfloat16's resolution (2^-8 ~ 4e-3), so a bfloat16 solve would never report
    convergence, and its implicit gradient needs the accurate fixed point."""
    is_linear = lambda m: isinstance(m, eqx.nn.Linear)  # noqa: E731
    return jax.tree.map(lambda m: _MixedLinear(m) if is_linear(m) else m, model,
                        is_leaf=is_linear)
