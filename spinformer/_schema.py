"""The building blocks of config schemas, and the one table where config words become classes.

- `option(default, help, ...)`: a field of a config section (a frozen dataclass), with its
  one-line meaning and its allowed values.
- The name table: `register_choice(kind, name)` offers a class under a config word (the
  attentions, the solvers and adjoints, and each family's algorithm choices: kinds such as
  `"attention"`, `"solver"`, `"spin.update"`), and `choice(kind, value)` turns the word into
  an object (one lookup, one "did you mean"). A plugin adds its entry with the same
  decorator. Below the config, modules take objects.
- A field declared with `option(obj, help, kind=...)` holds an object of that kind (a
  solver, an adjoint, an update rule): a config writes its name, or its name and the
  fields of its class (`solver: {name: picard, damping: 0.3}`), and reading the config
  builds the object (`spinformer.config`).
- `register_attention(name, config=...)`: an attention module and its config section, the
  `"attention"` entries of the same table:

```python
@dataclasses.dataclass(frozen=True)
class HopfieldConfig:
    beta: float = option(1.0, "inverse temperature")
    solver: solvers.AbstractSolver = option(solvers.Picard(), "retrieval", kind="solver")

_DEFAULTS = HopfieldConfig()

@register_attention("hopfield", config=HopfieldConfig, help="modern Hopfield retrieval")
class HopfieldAttention(eqx.Module):
    def __init__(self, dim, num_heads=1, causal=False, *, beta=_DEFAULTS.beta,
                 solver=_DEFAULTS.solver, key):
        ...
```

  After registration `Transformer(attention="hopfield")` builds it, every config made from
  then on accepts `model.attention: hopfield` with the section `model.hopfield`, and
  `spinformer.train.build_model` passes the section's fields to the constructor by name. The
  constructor's defaults are the section's, so a module built in Python equals one built
  from a default config.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Callable, ClassVar, Optional, Union

from . import solvers

__all__ = ["Choice", "ConfigError", "Registration", "attention_names", "check_solvers",
           "check_values", "choice", "choice_names", "default_attention", "get_attention",
           "kinds_of", "name_of", "option", "register_attention", "register_choice",
           "registrations", "unregister_attention"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


def option(
    default: Any,
    help: str,
    choices: Union[tuple, Callable[[], tuple], None] = None,
    *,
    kind: Optional[str] = None,
):
    """A config field: its default, its one-line meaning and, optionally, its allowed values.

    **Arguments:**

    - `default`: the default value, or a config dataclass (a nested section, built with its
      own defaults), or an instance of one (a nested section with these defaults).
    - `help`: one line saying what the field means (`spinformer.config.describe` prints it).
    - `choices`: the allowed values, if the field is an enumeration (a tuple, or a function
      returning one when the values are registered at run time).
    - `kind`: the field holds an object of a class registered under this kind
      (`register_choice`): a config gives its name, or a mapping of its name and fields, and
      reading the config builds the object.

    **Returns:** a `dataclasses.field`.
    """
    meta: dict[str, Any] = {"help": help}
    if kind is not None:
        meta["kind"] = kind
        choices = choices if choices is not None else (lambda: choice_names(kind))
    if choices is not None:
        meta["choices"] = choices if callable(choices) else tuple(choices)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ------------------------------------------------------------------------------ the table

# kind -> name -> class
_TABLE: dict[str, dict[str, type]] = {}


class Choice:
    """Base class of the families' option objects (frozen dataclasses, so they are hashable:
    modules keep them as static fields, and two equal options compare equal).

    `kind` and `name` are class attributes set by `register_choice`; `str(option)` is its
    name (what a config file holds)."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""

    def __str__(self) -> str:
        return self.name


def register_choice(kind: str, name: str) -> Callable[[type], type]:
    """Class decorator: offer class `cls` as the config word `name` of `kind` (e.g.
    `register_choice("spin.update", "tap")`, `register_choice("solver", "picard")`).
    A `Choice` must be a frozen dataclass and learns its `kind` and `name`. Registering a
    second class under a taken name is an error; re-registering the same class is not."""

    def decorate(cls: type) -> type:
        if not isinstance(cls, type):
            raise TypeError(f"register_choice({kind!r}, {name!r}): {cls!r} is not a class.")
        if issubclass(cls, Choice):
            if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
                raise TypeError(f"register_choice({kind!r}, {name!r}): {cls.__name__} must "
                                "be a frozen dataclass (options are hashable and compare by "
                                "value).")
            cls.kind, cls.name = kind, name
        table = _TABLE.setdefault(kind, {})
        if name in table and table[name] is not cls:
            raise ValueError(f"register_choice: {kind} {name!r} is already "
                             f"{table[name].__name__}.")
        table[name] = cls
        return cls

    return decorate


def did_you_mean(value: Any, options, *, n: int = 1, cutoff: float = 0.6,
                 prefix: str = "") -> str:
    """`" Did you mean 'x'?"` for the options nearest `value` (up to `n`, `prefix` put before
    each), or `""`: the one hint every refusal of a name gives."""
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=n,
                                      cutoff=cutoff)
    return f" Did you mean {' or '.join(repr(prefix + c) for c in close)}?" if close else ""


def choice_names(kind: str) -> tuple[str, ...]:
    """The registered names of a kind, in registration order."""
    return tuple(_TABLE.get(kind, {}))


def choice_class(kind: str, name: str, *, where: Optional[str] = None) -> type:
    """The class registered as `name` of `kind`; an unknown name raises `ConfigError` with
    the nearest registered one (the one "did you mean"), naming `where` (default: the
    kind)."""
    table = _TABLE.get(kind)
    if not table:
        raise KeyError(f"nothing of kind {kind!r} is registered.")
    if name in table:
        return table[name]
    raise ConfigError(f"{where or kind}={name!r} is not one of {list(table)}."
                      f"{did_you_mean(name, table)}")


def choice(kind: str, value: Any, *, where: Optional[str] = None) -> Any:
    """The object of `kind` that `value` names: a registered name becomes its class built
    with default fields; an object of a class registered under `kind` is returned as is.
    Anything else raises `ConfigError` (an unknown name) or `TypeError` (an object of
    another kind), naming `where` (default: the kind)."""
    if isinstance(value, str):
        return choice_class(kind, value, where=where)()
    table = _TABLE.get(kind, {})
    if any(type(value) is cls for cls in table.values()):
        return value
    if isinstance(value, Choice):
        raise TypeError(f"{where or kind}: {type(value).__name__} is a {value.kind or 'Choice'} "
                        f"option, not a {kind} option; choose one of {list(table)}.")
    raise TypeError(f"{where or kind}: expected one of {list(table)} (or its object), got "
                    f"{value!r}.")


# -------------------------------------------------- the solvers' config words (kind: class)

for _kind, _names in (
        ("solver", dict(anderson=solvers.Anderson, picard=solvers.Picard,
                        broyden=solvers.Broyden, newton=solvers.Newton,
                        reversible=solvers.Reversible)),
        ("adjoint", dict(implicit=solvers.Implicit, unrolled=solvers.Unrolled,
                         phantom=solvers.Phantom, onestep=solvers.OneStep,
                         reversible=solvers.ReversibleAdjoint)),
        ("linear_solver", dict(anderson=solvers.Anderson, picard=solvers.Picard,
                               gmres=solvers.GMRES, bicgstab=solvers.BiCGStab,
                               dense=solvers.Dense, auto=solvers.Auto))):
    for _name, _cls in _names.items():
        register_choice(_kind, _name)(_cls)
del _kind, _names, _name, _cls


def kinds_of(cls: type) -> tuple[str, ...]:
    """The kinds under which class `cls` is registered."""
    return tuple(k for k, table in _TABLE.items() if cls in table.values())


def name_of(kind: str, obj: Any) -> str:
    """The config word of object `obj` of `kind` (its class's registered name); a
    `ConfigError` if its class is not registered (a config cannot name it)."""
    for name, cls in _TABLE.get(kind, {}).items():
        if type(obj) is cls:
            return name
    raise ConfigError(f"{type(obj).__name__} is not registered as a {kind}; a config names "
                      f"only registered classes (register_choice({kind!r}, name)).")


def check_solvers(section, *, root: bool = False) -> None:
    """A family section's check of its `solver` and `adjoint` (in its `__post_init__`): they
    must fit each other and the problem (`root=True`: a root; `solvers.check_solver`); a
    `ConfigError` names both keys."""
    try:
        solvers.check_solver(section.solver, section.adjoint, root=root)
    except ValueError as e:
        raise ConfigError(f"solver.name={name_of('solver', section.solver)!r} with adjoint.name="
                          f"{name_of('adjoint', section.adjoint)!r}: {e}") from None


def check_values(config: type, where: str, **values) -> None:
    """Run the checks of config section `config` (its `__post_init__`) on `values`, fields of
    it (the others at their defaults): a module's constructor checks its arguments with the
    checks its section makes when a config is read, so each value is checked in one place.
    A failure is a `ValueError` led by `where`."""
    try:
        config(**values)
    except ConfigError as e:
        raise ValueError(f"{where}: {e}") from None


# ------------------------------------------------------------------------------ attentions
#
# An attention is one module plus its frozen config dataclass, registered under its config
# word (kind "attention"); `model.<name>` is then its section, whose fields are the
# constructor's keyword arguments.

# The coupling fields assumed for an attention that does not declare its own: the maps that
# build attention weights from queries and keys.
COUPLING_FIELDS = ("to_q", "to_k", "to_qk")


@dataclasses.dataclass(frozen=True)
class Registration:
    """What a registered attention declares (the arguments of `register_attention`, and
    `cls`, the class, called as `cls(dim=, num_heads=, causal=, key=, **kwargs)`)."""

    name: str
    cls: type
    config: Optional[type]
    help: str
    takes_max_len: bool = False
    min_head_dim: int = 1
    coupling_fields: tuple[str, ...] = COUPLING_FIELDS
    carries_state: Optional[dict] = None
    default: bool = False

    def build(self, *, dim: int, num_heads: int, causal: bool, max_len: int, key,
              **kwargs):
        """The attention module `cls(dim=, num_heads=, causal=, key=, **kwargs)`, given
        `max_len=` (the longest key sequence) when the class takes it and `kwargs` does not
        set it."""
        if self.takes_max_len:
            kwargs.setdefault("max_len", max_len)
        return self.cls(dim=dim, num_heads=num_heads, causal=causal, key=key, **kwargs)

    def kwargs_from(self, section) -> dict:
        """Constructor keyword arguments from the config section: its fields by name (`{}`
        without a config)."""
        if self.config is None:
            return {}
        if not isinstance(section, self.config):
            raise TypeError(f"attention {self.name!r}: expected a {self.config.__name__} "
                            f"section, got {type(section).__name__}.")
        return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


# name -> Registration
_REGISTRY: dict[str, Registration] = _TABLE.setdefault("attention", {})


def register_attention(name: str, *, config: Optional[type] = None, help: str = "",
                       takes_max_len: bool = False, min_head_dim: int = 1,
                       coupling_fields: tuple[str, ...] = COUPLING_FIELDS,
                       carries_state: Optional[dict] = None, default: bool = False):
    """Class decorator: register an attention module under `name`.

    **Arguments:**

    - `name`: a Python identifier (it becomes the config section `model.<name>`).
    - `config`: a frozen dataclass of the module's options (fields made with `option`), or
      None. Each field is passed to the constructor under its own name. Take the
      constructor's defaults from the section (`_DEFAULTS = Config()`,
      `beta=_DEFAULTS.beta`) so that both agree: a test builds every registration both ways.
    - `help`: one line saying what the attention is.
    - `takes_max_len`: the constructor takes `max_len=` (given by `Transformer`).
    - `min_head_dim`: the smallest head width `dim / num_heads` the class accepts (checked
      when a config is read).
    - `coupling_fields`: the fields holding the parameters that define the couplings (the
      optimizer group "couplings" of `nn.param_labels`).
    - `carries_state`: the section values under which the module carries its state from
      one call to the next (`state=`, what streaming data needs), e.g. `{"mode": "steps",
      "init": "carried"}`; None: never.
    - `default`: make this the default of `model.attention` (one registration at most).

    **Returns:** the decorator, which returns the class unchanged.
    """
    if not name.isidentifier():
        raise ValueError(f"register_attention: name {name!r} must be a Python identifier.")
    if config is not None and not (dataclasses.is_dataclass(config)
                                   and config.__dataclass_params__.frozen):
        raise TypeError(f"register_attention({name!r}): config must be a frozen dataclass, "
                        f"got {config!r}.")

    def decorate(cls):
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"register_attention: {name!r} is already registered to "
                             f"{_REGISTRY[name].cls.__name__}.")
        params = inspect.signature(cls.__init__).parameters
        missing = [f.name for f in dataclasses.fields(config)
                   if f.name not in params] if config else []
        if missing and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise TypeError(f"register_attention({name!r}): {cls.__name__}'s constructor has "
                            f"no argument {missing[0]!r} of its config section; rename the "
                            "field or the argument.")
        if default and any(r.default and r.name != name for r in _REGISTRY.values()):
            raise ValueError(f"register_attention({name!r}, default=True): "
                             f"{default_attention()!r} is already the default.")
        _REGISTRY[name] = Registration(name, cls, config, help, takes_max_len, min_head_dim,
                                       tuple(coupling_fields), carries_state, default)
        return cls

    return decorate


def unregister_attention(name: str) -> None:
    """Remove a registered attention (e.g. one a test registered)."""
    _REGISTRY.pop(name)


def default_attention() -> str:
    """The default of `model.attention`: the registration made with `default=True`, else the
    first registered."""
    if not _REGISTRY:
        raise ValueError("no attention is registered.")
    return next((r.name for r in _REGISTRY.values() if r.default), next(iter(_REGISTRY)))


def attention_names() -> tuple[str, ...]:
    """The registered attention names, in registration order."""
    return tuple(_REGISTRY)


def registrations() -> tuple[Registration, ...]:
    """Every registration, in registration order."""
    return tuple(_REGISTRY.values())


def get_attention(attention: Union[str, type, Callable]) -> Registration:
    """The registration of an attention name or class. An unregistered callable gets a
    registration of its own (no config, no `max_len`, the default coupling fields), so any
    `attention(dim=, num_heads=, causal=, key=, **kwargs)` works."""
    if isinstance(attention, str):
        return choice_class("attention", attention, where="attention")
    for reg in _REGISTRY.values():
        if reg.cls is attention:
            return reg
    if not callable(attention):
        raise TypeError(f"attention must be a name or a callable, got {attention!r}.")
    return Registration(getattr(attention, "__name__", "custom"), attention, None, "")
