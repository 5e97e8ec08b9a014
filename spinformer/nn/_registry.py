"""The attention registry: each attention class declares its name and its config section.

A new attention is one module plus one frozen config dataclass:

```python
@dataclasses.dataclass(frozen=True)
class HopfieldConfig:
    beta: float = option(1.0, "inverse temperature")
    solver: SolverOptions = option(SolverOptions(name="picard"), "retrieval")

_DEFAULTS = HopfieldConfig()

@register_attention("hopfield", config=HopfieldConfig, help="modern Hopfield retrieval")
class HopfieldAttention(eqx.Module):
    def __init__(self, dim, num_heads=1, causal=False, *, beta=_DEFAULTS.beta,
                 solver=_DEFAULTS.solver.build(), key):
        ...
```

After registration `Transformer(attention="hopfield")` builds it, every `ModelConfig` made
from then on accepts `model.attention: hopfield` with the section `model.hopfield` (the
config reads the registry when it is made, so it is never stale), and
`spinformer.train.build_model` passes the section's fields to the constructor by name, the
`solver` section built into a solver object (`section_kwargs`). The constructor's defaults
are the section's, so a module built in Python equals one built from a default config.

Registrations live in the one name table of `spinformer._schema` (kind `"attention"`), beside
the solvers, adjoints and the families' algorithm choices.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional, Union

from .._schema import _TABLE, choice, choice_class

# The coupling fields assumed for an attention that does not declare its own: the maps that
# build attention weights from queries and keys.
COUPLING_FIELDS = ("to_q", "to_k", "to_qk")

__all__ = [
    "Registration",
    "attention_names",
    "default_attention",
    "get_attention",
    "register_attention",
    "unregister_attention",
]


@dataclasses.dataclass(frozen=True)
class Registration:
    """What a registered attention declares.

    **Fields:**

    - `name`: the name used in configs (`model.attention`) and by `Transformer(attention=...)`.
    - `cls`: the attention class, called as `cls(dim=, num_heads=, causal=, key=, **kwargs)`.
    - `config`: its frozen config dataclass (the section `model.<name>`), or None if it has
      no options; `kwargs_from` turns a section into constructor keyword arguments
      (`section_kwargs`).
    - `help`: one line for `model.attention`'s description.
    - `takes_max_len`: the constructor needs `max_len=` (the longest key sequence).
    - `min_head_dim`: the smallest head width `dim / num_heads` the class accepts (checked
      when a config is read).
    - `coupling_fields`: the names of the module's fields whose parameters define its
      couplings (e.g. the query/key maps, or Ising couplings J); `nn.param_labels` puts them
      in the optimizer group "couplings".
    - `carries_state`: `carries_state(section) -> bool`, whether the module built from these
      options carries a state from one call to the next (`state=`, streaming data), or None
      if it never does; `carries_state_when` says in config keys what makes it so, and
      `carries_state_keys` names the section's keys it reads (quoted when it says no).
    - `default`: this attention is `model.attention`'s default.
    """

    name: str
    cls: type
    config: Optional[type]
    help: str
    takes_max_len: bool = False
    min_head_dim: int = 1
    coupling_fields: tuple[str, ...] = COUPLING_FIELDS
    carries_state: Optional[Callable[[Any], bool]] = None
    carries_state_when: str = ""
    carries_state_keys: tuple[str, ...] = ()
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
        """Constructor keyword arguments from the config section (`{}` without a config)."""
        if self.config is None:
            return {}
        if not isinstance(section, self.config):
            raise TypeError(f"attention {self.name!r}: expected a {self.config.__name__} "
                            f"section, got {type(section).__name__}.")
        return section_kwargs(section)


# name -> Registration: the "attention" entries of the one name table
_REGISTRY: dict[str, Registration] = _TABLE.setdefault("attention", {})


def register_attention(
    name: str,
    *,
    config: Optional[type] = None,
    help: str = "",
    takes_max_len: bool = False,
    min_head_dim: int = 1,
    coupling_fields: tuple[str, ...] = COUPLING_FIELDS,
    carries_state: Optional[Callable[[Any], bool]] = None,
    carries_state_when: str = "",
    carries_state_keys: tuple[str, ...] = (),
    default: bool = False,
):
    """Class decorator: register an attention module under `name`.

    **Arguments:**

    - `name`: a Python identifier (it becomes the config section `model.<name>`).
    - `config`: a frozen dataclass of the module's options (fields made with
      `spinformer.config.option`), or None. Each field is passed to the constructor under
      its own name (`solver`/`adjoint` sections built into objects, `section_kwargs`). Take
      the constructor's defaults from the section (`_DEFAULTS = Config()`,
      `beta=_DEFAULTS.beta`) so that both agree: a test builds every registration both ways.
    - `help`: one line saying what the attention is.
    - `takes_max_len`: the constructor takes `max_len=` (given by `Transformer`).
    - `min_head_dim`: the smallest allowed head width `dim / num_heads`.
    - `coupling_fields`: the fields holding the parameters that define the couplings (the
      optimizer group "couplings" of `nn.param_labels`).
    - `carries_state`, `carries_state_when`: `carries_state(section) -> bool` says whether the
      module built from a config section carries its state between calls (the condition
      streaming data needs), and `carries_state_when` says so in config keys, e.g.
      `"model.spin.mode=steps and model.spin.init=carried"`; `carries_state_keys` names the
      section keys the condition reads, e.g. `("mode", "init")`.
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
        if config is not None:
            _check_section_matches(name, cls, config)
        if default and any(r.default and r.name != name for r in _REGISTRY.values()):
            raise ValueError(f"register_attention({name!r}, default=True): "
                             f"{default_attention()!r} is already the default.")
        _REGISTRY[name] = Registration(name, cls, config, help, takes_max_len, min_head_dim,
                                       tuple(coupling_fields), carries_state,
                                       carries_state_when, tuple(carries_state_keys), default)
        return cls

    return decorate


def section_kwargs(section) -> dict:
    """Constructor keyword arguments from a config section: every field under its own name,
    a sub-section that describes an object (a solver, an adjoint: it has `build()`) built
    into that object, and a field declared with `option(..., kind=...)` turned from its name
    into its option object (`spinformer._schema.choice`). What `Registration.kwargs_from`
    uses."""
    return {f.name: (choice(f.metadata["kind"], v, where=f.name) if "kind" in f.metadata
                     else v.build() if hasattr(v, "build") else v)
            for f in dataclasses.fields(section) for v in [getattr(section, f.name)]}


def _check_section_matches(name: str, cls: type, config: type) -> None:
    """Every field of the section must be a constructor argument."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    missing = [f.name for f in dataclasses.fields(config) if f.name not in params]
    if missing:
        raise TypeError(f"register_attention({name!r}): {cls.__name__}'s constructor has no "
                        f"argument {missing[0]!r} of its config section; rename the field or "
                        "the argument.")


def unregister_attention(name: str) -> None:
    """Remove a registered attention (e.g. one a test registered)."""
    _REGISTRY.pop(name)


def default_attention() -> str:
    """The default of `model.attention`: the registration made with `default=True`, else the
    first registered."""
    for reg in _REGISTRY.values():
        if reg.default:
            return reg.name
    if not _REGISTRY:
        raise ValueError("no attention is registered.")
    return next(iter(_REGISTRY))


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
