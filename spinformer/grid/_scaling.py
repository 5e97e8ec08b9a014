"""The report of a grid at equal compute (every task with a budget of training FLOPs, such as
the scaling grid, `zoo/scaling`, whose tasks are model sizes), read from its ledger alone.

    spinformer grid report zoo/scaling --results experiments/results/scaling

It reads the grid file and the ledger (each run's `result.json` or `failed.json`, each cell's
`price.json`: what is committed; the run directories are not read) and writes into the
results folder:

- `scaling.md` and `scaling.json` (every number):
  - per family, the power law L = a·C^(−α) of the final test loss against the training FLOPs
    spent, fitted by least squares on log L against log C over all the family's finished runs,
    α with its 95 % t-interval (n − 2 degrees of freedom); fewer than 3 runs or 2 sizes:
    "not enough runs"; the local exponents between consecutive sizes (`alpha_between`: a bend
    in the curve shows there), and the FLOPs where the family's line meets softmax's
    (`meets_reference_at`, an extrapolation);
  - the compute-efficient frontier: the lowest validation loss any run reached at or below each
    FLOP value (from every run's validation curve), and the run that holds it;
  - per size, each family's test loss (mean ± 95 % t-interval over seeds), parameters, steps,
    FLOPs spent and wall time, and two gaps to softmax paired by seed: the test loss at equal
    FLOPs (with the ratio of the FLOPs actually spent) and the validation loss at equal wall
    time (both curves linearly interpolated at the end of the shorter run); `*` where the
    interval excludes zero; a cell still filling up says `[k of n seeds]`;
  - the runs still missing, and the failed runs with their message;
- `loss_vs_flops.png` (log–log: validation curves, final test points, fitted lines, the
  frontier dashed) and `loss_vs_time.png` (validation loss against wall time).

An empty ledger is not an error: the report says that no run has finished, writes empty
tables and figures, and exits with status 0.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Optional

import numpy as np

from ._grid import REFERENCE, GridError, Runs, chosen_factor, seeds_of
from ._report import _rel, effect_summary, effect_text
from ._stats import mean_ci, t975

FRONTIER_POINTS = 200  # the log-spaced FLOP values the frontier is tabulated at in the json
MARKERS = "os^Dv<>"


# ------------------------------------------------------------------------------ the ledger

def _read_json(path: pathlib.Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def families_of(grid) -> list[str]:
    """The grid's families, softmax first."""
    return [REFERENCE] + [f for f in grid["families"] if f != REFERENCE]


def collect(grid, ledger: pathlib.Path) -> dict:
    """Returns `{(size, family): cell}`, each cell a dict: `results` (seed → `result.json`, at
    the cell's chosen learning-rate factor), `failed` (the failed runs: `run`, `seed`,
    `message`, `last_logged_step`), `missing` (the grid's seeds without a result), `price`
    (`price.json` or None) and `skip` (the grid's reason for not running the cell, or None)."""
    runs = Runs(ledger, ledger)  # the ledger alone
    out = {}
    for size in grid["tasks"]:
        for fam in families_of(grid):
            skip = (grid["families"][fam].get("skip") or {}).get(size)
            cell = {"results": {}, "failed": [], "missing": [], "skip": skip and str(skip),
                    "price": _read_json(ledger / size / fam / "price.json")}
            out[size, fam] = cell
            if skip:
                continue
            for name in runs.names(size, fam):
                d = ledger / size / fam / name
                f = runs.read(d, "failed.json")
                if f is not None and runs.read(d, "result.json") is None:
                    cell["failed"].append({"run": name, "seed": int(name.rsplit("_s", 1)[1]),
                                           "message": f.get("message"),
                                           "last_logged_step": f.get("last_logged_step")})
            factor, _ = chosen_factor(grid, runs, size, fam)
            for s in seeds_of(grid, size):
                r = (None if factor is None or math.isnan(factor)
                     else runs.read(runs.dir(size, fam, factor, s), "result.json"))
                if r is None:
                    cell["missing"].append(s)
                else:
                    cell["results"][s] = r
    return out


def run_flops(result: dict, price: Optional[dict], budget: float) -> float:
    """Returns the training FLOPs a run spent: its own count, else its steps times the cell's
    priced FLOPs per step, else the size's budget."""
    if result.get("flops"):
        return float(result["flops"])
    if price and price.get("flops_per_step"):
        return float(result["steps"]) * float(price["flops_per_step"])
    return float(budget)


def curve_arrays(result: dict, price: Optional[dict]) -> dict:
    """Returns the run's validation curve as arrays `step`, `flops` (a point without its own
    count: step × the priced FLOPs per step, else NaN), `time` (seconds, NaN where absent) and
    `loss`."""
    rows = result.get("curve") or []
    per_step = float(price["flops_per_step"]) if price and price.get("flops_per_step") \
        else math.nan

    def col(i):
        return np.array([math.nan if r[i] is None else float(r[i]) for r in rows])

    step, flops, time_s, loss = (col(i) for i in range(4))
    flops = np.where(np.isnan(flops), step * per_step, flops) if rows else flops
    return {"step": step, "flops": flops, "time": time_s, "loss": loss}


# ------------------------------------------------------------------------------ statistics

def fit_power_law(flops, losses) -> dict:
    """Least squares of log L on log C. Returns `{"n", "alpha", "alpha_ci", "a", "r2"}`: L ≈
    a·C^(−alpha), `alpha_ci` the half-width of alpha's 95 % t-interval with n − 2 degrees of
    freedom (NaN for fewer than 3 points or a single C)."""
    x, y = np.log(np.asarray(flops, float)), np.log(np.asarray(losses, float))
    n = len(x)
    nan = {"n": n, "alpha": math.nan, "alpha_ci": math.nan, "a": math.nan, "r2": math.nan}
    sxx = float(((x - x.mean()) ** 2).sum()) if n else 0.0
    if n < 2 or sxx <= 0:
        return nan
    slope = float(((x - x.mean()) * (y - y.mean())).sum()) / sxx
    intercept = float(y.mean()) - slope * float(x.mean())
    resid = y - (intercept + slope * x)
    syy = float(((y - y.mean()) ** 2).sum())
    ci = (t975(n - 2) * math.sqrt(float(resid @ resid) / (n - 2) / sxx) if n > 2
          else math.nan)
    return {"n": n, "alpha": -slope, "alpha_ci": ci, "a": math.exp(intercept),
            "r2": 1 - float(resid @ resid) / syy if syy > 0 else math.nan}


def alpha_between(sizes, rows) -> list[dict]:
    """The local exponent between each two consecutive sizes that have runs: α = −Δ log L /
    Δ log C between the sizes' means of log test loss and log FLOPs (`rows`: one family's runs,
    dicts with `size`, `flops` and `test_loss`). A power law has the same α between every two
    sizes; a curve that bends shows it here first."""
    means = []
    for size in sizes:
        mine = [r for r in rows if r["size"] == size]
        if mine:
            means.append((size, np.mean(np.log([r["flops"] for r in mine])),
                          np.mean(np.log([r["test_loss"] for r in mine]))))
    return [{"from": s0, "to": s1, "alpha": -float((y1 - y0) / (x1 - x0))}
            for (s0, x0, y0), (s1, x1, y1) in zip(means, means[1:]) if x1 != x0]


def meeting_point(fit: dict, ref: Optional[dict]) -> Optional[float]:
    """The FLOPs C at which the power law `fit` meets `ref` (a·C^(−α) equal for both; beyond
    C the steeper of the two is lower). None where either fit is not `enough`, or for equal
    exponents. An extrapolation of the fitted lines, not a measurement."""
    if not (ref and fit["enough"] and ref["enough"]) or fit["alpha"] == ref["alpha"]:
        return None
    return math.exp((math.log(fit["a"]) - math.log(ref["a"])) / (fit["alpha"] - ref["alpha"]))


def frontier(points: list[dict], at) -> list[dict]:
    """The compute-efficient frontier. `points`: curve points, dicts with `flops`, `loss` and
    who reached it (`family`, `size`, `seed`, `step`). Returns, for each FLOP value `c` of
    `at`, the point of lowest loss among those with `flops` ≤ c, with `flops` set to c and the
    point's own FLOPs as `reached_at` (`loss` None where no point is that cheap)."""
    pts = sorted((p for p in points if np.isfinite(p["flops"]) and np.isfinite(p["loss"])),
                 key=lambda p: p["flops"])
    xs = np.array([p["flops"] for p in pts])
    best, holders = math.inf, []
    for p in pts:  # the running minimum, in order of FLOPs
        if p["loss"] < best:
            best, cur = p["loss"], p
        holders.append(cur)
    out = []
    for c in at:
        i = int(np.searchsorted(xs, c, side="right")) - 1
        if i < 0:
            out.append({"flops": float(c), "loss": None})
            continue
        h = holders[i]
        out.append({"flops": float(c), "loss": h["loss"], "reached_at": h["flops"],
                    **{k: h[k] for k in ("family", "size", "seed", "step")}})
    return out


def loss_at_time(curve: dict, t: float) -> float:
    """Returns the curve's validation loss at time `t`, linearly interpolated between the two
    evaluations around it; NaN outside the evaluated span."""
    ok = np.isfinite(curve["time"]) & np.isfinite(curve["loss"])
    ts, ls = curve["time"][ok], curve["loss"][ok]
    if not len(ts) or t < ts[0] or t > ts[-1]:
        return math.nan
    return float(np.interp(t, ts, ls))


def loss_at(curve: dict, axis: str, x: float) -> float:
    """Returns the curve's validation loss at `x` on `axis` (`"flops"` or `"step"`), linearly
    interpolated between the two evaluations around it; the last evaluation's where the run
    stopped short of `x`; NaN before its first evaluation."""
    ok = np.isfinite(curve[axis]) & np.isfinite(curve["loss"])
    xs, ls = curve[axis][ok], curve["loss"][ok]
    if not len(xs) or x < xs[0]:
        return math.nan
    return float(np.interp(x, xs, ls))


def against_stats(curves: dict, tests: dict, budget: float) -> dict:
    """Returns the paired differences of a family and the family its grid entry names as
    `against`, over the seeds both finished. `curves` and `tests` map each seed to a pair
    `(family's, other's)`: `val_at_budget` (the validation loss at the size's FLOP budget,
    `loss_at`), `test` (the test loss, at the FLOPs each run spent) and `val_equal_steps`
    (at the last step both runs evaluated; `step` per seed)."""
    steps = {k: float(min(np.nanmax(a["step"]), np.nanmax(b["step"])))
             for k, (a, b) in curves.items()}
    return {"val_at_budget": _interval([loss_at(a, "flops", budget) - loss_at(b, "flops", budget)
                                        for a, b in curves.values()]),
            "test": _interval([a - b for a, b in tests.values()]),
            "val_equal_steps": {**_interval([loss_at(a, "step", steps[k])
                                             - loss_at(b, "step", steps[k])
                                             for k, (a, b) in curves.items()]),
                                "step": steps}}


def equal_time_gap(curve: dict, ref: dict) -> tuple[float, float]:
    """Returns `(T, gap)`: T the shorter of the two runs' total times (each its last
    evaluation's time), and the validation loss of `curve` minus that of `ref` at T (NaN
    where T is before either run's first evaluation)."""
    ends = [c["time"][np.isfinite(c["time"])] for c in (curve, ref)]
    if not all(len(e) for e in ends):
        return math.nan, math.nan
    T = float(min(e[-1] for e in ends))
    return T, loss_at_time(curve, T) - loss_at_time(ref, T)


def _interval(values) -> dict:
    m, ci = mean_ci(values)
    return {"mean": m, "ci": ci, "n": len(values)}


def summarise(grid, cells: dict) -> dict:
    """Returns the report's numbers: `runs` (one row per finished run), `fits` (per family,
    `fit_power_law` plus its `sizes` and an `enough` flag), `frontier` (over a log-spaced grid
    of FLOP values), `frontier_at` (at each size's budget, or the most FLOPs a run of the size
    spent where that is more), `sizes` (per size and family: means and paired gaps),
    `missing` and `failed`."""
    sizes, fams = list(grid["tasks"]), families_of(grid)
    rows, curves, points = [], {}, []
    for (size, fam), cell in cells.items():
        budget = float(grid["tasks"][size]["flops"])
        for seed, r in cell["results"].items():
            c = curve_arrays(r, cell["price"])
            curves[size, fam, seed] = c
            rows.append({"size": size, "family": fam, "seed": seed,
                         "flops": run_flops(r, cell["price"], budget),
                         "test_loss": float(r["test"]["loss"]),
                         "val_loss": float(r["val"]["loss"]), "steps": r["steps"],
                         "wall_time_s": r.get("wall_time_s"), "num_params": r.get("num_params"),
                         "steps_per_s": r.get("steps_per_s"), "bad_steps": r.get("bad_steps")})
            points += [{"flops": f, "loss": v, "family": fam, "size": size, "seed": seed,
                        "step": int(s)} for s, f, v in zip(c["step"], c["flops"], c["loss"])]
    fits = {}
    for fam in fams:
        mine = [r for r in rows if r["family"] == fam]
        n_sizes = len({r["size"] for r in mine})
        # one size: the runs' FLOPs differ by rounding only, and a line through them means
        # nothing (its slope can overflow)
        fit = fit_power_law([r["flops"] for r in mine] if n_sizes > 1 else [],
                            [r["test_loss"] for r in mine] if n_sizes > 1 else [])
        fit["n"], fit["sizes"] = len(mine), n_sizes
        fit["enough"] = fit["n"] >= 3 and fit["sizes"] >= 2 and math.isfinite(fit["alpha_ci"])
        fit["alpha_between"] = alpha_between(sizes, mine)
        fits[fam] = fit
    for fit in fits.values():
        fit["meets_reference_at"] = meeting_point(fit, fits.get(REFERENCE))
    finite = [p["flops"] for p in points if np.isfinite(p["flops"]) and p["flops"] > 0]
    grid_c = (np.geomspace(min(finite), max(finite), FRONTIER_POINTS) if finite
              else np.array([]))
    at = {}
    for size in sizes:
        spent = [r["flops"] for r in rows if r["size"] == size]
        at[size] = max([float(grid["tasks"][size]["flops"])] + spent)
    per_size = {size: {fam: _size_stats(grid, cells, curves, size, fam) for fam in fams}
                for size in sizes}
    missing = [{"size": s, "family": f, "seeds": c["missing"],
                "failed": sorted(x["seed"] for x in c["failed"]),
                "of": len(seeds_of(grid, s))}
               for (s, f), c in cells.items() if c["missing"] and not c["skip"]]
    failed = [{"size": s, "family": f, **x} for (s, f), c in cells.items() for x in c["failed"]]
    return {"runs": rows, "fits": fits,
            "frontier": frontier(points, grid_c),
            "frontier_at": [{**p, "budget_of": s} for s, p in zip(sizes, frontier(
                points, at.values()))],
            "sizes": per_size, "missing": missing, "failed": failed,
            "skipped": {f"{s}/{f}": c["skip"] for (s, f), c in cells.items() if c["skip"]}}


def _size_stats(grid, cells, curves, size, fam) -> dict:
    """Returns one family's numbers on one size: seeds done of those asked, per-seed values,
    means with 95 % t-intervals, and the paired gaps to softmax (`gap_flops`: test loss at
    equal FLOPs, `flops_ratio`, `gap_time`: validation loss at equal wall time, with `T_s`),
    and the number of failed runs."""
    cell, ref = cells[size, fam], cells[size, REFERENCE]
    res = cell["results"]
    budget = float(grid["tasks"][size]["flops"])
    s = {"n": len(res), "of": len(seeds_of(grid, size)), "skip": cell["skip"],
         "failed": len(cell["failed"])}
    if not res:
        return s
    flops = {k: run_flops(r, cell["price"], budget) for k, r in res.items()}
    test = {k: float(r["test"]["loss"]) for k, r in res.items()}
    s.update(seeds=sorted(res), test_loss=_interval(list(test.values())),
             val_loss=_interval([float(r["val"]["loss"]) for r in res.values()]),
             num_params=_mean([r.get("num_params") for r in res.values()]),
             steps=_mean([r["steps"] for r in res.values()]),
             flops=_mean(list(flops.values())),
             wall_time_s=_mean([r.get("wall_time_s") for r in res.values()]),
             per_seed={k: {"test_loss": test[k], "flops": flops[k],
                           "wall_time_s": res[k].get("wall_time_s")} for k in sorted(res)})
    s["solver_effect"] = effect_summary(res.values())
    other = grid["families"][fam].get("against")
    both = sorted(set(res) & set(cells[size, other]["results"])) if (size, other) in cells \
        else []
    if both:
        o = cells[size, other]["results"]
        s["against"] = {"family": other, **against_stats(
            {k: (curves[size, fam, k], curves[size, other, k]) for k in both},
            {k: (test[k], float(o[k]["test"]["loss"])) for k in both}, budget)}
    common = sorted(set(res) & set(ref["results"]))
    if fam == REFERENCE or not common:
        return s
    ref_flops = {k: run_flops(ref["results"][k], ref["price"], budget) for k in common}
    s["gap_flops"] = _interval([test[k] - float(ref["results"][k]["test"]["loss"])
                                for k in common])
    s["flops_ratio"] = _interval([flops[k] / ref_flops[k] for k in common])
    timed = {k: equal_time_gap(curves[size, fam, k], curves[size, REFERENCE, k])
             for k in common}
    timed = {k: v for k, v in timed.items() if math.isfinite(v[1])}
    s["gap_time"] = {**_interval([g for _, g in timed.values()]),
                     "T_s": {k: T for k, (T, _) in timed.items()}}
    return s


def _mean(values) -> Optional[float]:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


# ------------------------------------------------------------------------------ the report

def _significant(iv: dict) -> bool:
    return iv["n"] > 1 and math.isfinite(iv["ci"]) and abs(iv["mean"]) > iv["ci"]


def _pm(iv: dict, d: int = 4, signed: bool = False) -> str:
    """`mean ± ci` (`*` where the interval excludes zero, for a gap), or `mean (1 seed)`."""
    if not iv or not iv["n"]:
        return "—"
    m = f"{iv['mean']:+.{d}f}" if signed else f"{iv['mean']:.{d}f}"
    if iv["n"] < 2:
        return f"{m} (1 seed)"
    return f"{m} ± {iv['ci']:.{d}f}" + ("*" if signed and _significant(iv) else "")


def _label(grid, fam: str) -> str:
    return grid["families"][fam].get("label") or fam


def markdown(grid, config, stats: dict) -> str:
    """Returns `scaling.md`: the fits, the frontier, one table per size, the missing and the
    failed runs."""
    fams = families_of(grid)
    sizes = grid["tasks"]
    lines = ["# Scaling: loss against training FLOPs and wall time", "",
             grid.get("description", ""), "",
             f"Grid `{_rel(config)}`, read from its ledger (`ledger/` beside this report). "
             "Sizes: " + "; ".join(
                 f"{s} ({t.get('label', s)}): {float(t['flops']):.2g} training FLOPs per run, "
                 f"seeds {seeds_of(grid, s)}" for s, t in sizes.items()) + ".", ""]
    if not stats["runs"]:
        lines += ["**No run has finished yet**: every table below is empty.", ""]
    lines += ["## Power laws: test loss against training FLOPs", "",
              "L = a·C^(−α), least squares on log L against log C over every finished run of "
              "the family (all sizes and seeds; C the FLOPs the run spent); α with the "
              "half-width of its 95 % t-interval (n − 2 degrees of freedom).", "",
              "α between sizes: the local exponent between consecutive sizes' means (a power "
              "law has the same one throughout). Meets softmax at: the FLOPs where the two "
              "fitted lines cross (beyond it the steeper one is lower); an extrapolation, not a "
              "measurement; a flatter line than softmax's is behind it beyond that point.", "",
              "| family | α | 95 % interval of α | a | R² | runs | sizes | α between sizes | "
              "meets softmax at |",
              "|---|---|---|---|---|---|---|---|---|"]
    top = max((r["flops"] for r in stats["runs"]), default=math.nan)
    for fam in fams:
        f = stats["fits"][fam]
        if not f["enough"]:
            lines.append(f"| {_label(grid, fam)} | not enough runs | | | | {f['n']} | "
                         f"{f['sizes']} | | |")
            continue
        between = ", ".join(f"{b['from']}→{b['to']} {b['alpha']:.3f}"
                            for b in f["alpha_between"])
        meets, ref = f["meets_reference_at"], stats["fits"][REFERENCE]
        if meets is not None and f["alpha"] < ref["alpha"]:  # ahead only below `meets`
            meets = ("never ahead (flatter)" if meets <= top
                     else f"behind beyond {meets:.2g} (flatter)")
        elif meets is not None and meets > 1e3 * top:
            meets = f"{meets:.2g} (> 1000× the largest run)"
        elif meets is not None:
            meets = f"{meets:.2g}"
        lines.append(f"| {_label(grid, fam)} | {f['alpha']:.4f} ± {f['alpha_ci']:.4f} | "
                     f"[{f['alpha'] - f['alpha_ci']:.4f}, {f['alpha'] + f['alpha_ci']:.4f}] | "
                     f"{f['a']:.3g} | {f['r2']:.3f} | {f['n']} | {f['sizes']} | {between} | "
                     f"{meets or '—'} |")
    lines += ["", "## The compute-efficient frontier", "",
              "The lowest validation loss any run reached at or below C training FLOPs (every "
              "run's validation curve, all families and sizes), at each size's budget (or the "
              "most FLOPs a run of that size spent, where that is more). The whole step "
              "function is in `scaling.json` (`frontier`).", "",
              "| C (FLOPs) | the budget of | lowest validation loss | reached by | at FLOPs |",
              "|---|---|---|---|---|"]
    for p in stats["frontier_at"]:
        if p["loss"] is None:
            lines.append(f"| {p['flops']:.3g} | {p['budget_of']} | — (no run yet) | | |")
            continue
        lines.append(f"| {p['flops']:.3g} | {p['budget_of']} | {p['loss']:.4f} | "
                     f"{_label(grid, p['family'])}, {p['size']} model, seed {p['seed']}, "
                     f"step {p['step']} | {p['reached_at']:.3g} |")
    lines += ["", "## Per size", "",
              "Test loss: mean ± the half-width of its 95 % t-interval over seeds. Gaps to "
              "softmax, paired by seed (`*`: the interval excludes zero): the test loss at "
              "equal FLOPs, with the ratio of the FLOPs each run actually spent (the same "
              "budget by construction: the steps are priced before training, the FLOPs counted "
              "during it), and the validation loss at equal wall time T (each pair's curves "
              "linearly interpolated at the end of the shorter run, its last evaluation; the "
              "mean T is given). Wall times include the compile and the evaluations, and are "
              "rough where workers shared the machine."]
    for size, t in sizes.items():
        lines += _size_table(grid, size, t, stats["sizes"][size])
    against = _cells_with(stats, "against")
    if against:
        lines += ["", "## Against another variant", "",
                  "Each family whose grid entry names another (`against`), paired by seed with "
                  "it (`*`: the 95 % interval excludes zero; negative: the family is lower): "
                  "the validation loss at the size's FLOP budget (each run's curve "
                  "interpolated there; a run that spent less is read at its last evaluation), "
                  "the test loss (at the FLOPs each run spent), and the validation loss at "
                  "equal steps (at the last step both runs evaluated; the run with more steps is "
                  "earlier in its learning-rate decay there, which favours the other).", "",
                  "| size | family | against | Δ val loss at the budget | Δ test loss | "
                  "Δ val loss at equal steps (step) | seeds |", "|---|---|---|---|---|---|---|"]
        for size, fam, a in against:
            at = ", ".join(f"{v:.0f}" for v in a["val_equal_steps"]["step"].values())
            lines.append(f"| {size} | {_label(grid, fam)} | {_label(grid, a['family'])} | "
                         f"{_pm(a['val_at_budget'], signed=True)} | "
                         f"{_pm(a['test'], signed=True)} | "
                         f"{_pm(a['val_equal_steps'], signed=True)} ({at}) | "
                         f"{a['test']['n']} |")
    effects = _cells_with(stats, "solver_effect")
    if effects:
        lines += ["", "## Is the solver doing anything?", "",
                  "The test loss of the trained models with every solve cut to its starting "
                  "point, to one iteration of its solver, and converged (means over the runs "
                  "that measured it, `spinformer.train.solver_effect`); **no effect** where, "
                  "cut to the start, every run scores within 0.1 % of its converged loss.", "",
                  "| size | family | start / 1 iteration / converged | runs |", "|---|---|---|---|"]
        lines += [f"| {size} | {_label(grid, fam)} | {effect_text(e)} | {e['n']} |"
                  for size, fam, e in effects]
    if stats["missing"]:
        lines += ["", "## Missing runs", "",
                  "Seeds the grid asks for that have no result in the ledger (pending, or "
                  "failed: see below).", "", "| size | family | missing seeds | done |",
                  "|---|---|---|---|"]
        for m in stats["missing"]:
            seeds = ", ".join(f"{s} (failed)" if s in m["failed"] else str(s)
                              for s in m["seeds"])
            lines.append(f"| {m['size']} | {m['family']} | {seeds} | "
                         f"{m['of'] - len(m['seeds'])} of {m['of']} |")
    if stats["failed"]:
        lines += ["", "## Failed runs", "", "| size | family | run | last step | error |",
                  "|---|---|---|---|---|"]
        lines += [f"| {x['size']} | {x['family']} | {x['run']} | {x['last_logged_step']} | "
                  f"{(x['message'] or '').replace('|', '/')} |" for x in stats["failed"]]
    if stats["skipped"]:
        lines += ["", "Not run by the grid: "] + [f"- {k}: {v}"
                                                   for k, v in stats["skipped"].items()]
    return "\n".join(lines) + "\n"


def _cells_with(stats: dict, key: str) -> list[tuple]:
    """`(size, family, value)` for every cell of the report whose numbers hold `key`."""
    return [(size, fam, v) for size, per_fam in stats["sizes"].items()
            for fam, cell in per_fam.items() if (v := cell.get(key))]


def _size_table(grid, size, task, per_fam) -> list[str]:
    lines = ["", f"### {size}: {task.get('label', size)}, {float(task['flops']):.2g} FLOPs "
             "per run", "",
             "| family | test loss | params | steps | FLOPs spent | wall time | "
             "Δ test loss, equal FLOPs | FLOPs × softmax | Δ val loss, equal time | mean T |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for fam, s in per_fam.items():
        if s["skip"]:
            lines.append(f"| {_label(grid, fam)} | not run: {s['skip']} |" + " |" * 8)
            continue
        tag = f" [{s['n']} of {s['of']} seeds]" if s["n"] < s["of"] else ""
        if not s["n"]:
            what = f"failed ({s['failed']} run{'s' * (s['failed'] > 1)})" if s["failed"] \
                else "pending"
            lines.append(f"| {_label(grid, fam)} | {what}{tag} |" + " |" * 8)
            continue
        ratio, gt = s.get("flops_ratio"), s.get("gap_time")
        T = f"{np.mean(list(gt['T_s'].values())):.0f} s" if gt and gt["n"] else "—"
        lines.append(
            f"| {_label(grid, fam)} | {_pm(s['test_loss'])}{tag} | {s['num_params'] or 0:,.0f} | "
            f"{s['steps']:.0f} | {s['flops']:.3g} | {s['wall_time_s'] or 0:.0f} s | "
            f"{'reference' if fam == REFERENCE else _pm(s.get('gap_flops'), signed=True)} | "
            f"{_pm(ratio, 3) if ratio else '—'} | {_pm(gt, signed=True) if gt else '—'} | "
            f"{T} |")
    return lines


def figures(grid, cells, stats, results: pathlib.Path) -> None:
    """Writes `loss_vs_flops.png` and `loss_vs_time.png` into `results`."""
    import matplotlib

    matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))
    import matplotlib.pyplot as plt

    fams, sizes = families_of(grid), list(grid["tasks"])
    colour = {f: plt.cm.tab10(i % 10) for i, f in enumerate(fams)}
    figs = {}
    for name, xkey, xlabel in (("loss_vs_flops", "flops", "training FLOPs"),
                               ("loss_vs_time", "time", "wall time (s)")):
        fig, ax = plt.subplots(figsize=(7.5, 5.0))
        figs[name] = (fig, ax)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (curves)" + (", test loss (points)"
                                                    if xkey == "flops" else ""))
        for (size, fam), cell in cells.items():
            for seed, r in cell["results"].items():
                c = curve_arrays(r, cell["price"])
                ax.plot(c[xkey], c["loss"], lw=0.7, alpha=0.6, color=colour[fam],
                        ls="-" if xkey == "flops" else ("-", "--", ":")[sizes.index(size) % 3])
        if not stats["runs"]:
            ax.text(0.5, 0.5, "no finished runs yet", transform=ax.transAxes, ha="center")
    ax = figs["loss_vs_flops"][1]
    ax.set_yscale("log")
    for fam in fams:
        mine = [r for r in stats["runs"] if r["family"] == fam]
        for i, size in enumerate(sizes):
            pts = [r for r in mine if r["size"] == size]
            ax.scatter([r["flops"] for r in pts], [r["test_loss"] for r in pts], s=18,
                       color=colour[fam], marker=MARKERS[i % len(MARKERS)], zorder=3)
        f = stats["fits"][fam]
        if f["enough"]:
            cs = np.geomspace(min(r["flops"] for r in mine), max(r["flops"] for r in mine))
            ax.plot(cs, f["a"] * cs ** -f["alpha"], color=colour[fam], lw=1.8,
                    label=f"{fam}: α = {f['alpha']:.3f} ± {f['alpha_ci']:.3f}")
        elif mine:
            ax.plot([], [], color=colour[fam], lw=1.8, label=f"{fam} (not enough runs)")
    front = [p for p in stats["frontier"] if p["loss"] is not None]
    if front:
        ax.step([p["flops"] for p in front], [p["loss"] for p in front], where="post",
                color="black", ls="--", lw=1.2, label="frontier (validation)")
    for i, size in enumerate(sizes):
        ax.scatter([], [], color="grey", marker=MARKERS[i % len(MARKERS)], label=size)
    ax.legend(fontsize=7)
    ax.set_title("Loss against training FLOPs (points: final test loss by size)", fontsize=9)
    ax = figs["loss_vs_time"][1]
    for fam in fams:
        if any(r["family"] == fam for r in stats["runs"]):
            ax.plot([], [], color=colour[fam], label=fam)
    for i, size in enumerate(sizes):
        ax.plot([], [], color="grey", ls=("-", "--", ":")[i % 3], label=size)
    ax.legend(fontsize=7)
    ax.set_title("Validation loss against wall time", fontsize=9)
    for name, (fig, _) in figs.items():
        fig.tight_layout()
        fig.savefig(results / f"{name}.png", dpi=130)
        plt.close(fig)


def _clean(x):
    """`x` with non-finite floats as None and tuple keys as strings (valid JSON)."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def scaling_report(grid, runs: Runs, results) -> dict:
    """Writes the report of the ledger (`runs.ledger`) into `results`; returns its numbers
    (`summarise`)."""
    results, ledger = pathlib.Path(results), runs.ledger
    if missing := [t for t, v in grid["tasks"].items() if v.get("flops") is None]:
        raise GridError(f"scaling report: the grid's tasks {missing} have no FLOP budget (`flops`); "
                         "this report compares runs at equal training FLOPs.")
    cells = collect(grid, ledger)
    stats = summarise(grid, cells)
    results.mkdir(parents=True, exist_ok=True)
    (results / "scaling.md").write_text(markdown(grid, grid['_path'], stats))
    payload = {"config": _rel(grid["_path"]), **stats}
    (results / "scaling.json").write_text(json.dumps(_clean(payload), indent=2) + "\n")
    figures(grid, cells, stats, results)
    n_missing = sum(len(m["seeds"]) for m in stats["missing"])
    if not stats["runs"]:
        print(f"scaling: no finished run in {ledger} yet (train the grid with "
              "`spinformer grid run`); the tables are empty.")
    else:
        print(f"scaling: {len(stats['runs'])} finished runs, {n_missing} missing "
              f"({len(stats['failed'])} failed)")
        for fam, f in stats["fits"].items():
            if f["n"] and len(grid["tasks"]) > 1:  # (a power law needs several sizes)
                print(f"  {fam:14s} alpha = {f['alpha']:.4f} ± {f['alpha_ci']:.4f} "
                      f"({f['n']} runs, {f['sizes']} sizes)" if f["enough"]
                      else f"  {fam:14s} not enough runs ({f['n']} runs, {f['sizes']} sizes)")
        for size, per in stats["sizes"].items():
            for fam, g in per.items():
                if (gap := g.get("gap_flops")) and gap["n"]:
                    pm = f" ± {gap['ci']:.4f}" if gap["n"] > 1 else " (1 seed)"
                    print(f"  {size} {fam}: test loss {g['test_loss']['mean']:.4f}, "
                          f"{gap['mean']:+.4f}{pm} against softmax at equal FLOPs "
                          f"({g['flops_ratio']['mean']:.2f}× its FLOPs, paired over "
                          f"{gap['n']} seed{'s' * (gap['n'] > 1)})")
        for p in stats["frontier_at"]:
            if p["loss"] is not None:
                print(f"  frontier at {p['flops']:.3g} FLOPs ({p['budget_of']} budget): "
                      f"{p['loss']:.4f}, {p['family']} {p['size']} seed {p['seed']}")
    print(f"scaling: wrote {results / 'scaling.md'}, scaling.json, loss_vs_flops.png, "
          "loss_vs_time.png")
    return stats
