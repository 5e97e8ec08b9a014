"""The experiment scripts run end to end at toy sizes (their numbers are not results)."""

import importlib.util
import pathlib
import sys

import pytest

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
