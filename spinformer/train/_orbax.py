"""Sharded checkpoints with orbax-checkpoint, for state that no single process holds whole.

With parameters split over a `model` axis across hosts, process 0 cannot write today's
single checksummed file without first gathering every array; orbax-checkpoint (the JAX
ecosystem's standard) instead has every process write its own shards, in parallel, into one
checkpoint directory that appears under its final name only once complete. Restoring puts
each shard straight onto the devices of the current mesh, which may differ from the mesh
that wrote it.

Layout: `RUN_DIR/orbax/<step>/{state,meta}`: `state` holds the array leaves of the
`RunState` (model, optimizer state, carried stream state if any, step) keyed by their position
(`"00000"`, ...), `meta` the same JSON metadata as a native checkpoint (data position, RNG,
early stopping, elapsed time). orbax keeps the `train.keep_checkpoints` newest. Orbax
checkpoints written before `RunState` (the leaves of `(model, opt_state)`, no step leaf) are
not readable by this version.
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import equinox as eqx
import jax

from ._state import RunState, host_step

__all__ = ["OrbaxCheckpoints", "available"]


def available() -> bool:
    """Whether orbax-checkpoint can be imported."""
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:
        return False
    return True


def _require():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        from .._schema import ConfigError

        raise ConfigError(
            "train.checkpointer=orbax (or a model axis spanning several processes) needs "
            "orbax-checkpoint: pip install orbax-checkpoint.") from e
    return ocp


def _leaves(tree):
    """The array leaves of `tree` (or their shapes, from `eqx.filter_eval_shape`) by name,
    the tree's structure, and the rest."""
    arrays, static = eqx.partition(
        tree, lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct))
    leaves, treedef = jax.tree.flatten(arrays)
    return {f"{i:05d}": x for i, x in enumerate(leaves)}, treedef, static


class OrbaxCheckpoints:
    """The orbax checkpoints of one run directory (`run_dir/orbax`)."""

    def __init__(self, run_dir, keep: int = 3):
        self.dir = pathlib.Path(run_dir).resolve() / "orbax"
        self.keep = keep
        self._manager = None

    def exists(self) -> bool:
        return self.dir.is_dir() and bool(self.steps())

    def manager(self):
        if self._manager is None:
            ocp = _require()
            self._manager = ocp.CheckpointManager(
                self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=self.keep,
                                                               create=True))
        return self._manager

    def steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(self.manager().all_steps())

    def path(self, step: int) -> pathlib.Path:
        return self.dir / str(step)

    def save(self, state: RunState, meta: dict[str, Any]) -> pathlib.Path:
        """Write the `RunState` `state` (every process its own shards) and `meta` as the
        checkpoint of step `int(state.step)`; returns when the checkpoint is complete on disk.
        Called by every process."""
        ocp = _require()
        step = host_step(state)
        leaves, _, _ = _leaves(state)
        mgr = self.manager()
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(leaves),
                                               meta=ocp.args.JsonSave(meta)), force=True)
        mgr.wait_until_finished()
        return self.path(step)

    def restore_latest(self, like: RunState, shardings: Optional[Any] = None
                       ) -> Optional[tuple[RunState, dict]]:
        """`(state, meta)` of the newest checkpoint, read into the structure of the
        `RunState` `like` with the array leaves placed by `shardings` (a tree like `like` of
        `Sharding`s, e.g. `_mesh.state_shardings`; None: the default device), or None if
        there is none."""
        steps = self.steps()
        if not steps:
            return None
        ocp = _require()
        leaves, treedef, static = _leaves(like)
        if shardings is None:
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            placed = {k: dev for k in leaves}
        else:  # one Sharding per array leaf, in the same order (None elsewhere is dropped)
            flat = jax.tree.leaves(shardings)
            if len(flat) != len(leaves):
                raise ValueError(f"{len(flat)} shardings for {len(leaves)} arrays.")
            placed = dict(zip(sorted(leaves), flat))
        abstract = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed[k])
                    for k, x in leaves.items()}
        step = steps[-1]
        got = self.manager().restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        arrays = jax.tree.unflatten(treedef, [got.state[k] for k in sorted(leaves)])
        return eqx.combine(arrays, static), dict(got.meta)

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None
