"""The report at equal compute (`spinformer.grid.scaling_report`) on synthetic ledgers whose answers are known by
construction: losses drawn from known power laws, hand-written curves (nothing is trained)."""

import json
import math
import pathlib

import numpy as np
import pytest
import yaml

from spinformer import grid as G
from spinformer.grid import _scaling

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIZES = ("small", "medium", "large")  # the scaling grid's first three
# L = a C^(-alpha): softmax is lower at the small budget, spin (steeper) at the large one
LAWS = {"softmax": (6.0, 0.05), "spin": (14.9, 0.08)}
GAMMA = 0.2  # within a run, val loss = L_final (C / f)^GAMMA: steeper than any law above
OVERSPEND = {"softmax": 1.001, "spin": 1.03}  # FLOPs spent / budget (spin: + 0.01 per seed)


@pytest.fixture(scope="module")
def scaling():
    return _scaling


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The scaling grid with its first three sizes (the synthetic ledgers' answers are
    worked out for them), written where the reports can name it."""
    g = yaml.safe_load((ROOT / "configs" / "zoo" / "scaling.yaml").read_text())
    g["tasks"] = {s: {**g["tasks"][s], "config": str(ROOT / g["tasks"][s]["config"])}
                  for s in SIZES}
    for fam in g["families"].values():
        fam.pop("skip", None)
    path = tmp_path_factory.mktemp("grid") / "scaling.yaml"
    path.write_text(yaml.safe_dump(g, sort_keys=False))
    return G.load_grid(path)


def _report(grid, results: pathlib.Path) -> dict:
    """The report of the ledger in `results/ledger`, written into `results`."""
    ledger = results / "ledger"
    return G.scaling_report(grid, G.Runs(ledger, ledger), results)


def _write(path: pathlib.Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _result(size, family, seed, *, test, flops, steps, curve, wall):
    return {"task": size, "family": family, "seed": seed, "lr_factor": 1.0, "lr": 1e-3,
            "val": {"loss": curve[-1][3]}, "split": "test", "test": {"loss": test},
            "steps": steps, "bad_steps": 0, "wall_time_s": wall, "num_params": 1000,
            "steps_per_s": steps / wall, "flops": flops, "curve": curve}


def _synthetic_ledger(ledger: pathlib.Path, budgets: dict, seeds: dict) -> dict:
    """Every size × {softmax, spin} × seed of the grid, except spin's large seed 1 (missing),
    plus one failed hopfield run. Returns the constructed test losses and FLOPs."""
    rng = np.random.default_rng(3)
    truth = {}
    for size, budget in budgets.items():
        for fam, (a, alpha) in LAWS.items():
            steps, per_step = 1000, budget / 1000
            _write(ledger / size / fam / "price.json",
                   {"flops": budget, "flops_per_step": per_step, "steps": steps})
            for seed in seeds[size]:
                if (size, fam, seed) == ("large", "spin", 1):
                    continue
                spent = budget * (OVERSPEND[fam] + (0.01 * seed if fam == "spin" else 0.0))
                final = a * spent ** -alpha * math.exp(rng.normal(0, 0.005))
                test = final * math.exp(rng.normal(0, 0.002))
                sec = 0.01 * (1.5 if fam == "spin" else 1.0)  # seconds per step
                curve = [[k, spent * k / steps, sec * k, final * (steps / k) ** GAMMA]
                         for k in range(100, steps + 1, 100)]
                _write(ledger / size / fam / f"lr1_s{seed}" / "result.json",
                       _result(size, fam, seed, test=test, flops=spent, steps=steps,
                               curve=curve, wall=sec * steps + 1))
                truth[size, fam, seed] = {"test": test, "flops": spent}
    _write(ledger / "small" / "hopfield" / "lr1_s0" / "failed.json",
           {"error": "RuntimeError", "message": "fixed_point: no convergence",
            "last_logged_step": 40})
    return truth


@pytest.fixture(scope="module")
def report(grid, tmp_path_factory):
    budgets = {s: float(t["flops"]) for s, t in grid["tasks"].items()}
    seeds = {s: G.seeds_of(grid, s) for s in grid["tasks"]}
    results = tmp_path_factory.mktemp("scaling")
    truth = _synthetic_ledger(results / "ledger", budgets, seeds)
    _report(grid, results)
    stats = json.loads((results / "scaling.json").read_text())
    return {"results": results, "stats": stats, "truth": truth, "budgets": budgets,
            "seeds": seeds, "md": (results / "scaling.md").read_text()}


def test_power_law_recovered(report):
    fits = report["stats"]["fits"]
    for fam, (a, alpha) in LAWS.items():
        f = fits[fam]
        assert f["n"] == (7 if fam == "softmax" else 6) and f["sizes"] == 3
        assert abs(f["alpha"] - alpha) < 0.01, (fam, f)
        assert f["alpha"] - f["alpha_ci"] < alpha < f["alpha"] + f["alpha_ci"], (fam, f)
        assert 0 < f["alpha_ci"] < 0.01
        assert [(b["from"], b["to"]) for b in f["alpha_between"]] == [("small", "medium"),
                                                                        ("medium", "large")]
        assert all(abs(b["alpha"] - alpha) < 0.01 for b in f["alpha_between"]), (fam, f)
    # the laws meet at exp(ln(14.9 / 6) / 0.03) = 1.5e13: between the small and large budgets
    meets = fits["spin"]["meets_reference_at"]
    assert report["budgets"]["small"] < meets < report["budgets"]["large"]
    assert abs(math.log(meets) - math.log(14.9 / 6.0) / 0.03) < 3.0
    assert fits["softmax"]["meets_reference_at"] is None
    assert fits["hopfield"]["n"] == 0 and not fits["hopfield"]["enough"]
    assert "| modern Hopfield | not enough runs |" in report["md"]


def test_equal_flop_gap_is_paired_by_seed(report):
    truth, sizes = report["truth"], report["stats"]["sizes"]
    for size, seeds in report["seeds"].items():
        common = [s for s in seeds if (size, "spin", s) in truth]
        diffs = [truth[size, "spin", s]["test"] - truth[size, "softmax", s]["test"]
                 for s in common]
        ratios = [truth[size, "spin", s]["flops"] / truth[size, "softmax", s]["flops"]
                  for s in common]
        g = sizes[size]["spin"]
        assert g["gap_flops"]["n"] == len(common)
        assert g["gap_flops"]["mean"] == pytest.approx(np.mean(diffs), abs=1e-12)
        assert g["flops_ratio"]["mean"] == pytest.approx(np.mean(ratios), rel=1e-12)
    # the laws cross: spin is worse than softmax at the small budget, better at the large one
    assert sizes["small"]["spin"]["gap_flops"]["mean"] > 0.03
    assert sizes["large"]["spin"]["gap_flops"]["mean"] < -0.03
    assert sizes["large"]["spin"]["gap_flops"]["n"] == 1  # seed 1 is missing


def test_frontier_holders(report):
    at = {p["budget_of"]: p for p in report["stats"]["frontier_at"]}
    # each size's row includes every run of that size (at the most FLOPs one of them spent)
    assert at["small"]["flops"] == pytest.approx(report["budgets"]["small"] * 1.05)
    assert (at["small"]["family"], at["small"]["size"]) == ("softmax", "small")
    assert (at["large"]["family"], at["large"]["size"]) == ("spin", "large")
    best_small = min(report["truth"]["small", "softmax", s]["test"]
                     for s in report["seeds"]["small"])
    assert at["small"]["loss"] == pytest.approx(best_small, rel=0.02)
    front = [p for p in report["stats"]["frontier"] if p["loss"] is not None]
    losses = [p["loss"] for p in front]
    assert losses == sorted(losses, reverse=True)  # a running minimum never rises
    assert len(front) == len(report["stats"]["frontier"])  # it starts at the cheapest point


def test_missing_and_failed_runs_are_listed(report):
    md, stats = report["md"], report["stats"]
    large = md.split("### large")[1].split("##")[0]
    spin_row = next(x for x in large.splitlines() if x.startswith("| spin (steady state"))
    assert "[1 of 2 seeds]" in spin_row
    assert {"size": "large", "family": "spin", "seeds": [1], "failed": [], "of": 2} \
        in stats["missing"]
    hop = next(m for m in stats["missing"] if (m["size"], m["family"]) == ("small", "hopfield"))
    assert hop["seeds"] == [0, 1, 2] and hop["failed"] == [0]
    assert "| small | hopfield | lr1_s0 | 40 | fixed_point: no convergence |" in md
    assert "| modern Hopfield | failed (1 run) [0 of 3 seeds] |" in md
    assert "| modern Hopfield | pending [0 of 2 seeds] |" in md  # medium


def test_meeting_point_by_hand(scaling):
    """1·C^(−0.1) = e·C^(−0.05) where −0.1 ln C = 1 − 0.05 ln C: ln C = −20."""
    fit = {"a": 1.0, "alpha": 0.1, "enough": True}
    ref = {"a": math.e, "alpha": 0.05, "enough": True}
    assert scaling.meeting_point(fit, ref) == pytest.approx(math.exp(-20.0))
    assert scaling.meeting_point(fit, {**ref, "enough": False}) is None
    assert scaling.meeting_point(fit, {**ref, "alpha": 0.1}) is None


def test_fit_interval_by_hand(scaling):
    """log L = 0, 1, 0 at log C = 0, 1, 2: slope 0, residuals (-1, 2, -1)/3, so the slope's
    standard error is sqrt((2/3) / 1 / 2) and its 95 % half-width t(1 df) = 12.71 times it."""
    f = scaling.fit_power_law(np.exp([0.0, 1.0, 2.0]), np.exp([0.0, 1.0, 0.0]))
    assert f["alpha"] == pytest.approx(0.0, abs=1e-12)
    assert f["a"] == pytest.approx(math.exp(1 / 3))
    assert f["alpha_ci"] == pytest.approx(12.71 * math.sqrt(1 / 3))
    assert math.isnan(scaling.fit_power_law([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])["alpha"])


def test_frontier_is_the_running_minimum_at_or_below(scaling):
    pts = [{"flops": f, "loss": v, "family": fam, "size": "small", "seed": 0, "step": 1}
           for f, v, fam in [(2.0, 1.0, "b"), (1.0, 3.0, "a"), (3.0, 2.0, "c")]]
    got = scaling.frontier(pts, [0.5, 1.0, 1.5, 2.0, 3.0])
    assert got[0]["loss"] is None  # no run is that cheap
    assert [(p["loss"], p["family"]) for p in got[1:]] == [(3.0, "a"), (3.0, "a"),
                                                            (1.0, "b"), (1.0, "b")]
    assert got[4]["reached_at"] == 2.0


def test_figures_written(report):
    for name in ("loss_vs_flops.png", "loss_vs_time.png"):
        assert (report["results"] / name).stat().st_size > 10_000


def test_equal_time_gap_interpolates(scaling, grid, tmp_path):
    """Hand-written curves: softmax ends first, at T = 30 s (seed 0) and 40 s (seed 1); spin's
    loss there lies between two of its evaluations."""
    ledger = tmp_path / "ledger"
    curves = {  # (seed, family): [(time_s, val loss)]
        (0, "softmax"): [(10, 3.0), (20, 2.0), (30, 1.5)],
        (0, "spin"): [(20, 2.5), (40, 1.5)],  # at 30 s: 2.0 -> gap +0.5
        (1, "softmax"): [(10, 2.0), (25, 1.9), (40, 1.6)],
        (1, "spin"): [(10, 3.0), (30, 2.0), (50, 1.0)],  # at 40 s: 1.5 -> gap -0.1
    }
    for (seed, fam), pts in curves.items():
        curve = [[i + 1, 1e12 * (i + 1), t, v] for i, (t, v) in enumerate(pts)]
        _write(ledger / "small" / fam / f"lr1_s{seed}" / "result.json",
               _result("small", fam, seed, test=pts[-1][1], flops=3e12, steps=len(pts),
                       curve=curve, wall=pts[-1][0] + 5))
    _report(grid, tmp_path)
    stats = json.loads((tmp_path / "scaling.json").read_text())
    g = stats["sizes"]["small"]["spin"]["gap_time"]
    assert g["T_s"] == {"0": 30.0, "1": 40.0}
    assert g["mean"] == pytest.approx((0.5 - 0.1) / 2)
    assert g["n"] == 2
    # the pieces on their own: outside a curve's span there is no value
    c = scaling.curve_arrays(_result("small", "spin", 0, test=1.0, flops=1.0, steps=2,
                                     curve=[[1, 1.0, 20, 2.5], [2, 2.0, 40, 1.5]], wall=41),
                             None)
    assert scaling.loss_at_time(c, 25.0) == pytest.approx(2.25)
    assert math.isnan(scaling.loss_at_time(c, 10.0))
    # the fit says "not enough runs" here: 2 runs per family, one size
    assert "| softmax | not enough runs | | | | 2 | 1 |" in \
        (tmp_path / "scaling.md").read_text()


def test_empty_ledger(grid, tmp_path, capsys):
    _report(grid, tmp_path)
    out = capsys.readouterr().out
    assert "no finished run" in out
    md = (tmp_path / "scaling.md").read_text()
    assert "No run has finished yet" in md and "pending [0 of 3 seeds]" in md
    stats = json.loads((tmp_path / "scaling.json").read_text())
    assert stats["runs"] == [] and stats["frontier"] == []
    assert (tmp_path / "loss_vs_flops.png").exists() and (tmp_path / "loss_vs_time.png").exists()


def test_a_variant_is_paired_with_the_family_it_names(grid, tmp_path):
    """`against: spin`: hand-written curves, read at the budget (3e12 FLOPs: seed 1's variant
    stopped short, so its last evaluation) and at the last step both runs evaluated."""
    g = yaml.safe_load(pathlib.Path(grid["_path"]).read_text())
    g["families"]["spin_steps"]["against"] = "spin"
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(g, sort_keys=False))
    curves = {  # (seed, family): [(step, FLOPs, val loss)], test loss
        (0, "spin"): ([(100, 1e12, 3.0), (200, 2e12, 2.0), (300, 3e12, 1.8)], 1.85),
        (0, "spin_steps"): ([(100, 0.5e12, 2.8), (200, 1e12, 2.4), (400, 2e12, 2.0),
                             (600, 3.3e12, 1.5)], 1.55),
        (1, "spin"): ([(100, 1e12, 2.5), (300, 3e12, 1.7)], 1.75),
        (1, "spin_steps"): ([(100, 1e12, 2.6), (250, 2.5e12, 1.9)], 1.95),
    }
    ledger = tmp_path / "ledger"
    for (seed, fam), (pts, test) in curves.items():
        curve = [[k, f, 0.01 * k, v] for k, f, v in pts]
        _write(ledger / "small" / fam / f"lr1_s{seed}" / "result.json",
               _result("small", fam, seed, test=test, flops=pts[-1][1], steps=pts[-1][0],
                       curve=curve, wall=1.0))
    _report(G.load_grid(path), tmp_path)
    a = json.loads((tmp_path / "scaling.json").read_text())["sizes"]["small"]["spin_steps"]
    a = a["against"]
    assert a["family"] == "spin" and a["test"]["n"] == 2
    # seed 0: 2.0 - 0.5 * 1/1.3 against 1.8; seed 1: 1.9 (its last) against 1.7
    assert a["val_at_budget"]["mean"] == pytest.approx((2.0 - 0.5 / 1.3 - 1.8 + 0.2) / 2)
    # seed 0 at step 300: 2.2 against 1.8; seed 1 at step 250: 1.9 against 2.5 - 0.6
    assert a["val_equal_steps"]["step"] == {"0": 300.0, "1": 250.0}
    assert a["val_equal_steps"]["mean"] == pytest.approx(0.2)
    assert a["test"]["mean"] == pytest.approx((-0.3 + 0.2) / 2)
    md = (tmp_path / "scaling.md").read_text()
    assert "## Against another variant" in md
    assert ("| small | spin (2 mean-field time steps) | spin (steady state, TAP) | +0.0077 ± "
            in md)
    g["families"]["spin_steps"]["against"] = "spins"
    path.write_text(yaml.safe_dump(g, sort_keys=False))
    with pytest.raises(G.GridError, match="families.spin_steps.against: 'spins' is not one"):
        G.load_grid(path)
