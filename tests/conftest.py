import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest


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
