"""The NLI datasets: batch format, determinism, the generated task's labels against its
oracle, held-out combinations, and the JSON-lines reader's counts and errors."""

import json
import pathlib

import numpy as np
import pytest

from spinformer import data
from spinformer.data import _nli

SAMPLE = pathlib.Path(__file__).parent / "data" / "nli_sample.jsonl"


def check_format(ds, batch):
    inputs = batch["inputs"]
    B, two, T = inputs.shape
    assert two == 2 and T == ds.seq_len and inputs.dtype == np.int32
    assert batch["targets"].shape == (B,) and batch["mask"].shape == (B,)
    assert set(np.unique(batch["targets"])) <= {0, 1, 2}
    for row in inputs:
        ids, seg = row
        n = int((ids != _nli.PAD).sum())
        assert np.all(ids[:n] != _nli.PAD) and np.all(ids[n:] == _nli.PAD)  # pad at the end
        assert ids[0] == _nli.CLS and ids[n - 1] == _nli.SEP and (ids[:n] == _nli.SEP).sum() == 2
        assert np.all(seg[n:] == 0) and seg[0] == 1 and seg[n - 1] == 2
        assert np.all(np.diff(seg[:n]) >= 0)  # premise segment, then hypothesis


def test_generated_format_balance_and_determinism():
    ds = data.GeneratedNLI(seq_len=32, batch_size=30, seed=3)
    b = ds.batch(0)
    check_format(ds, b)
    assert np.bincount(b["targets"], minlength=3).tolist() == [10, 10, 10]
    np.testing.assert_array_equal(b["inputs"], ds.batch(0)["inputs"])
    assert not np.array_equal(b["inputs"], ds.batch(1)["inputs"])
    assert not np.array_equal(b["inputs"], data.GeneratedNLI(batch_size=30, seed=4).batch(0)[
        "inputs"])
    base = ds.baselines(b)
    assert base["chance_accuracy"] == pytest.approx(1 / 3)
    assert all(0.0 <= v <= 1.0 for v in base.values())
    with pytest.raises(ValueError, match="seq_len"):
        data.GeneratedNLI(seq_len=12)
    with pytest.raises(ValueError, match="phenomena"):
        data.GeneratedNLI(phenomena=("sarcasm",))


@pytest.mark.parametrize("p,h,label", [
    (("intr", "the", "dog", False, "runs"), ("intr", "the", "animal", False, "runs"), 0),
    (("intr", "the", "animal", False, "runs"), ("intr", "the", "dog", False, "runs"), 1),
    (("intr", "the", "dog", False, "runs"), ("intr", "the", "cat", False, "runs"), 1),
    (("intr", "the", "dog", False, "runs"), ("intr", "the", "dog", True, "runs"), 2),
    (("intr", "the", "dog", False, "runs"), ("intr", "the", "dog", False, "sleeps"), 2),
    (("intr", "the", "dog", False, "runs"), ("intr", "the", "dog", True, "sleeps"), 0),
    (("intr", "every", "dog", False, "runs"), ("intr", "a", "dog", False, "runs"), 0),
    (("intr", "a", "dog", False, "runs"), ("intr", "every", "dog", False, "runs"), 1),
    (("intr", "no", "animal", False, "runs"), ("intr", "the", "dog", False, "runs"), 2),
    (("intr", "no", "animal", False, "runs"), ("intr", "no", "dog", False, "runs"), 0),
    (("intr", "every", "animal", False, "runs"), ("intr", "every", "dog", False, "runs"), 0),
    (("tr", "man", False, "pushes", "boy"), ("tr", "boy", False, "pushes", "man"), 1),
    (("tr", "man", False, "pushes", "boy"), ("tr", "person", False, "pushes", "person"), 0),
    (("tr", "man", False, "pushes", "boy"), ("tr", "man", True, "pushes", "boy"), 2),
])
def test_oracle_on_hand_written_pairs(p, h, label):
    assert _nli.oracle(p, h) == label
    words = _nli.render(p)
    assert words[0] in ("the", "a", "an", "every", "no")


def test_generated_labels_follow_the_oracle_and_distractors_do_not_matter():
    plain = data.GeneratedNLI(seed=1)
    noisy = data.GeneratedNLI(seed=1, distractors=2)
    rng = np.random.default_rng(0)
    for label in (0, 1, 2):
        for _ in range(40):
            p, h = plain.sample(rng, label)
            assert _nli.oracle(p, h) == label
    # same draws with fillers appended: the same parsed pairs, longer sentences
    b0, b2 = plain.batch(5), noisy.batch(5)
    np.testing.assert_array_equal(b0["targets"], b2["targets"])
    assert (b2["inputs"][:, 0] != 0).sum() >= (b0["inputs"][:, 0] != 0).sum()
    check_format(noisy, b2)


def test_held_out_combinations_never_reach_training():
    ds = data.GeneratedNLI(seed=0, batch_size=64)
    ids = {w: i for i, w in enumerate(ds.vocab)}
    verbs = set(_nli._VERBS) | set(_nli._VERBS.values())

    def combos(batch):
        out = set()
        for row in batch["inputs"]:
            for sent in ds.decode(row):
                nouns = [w for w in sent if w in _nli._NOUNS]
                vs = [w for w in sent if w in verbs]
                if len(nouns) == 1 and vs:  # intransitive: (noun, third-person verb)
                    v = vs[0] if vs[0] in _nli._VERBS else next(
                        k for k, b in _nli._VERBS.items() if b == vs[0])
                    out.add((nouns[0], v))
        return out

    train = set().union(*(combos(ds.batch(i)) for i in range(40)))
    test = set().union(*(combos(ds.batch(i, "test")) for i in range(10)))
    assert not any(_nli._held_out(*c) for c in train)
    assert any(_nli._held_out(*c) for c in test)
    assert ids["[PAD]"] == 0


def test_jsonl_reader_counts_and_vocab(tmp_path):
    ds = data.NLIFile.from_path(SAMPLE, seq_len=16, batch_size=4, seed=0)
    assert ds.dropped["train"] == 2  # the two "-" lines
    check_format(ds, ds.batch(0))
    check_format(ds, ds.batch(0, "val"))
    assert ds.truncated["train"] >= 1  # seq_len 16 cuts the longest pairs
    assert "dropped" in ds.summary()
    ds.save(tmp_path)
    vocab = data.load_vocab(tmp_path / "vocab.json")
    again = data.NLIFile.from_path(SAMPLE, seq_len=16, batch_size=4, vocab=vocab)
    np.testing.assert_array_equal(again.batch(3)["inputs"], ds.batch(3)["inputs"])
    prem, hyp = ds.decode(ds.batch(0)["inputs"][0])
    assert prem and hyp


def test_jsonl_reader_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad_train.jsonl"
    good = json.dumps({"sentence1": "a", "sentence2": "b", "gold_label": "neutral"})
    bad.write_text(good + "\n" + json.dumps({"sentence1": "a", "label": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2: missing field\(s\) \['sentence2', "
                                         r"'gold_label'\]"):
        data.NLIFile.from_path(bad)
    bad.write_text(good + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2: not JSON"):
        data.NLIFile.from_path(bad)
    bad.write_text(json.dumps({"sentence1": "a", "sentence2": "b", "gold_label": "maybe"}))
    with pytest.raises(ValueError, match="gold_label 'maybe'"):
        data.NLIFile.from_path(bad)
    with pytest.raises(FileNotFoundError, match="snli_1.0_train"):
        data.NLIFile.from_path(tmp_path / "missing")
