import json

import pytest

from spinformer import config as C
from spinformer import data, train
from spinformer.train import _experiment, _flops


def _cfg(**over):
    base = {
        "model.attention": "spin", "model.dim": "16", "model.ffn_hidden": "16",
        "model.depth": "2", "data.seq_len": "8", "data.batch_size": "8",
        "data.eval_batches": "1", "train.steps": "6", "train.log_every": "1",
        "train.eval_every": "3", "train.warmup_steps": "2", "train.progress": "false",
        # the fit's (they change no count): its step's variants are the ones counted below
        "train.count_flops": "true", "train.checkpoint_every": "3",
    }
    base.update(over)
    if base["model.attention"] == "spin":
        base.setdefault("model.attention.solver.tol", "1e-4")
    return C.load_config(None, [f"{k}={v}" for k, v in base.items()])


@pytest.fixture(scope="module", autouse=True)
def _counted_once():
    """Each straight-line variant's XLA count (`_flops._counts`, a trace and a lowering of a
    whole training step: seconds each) is taken once per module: `step_flops` of the configs
    below counts the same variants (Picard unrolled to 2 and 3 iterations) as the tests do
    themselves. The count is a function of the config (all here have the same data)."""
    counts, known = _flops._counts, {}

    def once(cfg, dataset, step=True):
        if (cfg, step) not in known:
            known[cfg, step] = counts(cfg, dataset, step)
        return known[cfg, step]

    mp = pytest.MonkeyPatch()
    mp.setattr(_flops, "_counts", once)
    yield
    mp.undo()


def test_step_flops_match_the_written_out_step():
    # Picard unrolled to k iterations with the unrolled adjoint does k forward iterations and
    # k backward products: XLA's count of that straight-line step must be the model's.
    cfg = _cfg(**{"model.attention.solver.name": "picard"})
    ds = train.build_dataset(cfg)
    model = train.step_flops(cfg, ds)
    assert model.exact and model.forward_iteration > 0 and model.backward_product > 0
    for k in (2, 3, 6):
        full, _ = _flops._counts(_flops.unrolled_config(cfg, k, picard=True), ds)
        assert model(k, k) == pytest.approx(full, rel=1e-6)
    # no solver: the step as it is
    soft = _cfg(**{"model.attention": "softmax"})
    got = train.step_flops(soft)
    assert (got.forward_iteration, got.backward_product) == (0.0, 0.0)
    assert got.base == _flops._counts(soft, train.build_dataset(soft))[0] > 0
    # a fixed number of backward products (one-step gradients) ignores the metric
    one = train.step_flops(_cfg(**{"model.attention.adjoint": "onestep"}))
    assert one(4, 99) == one(4, 1) == one.base + 4 * one.forward_iteration + one.backward_product


def test_fit_sums_each_steps_flops_and_resume_continues_the_sum(tmp_path, monkeypatch):
    # Picard: its step's FLOPs are the variants the test above counts (Anderson's are there)
    cfg = _cfg(**{"model.attention.solver.name": "picard"})
    full = train.run(cfg, tmp_path / "full")
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").open()]
    steps = [r for r in records if r["split"] == "train"]
    model = train.StepFlops(**full["step_flops"])
    total = 0.0
    for r in steps:  # one record per step: each adds its own counts
        total += model.of_metrics(r)
        assert r["flops"] == pytest.approx(total, rel=1e-9)
    assert full["flops"] == pytest.approx(total, rel=1e-9) and len(steps) == 6
    # the counts vary from step to step, so a wrong step's counts would show
    assert len({r["solver_steps"] for r in steps}) > 1 or len(
        {r["backward_steps"] for r in steps}) > 1

    class Killed(Exception):
        pass

    real_batch = data.BracketMatching.batch

    def dying_batch(self, index, split="train"):
        if split == "train" and index == 4:
            raise Killed()
        return real_batch(self, index, split)

    def no_recount(*args, **kwargs):
        raise AssertionError("a run given its step's FLOPs counted them again")

    # a count already known (a grid's price) is taken as given, not counted again
    monkeypatch.setattr(_experiment, "step_flops", no_recount)
    monkeypatch.setattr(data.BracketMatching, "batch", dying_batch)
    with pytest.raises(Killed):
        train.run(cfg, tmp_path / "cut", flops=model)
    monkeypatch.setattr(data.BracketMatching, "batch", real_batch)
    resumed = train.run(cfg, tmp_path / "cut", resume=True, flops=model)
    assert resumed["flops"] == full["flops"]


def test_count_flops_refuses_streams():
    cfg = _cfg(**{"data.task": "chars", "data.stream": "true", "train.count_flops": "true",
                  "model.attention.mode": "steps", "model.attention.init": "carried"})
    with pytest.raises(C.ConfigError, match="data.stream"):
        train.step_flops(cfg, dataset=object())
