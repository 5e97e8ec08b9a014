"""The grids (`spinformer.grid`, `spinformer grid`): cells, matching, the ledger, locks, the
time budget, prices and reports, at toy sizes through the command line (their numbers are
not results)."""

import json
import math
import pathlib
import re
import shutil
import sys

import pytest
import yaml

import spinformer as sf
from spinformer import cli
from spinformer import grid as G
from spinformer.grid import _grid as zoo

ROOT = pathlib.Path(__file__).resolve().parent.parent
GRIDS = ROOT / "configs" / "zoo"


def grid_cli(*argv) -> None:
    """`spinformer grid ...` in this process; a nonzero status fails the test."""
    assert cli.main(["grid", *map(str, argv)]) == 0


def write_grid(path: pathlib.Path, grid: dict) -> pathlib.Path:
    """`grid` written to `path`, its tasks' config files (and texts in the checkout) named by
    absolute paths, so that it runs from a temporary folder."""
    for task in grid["tasks"].values():
        task["config"] = str(ROOT / task["config"])
        text = (task.get("set") or {}).get("data.path")
        if text and (ROOT / text).is_file():
            task["set"]["data.path"] = str(ROOT / text)
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


def test_zoo_plan_every_cell_builds_or_says_why():
    """Every family × task of the quick grid is either built with its parameter count matched
    to softmax's (or says why it cannot be), or is empty with the library's reason; the runs
    come task by task, the learning-rate candidates of the first seed first."""
    for path in GRIDS.glob("*.yaml"):  # every shipped grid is valid
        zoo.load_grid(path)
    full = zoo.load_grid(GRIDS / "full.yaml")
    assert len(full["seeds"]) >= 3 and zoo.REFERENCE in full["families"]
    headline = zoo.load_grid(GRIDS / "headline.yaml")
    for name, task in headline["tasks"].items():  # an equal-FLOP task is its twin plus a budget
        twin = headline["tasks"].get(name.removesuffix("_flops"))
        assert twin is not None and {**task, "label": "", "flops": 0} == {
            **twin, "label": "", "flops": 0} or name == name.removesuffix("_flops")
    grid = zoo.load_grid(GRIDS / "quick.yaml")
    cells = zoo.plan_cells(grid, grid["_tasks"], grid["_families"])
    assert set(cells) == {(t, f) for t in grid["tasks"] for f in grid["families"]}
    for (task, fam), cell in cells.items():
        if cell.reason:
            # the non-causal families cannot be language models; the library says so
            assert fam in ("free_energy", "energy_transformer") and task in ("brackets", "chars")
            assert "causal" in cell.reason
            continue
        ref = cells[task, "softmax"].params
        assert abs(cell.params / ref - 1) < 0.02 or "larger than softmax" in cell.match_note
    # the NeuroGame family is the pooled head on the pair task, with a softmax encoder
    cfg = zoo.base_config(grid, "nli", "neurogame", cells["nli", "neurogame"].changes)
    assert (cfg.model.attention.name, cfg.model.pool.name) == ("softmax", "neurogame")
    order = zoo.jobs(grid, cells)
    first = [j for j in order if j[0] == "brackets"]
    n_live = sum(c.reason is None for (t, _), c in cells.items() if t == "brackets")
    assert [j[2] for j in first[:2 * n_live]] == [1.0, 3.0] * n_live  # candidates, seed 0
    assert {j[2] for j in first[2 * n_live:]} == {None}  # then the chosen factor, seed 1
    assert {j[3] for j in first[2 * n_live:]} == {1}


def test_zoo_quick_grid(tmp_path, monkeypatch, capsys):
    """The quick grid end to end on one task: the learning rate is chosen on seed 0, a run
    that raises is recorded and the grid goes on, the report has every cell and both
    figures, and a second `run` trains nothing."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    runs, results = tmp_path / "runs", tmp_path / "results"
    real = zoo.run_one

    def run_one(grid, cell, factor, seed, out, **kw):
        if cell.family == "hopfield" and factor == 3.0:
            raise FloatingPointError("injected: the loss diverged")
        return real(grid, cell, factor, seed, out, **kw)

    monkeypatch.setattr(zoo, "run_one", run_one)
    args = ["zoo/quick", "--tasks", "brackets", "--families", "hopfield,free_energy",
            "--runs", runs, "--results", results]
    grid_cli("run", *args)
    grid_cli("report", *args)
    done = sorted(str(p.parent.relative_to(runs)) for p in runs.glob("*/*/*/result.json"))
    # softmax: 2 candidates + seed 1 at the chosen factor; hopfield's 3.0 candidate failed,
    # so 1.0 is chosen
    assert len(done) == 5 and "brackets/hopfield/lr1_s1" in done
    failed = json.loads((runs / "brackets/hopfield/lr3_s0/failed.json").read_text())
    assert failed["error"] == "FloatingPointError" and "injected" in failed["message"]
    r = json.loads((runs / "brackets/softmax/lr1_s0/result.json").read_text())
    assert r["step_memory_bytes"] > 0 and r["steps_per_s"] > 0 and "accuracy" in r["test"]
    table = (results / "zoo.md").read_text()
    assert "| modern Hopfield |" in table and "injected" in table
    assert "FreeEnergyAttention: causal=True is not supported" in table  # the empty cell
    stats = json.loads((results / "zoo.json").read_text())
    assert stats["brackets/hopfield"]["n"] == 2 and "gap" in stats["brackets/hopfield"]
    assert stats["brackets/hopfield"]["lr_factor"] == 1.0
    for fig in ("gaps.png", "cost.png"):
        assert (results / fig).stat().st_size > 0
    before = {p: p.stat().st_mtime for p in runs.glob("*/*/*/result.json")}
    grid_cli("run", *args)
    assert {p: p.stat().st_mtime for p in runs.glob("*/*/*/result.json")} == before
    # the ledger beside the report holds every outcome: a fresh checkout (no run
    # directories) trains nothing and reports the same table
    ledger = results / "ledger"
    assert sorted(str(p.parent.relative_to(ledger))
                  for p in ledger.glob("*/*/*/result.json")) == done
    kept = json.loads((ledger / "brackets/hopfield/lr3_s0/failed.json").read_text())
    assert "injected" in kept["message"] and "traceback" not in kept  # no local paths
    shutil.rmtree(runs)
    monkeypatch.setattr(zoo, "run_one", None)  # training anything would raise
    grid_cli("run", *args)
    assert not list(runs.glob("*/*/*/result.json"))
    grid_cli("report", *args)
    assert json.loads((results / "zoo.json").read_text()) == stats
    # a cell whose factor the ledger fixes (runs recovered from an earlier report) skips the
    # other candidate and trains its other seeds at that factor
    (ledger / "brackets/hopfield/lr1_s1").rename(tmp_path / "moved")
    (ledger / "brackets/hopfield/lr3_s0/failed.json").unlink()  # the other candidate
    (ledger / "brackets/hopfield/choice.json").write_text('{"factor": 1.0}')
    trained = []

    # records what the grid trains; the outcome is the run moved away (not trained again)
    def retrain(grid, cell, factor, seed, out, **kw):
        trained.append((cell.family, factor, seed))
        shutil.copytree(tmp_path / "moved", out, dirs_exist_ok=True)
        return json.loads((out / "result.json").read_text())

    monkeypatch.setattr(zoo, "run_one", retrain)
    grid_cli("run", *args)
    assert trained == [("hopfield", 1.0, 1)]
    # the step-cost probe of every live cell, kept for the next call
    grid_cli("price", *args)
    costs = json.loads((runs / "step_cost.json").read_text())
    assert set(costs) == {"brackets/softmax", "brackets/hopfield"}
    assert all(c["step_s"] > 0 and c["compile_s"] > 0 for c in costs.values())
    # without the task's data the cells cannot be built: report takes them from the ledger
    # (the parameter counts its runs recorded) rather than writing them as empty cells
    def no_data(cfg):
        raise OSError("injected: no data here")

    real_build = sf.train.build_dataset

    monkeypatch.setattr(zoo, "_DATASETS", {})
    monkeypatch.setattr(sf.train, "build_dataset", no_data)
    grid = G.load_grid(GRIDS / "quick.yaml", tasks=["brackets"], families=["hopfield"])
    G.report(grid, G.Runs(runs, results / "ledger"), results / "no_data")
    again = json.loads((results / "no_data" / "zoo.json").read_text())
    for key in ("brackets/softmax", "brackets/hopfield"):  # (a failure was removed above)
        assert [again[key].get(k) for k in ("params", "values", "mean", "gap", "lr_factor")] \
            == [stats[key].get(k) for k in ("params", "values", "mean", "gap", "lr_factor")]
    assert "counted by its runs: the task's data is not on this machine" in \
        again["brackets/hopfield"]["match"]
    # nor does run train nothing in silence: it says which task's data is missing
    with pytest.raises(G.GridError, match="run: the task's data is not available for task"
                                          r"\(s\) \['brackets'\].*injected: no data here"):
        G.run_grid(grid, G.Runs(runs, results / "ledger"))
    # with another task whose data is here, that one trains and the missing one is named
    monkeypatch.setattr(sf.train, "build_dataset", lambda cfg: (
        no_data(cfg) if cfg.data.task == "brackets" else real_build(cfg)))
    monkeypatch.setattr(zoo, "_DATASETS", {})
    grid = G.load_grid(GRIDS / "quick.yaml", tasks=["brackets", "digits"], families=["softmax"])
    trained.clear()

    def fake_run(grid, runs, cell, factor, seed, **kw):  # records the run as done
        out = runs.dir(cell.task, cell.family, factor, seed)
        out.mkdir(parents=True)
        (out / "result.json").write_text(json.dumps({"val": {"loss": 1.0, "accuracy": 0.5}}))
        trained.append(cell.task)
        return True

    monkeypatch.setattr(zoo, "train_run", fake_run)
    G.run_grid(grid, G.Runs(tmp_path / "other", tmp_path / "other_ledger"))
    assert set(trained) == {"digits"}
    assert "task brackets is left out: the task's data is not available" in \
        capsys.readouterr().out


def test_an_equal_steps_report_pairs_a_variant_with_the_family_it_names():
    """`against: spin` in a grid without FLOP budgets: the variant's metric minus the
    family's, over the seeds both finished (hand-written results)."""
    from spinformer.grid import _report

    grid = G.load_grid(GRIDS / "adjoints_tasks.yaml", tasks=["brackets12"])

    def result(acc):  # the loss on the test split, where the grid recorded it
        test = {"accuracy": acc} if acc == 0.96 else {"accuracy": acc, "loss": 1 - acc}
        return {"split": "test", "test": test, "val": {}, "steps_per_s": 10.0,
                "lr": 1e-2, "wall_time_s": 1.0, "bad_steps": 0}

    accs = {"softmax": (0.99, 0.98, 0.97), "spin": (1.0, 1.0, 0.99),
            "spin_onestep": (0.93, 0.95, None), "spin_shine": (None, 0.96, None)}
    data = {("brackets12", f): {"label": f, "reason": None, "params": 1, "match": None,
                                "failures": [], "step_memory_bytes": None,
                                "results": {k: result(a) for k, a in enumerate(v)
                                            if a is not None}}
            for f, v in accs.items()}
    stats = _report.summarise(grid, data)
    a = stats["brackets12", "spin_onestep"]["against"]
    assert a["family"] == "spin" and a["n"] == 2
    assert a["gap"] == pytest.approx(-0.06) and a["gap_ci"] > 0
    assert a["loss_gap"] == pytest.approx(0.06) and a["loss_gap_ci"] == pytest.approx(
        a["gap_ci"])
    one = stats["brackets12", "spin_shine"]["against"]
    assert one["n"] == 1 and one["gap"] == pytest.approx(-0.04) and "loss_gap" not in one
    assert "against" not in stats["brackets12", "spin"]
    lines = _report._against_table(grid, ["brackets12"], list(accs), stats)
    assert "| brackets T=12 | spin_onestep | spin | -6.0 ± " in "\n".join(lines)
    assert "| brackets T=12 | spin_shine | spin | -4.0 (1 seed) (accuracy) | — | 1 |" in lines
    assert _report._against_table(grid, ["brackets12"], ["softmax", "spin"], stats) == []


def test_zoo_time_budget_stops_a_run_and_records_why(tmp_path):
    """A run over the grid's `max_run_minutes` is stopped after the step in flight,
    checkpointed and recorded as failed with the budget in its message; `--retry-failed`
    leaves it alone, and a budget that is not a positive number is refused."""
    grid = yaml.safe_load((GRIDS / "quick.yaml").read_text())
    grid["lr_factors"], grid["seeds"] = [1.0], [0]
    grid["max_run_minutes"] = 1e-4  # 6 ms: over budget at the first step
    path = write_grid(tmp_path / "grid.yaml", grid)
    runs = tmp_path / "runs"
    args = [path, "--tasks", "brackets", "--families", "softmax",
            "--runs", runs, "--results", tmp_path / "results"]
    grid_cli("run", *args)
    out = runs / "brackets" / "softmax" / "lr1_s0"
    failed = json.loads((out / "failed.json").read_text())
    assert failed["error"] == "RunOverBudget" and "time budget of 0.0001 min" in failed["message"]
    assert not (out / "result.json").exists()
    assert ("checkpointed" in failed["message"]) == bool(list(out.glob("ckpt-*")))
    stamp = (out / "failed.json").stat().st_mtime
    grid_cli("run", "--retry-failed", *args)
    assert (out / "failed.json").stat().st_mtime == stamp
    grid["max_run_minutes"] = 0
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    with pytest.raises(G.GridError, match="max_run_minutes must be a positive number"):
        zoo.load_grid(path)


def test_zoo_budget_abandons_a_run_whose_step_never_returns(tmp_path):
    """If the stop request of the time budget is never taken up (a hang in compiled code),
    the run is recorded as failed and the worker process exits, so the grid goes on."""
    import subprocess

    out = tmp_path / "t" / "f" / "lr1_s0"
    out.mkdir(parents=True)
    script = f"""
import sys, time, pathlib
from spinformer.grid import _grid as zoo
out = pathlib.Path({str(out)!r})
assert zoo.claim(out)
budget = zoo._Budget(1e-4, 0.0, out, grace_s=0.5)
budget.start()
time.sleep(60)  # a step that never returns: no loop ever reads the request
"""
    t0 = __import__("time").time()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert __import__("time").time() - t0 < 50
    failed = json.loads((out / "failed.json").read_text())
    assert failed["error"] == "RunOverBudget" and "did not return" in failed["message"]
    assert not (out.parent / (out.name + ".lock")).exists()


def test_zoo_locks(tmp_path):
    """A run claimed by a live process is left alone; a dead process's lock is taken over."""
    import os
    import subprocess

    out = tmp_path / "t" / "f" / "lr1_s0"
    assert zoo.claim(out) and not zoo.claim(out)  # ours, and alive
    zoo.release(out)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    lock = out.parent / (out.name + ".lock")
    lock.mkdir(parents=True)
    (lock / "owner").write_text(f"{__import__('socket').gethostname()} {dead}")
    assert zoo.claim(out)
    assert (lock / "owner").read_text().endswith(str(os.getpid()))


def test_scaling_grid_prices_each_cell_and_spends_its_flop_budget(tmp_path, monkeypatch):
    """The scaling grid (configs/zoo/scaling.yaml) is valid; a tiny version of it (README.md
    as the text, a tiny model, a tiny budget) prices its cell once (steps = budget / FLOPs
    per step, kept in the ledger), trains that many steps with the FLOPs counted, uses the
    size's own seeds, and records the validation curve. (A solving family's price, at the
    probe's solver counts, is checked by `test_own_attention_goes_through_a_grid`.)"""
    grid = zoo.load_grid(GRIDS / "scaling.yaml")
    assert {"softmax", "spin", "spin_steps", "hopfield", "boltzmann_mf"} <= set(grid["families"])
    assert all(t.get("flops") for t in grid["tasks"].values())
    assert zoo.seeds_of(grid, "small") == [0, 1, 2] and zoo.seeds_of(grid, "large") == [0, 1]
    tiny = yaml.safe_load((GRIDS / "scaling.yaml").read_text())
    # seeds other than the grid's [0, 1], so that running the grid's would show
    tiny["tasks"] = {"tiny": {**tiny["tasks"]["small"], "flops": 4.0e7, "probe_steps": 2,
                              "seeds": [1, 2], "test_batches": 1}}
    tiny["tasks"]["tiny"]["set"] = {
        "data.path": "README.md", "data.val_fraction": 0.1, "data.test_fraction": 0.1,
        "data.seq_len": 8, "data.batch_size": 4, "data.eval_batches": 1, "model.dim": 8,
        "model.depth": 1, "model.num_heads": 1, "model.ffn_hidden": 8, "model.dropout": 0.0,
        "train.warmup_steps": 1, "train.eval_every": 5, "train.log_every": 1,
        "train.checkpoint_every": 0}
    for fam in tiny["families"].values():
        fam.pop("skip", None)  # (the sizes it names are not in the tiny grid)
    path = write_grid(tmp_path / "grid.yaml", tiny)
    runs, results = tmp_path / "runs", tmp_path / "results"
    args = [path, "--families", "softmax", "--runs", runs, "--results", results]
    counted, count = [], sf.train.step_flops
    monkeypatch.setattr(sf.train, "step_flops", lambda *a: counted.append(a) or count(*a))
    grid_cli("run", *args)
    assert len(counted) == 1  # priced once per cell, not once per run
    price = json.loads((results / "ledger" / "tiny" / "softmax" / "price.json").read_text())
    assert price["steps"] == math.ceil(4.0e7 / price["flops_per_step"]) >= 2
    assert price["solver_steps"] == 0
    assert not (results / "ledger" / "tiny" / "softmax" / "lr1_s0").exists()  # the grid's seed
    for seed in (1, 2):
        r = json.loads((results / "ledger" / "tiny" / "softmax" / f"lr1_s{seed}" /
                        "result.json").read_text())
        # no solver: exactly the priced steps' FLOPs
        assert r["steps"] == price["steps"]
        assert 4.0e7 <= r["flops"] < 4.0e7 + price["flops_per_step"]
        assert r["curve"][-1][0] == r["steps"] and r["curve"][-1][1] == r["flops"]
        assert "test" in r


def test_report_of_the_committed_scaling_ledger(tmp_path, capsys, monkeypatch):
    """`spinformer grid report zoo/scaling` refits the committed ledger (copied: the report
    writes beside it): power laws, the frontier, the tables and both figures."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    shutil.copytree(ROOT / "experiments" / "results" / "scaling" / "ledger",
                    tmp_path / "ledger")
    grid_cli("report", "zoo/scaling", "--results", tmp_path, "--runs", tmp_path / "runs")
    out = capsys.readouterr().out
    assert re.search(r"^scaling: \d+ finished runs", out, re.M)
    assert re.search(r"^  softmax +alpha = \d\.\d+ ± \d\.\d+", out, re.M)
    assert re.search(r"^  frontier at \S+ FLOPs", out, re.M)
    for name in ("scaling.md", "scaling.json", "loss_vs_flops.png", "loss_vs_time.png"):
        assert (tmp_path / name).stat().st_size > 0


def _compare_dir(tmp: pathlib.Path, *, families=("softmax", "mine"), seeds=(0,)) -> pathlib.Path:
    """The own-attention guide's "compare it" at toy size in `tmp/work`: `my_attention.py`
    (the guide's example above `cfg = ...`) and its `compare.yaml`, with a tiny model and
    budget and the given families and seeds."""
    md = (ROOT / "docs" / "guides" / "own_attention.md").read_text()
    code = md.split("```python\n")[1].split("```")[0].split("\ncfg = ")[0]
    grid = yaml.safe_load(md.split("```yaml\n")[1].split("```")[0])
    work = tmp / "work"
    work.mkdir()
    (work / "my_attention.py").write_text(code)
    grid["seeds"] = list(seeds)
    grid["families"] = {f: grid["families"][f] for f in families}
    task = grid["tasks"]["brackets"]
    task["flops"], task["test_batches"], task["probe_steps"] = 2.0e8, 1, 2
    task["set"].update({"data.seq_len": 6, "data.batch_size": 4, "data.eval_batches": 1,
                        "model.dim": 8, "model.ffn_hidden": 8, "train.eval_every": 5,
                        "train.warmup_steps": 1, "train.log_every": 1})
    (work / "compare.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    return work


IDLE = """
from spinformer import nn, solvers


@nn.register_attention("idle", help="softmax, then a solve whose map returns its start")
class Idle(nn.SoftmaxAttention):
    def __call__(self, x, *, return_diagnostics=False, **kw):
        y = super().__call__(x, **kw)
        sol = solvers.fixed_point(lambda m, c: c, y, y, solver=solvers.Anderson(tol=1e-5))
        if return_diagnostics:
            return sol.value, nn.Diagnostics(solver=nn.Stats.of(sol))
        return sol.value
"""


def test_own_attention_goes_through_a_grid(tmp_path, capsys, monkeypatch):
    """The guide's family of one's own, imported by the grid file (`imports`), is matched,
    priced, trained and reported against softmax at equal FLOPs from another folder; the
    ledger records the module, and `report` imports it from there without being told. A
    family whose solve returns its start is flagged by the report's solver-effect column;
    the guide's is not."""
    from spinformer import nn

    monkeypatch.setenv("MPLBACKEND", "Agg")
    work = _compare_dir(tmp_path)
    (work / "idle.py").write_text(IDLE)
    grid = yaml.safe_load((work / "compare.yaml").read_text())
    grid["imports"].append("idle.py")
    grid["families"]["idle"] = {"set": {"model.attention": "idle"}}
    (work / "compare.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    monkeypatch.chdir(work)
    try:
        grid_cli("all", "compare.yaml")
        out = capsys.readouterr().out
        assert re.search(r"^  brackets mine: test loss \d\.\d+, [+-]\d\.\d+ \(1 seed\) against "
                         r"softmax at equal FLOPs", out, re.M), out
        ledger = work / "experiments" / "results" / "compare" / "ledger"
        assert json.loads((ledger / "imports.json").read_text())["modules"] == [
            str(work / "my_attention.py"), str(work / "idle.py")]
        md = (ledger.parent / "scaling.md").read_text()
        effect = md.split("## Is the solver doing anything?")[1]
        assert re.search(r"^\| brackets \| idle \| [\d.]+ / [\d.]+ / [\d.]+ \*\*no effect\*\* \| 1 \|",
                         effect, re.M), effect
        assert re.search(r"^\| brackets \| mine \| [\d.]+ / [\d.]+ / [\d.]+ \| 1 \|", effect,
                         re.M), effect
        assert "softmax" not in effect  # no solves, no row
        price = json.loads((ledger / "brackets" / "mine" / "price.json").read_text())
        assert price["solver_steps"] > 0 and price["step_flops"]["exact"] is False
        # priced at the probe's solver counts: spent what was priced, up to their drift
        r = json.loads((ledger / "brackets" / "mine" / "lr1_s0" / "result.json").read_text())
        assert r["steps"] == price["steps"] >= 2
        assert r["flops"] == pytest.approx(2.0e8, rel=0.5)
        assert r["curve"][-1][0] == r["steps"] and r["curve"][-1][1] == r["flops"]
        # a grid file without `imports` reads the same ledger: the module comes from it
        sf._schema.unregister_attention("mine")
        plain = yaml.safe_load((work / "compare.yaml").read_text())
        del plain["imports"]
        (work / "plain.yaml").write_text(yaml.safe_dump(plain, sort_keys=False))
        sys.modules.pop("my_attention", None)
        grid_cli("report", "plain.yaml", "--results", ledger.parent)
        assert "brackets mine" in capsys.readouterr().out
    finally:
        for name, module in (("mine", "my_attention"), ("idle", "idle")):
            if name in nn.attention_names():
                sf._schema.unregister_attention(name)
            sys.modules.pop(module, None)


@pytest.mark.slow  # ~2 min: builds and installs a wheel, then trains four toy runs
def test_own_attention_compared_from_a_plain_install(tmp_path):
    """`pip install .` (not editable), used from a folder outside the checkout: the guide's
    family goes through its grid against softmax and the spin TAP steady state with one
    command, and the report gives its paired gap at equal FLOPs."""
    import os
    import subprocess

    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", wheels, ROOT],
                   check=True, cwd=tmp_path, timeout=600)
    subprocess.run([*pip, "install", "--no-deps", "--target", site, *wheels.glob("*.whl")],
                   check=True, cwd=tmp_path, timeout=600)
    work = _compare_dir(tmp_path, families=("softmax", "spin", "mine"), seeds=(0, 1))
    env = dict(os.environ, PYTHONPATH=str(site), MPLBACKEND="Agg", SPINFORMER_HUGEPAGES="0")
    proc = subprocess.run([sys.executable, "-m", "spinformer", "grid", "all", "compare.yaml"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(site) in subprocess.run(
        [sys.executable, "-c", "import spinformer; print(spinformer.__file__)"], cwd=work,
        env=env, capture_output=True, text=True).stdout  # the installed copy, not the checkout
    assert re.search(r"^  brackets mine: test loss \d\.\d+, [+-]\d\.\d+ ± \d\.\d+ against "
                     r"softmax at equal FLOPs", proc.stdout, re.M), proc.stdout
    assert "frontier at" in proc.stdout
    assert (work / "experiments" / "results" / "compare" / "scaling.md").exists()


def test_the_submitit_engine_trains_a_grid_through_its_local_executor(tmp_path):
    """`--engine submitit` hands each run to submitit as a job (here its local executor, as
    processes); the jobs write the same ledger the local workers write, and a second call
    submits nothing. (In a process of its own, as the command line runs it, and without
    importing submitit here: unless `SUBMITIT_LOG_LEVEL=NOCONFIG`, which the engine sets, its
    import configures logging with `dictConfig`, which closes every handler already set up,
    pytest's log capture among them.)"""
    import importlib.util
    import os
    import subprocess

    if importlib.util.find_spec("submitit") is None:
        pytest.skip("submitit is not installed (pip install submitit)")
    grid = yaml.safe_load((GRIDS / "quick.yaml").read_text())
    grid["tasks"] = {"brackets": grid["tasks"]["brackets"]}
    grid["lr_factors"], grid["seeds"] = [1.0], [0, 1]
    grid["families"] = {"softmax": grid["families"]["softmax"]}
    path = write_grid(tmp_path / "grid.yaml", grid)
    cmd = [sys.executable, "-m", "spinformer", "grid", "run", str(path), "--runs",
           str(tmp_path / "runs"), "--results", str(tmp_path / "results"), "--engine",
           "submitit", "--engine-option", "cluster=local"]
    env = dict(os.environ, SPINFORMER_HUGEPAGES="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "submitted 2 runs (local)" in proc.stdout
    ledger = tmp_path / "results" / "ledger" / "brackets" / "softmax"
    for seed in (0, 1):
        r = json.loads((ledger / f"lr1_s{seed}" / "result.json").read_text())
        assert r["seed"] == seed and "accuracy" in r["test"]
    assert list((tmp_path / "runs" / "submitit").glob("*_log.out"))  # the jobs' own logs
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "submitted" not in proc.stdout, proc.stderr[-3000:]
