"""The building blocks of config schemas, and the one table where config words become classes.

- `option(default, help, ...)`: a field of a config section (a frozen dataclass), with its
  one-line meaning and its allowed values.
- The name table: `register_choice(kind, name)` offers a class under a config word (the
  attentions, the solvers and adjoints, and each family's algorithm choices: kinds such as
  `"attention"`, `"solver"`, `"spin.update"`), and `choice(kind, value)` turns the word into
  an object (one lookup, one "did you mean"). A plugin adds its entry with the same
  decorator. Below the config, modules take objects.
- `SolverOptions`, `AdjointOptions`: the YAML sections `solver` and `adjoint` of a family,
  turned into solver and adjoint objects by `build()` (the reusable `solvers` package knows
  nothing of YAML).
- `register_attention(name, config=...)`: an attention module and its config section, the
  `"attention"` entries of the same table:

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
import re
from typing import Any, Callable, ClassVar, Optional, Union

from . import solvers

__all__ = ["AdjointOptions", "Choice", "ConfigError", "Registration", "SolverOptions",
           "attention_names", "check_options", "choice", "choice_names", "default_attention",
           "get_attention", "option", "register_attention", "register_choice",
           "registrations", "section_kwargs", "unregister_attention"]


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
    - `kind`: the field names a registered class of this kind (`register_choice`): its
      allowed values are the registered names, and reading the config builds the object
      (`nn.section_kwargs`).

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


# ----------------------------------------------------------- solvers and adjoints as YAML

for _name, _cls in (("anderson", solvers.Anderson), ("picard", solvers.Picard),
                    ("broyden", solvers.Broyden), ("newton", solvers.Newton),
                    ("jaxopt_anderson", solvers.JaxoptAnderson),
                    ("reversible", solvers.Reversible)):
    register_choice("solver", _name)(_cls)
for _name, _cls in (("implicit", solvers.Implicit), ("unrolled", solvers.Unrolled),
                    ("phantom", solvers.Phantom), ("onestep", solvers.OneStep),
                    ("reversible", solvers.ReversibleAdjoint)):
    register_choice("adjoint", _name)(_cls)
del _name, _cls

# adjoints that differentiate fixed points only (every other registered adjoint also
# differentiates roots)
_FIXED_POINT_ADJOINTS = (solvers.Phantom, solvers.OneStep, solvers.ReversibleAdjoint)


def _fits(kind: str, cls: type, root: bool) -> bool:
    if not root:
        return True
    if kind == "solver":
        return issubclass(cls, solvers.AbstractRootFinder)
    return not issubclass(cls, _FIXED_POINT_ADJOINTS)


def _field_default(cls, name):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


class _Named:
    """What the two sections share: a registered `name` that must fit the problem."""

    _KIND: ClassVar[str]

    def _class(self, root: bool) -> type:
        cls = choice_class(self._KIND, self.name, where="name")
        if not _fits(self._KIND, cls, root):
            fits = [n for n, c in _TABLE[self._KIND].items() if _fits(self._KIND, c, True)]
            raise ConfigError(f"name: {self.name!r} does not fit this problem (a root, not a "
                              f"fixed point); the {self._KIND}s that fit: {fits}.")
        return cls

    def __post_init__(self):
        # the object's own class checks the values (one check each, where they are owned);
        # its message names the argument, `Cls(tol=0.0) must be ...`: the key leads
        try:
            self.build()
        except ConfigError:
            raise
        except ValueError as e:
            key = re.match(r"\w+\((\w+)=", str(e))
            lead = f"{key.group(1)}={getattr(self, key.group(1), None)!r}: " if key else ""
            raise ConfigError(lead + str(e)) from None


@dataclasses.dataclass(frozen=True)
class SolverOptions(_Named):
    """A solver as config keys (the section `solver` of an attention family).

    **Fields:** `name` (a registered solver: `anderson`, `picard`, `broyden`, `newton`,
    `jaxopt_anderson`, `reversible`, ...), its stopping rule `tol` (on the max-norm
    residual) and `max_steps`, and the options some solvers take: `damping` (picard,
    anderson, newton, reversible: the fraction of the old iterate kept), `history`
    (anderson: residuals kept; broyden: rank-one updates kept before a restart), `unroll`
    (picard, anderson: exactly `max_steps` iterations without a while loop) and `precision`
    (the solve's matrix-product precision; see `solvers.AbstractSolver`).
    """

    _KIND = "solver"

    name: str = option("anderson", "the solver (anderson, picard, broyden, newton, "
                       "jaxopt_anderson, reversible; root problems: the root finders)",
                       kind="solver")
    tol: float = option(_field_default(solvers.Anderson, "tol"),
                        "stop when the max-norm residual is <= tol")
    max_steps: int = option(_field_default(solvers.Anderson, "max_steps"), "most iterations")
    damping: Optional[float] = option(None, "picard, anderson, newton, reversible: fraction "
                                      "of the old iterate kept (null: the solver's default)")
    history: Optional[int] = option(None, "anderson: residuals kept (null: its default); "
                                    "broyden: updates kept before a restart (null: a dense "
                                    "estimate)")
    unroll: bool = option(False, "picard, anderson: run exactly max_steps iterations as "
                          "straight-line code, no while loop (small solves on a GPU); the "
                          "residual is checked once, at the end")
    precision: Optional[str] = option("highest", "matrix-product precision of the solve "
                                      "(jax.default_matmul_precision): highest makes float32 "
                                      "products float32 on GPUs too, whose default TF32 "
                                      "rounding stalls tight tolerances; null: the caller's "
                                      "setting", choices=(*solvers._solvers.PRECISIONS, None))

    def build(self, *, root: bool = False) -> solvers.AbstractSolver:
        """The solver object (`root=True`: refuse a fixed-point-only solver)."""
        cls = self._class(root)
        names = {f.name for f in dataclasses.fields(cls)}
        if self.unroll and "unroll" not in names:
            raise ConfigError(f"unroll: set to true, but the solver {self.name!r} does not "
                              "use it (it always runs a while loop; unroll=true fits picard "
                              "and anderson).")
        values = dict(tol=self.tol, max_steps=self.max_steps, damping=self.damping,
                      history=self.history, unroll=self.unroll or None)
        return cls(precision=self.precision,  # None is a value: the caller's precision
                   **{k: v for k, v in values.items() if k in names and v is not None})


_LINEAR = {"anderson": lambda o: solvers.Anderson(history=o.restart, safeguard=False),
           "picard": lambda o: solvers.Picard(),
           "gmres": lambda o: solvers.GMRES(restart=o.restart),
           "bicgstab": lambda o: solvers.BiCGStab(),
           "dense": lambda o: solvers.Dense(),
           "auto": lambda o: solvers.Auto()}
_FALLBACK = {"auto": solvers.Auto, "dense": solvers.Dense,
             "gmres": lambda: solvers.GMRES(restart=50), "none": lambda: None}


@dataclasses.dataclass(frozen=True)
class AdjointOptions(_Named):
    """An adjoint as config keys (the section `adjoint` of an attention family).

    **Fields:** `name` (a registered adjoint: `implicit`, `unrolled`, `phantom`, `onestep`,
    `reversible` (with the solver `reversible` only), ...); for `implicit` the backward
    `linear_solver` (`anderson` or `picard` on the Richardson map, `gmres`, `bicgstab`,
    `dense`: the matrix formed and solved directly, `auto`: dense up to 512 unknowns, else
    GMRES(50)), its relative `tol`, its `max_steps` (matrix–vector products) and `restart`
    (the GMRES Krylov size or the Anderson history), and the `fallback` tried when that
    solve misses its tolerance (`auto`, `dense`, `gmres` with a 50-vector basis, `none`);
    for `phantom` its `steps` and `damping`.
    """

    _KIND = "adjoint"

    name: str = option("implicit", "how gradients flow through the solution (implicit, "
                       "unrolled, phantom, onestep, reversible)", kind="adjoint")
    linear_solver: str = option("anderson", "implicit: the backward linear solver",
                                tuple(_LINEAR))
    tol: float = option(_field_default(solvers.Implicit, "tol"), "implicit: relative "
                        "tolerance of the backward solve")
    max_steps: int = option(_field_default(solvers.Implicit, "max_steps"), "implicit: most "
                            "matrix-vector products of the backward solve")
    restart: int = option(_field_default(solvers.Implicit, "linear_solver").history,
                          "implicit: GMRES Krylov size or Anderson history of the backward "
                          "solve")
    fallback: str = option("auto", "implicit: the solver tried when the backward solve "
                           "misses its tolerance (auto: dense up to 512 unknowns, else "
                           "GMRES(50); none: no second try)", tuple(_FALLBACK))
    steps: int = option(_field_default(solvers.Phantom, "steps"), "phantom: damped steps "
                        "backpropagated")
    damping: float = option(_field_default(solvers.Phantom, "damping"), "phantom: fraction "
                            "of the old iterate kept")

    def build(self, *, root: bool = False) -> solvers.AbstractAdjoint:
        """The adjoint object (`root=True`: refuse one that differentiates fixed points
        only)."""
        cls = self._class(root)
        if cls is solvers.Implicit:
            return solvers.Implicit(linear_solver=_LINEAR[self.linear_solver](self),
                                    tol=self.tol, max_steps=self.max_steps,
                                    fallback=_FALLBACK[self.fallback]())
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: getattr(self, k) for k in ("steps", "damping") if k in names})


def _used_keys(options, cls) -> set:
    """The keys of a solver or adjoint section that building class `cls` reads."""
    if isinstance(options, AdjointOptions):
        if cls is solvers.Implicit:
            return {"linear_solver", "tol", "max_steps", "restart", "fallback"}
        return {"steps", "damping"} & {f.name for f in dataclasses.fields(cls)}
    names = {f.name for f in dataclasses.fields(cls)}
    return {"tol", "max_steps", "precision"} | ({"damping", "history", "unroll"} & names)


def _check_unused(key, options, default, root) -> None:
    """Refuse a key of the section `key` that its solver or adjoint does not read, when it
    is set away from the family's default section (a family default such as spin's GMRES
    backward solve stays harmless when a config switches to an adjoint that has none), or
    from the section class's own defaults where the family gives none."""
    if not isinstance(default, type(options)):
        default = type(options)()
    used = _used_keys(options, options._class(root))
    for f in dataclasses.fields(options):
        if f.name == "name" or f.name in used:
            continue
        value = getattr(options, f.name)
        if value != getattr(default, f.name):
            takes = ", ".join(sorted(used)) if used else "no options"
            an = "an" if options._KIND[0] in "aeiou" else "a"
            raise ConfigError(
                f"{key}.{f.name}: set to {value!r}, but the {options._KIND} "
                f"{options.name!r} does not use it (it takes {takes}); remove the key, or "
                f"choose {an} {options._KIND} that takes it.")


def check_options(section, *, solver: str = "solver", adjoint: str = "adjoint",
                  root: bool = False) -> None:
    """Check a family section's `solver` and `adjoint` sub-sections (in its
    `__post_init__`): they must name a registered solver and adjoint that fit the problem
    (`root=True`: a root, so root finders only) and each other (the adjoint `reversible`
    needs the solver `reversible`). A `ConfigError` names the key and what fits."""
    classes = {}
    for key in (solver, adjoint):
        try:
            classes[key] = getattr(section, key)._class(root)
        except ConfigError as e:
            raise ConfigError(f"{key}.{e}") from None
    defaults = ({f.name: f.default for f in dataclasses.fields(section)}
                if dataclasses.is_dataclass(section) else {})
    for key in (solver, adjoint):
        _check_unused(key, getattr(section, key), defaults.get(key), root)
    if (classes[adjoint] is solvers.ReversibleAdjoint
            and not issubclass(classes[solver], solvers.Reversible)):
        raise ConfigError(f"{adjoint}.name: {getattr(section, adjoint).name!r} runs the "
                          f"solver 'reversible' backwards and fits no other; {solver}.name is "
                          f"{getattr(section, solver).name!r}.")


# ------------------------------------------------------------------------------ attentions
#
# An attention is one module plus its frozen config dataclass, registered under its config
# word (kind "attention"); `model.<name>` is then its section, and `section_kwargs` turns the
# section into the constructor's keyword arguments (solver sections built into objects).

# The coupling fields assumed for an attention that does not declare its own: the maps that
# build attention weights from queries and keys.
COUPLING_FIELDS = ("to_q", "to_k", "to_qk")


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


# name -> Registration
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
