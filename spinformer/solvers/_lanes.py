"""A while loop that, under `vmap`, stops paying for the systems that have finished.

`jax.lax.while_loop` under `vmap` runs its body on every example until the slowest one is
done, keeping the finished ones with a `select`: a batch whose solves take 17 iterations on
average and 73 at most pays 73 for all of them. `while_lanes` gives the same result (every
system goes through the same iterations) at about the cost of its active systems: once at
most half of them are still running, it gathers those into a batch half the size and runs
the loop on that, and so on down to batches of `_FLOOR` (8) systems. Each level compiles one
more copy of the loop body (5 for the 128 systems of 32 examples × 4 heads); halving saved
more than quartering on modern Hopfield's retrievals, and levels of 4 and 2 systems cost
compilation without saving step time (docs/results/cost.md). The tests check the results
bit for bit against the plain loop's on small problems, and floors of 2, 8 and 16 trained
the zoo's cells measured to the same bits; but a floor of 32 changed modern Hopfield's
characters cell in the last bits after 60 steps: XLA may round a batch of one size
differently from another, so it is not a guarantee.

Nested `vmap`s (examples × heads) are flattened into one batch of systems first, so the
compaction sees every system of the call at once.
"""

from __future__ import annotations

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp

# Each level gathers the active systems into a batch this many times smaller than the last.
_SHRINK = 2
# The smallest batch a level gathers (>= 2): smaller levels cost a compiled copy of the loop
# each and saved no step time on the CPU (docs/results/cost.md, "Lane compaction where it
# pays")
_FLOOR = 8


def while_lanes(cond: Callable[[Any, Any], Any], body: Callable[[Any, Any], Any],
                operands: Any, init: Any) -> Any:
    """`jax.lax.while_loop(lambda c: cond(operands, c), lambda c: body(operands, c), init)`,
    compacting finished systems under `vmap` (see the module docstring).

    `operands` holds everything `cond` and `body` read besides the carry (arrays and other
    leaves; they must not close over traced values). `cond` returns a scalar bool. Without
    `vmap` this is the plain loop."""
    dyn, static = eqx.partition(operands, eqx.is_array)

    def cond1(d, c):
        return cond(eqx.combine(d, static), c)

    def body1(d, c):
        return body(eqx.combine(d, static), c)

    @jax.custom_batching.custom_vmap
    def one(d, c):
        return jax.lax.while_loop(lambda c_: cond1(d, c_), lambda c_: body1(d, c_), c)

    @one.def_vmap
    def _rule(axis_size, in_batched, d, c):
        d_axes = jax.tree.map(lambda b: 0 if b else None, in_batched[0])
        c = _broadcast(c, in_batched[1], axis_size)
        out = _lanes(cond1, body1, d_axes, d, c)
        return out, jax.tree.map(lambda _: True, out)

    return one(dyn, init)


def _broadcast(tree, batched, n):
    return jax.tree.map(lambda x, b: x if b else jnp.broadcast_to(x, (n, *jnp.shape(x))),
                        tree, batched)


def _lanes(cond, body, d_axes, d, c):
    """The loop over `n` stacked systems: carries `c` with a leading axis n, operands `d`
    with a leading axis where `d_axes` says 0. Under an enclosing `vmap` (size B) the
    systems of every example are flattened into one batch of B·n systems."""

    @jax.custom_batching.custom_vmap
    def run(d, c):
        return _compact(cond, body, d_axes, d, c)

    @run.def_vmap
    def _rule(B, in_batched, d, c):
        first, first_batched = jax.tree.leaves(c)[0], jax.tree.leaves(in_batched[1])[0]
        n = first.shape[1] if first_batched else first.shape[0]
        c = _broadcast(c, in_batched[1], B)
        c = jax.tree.map(lambda x: x.reshape(B * n, *x.shape[2:]), c)

        def flat(x, inner, outer):  # (B·n, ...) for every leaf batched at either level
            if inner is None and not outer:
                return [x, None]
            if not outer:
                x = jnp.broadcast_to(x, (B, *x.shape))
            if inner is None:
                x = jnp.broadcast_to(x[:, None], (B, n, *x.shape[1:]))
            return [x.reshape(B * n, *x.shape[2:]), 0]

        pairs = [flat(x, a, b) for x, a, b in zip(
            jax.tree.leaves(d), _axes_leaves(d, d_axes), jax.tree.leaves(in_batched[0]))]
        treedef = jax.tree.structure(d)
        d2 = jax.tree.unflatten(treedef, [p[0] for p in pairs])
        axes2 = jax.tree.unflatten(treedef, [p[1] for p in pairs])
        out = _lanes(cond, body, axes2, d2, c)
        out = jax.tree.map(lambda x: x.reshape(B, n, *x.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return run(d, c)


def _axes_leaves(d, d_axes):
    """The vmap axis (0 or None) of every leaf of `d`, in `jax.tree.leaves(d)`'s order."""
    return jax.tree.structure(d).flatten_up_to(d_axes)


def _compact(cond, body, d_axes, d, c):
    """Run every system of `c` (leading axis n) until its `cond` is False, gathering the
    active ones into batches of n/2, n/4, ... (at least `_FLOOR`) once few enough are left."""
    n = jax.tree.leaves(c)[0].shape[0]
    vcond = jax.vmap(cond, in_axes=(d_axes, 0))
    vbody = jax.vmap(body, in_axes=(d_axes, 0))

    def keep(active, new, old):
        return jax.tree.map(
            lambda a, b: jnp.where(active.reshape(-1, *(1,) * (a.ndim - 1)), a, b), new, old)

    def level(dd, cc, active, stop_at):
        """Iterate the systems `cc` until at most `stop_at` are active."""
        def lbody(carry):
            cc, active = carry
            cc = keep(active, vbody(dd, cc), cc)
            return cc, active & vcond(dd, cc)

        return jax.lax.while_loop(lambda carry: jnp.sum(carry[1]) > stop_at, lbody,
                                  (cc, active))

    sizes = [n]
    while -(-sizes[-1] // _SHRINK) >= _FLOOR:
        sizes.append(-(-sizes[-1] // _SHRINK))
    active = vcond(d, c)
    c, active = level(d, c, active, sizes[1] if len(sizes) > 1 else 0)
    for i, size in enumerate(sizes[1:], start=1):
        stop_at = sizes[i + 1] if i + 1 < len(sizes) else 0

        def gathered(c, active, size=size, stop_at=stop_at):
            # the active systems first (a stable sort keeps their order)
            idx = jnp.argsort(~active, stable=True)[:size]
            dd = jax.tree.unflatten(jax.tree.structure(d), [
                x if a is None else x[idx]
                for x, a in zip(jax.tree.leaves(d), _axes_leaves(d, d_axes))])
            cc, act = level(dd, jax.tree.map(lambda x: x[idx], c), active[idx], stop_at)
            return (jax.tree.map(lambda full, part: full.at[idx].set(part), c, cc),
                    active.at[idx].set(act))

        # a level that would not iterate (few enough already) costs no gather
        c, active = jax.lax.cond(jnp.sum(active) > stop_at, gathered, lambda c, a: (c, a),
                                 c, active)
    return c
