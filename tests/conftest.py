import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
