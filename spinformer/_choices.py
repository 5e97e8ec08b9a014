"""Options that select behaviour, as objects: the one mechanism every attention family uses.

A solver is an object that carries its own stopping rule; the same holds for every other
option that changes what a module computes: the spin layer's update rule, its dynamics and
its initial state, Boltzmann inference, NeuroGame's estimator and pooling, and so on. Each
such option is a small frozen dataclass registered under a *kind* (for example
`"spin.update"`) and a *name* (`"tap"`), and it carries the behaviour itself (a method such
as `update.step(...)`), so the module calls it instead of comparing strings.

Names become objects in exactly one function, `choice(kind, value)`:

- a config section declares the field with `option("tap", help, kind="spin.update")`: the
  YAML holds the name, the allowed values are the registered names (read when a config is
  made, so a registration made later is listed), and `nn.section_kwargs` turns the name into
  the object when the config is read;
- a constructor given a name (`SpinAttention(64, update="tap")`, a convenience for notebooks)
  resolves it through the same function, so the module always holds objects.

```python
@register_choice("spin.update", "tap")
@dataclasses.dataclass(frozen=True)
class TAPUpdate(Choice):
    def step(self, ...): ...
```

Imports only the standard library, so any module may declare choices without import cycles.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, ClassVar, Optional

__all__ = ["Choice", "choice", "choice_names", "register_choice"]

# kind -> name -> class
_KINDS: dict[str, dict[str, type]] = {}


class Choice:
    """Base class of the option objects (frozen dataclasses, so they are hashable: modules
    keep them as static fields, and two equal options compare equal).

    `kind` and `name` are class attributes set by `register_choice`; `str(option)` is its
    name (what a config file holds)."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""

    def __str__(self) -> str:
        return self.name


def register_choice(kind: str, name: str) -> Callable[[type], type]:
    """Class decorator: offer the frozen dataclass `cls` (a `Choice`) as the value `name` of
    the options of `kind` (e.g. `register_choice("spin.update", "tap")`). Registering a
    second class under a taken name is an error; re-registering the same class is not."""

    def decorate(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Choice)):
            raise TypeError(f"register_choice({kind!r}, {name!r}): {cls!r} must subclass "
                            "spinformer._choices.Choice.")
        if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
            raise TypeError(f"register_choice({kind!r}, {name!r}): {cls.__name__} must be a "
                            "frozen dataclass (options are hashable and compare by value).")
        table = _KINDS.setdefault(kind, {})
        if name in table and table[name] is not cls:
            raise ValueError(f"register_choice: {kind} {name!r} is already "
                             f"{table[name].__name__}.")
        cls.kind, cls.name = kind, name
        table[name] = cls
        return cls

    return decorate


def choice_names(kind: str) -> tuple[str, ...]:
    """The registered names of a kind, in registration order."""
    return tuple(_KINDS.get(kind, {}))


def choice(kind: str, value: Any, *, where: Optional[str] = None) -> Choice:
    """The option object of `kind` that `value` names: a registered name becomes its class
    built with default fields; an object of a class registered under `kind` is returned as
    is. Anything else raises `ValueError` (unknown name, with the nearest registered one) or
    `TypeError` (an object of another kind), naming `where` (default: the kind)."""
    table = _KINDS.get(kind)
    if not table:
        raise KeyError(f"no option of kind {kind!r} is registered.")
    where = where or kind
    if isinstance(value, Choice):
        if table.get(value.name) is type(value):
            return value
        raise TypeError(f"{where}: {type(value).__name__} is a {value.kind or 'Choice'} "
                        f"option, not a {kind} option; choose one of {list(table)}.")
    if isinstance(value, str):
        if value in table:
            return table[value]()
        close = difflib.get_close_matches(value, list(table), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where}={value!r} is not one of {list(table)}.{hint}")
    raise TypeError(f"{where}: expected one of {list(table)} (or its option object), got "
                    f"{value!r}.")
