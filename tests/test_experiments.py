"""The experiment scripts run end to end at toy sizes (their numbers are not results)."""

import importlib.util
import json
import math
import pathlib
import shutil
import sys

import pytest
import yaml

import spinformer as sf
from spinformer import solvers
from spinformer.config import ConfigError, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # (dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # ~60 s: the sweep's whole quick grid
def test_boltzmann_ablation_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    ablation = _load("boltzmann_ablation")
    runs, results = tmp_path / "runs", tmp_path / "results"
    ablation.main(["all", "--quick", "--seeds", "2", "--tasks", "brackets",
                   "--runs", str(runs), "--results", str(results)])
    # every mode (and extra variant) x seed finished, and a second `run` skips them all
    n_modes = len(ablation.MODES) + len(ablation.EXTRAS)
    assert len(list(runs.glob("*/summary.json"))) == 2 * n_modes
    ablation.main(["run", "--quick", "--seeds", "2", "--tasks", "brackets", "--runs", str(runs)])
    # the variant trains mode hJ with the couplings' learning rate raised to the main one
    base = load_config(runs / "brackets_T4_ffn0_hJ_s0" / "config.yaml")
    fast = load_config(runs / "brackets_T4_ffn0_hJlr_s0" / "config.yaml")
    assert fast.model.attention.mode == "hJ"
    assert fast.train.coupling_lr == fast.train.lr > base.train.coupling_lr

    table = (results / "ablation.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| 4 |"))
    assert row.count("(n=2)") == n_modes
    for fig in ("brackets_ffn0_accuracy.png", "curves_brackets_T4_ffn0.png",
                "couplings_brackets_T4_ffn0.png"):
        assert (results / fig).stat().st_size > 0

    approx = (results / "approximation.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in approx.splitlines()
            if line.startswith("| ") and "inference" not in line}
    assert set(rows) == {"exact", "mean_field", "tap", "gibbs", "parallel_tempering", "dqa",
                         f"dqa τ={ablation.DQA_TIMES[0]:g}"}
    assert float(rows["exact"][0]) == 0.0
    # T = 4 after a few steps: the couplings are tiny, mean field is close to exact; sampling
    # noise with 64 samples is of order 1/sqrt(64)
    assert float(rows["mean_field"][0]) < 1e-3
    assert 1e-3 < float(rows["gibbs"][0]) < 0.2


def test_boltzmann_ablation_plan():
    """The sweep's order and filters (no training)."""
    ablation = _load("boltzmann_ablation")
    full = ablation.plan(("brackets", "chars"), False, 3)
    # the seed's headline first: bracket matching without FFN at T = 12, every mode per seed
    assert [m for _, m, _ in full[:4]] == list(ablation.MODES)
    assert {g for g, _, _ in full[:12]} == {("brackets", 12, 0)}
    assert len(full) == (6 + 3) * 3 * len(ablation.MODES) + 2 * 3 * len(ablation.EXTRAS)
    only = ablation.plan(("brackets",), False, 6, "only", ("hJL", "softmaxL"))
    assert {m for _, m, _ in only} == {"hJL", "softmaxL"}
    assert {g for g, _, _ in only} == {("brackets", 12, 0), ("brackets", 16, 0)}
    assert len(only) == 2 * 6 * 2


def test_ngt_nli_plan_and_configs():
    """The sweep's order and each variant's config (no training)."""
    ngt = _load("ngt_nli")
    order = ngt.plan(list(ngt.VARIANTS), 2)
    assert [v for v, s in order[:len(ngt.VARIANTS)]] == list(ngt.VARIANTS)  # seed-major
    assert {s for _, s in order[:len(ngt.VARIANTS)]} == {0}
    base = ngt.config_for("softmax", 0, False)
    for name in ngt.VARIANTS:
        cfg = ngt.config_for(name, 3, False)
        assert cfg.train.seed == cfg.data.seed == 3
        assert (cfg.model.dim, cfg.train.steps, cfg.data.task) == (
            base.model.dim, base.train.steps, base.data.task)  # equal width and budget
        if name.startswith("ngt") or name.startswith("short"):
            games = cfg.model.attention if name == "ngt_query" else cfg.model.pool
            assert games.adjoint == (
                solvers.Implicit(rtol=1e-4) if name == "ngt_implicit" else solvers.Unrolled())
    assert ngt.config_for("ngt_lambda0", 0, False).model.pool.gate == "banzhaf"
    assert ngt.config_for("ngt_query", 0, False).model.attention.name == "neurogame"
    short = ngt.config_for("short_exact", 0, False)
    assert short.data.seq_len == 13 and str(short.model.pool.estimator) == "exact"
    assert ngt.usable("short_exact", short)
    assert not ngt.usable("short_exact", short.replace({"data.seq_len": 32}))  # > 16 slots
    assert sf.train.build_dataset(short).seq_len == 13  # every pair of the subset fits
    with pytest.raises(ConfigError, match="seq_len"):  # word order needs 17 slots
        sf.train.build_dataset(base.replace({"data.seq_len": 13}))


@pytest.mark.slow
def test_ngt_nli_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    ngt = _load("ngt_nli")
    runs, results = tmp_path / "runs", tmp_path / "results"
    variants = "softmax,ngt,ngt_noJ"
    ngt.main(["all", "--quick", "--seeds", "2", "--variants", variants, "--runs", str(runs),
              "--results", str(results)])
    assert len(list(runs.glob("*/test.json"))) == 6
    cfg = load_config(runs / "ngt_noJ_s1" / "config.yaml")
    assert cfg.model.pool.name == "neurogame" and not cfg.model.pool.interactions
    assert cfg.train.seed == cfg.data.seed == 1
    table = (results / "nli.md").read_text()
    assert "| ngt_noJ |" in table and "(n=2)" in table
    assert (results / "negation_example.png").stat().st_size > 0
    # a second run skips the finished ones (no new directories, nothing retrained)
    before = {p: p.stat().st_mtime for p in runs.glob("*/test.json")}
    ngt.main(["run", "--quick", "--seeds", "2", "--variants", variants, "--runs", str(runs)])
    assert {p: p.stat().st_mtime for p in runs.glob("*/test.json")} == before


@pytest.mark.slow
def test_implicit_images_quick(tmp_path, monkeypatch):
    """The Fashion-MNIST sweep end to end on the digits: the three main configs train, are
    evaluated on the test split (the implicit one with its spectral radius), the report
    pairs them; a second run retrains nothing."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    exp = _load("implicit_images")
    runs, results = tmp_path / "runs", tmp_path / "results"
    exp.main(["all", "--quick", "--seeds", "1", "--runs", str(runs), "--results", str(results)])
    assert sorted(p.parent.name for p in runs.glob("*/test.json")) == [
        "free_energy_s0", "implicit_s0", "softmax_s0"]
    test = (runs / "implicit_s0" / "test.json").read_text()
    assert "spectral_radius_mean" in test
    table = (results / "fmnist.md").read_text()
    for v in ("softmax", "implicit", "free_energy"):
        assert f"| {v} |" in table
    assert (results / "curves.png").stat().st_size > 0
    assert (results / "couplings.png").stat().st_size > 0
    before = {p: p.stat().st_mtime for p in runs.glob("*/test.json")}
    exp.main(["run", "--quick", "--seeds", "1", "--runs", str(runs)])
    assert {p: p.stat().st_mtime for p in runs.glob("*/test.json")} == before


@pytest.mark.slow  # ~20 s: four tiny training runs
def test_spin_lm_runs_resumes_and_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    study = _load("spin_lm")
    runs, results = tmp_path / "runs", tmp_path / "results"
    args = ["--variants", "softmax,steps2", "--seeds", "0,1", "--steps", "4",
            "--runs", str(runs), "--results", str(results)]
    study.main(["all", *args])
    assert len(list((runs / "quickstart").glob("*/summary.json"))) == 4
    study.main(["run", *args])  # finished runs are skipped, not retrained or refused
    cfg = load_config(runs / "quickstart" / "steps2_s1" / "config.yaml")
    assert (cfg.model.attention.mode, cfg.model.attention.num_steps, cfg.train.seed) == ("steps", 2, 1)
    table = (results / "quickstart.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| steps2 |"))
    assert row.count("±") == 2 and "| 2 |" in row  # mean ± std, and a paired gap over 2 seeds
    assert (results / "quickstart_curves.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="unknown variants"):
        study.main(["run", "--variants", "sofmax", "--runs", str(runs)])


def test_zoo_plan_every_cell_builds_or_says_why():
    """Every family × task of the quick grid is either built with its parameter count matched
    to softmax's (or says why it cannot be), or is empty with the library's reason; the runs
    come task by task, the learning-rate candidates of the first seed first."""
    zoo = _load("zoo")
    for path in (ROOT / "configs" / "zoo").glob("*.yaml"):  # every shipped grid is valid
        zoo.load_grid(path)
    full = zoo.load_grid(ROOT / "configs" / "zoo" / "full.yaml")
    assert len(full["seeds"]) >= 3 and zoo.REFERENCE in full["families"]
    headline = zoo.load_grid(ROOT / "configs" / "zoo" / "headline.yaml")
    for name, task in headline["tasks"].items():  # an equal-FLOP task is its twin plus a budget
        twin = headline["tasks"].get(name.removesuffix("_flops"))
        assert twin is not None and {**task, "label": "", "flops": 0} == {
            **twin, "label": "", "flops": 0} or name == name.removesuffix("_flops")
    grid = zoo.load_grid(ROOT / "configs" / "zoo" / "quick.yaml")
    grid["_tasks"], grid["_families"] = list(grid["tasks"]), list(grid["families"])
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


def test_zoo_quick_grid(tmp_path, monkeypatch):
    """The quick grid end to end on one task: the learning rate is chosen on seed 0, a run
    that raises is recorded and the grid goes on, the report has every cell and both
    figures, and a second `run` trains nothing."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    zoo = _load("zoo")
    runs, results = tmp_path / "runs", tmp_path / "results"
    real = zoo.run_one

    def run_one(grid, cell, factor, seed, out, **kw):
        if cell.family == "hopfield" and factor == 3.0:
            raise FloatingPointError("injected: the loss diverged")
        return real(grid, cell, factor, seed, out, **kw)

    monkeypatch.setattr(zoo, "run_one", run_one)
    args = ["--quick", "--tasks", "brackets", "--families", "hopfield,free_energy",
            "--runs", str(runs), "--results", str(results)]
    zoo.main(["all", *args])
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
    zoo.main(["run", *args])
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
    zoo.main(["run", *args])
    assert not list(runs.glob("*/*/*/result.json"))
    zoo.main(["report", *args])
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
    zoo.main(["run", *args])
    assert trained == [("hopfield", 1.0, 1)]
    # the step-cost probe of every live cell, kept for the next call
    zoo.main(["cost", *args])
    costs = json.loads((runs / "step_cost.json").read_text())
    assert set(costs) == {"brackets/softmax", "brackets/hopfield"}
    assert all(c["step_s"] > 0 and c["compile_s"] > 0 for c in costs.values())
    # without the task's data the cells cannot be built: report refuses rather than writing
    # the finished runs over as empty cells
    stamp = (results / "zoo.md").stat().st_mtime

    def no_data(cfg):
        raise OSError("injected: no data here")

    monkeypatch.setattr(zoo, "_DATASETS", {})
    monkeypatch.setattr(sf.train, "build_dataset", no_data)
    with pytest.raises(SystemExit, match="not on this machine.*injected: no data here"):
        zoo.main(["report", *args])
    assert (results / "zoo.md").stat().st_mtime == stamp


def test_zoo_time_budget_stops_a_run_and_records_why(tmp_path):
    """A run over the grid's `max_run_minutes` is stopped after the step in flight,
    checkpointed and recorded as failed with the budget in its message; `--retry-failed`
    leaves it alone, and a budget that is not a positive number is refused."""
    zoo = _load("zoo")
    grid = yaml.safe_load((ROOT / "configs" / "zoo" / "quick.yaml").read_text())
    grid["lr_factors"], grid["seeds"] = [1.0], [0]
    grid["max_run_minutes"] = 1e-4  # 6 ms: over budget at the first step
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    runs = tmp_path / "runs"
    args = ["--config", str(path), "--tasks", "brackets", "--families", "softmax",
            "--runs", str(runs), "--results", str(tmp_path / "results")]
    zoo.main(["run", *args])
    out = runs / "brackets" / "softmax" / "lr1_s0"
    failed = json.loads((out / "failed.json").read_text())
    assert failed["error"] == "RunOverBudget" and "time budget of 0.0001 min" in failed["message"]
    assert not (out / "result.json").exists()
    assert ("checkpointed" in failed["message"]) == bool(list(out.glob("ckpt-*")))
    stamp = (out / "failed.json").stat().st_mtime
    zoo.main(["run", "--retry-failed", *args])
    assert (out / "failed.json").stat().st_mtime == stamp
    grid["max_run_minutes"] = 0
    path.write_text(yaml.safe_dump(grid))
    with pytest.raises(SystemExit, match="max_run_minutes must be a positive number"):
        zoo.load_grid(path)


def test_zoo_budget_abandons_a_run_whose_step_never_returns(tmp_path):
    """If the stop request of the time budget is never taken up (a hang in compiled code),
    the run is recorded as failed and the worker process exits, so the grid goes on."""
    import subprocess

    out = tmp_path / "t" / "f" / "lr1_s0"
    out.mkdir(parents=True)
    script = f"""
import sys, time, pathlib
sys.path.insert(0, {str(ROOT / "experiments")!r})
import zoo
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
    import sys

    zoo = _load("zoo")
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


def test_a_grid_in_one_process_does_not_grow_its_memory_mappings(tmp_path):
    """Each XLA:CPU executable keeps memory mappings of its own; a grid of runs in one process
    kept them all and died at the kernel's limit (vm.max_map_count, 65,530) after 38 runs.
    The experiments' entry point (`_cli.run_script`) releases the compiled programs after
    every training run: four tiny runs of different shapes (each compiling its own
    programs) leave the process's mapping count where the first left it (unreleased, each
    run here added about 400)."""
    import subprocess

    script = f"""
import pathlib, sys
sys.path.insert(0, {str(ROOT / "experiments")!r})
import _cli
import spinformer as sf


def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def main():
    base = sf.config.load_config({str(ROOT / "configs" / "brackets_softmax.yaml")!r})
    counts = []
    for i, dim in enumerate([8, 12, 16, 20]):
        cfg = base.replace({{"model.dim": dim, "model.ffn_hidden": 8, "data.seq_len": 6,
                            "data.batch_size": 2, "data.eval_batches": 1, "train.steps": 1,
                            "train.eval_every": 1, "train.progress": False}})
        sf.train.run(cfg, pathlib.Path({str(tmp_path)!r}) / f"cell{{i}}")
        counts.append(maps())
    print("maps", *counts)


_cli.run_script(main)
"""
    if not pathlib.Path("/proc/self/maps").exists():
        pytest.skip("no /proc/self/maps on this system")
    env = dict(__import__("os").environ, SPINFORMER_HUGEPAGES="0")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [int(c) for c in proc.stdout.split("maps", 1)[1].split()]
    assert max(counts) - counts[0] < 150, counts


def test_scaling_grid_prices_each_cell_and_spends_its_flop_budget(tmp_path, monkeypatch):
    """The scaling grid (configs/zoo/scaling.yaml) is valid; a tiny version of it (README.md
    as the text, tiny models, tiny budgets) prices each cell once (steps = budget / FLOPs
    per step at the probe's solver counts, kept in the ledger), trains that many steps with
    the FLOPs counted, uses the size's own seeds, and records the validation curve."""
    zoo = _load("zoo")
    grid = zoo.load_grid(ROOT / "configs" / "zoo" / "scaling.yaml")
    assert {"softmax", "spin", "spin_steps", "hopfield", "boltzmann_mf"} <= set(grid["families"])
    assert all(t.get("flops") for t in grid["tasks"].values())
    assert zoo.seeds_of(grid, "small") == [0, 1, 2] and zoo.seeds_of(grid, "large") == [0, 1]
    tiny = yaml.safe_load((ROOT / "configs" / "zoo" / "scaling.yaml").read_text())
    # seeds other than the grid's [0, 1], so that running the grid's would show
    tiny["tasks"] = {"tiny": {**tiny["tasks"]["small"], "flops": 4.0e7, "probe_steps": 2,
                              "seeds": [1, 2], "test_batches": 1}}
    tiny["tasks"]["tiny"]["set"] = {
        "data.path": "README.md", "data.val_fraction": 0.1, "data.test_fraction": 0.1,
        "data.seq_len": 8, "data.batch_size": 4, "data.eval_batches": 1, "model.dim": 8,
        "model.depth": 1, "model.num_heads": 1, "model.ffn_hidden": 8, "model.dropout": 0.0,
        "train.warmup_steps": 1, "train.eval_every": 5, "train.log_every": 1,
        "train.checkpoint_every": 0}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(tiny))
    runs, results = tmp_path / "runs", tmp_path / "results"
    args = ["--config", str(path), "--families", "softmax,spin", "--runs", str(runs),
            "--results", str(results)]
    counted, count = [], sf.train.step_flops
    monkeypatch.setattr(sf.train, "step_flops", lambda *a: counted.append(a) or count(*a))
    zoo.main(["run", *args])
    assert len(counted) == 2  # priced once per cell, not once per run
    for fam in ("softmax", "spin"):
        price = json.loads((results / "ledger" / "tiny" / fam / "price.json").read_text())
        assert price["steps"] == math.ceil(4.0e7 / price["flops_per_step"]) >= 2
        assert (price["solver_steps"] > 0) == (fam == "spin")
        assert not (results / "ledger" / "tiny" / fam / "lr1_s0").exists()  # the grid's seed
        for seed in (1, 2):
            r = json.loads((results / "ledger" / "tiny" / fam / f"lr1_s{seed}" /
                            "result.json").read_text())
            assert r["steps"] == price["steps"]
            # spent what was priced, up to the solver counts' drift from the probe's
            if fam == "softmax":  # no solver: exactly the priced steps' FLOPs
                assert 4.0e7 <= r["flops"] < 4.0e7 + price["flops_per_step"]
            else:
                assert r["flops"] == pytest.approx(4.0e7, rel=0.5)
            assert r["curve"][-1][0] == r["steps"] and r["curve"][-1][1] == r["flops"]
            assert "test" in r
