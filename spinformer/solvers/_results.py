"""Result codes and the `Solution` returned by every solve."""

from __future__ import annotations

import equinox as eqx
from jaxtyping import Array, Float, Int, PyTree


class RESULTS:
    """Integer codes stored in `Solution.result`.

    They are plain Python ints, so `sol.result == RESULTS.successful` works elementwise on the
    integer array a solve returns (also under `jit` and `vmap`).
    """

    successful = 0
    max_steps_reached = 1
    nonfinite = 2

    _messages = {
        successful: "",
        max_steps_reached: (
            "the solver reached max_steps without the residual falling below tol. "
            "Increase max_steps, loosen tol, add damping (Picard(damping=0.5)) or use "
            "Anderson; pass throw=False to get the Solution and inspect `result`/`residual`."
        ),
        nonfinite: (
            "the iteration produced a non-finite value (NaN or inf): the map diverged or is "
            "undefined at an iterate. Check the inputs, lower the coupling strength, add "
            "damping, or pass throw=False to get the Solution and inspect `result`."
        ),
    }

    @classmethod
    def message(cls, code: int) -> str:
        """A human-readable explanation of a result code."""
        return cls._messages[int(code)]

    @classmethod
    def name(cls, code: int) -> str:
        """The name of a result code, e.g. `"max_steps_reached"`."""
        for k in ("successful", "max_steps_reached", "nonfinite"):
            if getattr(cls, k) == int(code):
                return k
        raise ValueError(f"unknown result code {code!r}")


class Solution(eqx.Module):
    """The outcome of `fixed_point` or `root_find` for one problem.

    **Fields:**

    - `value`: the solution, a pytree with the structure of `x0`.
    - `num_steps`: iterations taken after the initial evaluation (int32 scalar). The map was
      evaluated `num_steps + 1` times by Picard and Anderson.
    - `residual`: the final residual norm, ‖fn(x) − x‖ for fixed points or ‖F(x)‖ for roots
      (∞-norm unless `norm="l2"` was asked for).
    - `result`: a `RESULTS` code (int32 scalar).

    Under `vmap` every field gains the batch dimension: each example has its own steps,
    residual and result.
    """

    value: PyTree[Array]
    num_steps: Int[Array, ""]
    residual: Float[Array, ""]
    result: Int[Array, ""]
