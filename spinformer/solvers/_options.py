"""Solvers and adjoints as config sections: the one place where their names become objects.

Every attention family that solves something has the two sections `solver` and `adjoint`
(`model.spin.solver.name: picard`, `model.boltzmann.adjoint.tol: 1e-4`, ...), built from the
same classes here, so each family accepts every solver and adjoint that fits its problem: any
solver where it iterates a map (`fixed_point` also runs root finders on x − g(x)), root
finders only where it solves a root. A family gives its own defaults as an instance,
`option(SolverOptions(name="picard", tol=1e-4), ...)`, and its module's constructor takes
its defaults from that same instance (`.build()`), so both agree.

Names are registered: `register_solver("saddle_newton", SaddleNewton, root=True)` lets a
physics module offer its own solver under a config name.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, ClassVar, Optional

from .._schema import ConfigError, option
from ._adjoint import AbstractAdjoint, Implicit, OneStep, Phantom, Unrolled
from ._linear import Auto, BiCGStab, Dense, GMRES
from ._reversible import Reversible, ReversibleAdjoint
from ._solvers import (AbstractRootFinder, AbstractSolver, Anderson, Broyden, JaxoptAnderson,
                       Newton, Picard, PRECISIONS)

__all__ = ["AdjointOptions", "SolverOptions", "check_options", "register_adjoint",
           "register_solver"]

# name -> (class, root finder?)
_SOLVERS: dict[str, tuple[type, bool]] = {}
# name -> (class, usable for roots?)
_ADJOINTS: dict[str, tuple[type, bool]] = {}


def register_solver(name: str, cls: type, *, root: Optional[bool] = None) -> None:
    """Offer solver class `cls` under the config name `name` (`solver.name`). `root`: whether
    it finds roots (default: it is an `AbstractRootFinder`); root finders also solve fixed
    points, fixed-point solvers only fixed points."""
    if not (isinstance(cls, type) and issubclass(cls, AbstractSolver)):
        raise TypeError(f"register_solver({name!r}): {cls!r} is not a solver class.")
    if root is None:
        root = issubclass(cls, AbstractRootFinder)
    if name in _SOLVERS and _SOLVERS[name][0] is not cls:
        raise ValueError(f"register_solver: {name!r} is already {_SOLVERS[name][0].__name__}.")
    _SOLVERS[name] = (cls, bool(root))


def register_adjoint(name: str, cls: type, *, root: bool = True) -> None:
    """Offer adjoint class `cls` under the config name `name` (`adjoint.name`); `root`:
    whether it also differentiates roots (not only fixed points)."""
    if not (isinstance(cls, type) and issubclass(cls, AbstractAdjoint)):
        raise TypeError(f"register_adjoint({name!r}): {cls!r} is not an adjoint class.")
    if name in _ADJOINTS and _ADJOINTS[name][0] is not cls:
        raise ValueError(f"register_adjoint: {name!r} is already {_ADJOINTS[name][0].__name__}.")
    _ADJOINTS[name] = (cls, bool(root))


for _name, _cls in (("anderson", Anderson), ("picard", Picard), ("broyden", Broyden),
                    ("newton", Newton), ("jaxopt_anderson", JaxoptAnderson),
                    ("reversible", Reversible)):
    register_solver(_name, _cls)
# the adjoint `reversible` fits the solver `reversible` only (check_options and fixed_point
# say so)
for _name, _cls, _root in (("implicit", Implicit, True), ("unrolled", Unrolled, True),
                           ("phantom", Phantom, False), ("onestep", OneStep, False),
                           ("reversible", ReversibleAdjoint, False)):
    register_adjoint(_name, _cls, root=_root)
del _name, _cls, _root


def _default(cls, name):
    """The default of field `name` of a solver/adjoint class (defaults are not repeated)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default
    raise AttributeError(name)  # pragma: no cover


def _kwargs(cls, values: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}


def _choose(what: str, name: str, table: dict, root: bool) -> type:
    fits = [n for n, (_, r) in table.items() if r or not root]
    if name not in table:
        close = difflib.get_close_matches(name, list(table), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"name: unknown {what} {name!r}; choose one of {fits}.{hint}")
    if root and not table[name][1]:
        raise ConfigError(f"name: {name!r} does not fit this problem (a root, not a fixed "
                          f"point); the {what}s that fit: {fits}.")
    return table[name][0]


class _Named:
    """What the two option sections share: a registered `name` that must fit the problem."""

    _WHAT: ClassVar[str]
    _TABLE: ClassVar[dict]

    @staticmethod
    def _moved_value(where: str, value) -> str:
        # an old config gave the name as the value of the section
        return (f"{where} is a section now (name, tol, max_steps, ...): use "
                f"{where}.name={value}.")

    def _class(self, root: bool) -> type:
        return _choose(self._WHAT, self.name, self._TABLE, root)

    def check(self, *, root: bool = False) -> None:
        """Raise `ConfigError` unless the name is registered and fits the problem (`root`:
        a root, so a root finder, or an adjoint that differentiates roots, is needed)."""
        self._class(root)


@dataclasses.dataclass(frozen=True)
class SolverOptions(_Named):
    """A solver as config keys (the section `solver` of an attention family).

    **Fields:** `name` (a registered solver: `anderson`, `picard`, `broyden`, `newton`,
    `jaxopt_anderson`, `reversible` (`damping` = 1 − β), ...), its stopping rule `tol`
    (on the max-norm residual) and `max_steps`, and the options some solvers take:
    `damping` (picard, anderson, newton, reversible: the fraction of the old iterate kept) and `history`
    (anderson: residuals kept; broyden: rank-one updates kept before a restart, i.e. limited
    memory; null: each solver's own default, Anderson's 5 and Broyden's dense estimate),
    `unroll` (picard, anderson: exactly `max_steps` iterations without a while loop), and
    `precision` (the solve's matrix-product precision, `"highest"` by default; see
    `AbstractSolver`).
    """

    _WHAT, _TABLE = "solver", _SOLVERS

    name: str = option("anderson", "the solver (anderson, picard, broyden, newton, "
                       "jaxopt_anderson, reversible; root problems: the root finders)",
                       choices=lambda: tuple(_SOLVERS))
    tol: float = option(_default(Anderson, "tol"), "stop when the max-norm residual is <= tol")
    max_steps: int = option(_default(Anderson, "max_steps"), "most iterations")
    damping: Optional[float] = option(None, "picard, anderson, newton, reversible: fraction "
                                      "of the old iterate kept (null: the solver's default, 0; "
                                      "reversible's 0.2)")
    history: Optional[int] = option(None, "anderson: residuals kept (null: 5); broyden: "
                                    "updates kept before a restart (null: a dense estimate)")
    unroll: bool = option(False, "picard, anderson: run exactly max_steps iterations as "
                          "straight-line code, no while loop (small solves on a GPU); the "
                          "residual is checked once, at the end")
    precision: Optional[str] = option("highest", "matrix-product precision of the solve "
                                      "(jax.default_matmul_precision): highest makes float32 "
                                      "products float32 on GPUs too, whose default TF32 "
                                      "rounding (~1e-3) stalls tight tolerances; null: the "
                                      "caller's setting", choices=lambda: (*PRECISIONS, None))

    def __post_init__(self):
        if not self.tol > 0:
            raise ConfigError(f"tol={self.tol} must be > 0.")
        if not (self.max_steps >= 1 and (self.history is None or self.history >= 1)):
            raise ConfigError(f"max_steps={self.max_steps} and history={self.history} must "
                              "be >= 1.")
        if self.damping is not None and not 0.0 <= self.damping < 1.0:
            raise ConfigError(f"damping={self.damping} must be in [0, 1).")

    def build(self, *, root: bool = False) -> AbstractSolver:
        """The solver object (`root=True`: refuse a fixed-point-only solver)."""
        cls = self._class(root)
        values = dict(tol=self.tol, max_steps=self.max_steps, precision=self.precision)
        if self.damping is not None:
            values["damping"] = self.damping
        if self.history is not None:
            values["history"] = self.history
        if self.unroll:
            if "unroll" not in {f.name for f in dataclasses.fields(cls)}:
                raise ConfigError(f"unroll: the solver {self.name!r} always runs a while loop; "
                                  "unroll=true fits picard and anderson.")
            values["unroll"] = True
        return cls(**_kwargs(cls, values))


_LINEAR = ("anderson", "picard", "gmres", "bicgstab", "dense", "auto")
_FALLBACK = ("auto", "dense", "gmres", "none")


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

    _WHAT, _TABLE = "adjoint", _ADJOINTS

    name: str = option("implicit", "how gradients flow through the solution (implicit, "
                       "unrolled, phantom, onestep, reversible)",
                       choices=lambda: tuple(_ADJOINTS))
    linear_solver: str = option("anderson", "implicit: the backward linear solver", _LINEAR)
    tol: float = option(_default(Implicit, "tol"), "implicit: relative tolerance of the "
                        "backward solve")
    max_steps: int = option(_default(Implicit, "max_steps"), "implicit: most matrix-vector "
                            "products of the backward solve")
    restart: int = option(_default(Implicit, "linear_solver").history, "implicit: GMRES "
                          "Krylov size or Anderson history of the backward solve")
    fallback: str = option("auto", "implicit: the solver tried when the backward solve "
                           "misses its tolerance (auto: dense up to 512 unknowns, else "
                           "GMRES(50); none: no second try)", _FALLBACK)
    steps: int = option(_default(Phantom, "steps"), "phantom: damped steps backpropagated")
    damping: float = option(_default(Phantom, "damping"), "phantom: fraction of the old "
                            "iterate kept")

    def __post_init__(self):
        if not self.tol > 0:
            raise ConfigError(f"tol={self.tol} must be > 0.")
        if not (self.max_steps >= 1 and self.restart >= 1 and self.steps >= 1):
            raise ConfigError(f"max_steps={self.max_steps}, restart={self.restart} and "
                              f"steps={self.steps} must be >= 1.")
        if not 0.0 <= self.damping < 1.0:
            raise ConfigError(f"damping={self.damping} must be in [0, 1).")

    def build(self, *, root: bool = False) -> AbstractAdjoint:
        """The adjoint object (`root=True`: refuse one that differentiates fixed points
        only)."""
        cls = self._class(root)
        if cls is Implicit:
            linear: Any = {
                "anderson": lambda: Anderson(history=self.restart, safeguard=False),
                "picard": Picard,
                "gmres": lambda: GMRES(restart=self.restart),
                "bicgstab": BiCGStab,
                "dense": Dense,
                "auto": Auto,
            }[self.linear_solver]()
            fallback = {"auto": Auto, "dense": Dense, "gmres": lambda: GMRES(restart=50),
                        "none": lambda: None}[self.fallback]()
            return Implicit(linear_solver=linear, tol=self.tol, max_steps=self.max_steps,
                            fallback=fallback)
        return cls(**_kwargs(cls, dict(steps=self.steps, damping=self.damping)))


def _used_keys(options, cls) -> set:
    """The keys of a solver or adjoint section that building class `cls` reads."""
    if isinstance(options, AdjointOptions):
        if cls is Implicit:
            return {"linear_solver", "tol", "max_steps", "restart", "fallback"}
        return {k for k in ("steps", "damping") if k in {f.name for f in
                                                          dataclasses.fields(cls)}}
    names = {f.name for f in dataclasses.fields(cls)}
    return {"tol", "max_steps"} | {k for k in ("damping", "history", "unroll") if k in names}


def _check_unused(key, options, default, root) -> None:
    """Refuse a key of the section `key` that its solver or adjoint does not read, when it
    is set away from the family's default section (a family default such as spin's GMRES
    backward solve stays harmless when a config switches to an adjoint that has none), or
    from the options class's own defaults where the section gives none."""
    if not isinstance(default, type(options)):  # no family default: the class's own
        default = type(options)()
    cls = options._class(root)
    used = _used_keys(options, cls)
    for f in dataclasses.fields(options):
        if f.name == "name" or f.name in used:
            continue
        value = getattr(options, f.name)
        if value != getattr(default, f.name):
            takes = ", ".join(sorted(used)) if used else "no options"
            an = "an" if options._WHAT[0] in "aeiou" else "a"
            raise ConfigError(
                f"{key}.{f.name}: set to {value!r}, but the {options._WHAT} "
                f"{options.name!r} does not use it (it takes {takes}); remove the key, or "
                f"choose {an} {options._WHAT} that takes it.")


def check_options(section, *, solver: str = "solver", adjoint: str = "adjoint",
                  root: bool = False) -> None:
    """Check a family section's `solver` and `adjoint` sub-sections (in its
    `__post_init__`): they must name a registered solver and adjoint that fit the problem
    (`root=True`: a root, so root finders only) and each other (the adjoint `reversible`
    needs the solver `reversible`). A `ConfigError` names the key and what fits."""
    for key in (solver, adjoint):
        try:
            getattr(section, key).check(root=root)
        except ConfigError as e:
            raise ConfigError(f"{key}.{e}") from None
    solver_cls = getattr(section, solver)._class(root)
    defaults = ({f.name: f.default for f in dataclasses.fields(section)}
                if dataclasses.is_dataclass(section) else {})
    for key in (solver, adjoint):
        _check_unused(key, getattr(section, key), defaults.get(key), root)
    if (getattr(section, adjoint)._class(root) is ReversibleAdjoint
            and not issubclass(solver_cls, Reversible)):
        raise ConfigError(f"{adjoint}.name: {getattr(section, adjoint).name!r} runs the "
                          f"solver 'reversible' backwards and fits no other; {solver}.name is "
                          f"{getattr(section, solver).name!r}.")

