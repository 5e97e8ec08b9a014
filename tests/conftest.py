import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compile for the tests' small programs, not for speed. Almost all of the suite's time is
# XLA:CPU compiling (about 85 % of test_nn.py: 84 s of 103 s in its two slowest tests), and
# with its per-kernel LLVM pipeline most of that goes into optimising kernels that then run
# for microseconds. These two flags cut the compile of one spin-attention gradient from 11.6
# to 2.5 s (neither alone: 8.3 and 8.5 s). Both keep the arithmetic (no fast-math); they
# change how fast the code runs, which no default test measures. Subprocesses the tests start
# (the CLI, the experiments, the sharding workers) inherit them. SPINFORMER_TEST_OPTIMIZED=1
# runs the suite with XLA's defaults instead.
_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if os.environ.get("SPINFORMER_TEST_OPTIMIZED", "") in ("", "0"):
    _flags = os.environ.get("XLA_FLAGS", "").split()
    _flags += [f for f in _TEST_XLA_FLAGS if f.split("=")[0] not in " ".join(_flags)]
    os.environ["XLA_FLAGS"] = " ".join(_flags)

import jax
import pytest


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
