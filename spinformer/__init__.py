"""spinformer: attention as the response of a spin system, in JAX and Equinox.

- `spinformer.solvers`: fixed points and roots (Picard, Anderson, Broyden, Newton) and how to
  differentiate them (implicit, unrolled, phantom, one-step).
- `spinformer.spins`: the physics as pure functions (binary Ising, kinetic Ising, vector spins).
- `spinformer.nn`: Equinox attention modules, blocks, stacked transformers and heads.
- `spinformer.data`, `spinformer.train`, `spinformer.config`: datasets, the training loop
  and typed experiment configs behind the `spinformer` command.
"""

import os as _os


def _xla_cpu_workaround() -> None:
    """Turn off XLA:CPU's concurrency-optimised scheduler unless the user set it.

    With it (the default of jaxlib 0.10.x), programs with nested while loops and LAPACK calls
    -- the free-energy attention's damped-Newton saddle under `vmap`, differentiated
    implicitly -- deadlock at random inside one execution: every thread idle, the step never
    returns (jaxlib 0.10.2: about one training step in 150; 0.10.1: the first step, every
    time). With the flag off, 1,600 steps ran without a stall. `XLA_FLAGS` is read when the
    backend starts, so this only takes effect if nothing ran on JAX before spinformer was
    imported; a value of the flag already in `XLA_FLAGS` is left alone. The flag is a debug
    option that other backends ignore; it is set only for jaxlib >= 0.10 (where it was tested:
    XLA aborts on flags it does not know).
    """
    from importlib import metadata

    try:
        major, minor = (int(x) for x in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return
    flag = "xla_cpu_enable_concurrency_optimized_scheduler"
    flags = _os.environ.get("XLA_FLAGS", "")
    if (major, minor) >= (0, 10) and flag not in flags:
        _os.environ["XLA_FLAGS"] = f"{flags} --{flag}=false".strip()


_xla_cpu_workaround()

from . import config, data, nn, solvers, spins, train  # noqa: E402

__version__ = "0.1.0"

__all__ = ["config", "data", "nn", "solvers", "spins", "train", "__version__"]
