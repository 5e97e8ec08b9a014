"""Checks of the installed toolchain against upstream bugs that would hurt this library."""

from __future__ import annotations

import functools
import os
import warnings

# jaxlib releases that split a batched LAPACK call on the CPU over XLA's intra-op pool and
# wait for the parts there: as many concurrent calls as the pool has threads never return.
# Measured on 2 cores: 0.10.0 and 0.10.2 hang (Cholesky, LU and triangular solves, eigh,
# inverse), 0.9.2 does not (tests/test_toolchain.py). pyproject.toml excludes them; an
# environment installed around that (`--no-deps`, a GPU build) can still have one.
_DEADLOCKING_JAXLIB = ("0.10.",)


@functools.cache
def check_jaxlib() -> bool:
    """Warns (once per process) if the installed jaxlib is a release known to deadlock
    batched LAPACK calls on the CPU and this process computes on the CPU.

    **Returns:** whether it warned.
    """
    import jax
    import jaxlib

    version = getattr(jaxlib, "__version__", "")
    if not version.startswith(_DEADLOCKING_JAXLIB) or jax.default_backend() != "cpu":
        return False
    try:
        threads = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        threads = os.cpu_count() or 1
    if threads <= 1:  # a pool of one thread runs the parts inline and cannot wedge
        return False
    warnings.warn(
        f"jaxlib {version} can deadlock batched linear algebra on the CPU (Cholesky, "
        "solves, eigh: free-energy, adaptive-TAP and Deep Implicit attention use them): a "
        "training step may then never return, with no CPU in use. Install a jaxlib without "
        "this bug (pip install 'jax!=0.10.*' 'jaxlib!=0.10.*'), or pin the process to one "
        "CPU (taskset -c 0 ...). See the installing guide's 'Known problem'.",
        RuntimeWarning, stacklevel=3,
    )
    return True
