"""spinformer: attention as the response of a spin system, in JAX and Equinox.

- `spinformer.solvers`: fixed points and roots (Picard, Anderson, Broyden, Newton) and how to
  differentiate them (implicit, unrolled, phantom, one-step).
- `spinformer.spins`: the physics as pure functions (binary Ising, kinetic Ising, vector spins).
- `spinformer.nn`: Equinox attention modules, blocks, stacked transformers and heads.
- `spinformer.data`, `spinformer.train`, `spinformer.config`: datasets, the training loop
  and typed experiment configs behind the `spinformer` command.
- `spinformer.grid`: grids of runs against softmax at equal steps or equal compute (the zoo,
  the scaling study, a family of one's own), behind `spinformer grid`.

The subpackages are imported when first used (`spinformer.nn` or `import spinformer.nn`), so
that `import spinformer.solvers` loads the solvers alone.
"""

import importlib as _importlib

__version__ = "0.2.0"

__all__ = ["config", "data", "grid", "nn", "solvers", "spins", "train", "__version__"]


def __getattr__(name: str):
    if name in __all__:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'spinformer' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
