"""The run state: everything a training run carries from one optimizer step to the next."""

from __future__ import annotations

from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._optim import init_opt_state

__all__ = ["RunState"]


def _as_step(x):
    return jnp.asarray(x, jnp.int32) if isinstance(x, (int, np.integer)) else x


class RunState(eqx.Module):
    """The state of a training run, one pytree through the step, the loop, both
    checkpointers and resume.

    **Fields:**

    - `model`: the Equinox model (parameters and static structure).
    - `opt_state`: the optimizer's state (`optimizer.init` on the model's trainable leaves;
      None for a model trained without an optax optimizer).
    - `stream`: `(B, ...)`, the state each of the B parallel streams of a streaming run
      (`fit(stream=True)`, `data.stream: true`) starts its next chunk from (the model's
      `diagnostics.state` of the previous step; `init_stream_state` at the start); None for
      a run that carries nothing between batches. A step streams iff it is not None.
    - `step`: `()` int32, the number of optimizer steps taken (skipped non-finite steps
      included: the data position advances). Keyword only; a Python int is made an array
      (a Python int would be a static leaf, compiled into the step).

    `RunState.init(model, optimizer)` starts a run; `jit_step(optimizer)` maps a state to
    the next one; `save_checkpoint(dir, state, meta)` / `load_latest(dir, like)` and the
    orbax checkpointer write and read it whole.
    """

    model: Any
    opt_state: Any
    stream: Optional[Array] = None
    step: Array = eqx.field(kw_only=True, converter=_as_step)

    @classmethod
    def init(cls, model, optimizer, *, stream: Optional[Array] = None) -> "RunState":
        """The state before the first step: `optimizer.init` on the model's trainable leaves
        (None if `optimizer` is None), the carried `stream` state `(B, ...)` of a streaming run
        (None otherwise), step 0."""
        opt_state = None if optimizer is None else init_opt_state(optimizer, model)
        return cls(model, opt_state, stream, step=0)


def host_step(state: RunState) -> int:
    """`state.step` as a Python int, read on the host (also when the scalar is an array
    replicated over devices of several processes)."""
    x = state.step
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return int(np.asarray(x))
