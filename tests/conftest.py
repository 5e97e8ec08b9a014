import contextlib
import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compile for the tests' small programs, not for speed. Almost all of the suite's time is
# XLA:CPU compiling (about 85 % of test_nn.py: 84 s of 103 s in its two slowest tests), and
# with its per-kernel LLVM pipeline most of that goes into optimising kernels that then run
# for microseconds. JAX's `jax_disable_most_optimizations` (LLVM at level 0, no expensive
# passes) and XLA's `--xla_cpu_use_fusion_emitters=false` together cut the compile of one
# spin-attention gradient from 11.6 to 2.7 s (either alone: about 8.5 s). Neither changes
# the arithmetic's semantics (no fast-math); they change how fast the code runs, which no
# default test measures. Both are set through the environment, so the subprocesses the tests
# start (the CLI, the experiments, the sharding workers) inherit them. Modules whose time is
# spent running long Monte Carlo chains rather than compiling turn the first back on with
# the `optimized_compiles` fixture (the second is fixed when the backend starts).
# SPINFORMER_TEST_OPTIMIZED=1 runs the whole suite with XLA's defaults.
if os.environ.get("SPINFORMER_TEST_OPTIMIZED", "") in ("", "0"):
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_use_fusion_emitters" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_cpu_use_fusion_emitters=false".strip()

# One persistent compilation cache, shared by the xdist workers and the subprocesses the
# tests start (the CLI, the experiments): a program compiled by one test is read back by every
# other that builds the same one (the zoo's runs of one cell, the CLI's configs and the
# modules that `jax.clear_caches()` (below) separates repeat many programs), and by the next
# run of the suite. It is the command line's cache folder (`spinformer._toolchain
# .compilation_cache_dir`) with `tests` appended, kept between runs (the tests' programs are
# compiled with other flags, which are part of every entry's key), and pruned as the command
# line prunes its own (`prune_compilation_cache`: past 2 GiB when a run starts, the least
# recently used entries go) rather than by JAX's size limit, whose file lock and scan of the
# whole folder on every entry written made a run with an empty folder much slower over the
# suite's thousands of small programs (69 % of the tests in 21 minutes, against 17 minutes
# for all of them without it). An entry read while another process is writing it does not
# decompress, and JAX then warns and compiles. The cache holds compiled code only (tracing
# still happens), so no test's behaviour changes. SPINFORMER_TEST_CACHE=fresh uses a throwaway
# folder (removed at the end: a run that pays every compilation, as on a fresh machine);
# SPINFORMER_TEST_CACHE=0 turns it off.
_CACHE_OWNER = False
_TEST_CACHE = os.environ.get("SPINFORMER_TEST_CACHE", "")
if _TEST_CACHE != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    if _TEST_CACHE == "fresh":
        import tempfile

        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spinformer-test-xla-")
        _CACHE_OWNER = True
    else:
        from spinformer._toolchain import compilation_cache_dir, prune_compilation_cache

        _dir = compilation_cache_dir()
        if _dir is not None:
            _dir = _dir / "tests"
            prune_compilation_cache(_dir)
            os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_dir)
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax
import pytest


def pytest_unconfigure(config):
    if _CACHE_OWNER and not hasattr(config, "workerinput"):  # the controlling process
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop every compiled program after each test module. Each XLA:CPU executable keeps
    memory mappings of its own; over the whole suite one process accumulated more than the
    kernel's default limit of 65530 (vm.max_map_count), and LLVM then crashed with a
    segmentation fault while compiling (reproducibly, ~80 % into the run). Test modules share
    jitted functions within themselves, not across modules, so this costs little."""
    yield
    jax.clear_caches()
    gc.collect()


@contextlib.contextmanager
def _xla_optimizations(enabled: bool):
    """XLA's optimisations on (`True`) or off for the programs compiled inside."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", not enabled)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture(scope="session")
def xla_optimizations():
    """The context manager `xla_optimizations(enabled)`: XLA's optimisations on or off for
    the programs compiled inside it (e.g. off again for the short programs of a module that
    `optimized_compiles` turns them on for)."""
    return _xla_optimizations


@pytest.fixture(scope="module")
def optimized_compiles():
    """XLA's full optimisation for a module whose programs run long (Monte Carlo chains):
    there the optimised code saves more than its compile costs."""
    with _xla_optimizations(True):
        yield


@pytest.fixture
def getkey():
    """Returns a function that hands out fresh PRNG keys, deterministically per test."""
    state = {"key": jax.random.key(0)}

    def _getkey():
        state["key"], sub = jax.random.split(state["key"])
        return sub

    return _getkey


@pytest.fixture
def x64():
    """Runs the test with float64 enabled (restored afterwards)."""
    with jax.enable_x64(True):
        yield
