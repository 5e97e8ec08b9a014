import numpy as np
import pytest

from spinformer import data
from spinformer.data._brackets import CLOSE, OPEN


def _is_dyck(tokens):
    depth = 0
    for t in tokens:
        if t == OPEN:
            depth += 1
        elif t == CLOSE:
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def test_brackets_shapes_and_vocab():
    ds = data.BracketMatching(seq_len=16, batch_size=8, seed=3)
    b = ds.batch(0)
    assert b["inputs"].shape == b["targets"].shape == b["mask"].shape == (8, 16)
    assert b["inputs"].dtype == np.int32 and b["mask"].dtype == np.float32
    assert ds.vocab_size == 12 and ds.num_classes == 16
    assert b["inputs"].min() >= 0 and b["inputs"].max() < 12


def test_brackets_targets_match_pairs():
    ds = data.BracketMatching(seq_len=14, batch_size=64, seed=0)
    b = ds.batch(5)
    for toks, tgts, mask in zip(b["inputs"], b["targets"], b["mask"]):
        assert _is_dyck(toks)  # fillers ignored: the brackets form a Dyck-1 word
        assert (mask == (toks == CLOSE)).all()  # loss on closing brackets only
        assert (toks == OPEN).sum() >= 1
        for t in np.flatnonzero(mask):
            s = tgts[t]
            assert s < t and toks[s] == OPEN
            # the brackets strictly between a matched pair are balanced
            inner = toks[s + 1 : t]
            assert _is_dyck(inner[(inner == OPEN) | (inner == CLOSE)])


def test_brackets_fillers_present_and_deterministic():
    ds = data.BracketMatching(seq_len=12, batch_size=32, seed=1)
    a, b = ds.batch(2), ds.batch(2)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(ds.batch(3)["inputs"], a["inputs"])
    assert not np.array_equal(ds.batch(2, "val")["inputs"], a["inputs"])
    assert (a["inputs"] >= 2).any()  # filler tokens interleaved
    other = data.BracketMatching(seq_len=12, batch_size=32, seed=2).batch(2)
    assert not np.array_equal(other["inputs"], a["inputs"])
    assert 0.0 < ds.chance_accuracy(a) < ds.nearest_open_baseline(a) < 1.0
    assert ds.baselines(a) == {"chance_accuracy": ds.chance_accuracy(a),
                               "nearest_open_accuracy": ds.nearest_open_baseline(a)}


def test_brackets_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        data.BracketMatching(seq_len=1)
    with pytest.raises(ValueError, match="split"):
        data.BracketMatching().batch(0, "dev")


TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20


def test_chars_split_and_windows():
    ds = data.CharText(TEXT, seq_len=16, batch_size=4, seed=0)
    n = len(TEXT)
    assert len(ds.val_data) == round(0.1 * n) and len(ds.train_data) + len(ds.val_data) == n
    assert ds.vocab_size == len(set(TEXT))
    b = ds.batch(0)
    assert b["inputs"].shape == (4, 16) and b["mask"].sum() == 64
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    window = ds.decode(b["inputs"][0]) + ds.decode(b["targets"][0][-1:])
    assert window in TEXT[: len(ds.train_data)]
    assert ds.decode(ds.encode("to be")) == "to be"
    np.testing.assert_array_equal(ds.batch(7, "val")["inputs"], ds.batch(7, "val")["inputs"])
    # unigram perplexity: between 1 and the vocabulary size, equal to a direct count
    ppl = ds.baselines(b)["unigram_perplexity"]
    assert 1.0 < ppl < ds.vocab_size
    freq = {c: (TEXT[: len(ds.train_data)].count(c) + 1) / (len(ds.train_data) + ds.vocab_size)
            for c in ds.chars}
    direct = np.exp(-np.mean([np.log(freq[ds.chars[t]]) for t in b["targets"].ravel()]))
    np.testing.assert_allclose(ppl, direct, rtol=1e-10)


def test_chars_from_file_and_missing(tmp_path, monkeypatch):
    p = tmp_path / "tiny.txt"
    p.write_text(TEXT)
    ds = data.CharText.from_path(p, seq_len=8, batch_size=2)
    assert ds.batch(0)["inputs"].shape == (2, 8)
    with pytest.raises(FileNotFoundError, match="not found"):
        data.CharText.from_path(tmp_path / "nope.txt")
    monkeypatch.setenv("SPINFORMER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="spinformer data fetch shakespeare"):
        data.CharText.from_path("shakespeare")
    with pytest.raises(ValueError, match="fewer than"):
        data.CharText("abc", seq_len=8)
    with pytest.raises(ValueError, match="unknown dataset"):
        data.fetch("moby-dick")
