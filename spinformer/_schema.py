"""The building blocks of config schemas, shared by `spinformer.config` and the attention
modules that declare their own config section (`spinformer.nn.register_attention`).

Imports only the standard library, so any module may define a section without import cycles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Union

__all__ = ["ConfigError", "option"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


def option(
    default: Any,
    help: str,
    choices: Union[tuple, Callable[[], tuple], None] = None,
    *,
    renamed: Optional[Mapping[Any, Any]] = None,
    kind: Optional[str] = None,
):
    """A config field: its default, its one-line meaning and, optionally, its allowed values.

    **Arguments:**

    - `default`: the default value, or a config dataclass (a nested section, built with its
      own defaults), or an instance of one (a nested section with these defaults).
    - `help`: one line saying what the field means (`spinformer.config.describe` prints it).
    - `choices`: the allowed values, if the field is an enumeration (a tuple, or a function
      returning one when the values are registered at run time).
    - `renamed`: old values that are no longer accepted, each mapped to its new name; reading
      one is an error that names the new value.
    - `kind`: the field names an option object of this kind (`spinformer._choices`): its
      allowed values are the registered names, and reading the config builds the object
      (`nn.section_kwargs`).

    **Returns:** a `dataclasses.field`.
    """
    meta: dict[str, Any] = {"help": help}
    if kind is not None:
        from ._choices import choice_names  # standard library only, like this module

        meta["kind"] = kind
        choices = choices if choices is not None else (lambda: choice_names(kind))
    if choices is not None:
        meta["choices"] = choices if callable(choices) else tuple(choices)
    if renamed:
        meta["renamed"] = dict(renamed)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
