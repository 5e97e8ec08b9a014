"""Checks of the installed toolchain against upstream bugs that would hurt this library."""

from __future__ import annotations

import functools
import os
import warnings

# jaxlib releases that split a batched LAPACK call on the CPU over XLA's intra-op pool and
# wait for the parts there: as many concurrent calls as the pool has threads never return
# (0.10.0 and 0.10.2 hang in Cholesky, LU and triangular solves, eigh and inverse; 0.9.x does
# not; tests/test_toolchain.py). pyproject.toml excludes them; an environment installed
# around that (`--no-deps`, a GPU build) can still have one.
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


# glibc's malloc serves XLA:CPU's large buffers (a training step's temporaries, often more
# than 100 MiB) by fresh memory mappings, so every step pays a page fault per 4 KiB page it
# touches. With the tunable below (glibc >= 2.35) malloc asks the kernel for transparent huge
# pages on those mappings (where THP is in `madvise` or `always` mode): one fault per 2 MiB
# instead of per 4 KiB, which shortens the steps of models with large activations (the
# installing guide's "Speed on the CPU" has the figures); programs with small buffers are
# unaffected. The tunable must be in the environment when the process starts, so the
# `spinformer` command and the experiment scripts re-execute themselves with it
# (`restart_with_hugepages`).
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def hugepage_environment(environ=None, *, libc=None, thp_setting=_THP_SETTING):
    """The environment to restart this process with so that glibc's malloc backs large
    buffers with transparent huge pages, or None where that does not apply: not Linux,
    not glibc >= 2.35 (`libc`: `platform.libc_ver()`'s `(name, version)`), transparent huge
    pages off (`never`) or unknown, the tunable already set, or the user opted out with
    `SPINFORMER_HUGEPAGES=0`.

    **Returns:** a copy of `environ` (default `os.environ`) with `HUGEPAGE_TUNABLE` added to
    `GLIBC_TUNABLES` (keeping the tunables already there), or None.
    """
    import platform
    import sys

    environ = dict(os.environ if environ is None else environ)
    if environ.get("SPINFORMER_HUGEPAGES", "") == "0" or not sys.platform.startswith("linux"):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return None
    name, version = platform.libc_ver() if libc is None else libc
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return None
    if name != "glibc" or (major, minor) < (2, 35):
        return None
    try:
        with open(thp_setting) as f:
            mode = f.read()
    except OSError:
        return None
    if "[always]" not in mode and "[madvise]" not in mode:
        return None
    environ["GLIBC_TUNABLES"] = f"{tunables}:{HUGEPAGE_TUNABLE}" if tunables else HUGEPAGE_TUNABLE
    return environ


def hugepages_on(environ=None) -> bool:
    """Whether `environ` (default `os.environ`) asks glibc's malloc for huge pages."""
    environ = os.environ if environ is None else environ
    return HUGEPAGE_TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def restart_with_hugepages(command=None) -> None:
    """Replace this process by `command` (default: the same script with the same arguments,
    `[sys.executable, *sys.argv]`) run with the huge-page malloc tunable in its environment;
    a no-op where `hugepage_environment` says it does not apply or it is already set. Call it
    first thing in a program's entry point, never from library code: the process is
    replaced (same PID), so nothing done before survives."""
    import sys

    env = hugepage_environment()
    if env is None:
        return
    command = [sys.executable, *sys.argv] if command is None else list(command)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(command[0], command, env)
    except OSError:  # cannot restart (a frozen executable, a sandbox): run as we are
        return
