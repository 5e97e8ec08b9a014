"""The one check of a `Literal[...]` option field's value, where a module stores it."""

from __future__ import annotations

import difflib
import typing
from typing import Any


def check_literal(where: str, arg: str, value: Any, alias: Any) -> str:
    """`value` if it is one of the values of the `Literal` alias `alias`; otherwise a
    `ValueError` naming `where`, the argument `arg`, the allowed values and the nearest one."""
    allowed = typing.get_args(alias)
    if isinstance(value, str) and value in allowed:
        return value
    close = difflib.get_close_matches(str(value), list(allowed), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{where}: {arg}={value!r} is not one of {list(allowed)}.{hint}")
