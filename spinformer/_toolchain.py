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


# ----------------------------------------------------------- the persistent compilation cache

# Where the command line keeps compiled programs between runs: a folder, or 0/off to switch
# the cache off. Unset: $XDG_CACHE_HOME/spinformer/jax (~/.cache/spinformer/jax); a
# JAX_COMPILATION_CACHE_DIR the user set is kept.
CACHE_ENV = "SPINFORMER_COMPILATION_CACHE"
# The most the cache holds: a folder grown past it loses its least recently used programs
# when the next process starts (`prune_compilation_cache`), down to half of it.
CACHE_MAX_BYTES = 2 * 1024**3
_OFF = ("0", "off", "false", "no", "none")


def compilation_cache_dir(environ=None):
    """The folder `use_compilation_cache` would use, or None when it is switched off
    (`SPINFORMER_COMPILATION_CACHE=off`): SPINFORMER_COMPILATION_CACHE, else JAX's own
    JAX_COMPILATION_CACHE_DIR, else the user's cache directory."""
    import pathlib

    env = os.environ if environ is None else environ
    value = env.get(CACHE_ENV, "").strip()
    if value.lower() in _OFF:
        return None
    if value:
        return pathlib.Path(value).expanduser()
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return pathlib.Path(env["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "spinformer" / "jax"


def prune_compilation_cache(path, max_bytes: int = CACHE_MAX_BYTES) -> int:
    """Keep a compilation-cache folder under `max_bytes`: when its files add up to more, the
    least recently used (by access, else modification, time) are deleted until half of
    `max_bytes` is left. JAX's own size limit would do this too, but with a file lock and a
    scan of the whole folder on every entry written, a cost that grows with the folder and
    that a cache of every small program cannot afford; here the folder is scanned once, when
    a process starts (figures: docs/results/cost.md, "Compile time").

    **Returns:** the number of files deleted."""
    try:
        entries = [(max(st.st_atime, st.st_mtime), st.st_size, e.path)
                   for e in os.scandir(path) if e.is_file(follow_symlinks=False)
                   for st in (e.stat(),)]
    except OSError:
        return 0
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    deleted = 0
    for _, size, file in sorted(entries):
        if total <= max_bytes // 2:
            break
        try:
            os.remove(file)
        except OSError:
            continue
        total -= size
        deleted += 1
    return deleted


def use_compilation_cache(environ=None):
    """Switch on JAX's persistent compilation cache for this process (before its first
    compilation): every program compiled is written to `compilation_cache_dir()` and read
    back by the next run with the same program, jax, jaxlib and device (all part of the
    entry's key, so versions never mix), small ones included (building a model eagerly
    compiles dozens of small programs, which a second run would otherwise pay for again).
    The folder is pruned to `CACHE_MAX_BYTES` first (`prune_compilation_cache`). Concurrent
    processes share it: an entry read while another process is writing it does not
    decompress, and JAX then warns and compiles it. A folder that cannot be created leaves
    the cache off with a warning. A JAX_COMPILATION_CACHE_DIR the user set is left to JAX's
    own settings (JAX reads it).

    **Returns:** the folder, or None when the cache is off."""
    path = compilation_cache_dir(environ)
    env = os.environ if environ is None else environ
    if path is not None and environ is None:
        # jaxlib logs a C++ warning for every program it reads back ("Assume version
        # compatibility. PjRt-IFRT does not track XLA executable versions."), a line per
        # cached program; read when jaxlib loads, so this only takes effect before the
        # first `import jax`. TF_CPP_MIN_LOG_LEVEL=0 shows them again.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if path is None or (not env.get(CACHE_ENV, "").strip()
                        and env.get("JAX_COMPILATION_CACHE_DIR")):
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"the compilation cache {path} cannot be created ({e.strerror or e}); "
                      f"compiling without it. Set {CACHE_ENV} to another folder, or to off.",
                      RuntimeWarning, stacklevel=2)
        return None
    prune_compilation_cache(path)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


class CompileClock:
    """Seconds JAX spends tracing, lowering and compiling (XLA) while the clock is active,
    and the programs read from the persistent cache instead of compiled:

        with CompileClock() as clock:
            step(...)
        clock.seconds, clock.cache_hits
    """

    _active: list = []
    _listening = False
    _EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
               "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
               "/jax/core/compile/backend_compile_duration": "xla"}

    def __init__(self):
        self.parts = {"trace": 0.0, "lower": 0.0, "xla": 0.0}
        self.cache_hits = 0

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    @classmethod
    def _listen(cls):
        if cls._listening:
            return
        from jax import monitoring

        def duration(event, secs, **_):
            part = cls._EVENTS.get(event)
            for clock in cls._active if part else ():
                clock.parts[part] += secs

        def count(event, **_):
            if event == "/jax/compilation_cache/cache_hits":
                for clock in cls._active:
                    clock.cache_hits += 1

        monitoring.register_event_duration_secs_listener(duration)
        monitoring.register_event_listener(count)
        cls._listening = True

    def __enter__(self):
        self._listen()
        CompileClock._active.append(self)
        return self

    def __exit__(self, *exc):
        CompileClock._active.remove(self)
        return False


def release_compiled_code() -> None:
    """Drop every compiled program of this process (`jax.clear_caches()`, then a garbage
    collection so that the executables, and the memory mappings each holds, are freed now).

    Each XLA:CPU executable keeps memory mappings of its own. A training run compiles its
    programs once, but a grid of runs in one process kept them all: the quick zoo grid
    grew by about 1,650 mappings per run and died at the kernel's limit of 65,530
    (`vm.max_map_count`) with "LLVM compilation error: Cannot allocate memory", 38 runs in.
    Between runs nothing compiled is reused (the persistent compilation cache gives the next
    run of the same program its code back), so dropping it costs nothing."""
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def failure_message(e: BaseException) -> str:
    """The one line of an exception that says what failed: a solver's own line
    (`fixed_point: ...`, `root_find: ...`, without JAX's wrapper prefix) where there is one,
    else the first line of the message (the type's name for an empty one). What a grid's
    failed run records (`failed.json`) and the experiment scripts print."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    msg = next((x for x in lines if "fixed_point:" in x or "root_find:" in x),
               lines[0] if lines else type(e).__name__)
    return msg.split("EquinoxRuntimeError: ")[-1]
