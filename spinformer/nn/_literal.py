"""The one check of a `Literal[...]` option field's value, where a module stores it."""

from __future__ import annotations

import typing
from typing import Any

from .._schema import did_you_mean


def check_literal(where: str, arg: str, value: Any, alias: Any) -> str:
    """`value` if it is one of the values of the `Literal` alias `alias`; otherwise a
    `ValueError` naming `where`, the argument `arg`, the allowed values and the nearest one."""
    allowed = typing.get_args(alias)
    if isinstance(value, str) and value in allowed:
        return value
    raise ValueError(f"{where}: {arg}={value!r} is not one of {list(allowed)}."
                     f"{did_you_mean(value, allowed)}")
