"""Data parallelism with `jax.sharding`: a device mesh, sharded batches, replicated (or
`model`-sharded) parameters, and several processes.

JAX's own engine does the work: the training step is one `jit` over global arrays, and the
compiler (GSPMD) inserts the gradient all-reduce because the batch is sharded along the
`data` axis while the parameters are replicated. Nothing here is per-device code (no `pmap`).

```python
mesh = make_mesh({"data": 4})                  # or None: every device on `data`
state = place_state(RunState.init(model, optimizer), mesh)
batch = shard_batch(dataset.batch(step), mesh)  # each process passes the global batch
```

Several processes (`jax.distributed`): each process calls `initialize_distributed` first,
builds the same model (same seed), and passes the *global* batch to `shard_batch`; each
process only turns its own rows into device buffers (every process reads its own slice of
the data). Only process 0 writes files (`is_writer`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._schema import ConfigError

__all__ = [
    "MODEL_SHARD_MIN_SIZE",
    "initialize_distributed",
    "is_writer",
    "make_mesh",
    "place_state",
    "shard_batch",
]

# parameters smaller than this stay replicated on a `model` axis (sharding them saves nothing)
MODEL_SHARD_MIN_SIZE = 4096


def initialize_distributed(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> bool:
    """Start `jax.distributed` when several processes are asked for; returns whether it did.

    Arguments override the environment: `SPINFORMER_COORDINATOR` (host:port of process 0),
    `SPINFORMER_NUM_PROCESSES`, `SPINFORMER_PROCESS_ID`; with none of them set (and no
    cluster JAX detects by itself, e.g. SLURM or a TPU pod, which `jax.distributed.initialize`
    reads when called without arguments and `SPINFORMER_DISTRIBUTED=auto` is set) nothing is
    started and training uses this process's devices. Must run before any JAX computation.
    On CPU the cross-process collectives are gloo's (over TCP).
    """
    env = os.environ
    coordinator = coordinator or env.get("SPINFORMER_COORDINATOR")
    if num_processes is None and env.get("SPINFORMER_NUM_PROCESSES"):
        num_processes = int(env["SPINFORMER_NUM_PROCESSES"])
    if process_id is None and env.get("SPINFORMER_PROCESS_ID"):
        process_id = int(env["SPINFORMER_PROCESS_ID"])
    if coordinator is None and num_processes is None and process_id is None:
        if env.get("SPINFORMER_DISTRIBUTED") == "auto":
            jax.distributed.initialize()
            return True
        return False
    missing = [n for n, v in (("--coordinator", coordinator), ("--num-processes", num_processes),
                              ("--process-id", process_id)) if v is None]
    if missing:
        raise ConfigError(f"several processes need all of --coordinator, --num-processes and "
                          f"--process-id (or SPINFORMER_COORDINATOR, ..._NUM_PROCESSES, "
                          f"..._PROCESS_ID); missing {', '.join(missing)}.")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id {process_id} must be in [0, {num_processes}).")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    return True


def is_writer() -> bool:
    """Whether this process writes checkpoints, metrics and figures (process 0)."""
    return jax.process_index() == 0


def make_mesh(spec: Optional[Mapping[str, int]] = None, devices=None) -> Mesh:
    """A `Mesh` with axes `("data", "model")` from `train.mesh`.

    **Arguments:**

    - `spec`: axis name -> size (`{"data": 4}`, `{"data": 2, "model": 2}`; one size may be -1,
      the devices left over); a missing axis has size 1; None: every device on `data`.
    - `devices`: the devices to use (default `jax.devices()`, all processes').

    Raises `ConfigError` when the sizes do not multiply to at most the number of devices (a
    smaller mesh uses the first devices; with several processes it must use all of them).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    spec = dict(spec or {"data": -1})
    sizes = {"data": spec.get("data", 1), "model": spec.get("model", 1)}
    free = [k for k, v in sizes.items() if v == -1]
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if n % fixed:
            raise ConfigError(f"train.mesh={dict(spec)}: {n} devices are not divisible by the "
                              f"fixed axis sizes ({fixed}).")
        sizes[free[0]] = n // fixed
    total = sizes["data"] * sizes["model"]
    if total > n:
        raise ConfigError(f"train.mesh={dict(spec)} needs {total} devices; there are {n} "
                          f"({', '.join(sorted({d.platform for d in devices}))}). On CPU, "
                          "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N.")
    if jax.process_count() > 1 and total != n:
        raise ConfigError(f"train.mesh={dict(spec)} uses {total} of the {n} devices of "
                          f"{jax.process_count()} processes; with several processes the mesh "
                          "must use every device.")
    grid = np.asarray(devices[:total], dtype=object).reshape(sizes["data"], sizes["model"])
    return Mesh(grid, ("data", "model"))


def mesh_for(spec: Optional[Mapping[str, int]]) -> Optional[Mesh]:
    """The mesh a run trains on for `train.mesh = spec`: `make_mesh(spec)`, or None (nothing
    sharded, the default device) when no mesh is asked for and there is one device."""
    if spec is None and jax.device_count() == 1:
        return None
    return make_mesh(spec)


def _param_spec(x, model_size: int) -> P:
    """Replicated, or the last axis split over `model` for large enough matrices."""
    if (model_size > 1 and getattr(x, "ndim", 0) >= 2 and x.size >= MODEL_SHARD_MIN_SIZE
            and x.shape[-1] % model_size == 0):
        return P(*([None] * (x.ndim - 1)), "model")
    return P()


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """The `NamedSharding` of every array leaf of `tree` (a `RunState`, or parameters and
    optimiser state): replicated, except the large matrices whose last axis is split over a
    `model` axis of size > 1 (Adam's moments follow their parameters, having the same
    shapes); a `RunState`'s carried stream state `(B, ...)` is split over `data` like the
    batch it belongs to."""
    from ._state import RunState

    model_size = mesh.shape["model"]
    out = jax.tree.map(
        lambda x: NamedSharding(mesh, _param_spec(x, model_size)) if eqx.is_array(x) else None,
        tree)
    if isinstance(tree, RunState) and tree.stream is not None:
        out = eqx.tree_at(lambda s: s.stream, out, batch_sharding(mesh, np.ndim(tree.stream)))
    return out


def place_state(tree: Any, mesh: Mesh) -> Any:
    """Put every array leaf of `tree` (a `RunState`, or parameters and optimiser state) on
    `mesh` (see `state_shardings`); other leaves pass, and so do arrays already placed so.

    With several processes every process holds the same values (same seed, same checkpoint),
    and each contributes its own devices' copies or shards."""
    shardings = state_shardings(tree, mesh)

    def put(x, s):
        if s is None or (isinstance(x, jax.Array) and x.sharding == s):
            return x
        if jax.process_count() == 1:
            return jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings, is_leaf=lambda x: x is None)


def constrain_state(tree: Any, mesh: Mesh) -> Any:
    """`jax.lax.with_sharding_constraint` of every array leaf to `state_shardings` (inside
    `jit`: the step's outputs keep the layout of its inputs)."""
    arrays, rest = eqx.partition(tree, eqx.is_array)
    shardings = state_shardings(arrays, mesh)
    arrays = jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, s), arrays,
                          shardings)
    return eqx.combine(arrays, rest)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) axis split over `data`, the rest replicated."""
    return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))


def check_batch_size(batch_size: int, mesh: Mesh, what: str = "data.batch_size") -> None:
    """A batch that does not split evenly over the `data` axis is a `ConfigError`."""
    d = mesh.shape["data"]
    if batch_size % d:
        raise ConfigError(f"{what}={batch_size} is not divisible by the data axis of the mesh "
                          f"({d} devices); choose a multiple of {d} or set train.mesh.")


def shard_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """The global batch (numpy arrays, leading axis the examples) as arrays sharded over
    `data`. With several processes each passes the same global batch and only its own rows
    (those of its devices) are copied to devices."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        s = batch_sharding(mesh, v.ndim)
        if jax.process_count() == 1:
            out[k] = jax.device_put(v, s)
        else:
            out[k] = jax.make_array_from_callback(v.shape, s, lambda idx, v=v: v[idx])
    return out


def gather(tree: Any) -> Any:
    """Every array leaf as a host numpy array with its global value (an all-gather across
    processes for arrays not fully addressable here)."""
    from jax.experimental import multihost_utils

    def get(x):
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:  # every process holds the whole value
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)
