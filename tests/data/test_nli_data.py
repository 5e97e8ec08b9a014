"""The NLI datasets: the batch format, determinism, the generated task's labels against an
oracle that enumerates scenes, distractors and held-out words, and the JSON-lines reader."""

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

from spinformer import data
from spinformer.data import _logic, _nli, _pairs, _snli

SAMPLE = pathlib.Path(__file__).parents[1] / "fixtures" / "nli_sample.jsonl"
E, N, C = 0, 1, 2


def check_format(ds, batch):
    """Shapes, dtypes, [CLS]/[SEP] positions, padding only at the end, segments."""
    inputs, targets, mask = batch["inputs"], batch["targets"], batch["mask"]
    B = ds.batch_size
    assert inputs.shape == (B, 2, ds.seq_len) and inputs.dtype == np.int32
    assert targets.shape == (B,) and targets.dtype == np.int32
    assert mask.shape == (B,) and mask.dtype == np.float32 and np.all(mask == 1.0)
    assert set(targets.tolist()) <= {0, 1, 2}
    assert inputs[:, 0].min() >= 0 and inputs[:, 0].max() < ds.vocab_size
    for ids, seg in inputs:
        n = int((ids != _pairs.PAD).sum())
        assert np.all(ids[n:] == _pairs.PAD) and np.all(seg[n:] == 0)  # padding at the end
        n1, n2 = int((seg == 1).sum()), int((seg == 2).sum())
        assert n1 >= 2 and n2 >= 1 and n1 + n2 == n
        assert np.all(seg[:n1] == 1) and np.all(seg[n1:n] == 2)
        assert ids[0] == _pairs.CLS and ids[n1 - 1] == _pairs.SEP and ids[n - 1] == _pairs.SEP
        assert (ids == _pairs.SEP).sum() == 2 and (ids == _pairs.CLS).sum() == 1


# ------------------------------------------------------------------------ generated task


def test_generated_format_balance_determinism():
    ds = data.GeneratedNLI(seq_len=32, batch_size=30, seed=3)
    assert ds.kind == "pair_classification" and ds.num_classes == 3
    assert ds.vocab[:4] == ["[PAD]", "[CLS]", "[SEP]", "[UNK]"] and len(ds.vocab) == ds.vocab_size
    for split in ("train", "val", "test"):
        b = ds.batch(2, split)
        check_format(ds, b)
        assert np.bincount(b["targets"], minlength=3).tolist() == [10, 10, 10]
        again = ds.batch(2, split)
        for k in b:
            np.testing.assert_array_equal(b[k], again[k])
    b = ds.batch(0)
    assert not np.array_equal(b["inputs"], ds.batch(1)["inputs"])
    assert not np.array_equal(b["inputs"], ds.batch(0, "val")["inputs"])
    assert not np.array_equal(b["inputs"], data.GeneratedNLI(batch_size=30, seed=4).batch(0)
                              ["inputs"])
    counts = np.bincount(data.GeneratedNLI(batch_size=32).batch(5)["targets"], minlength=3)
    assert sorted(counts.tolist()) == [10, 11, 11]
    prem, hyp = ds.decode(b["inputs"][0])
    assert (" ".join(prem), " ".join(hyp)) == tuple(ds.examples(0)[0][k]
                                                    for k in ("premise", "hypothesis"))


def _parsed_pairs(ds, index, split):
    b = ds.batch(index, split)
    return b, [tuple(_logic.parse_sentence(s) for s in ds.decode(row)) for row in b["inputs"]]


@pytest.mark.parametrize("kwargs", [{}, {"distractors": 3}, {"held_out": False, "seed": 7}])
def test_generated_labels_agree_with_the_oracle(kwargs):
    ds = data.GeneratedNLI(batch_size=64, **kwargs)
    for split in ("train", "test"):
        for i in range(12):
            b, pairs = _parsed_pairs(ds, i, split)
            got = [_logic.oracle(p, h) for p, h in pairs]
            np.testing.assert_array_equal(got, b["targets"])


@pytest.mark.parametrize("row", _nli._SCHEMAS, ids=lambda r: "-".join(map(str, r)))
def test_label_table_rows_agree_with_the_oracle(row):
    """Every hand-written row of the generator's table, on concrete nouns of its relation."""
    phen, pf, hf, rel, label = row
    (pd, pn_), (hd, hn_) = _nli._FORMS[pf], _nli._FORMS[hf]
    if phen == "order":
        for x, y in (("man", "boy"), ("dog", "woman"), ("animal", "child")):
            subj, obj = (x, y) if rel == "same" else (y, x)
            p = _logic.Sentence(pd, x, "push", pn_, obj=y)
            h = _logic.Sentence(hd, subj, "push", hn_, obj=obj)
            assert _logic.oracle(p, h) == label, (str(p), str(h))
        return
    nouns = {"same": [("dog", "dog"), ("person", "person")],
             "up": [("dog", "animal"), ("boy", "child"), ("girl", "person")],
             "down": [("animal", "cat"), ("person", "man"), ("adult", "woman")],
             "other": [("dog", "cat"), ("man", "boy"), ("dog", "girl"), ("child", "adult")]}
    for a, b in nouns[rel]:
        for det_p, det_h in ((pd, hd), ("some" if pd == "a" else pd, hd)):
            p = _logic.Sentence(det_p, a, "run", pn_)
            h = _logic.Sentence(det_h, b, "run", hn_)
            assert _logic.oracle(p, h) == label, (str(p), str(h))


@pytest.mark.parametrize("premise,hypothesis,label", [
    # negation
    ("a dog runs", "no dog runs", C),
    ("a dog runs in the park", "no dog runs in the park", C),
    ("the dog sleeps", "the dog does not sleep", C),
    ("a dog sleeps", "a dog does not sleep", N),  # there may be two dogs
    ("the dog does not sleep", "no dog sleeps", E),
    ("no dog sleeps", "some dog does not sleep", N),  # there may be no dog
    # quantifiers
    ("every dog runs", "a dog runs", E),
    ("some dog runs", "every dog runs", N),
    ("no animal runs", "a dog runs", C),
    ("every dog runs", "no dog runs", C),
    ("every animal runs", "every dog runs", E),
    ("every dog runs", "every animal runs", N),
    ("every animal runs", "a dog does not run", C),
    # word order and roles
    ("the man pushes the boy", "the boy pushes the man", N),
    ("the man pushes the boy", "the man does not push the boy", C),
    ("the man does not push the boy", "the boy pushes the man", N),
    ("the man pushes the boy quickly", "the man pushes the boy", E),
    # lexical entailment
    ("a dog runs", "an animal runs", E),
    ("an animal runs", "a dog runs", N),
    ("a dog runs", "a cat runs", N),
    ("a boy sings", "a person sings", E),
    ("no person sings", "a girl sings", C),
    ("no animal sleeps", "no dog sleeps", E),
    ("a dog runs", "a man runs", N),
    # modifiers: narrower noun phrases and verb phrases
    ("a small dog runs", "a dog runs", E),
    ("a dog runs", "a small dog runs", N),
    ("a dog runs quickly in the park", "a dog runs", E),
    ("a dog runs", "a dog runs in the park", N),
    ("no dog runs", "a dog runs quickly", C),
    ("a small dog runs quickly", "a small animal runs quickly", E),
    ("the dog runs", "the dog sleeps", N),  # verbs are independent
])
def test_oracle_on_hand_written_pairs(premise, hypothesis, label):
    assert _logic.oracle(premise, hypothesis) == label


def test_parser_and_oracle_refuse_what_is_outside_the_language():
    assert str(_logic.parse_sentence("an old dog does not run quickly")) == (
        "an old dog does not run quickly")
    for bad in ("every dog does not run", "a dog flies", "dog runs", "a old dog runs",
                "the man pushes", "a dog runs the cat", "no dog does not run"):
        with pytest.raises(ValueError, match="cannot parse"):
            _logic.parse_sentence(bad)
    with pytest.raises(ValueError, match="intransitive or two transitive"):
        _logic.oracle("the man pushes the boy", "a man runs")
    with pytest.raises(ValueError, match="identical or disjoint"):
        _logic.oracle("the man pushes the boy", "the person pushes the boy")


def _bare(s):
    return dataclasses.replace(s, adjs=(), obj_adjs=(), mods=())


@pytest.mark.parametrize("d", [1, 2, 3])
def test_distractors_leave_pairs_and_labels_unchanged(d):
    plain = data.GeneratedNLI(batch_size=48, seed=2)
    noisy = data.GeneratedNLI(batch_size=48, seed=2, distractors=d)
    for split, i in (("train", 0), ("train", 9), ("test", 4)):
        b0, pairs0 = _parsed_pairs(plain, i, split)
        b1, pairs1 = _parsed_pairs(noisy, i, split)
        np.testing.assert_array_equal(b0["targets"], b1["targets"])
        assert (b1["inputs"][:, 0] != 0).sum() > (b0["inputs"][:, 0] != 0).sum()
        for (p0, h0), (p1, h1) in zip(pairs0, pairs1):
            assert (_bare(p1), _bare(h1)) == (p0, h0)
            kinds = bool(p1.adjs) + len(p1.mods)
            assert kinds == d and (p1.adjs, p1.mods) == (h1.adjs, h1.mods)
            assert p1.obj_adjs == (p1.adjs if p1.obj else ())


def test_phenomena_knob_and_bad_arguments():
    order = data.GeneratedNLI(phenomena=("order",), batch_size=30)
    _, pairs = _parsed_pairs(order, 0, "train")
    assert all(p.obj is not None and h.obj is not None for p, h in pairs)
    lexical = data.GeneratedNLI(phenomena="lexical", batch_size=30)
    _, pairs = _parsed_pairs(lexical, 0, "train")
    assert all(p.noun != h.noun for p, h in pairs)
    neg = data.GeneratedNLI(phenomena=("negation",), batch_size=30)
    assert {e["phenomenon"] for e in neg.examples(0)} == {"negation"}
    with pytest.raises(ValueError, match="phenomena"):
        data.GeneratedNLI(phenomena=("sarcasm",))
    with pytest.raises(ValueError, match="distractors"):
        data.GeneratedNLI(distractors=4)
    with pytest.raises(ValueError, match="raise seq_len to at least 29"):
        data.GeneratedNLI(seq_len=28, distractors=3)
    data.GeneratedNLI(seq_len=16, phenomena=("negation",))  # 3 + 2 * 5 = 13 tokens suffice
    with pytest.raises(ValueError, match="split"):
        data.GeneratedNLI().batch(0, "dev")
    with pytest.raises(ValueError, match="non-negative"):
        data.GeneratedNLI().batch(-1)


def test_held_out_words_and_template_never_reach_training():
    ds = data.GeneratedNLI(batch_size=32, seed=0, distractors=1)
    held = ds.held_out_words
    assert {"fox", "rabbit", "swims", "swim", "greets", "tired", "loudly", "lake"} <= held
    assert not held & {"a", "some", "does", "not", "the", "dog", "runs", "in", "at"}
    train_words, some_neg = set(), 0
    for i in range(200):
        for row in ds.batch(i)["inputs"]:
            for sent in ds.decode(row):
                train_words.update(sent)
                some_neg += sent[0] == "some" and "not" in sent
    assert not train_words & held and some_neg == 0  # "some N does not V" is held out
    assert train_words | held == set(ds.vocab[4:])  # every other word does occur in training
    test_words, some_neg, held_nouns = set(), 0, 0
    for i in range(20):
        _, pairs = _parsed_pairs(ds, i, "test")
        for p, h in pairs:
            test_words.update(p.words() + h.words())
            assert p.verb in held  # every val/test pair has a verb never seen in training
            some_neg += (p.det == "some" and p.neg) + (h.det == "some" and h.neg)
            if {p.noun, h.noun, p.obj, h.obj} & held:
                held_nouns += 1
                # held-out nouns only where the hierarchy does not matter
                assert p.noun == h.noun or p.obj is not None
    assert held <= test_words and some_neg > 0 and held_nouns > 0
    # held_out=False: every split draws from all words
    everything = data.GeneratedNLI(batch_size=32, seed=0, held_out=False)
    words = {w for i in range(30) for row in everything.batch(i)["inputs"]
             for s in everything.decode(row) for w in s}
    assert words & {"fox", "swims", "swim", "rabbit"} and not everything.held_out_words


def test_generated_baselines_and_save(tmp_path):
    ds = data.GeneratedNLI(batch_size=64, seed=1)
    b = ds.batch(0, "test")
    base = ds.baselines(b)
    np.testing.assert_allclose(base["chance_accuracy"], 1 / 3, rtol=1e-6)
    assert set(base) == {"chance_accuracy", "majority_accuracy", "overlap_accuracy"}
    assert all(0.0 <= v <= 1.0 for v in base.values())
    np.testing.assert_allclose(base["majority_accuracy"], np.mean(b["targets"] == 0), rtol=1e-6)
    overlap = np.mean([ds.baselines(ds.batch(i, "test"))["overlap_accuracy"] for i in range(8)])
    assert 0.45 < overlap < 0.8  # shallow cues help, but do not solve the task
    ds.save(tmp_path)
    assert data.load_vocab(tmp_path / "vocab.json") == ds.vocab


def test_generation_is_fast():
    import time

    ds = data.GeneratedNLI(batch_size=64, distractors=2)
    ds.batch(0)
    t0 = time.perf_counter()
    for i in range(10):
        ds.batch(i + 1)
    assert (time.perf_counter() - t0) / 10 < 0.05


# ------------------------------------------------------------------------ JSON lines


def test_tokenizer_and_truncation_rule():
    assert _pairs.tokenize("A man's dog didn't run, OK?") == [
        "a", "man", "'s", "dog", "did", "n't", "run", ",", "ok", "?"]
    assert _pairs._fit_lengths(3, 4, 10) == (3, 4)
    assert _pairs._fit_lengths(12, 2, 8) == (6, 2)  # the longer one is cut first
    assert _pairs._fit_lengths(2, 12, 8) == (2, 6)
    assert _pairs._fit_lengths(9, 7, 8) == (4, 4)
    assert _pairs._fit_lengths(9, 7, 9) == (4, 5)  # ties: the premise loses the token


def test_single_file_splits_drops_and_format(tmp_path):
    ds = data.NLIFile.from_path(SAMPLE, seq_len=32, batch_size=4, seed=0)
    assert ds.kind == "pair_classification" and ds.num_classes == 3
    assert ds.dropped == {"train": 2, "val": 0, "test": 0}  # the two "-" lines
    assert ds.sizes == {"train": 26, "val": 1, "test": 1}  # 5% of 28 labelled pairs, at least 1
    for split in ("train", "val", "test"):
        check_format(ds, ds.batch(0, split))
    b = ds.batch(3)
    np.testing.assert_array_equal(b["inputs"], ds.batch(3)["inputs"])
    assert "dropped" in ds.summary() and "1 pairs each" in ds.summary()
    # the training split's epochs: permutations by (seed, epoch), batches disjoint within one
    n = ds.sizes["train"]
    per_epoch = n // 4
    rows = [tuple(map(tuple, r)) for i in range(per_epoch) for r in ds.batch(i)["inputs"]]
    assert len(rows) == per_epoch * 4 and len(set(rows)) == len(rows)
    epoch1 = [tuple(map(tuple, r)) for i in range(per_epoch, 2 * per_epoch)
              for r in ds.batch(i)["inputs"]]
    assert epoch1 != rows and len(set(epoch1)) == len(epoch1)
    other_seed = data.NLIFile.from_path(SAMPLE, seq_len=32, batch_size=4, seed=1)
    assert not np.array_equal(other_seed.batch(0)["inputs"], ds.batch(0)["inputs"])
    assert other_seed.sizes == ds.sizes  # the carved val/test do not depend on the seed
    # val/test walk in order and wrap around
    val = data.NLIFile.from_path(SAMPLE, seq_len=32, batch_size=4)
    v = [val.batch(i, "val")["inputs"] for i in range(2)]
    np.testing.assert_array_equal(v[0], v[1])  # one pair, repeated
    prem, hyp = ds.decode(b["inputs"][0])
    assert prem and hyp and prem[-1] == "." and prem[0] in ("a", "an", "two", "workers")


def test_directory_layouts(tmp_path):
    lines = SAMPLE.read_text().splitlines(keepends=True)
    snli = tmp_path / "snli"
    snli.mkdir()
    for name, part in (("train", lines[:18]), ("dev", lines[18:24]), ("test", lines[24:])):
        (snli / f"snli_1.0_{name}.jsonl").write_text("".join(part))
    ds = data.NLIFile.from_path(snli, batch_size=4)
    assert ds.sizes == {"train": 17, "val": 5, "test": 6}
    assert ds.dropped == {"train": 1, "val": 1, "test": 0}
    mnli = tmp_path / "mnli" / "multinli_1.0"
    mnli.mkdir(parents=True)
    shutil.copy(snli / "snli_1.0_train.jsonl", mnli / "multinli_1.0_train.jsonl")
    shutil.copy(snli / "snli_1.0_dev.jsonl", mnli / "multinli_1.0_dev_matched.jsonl")
    m = data.NLIFile.from_path(mnli.parent, batch_size=4, max_examples=10)
    assert m.sizes == {"train": 10, "val": 5, "test": 5}
    assert "test = dev_matched" in m.summary()
    generic = tmp_path / "generic"
    generic.mkdir()
    shutil.copy(snli / "snli_1.0_train.jsonl", generic / "my_train.jsonl")
    shutil.copy(snli / "snli_1.0_dev.jsonl", generic / "my_val.jsonl")
    g = data.NLIFile.from_path(generic, batch_size=4)
    assert g.sizes == {"train": 17, "val": 5, "test": 5} and "no test file" in g.summary()
    (snli / "snli_1.0_test.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="snli_1.0_test.jsonl"):
        data.NLIFile.from_path(snli)
    with pytest.raises(FileNotFoundError, match="snli_1.0_train.jsonl"):
        data.NLIFile.from_path(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no train file.*'train'"):
        data.NLIFile.from_path(empty)


@pytest.mark.parametrize("line,match", [
    ("{not json", r"bad\.jsonl, line 2: not valid JSON.*sentence1"),
    (json.dumps({"sentence1": "a", "label": "x"}),
     r"line 2: missing field\(s\) \['sentence2', 'gold_label'\]; expected fields"),
    (json.dumps({"sentence1": "a", "sentence2": "b", "gold_label": "maybe"}),
     r"line 2: unknown gold_label 'maybe'; expected one of \['entailment'"),
    (json.dumps(["a", "b", "neutral"]), r"line 2: expected a JSON object with fields"),
    (json.dumps({"sentence1": "a", "sentence2": None, "gold_label": "neutral"}),
     r"line 2: field\(s\) \['sentence2'\] must be strings"),
])
def test_malformed_lines_name_file_line_and_fields(tmp_path, line, match):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"sentence1": "a b", "sentence2": "b", "gold_label": "neutral"})
    bad.write_text(good + "\n" + line + "\n" + good + "\n")
    with pytest.raises(ValueError, match=match):
        _snli.read_jsonl(bad)
    with pytest.raises(ValueError, match=match):
        data.NLIFile.from_path(bad)


def test_vocab_round_trip_and_unknown_words(tmp_path):
    ds = data.NLIFile.from_path(SAMPLE, seq_len=24, batch_size=4, seed=0)
    path = ds.save(tmp_path / "run")
    assert path.name == "vocab.json"
    vocab = data.load_vocab(path)
    assert vocab == ds.vocab
    again = data.NLIFile.from_path(SAMPLE, seq_len=24, batch_size=4, seed=0, vocab=vocab)
    for split in ("train", "test"):
        np.testing.assert_array_equal(again.batch(3, split)["inputs"],
                                      ds.batch(3, split)["inputs"])
    assert data.NLIFile.from_path(SAMPLE, seq_len=24, vocab=path).vocab == ds.vocab
    small = data.NLIFile.from_path(SAMPLE, max_vocab=12, batch_size=30)
    assert small.vocab_size == 12 and small.vocab[4] == "a"  # the most frequent word
    assert (small.batch(0)["inputs"][:, 0] == _pairs.UNK).any()
    rare = data.NLIFile.from_path(SAMPLE, min_count=3, batch_size=4)
    assert rare.vocab_size < ds.vocab_size
    (tmp_path / "junk.json").write_text(json.dumps({"tokens": []}))
    with pytest.raises(ValueError, match="'words' list"):
        data.load_vocab(tmp_path / "junk.json")
    (tmp_path / "list.json").write_text(json.dumps(ds.vocab))  # a plain list is read too
    assert data.load_vocab(tmp_path / "list.json") == ds.vocab


def test_truncation_keeps_both_separators_and_is_counted():
    examples = {s: [("one two three four five six seven eight nine ten", "short one", 0),
                    ("a b", "c", 1)] for s in ("train", "val", "test")}
    ds = data.NLIFile(examples, seq_len=8, batch_size=2)
    assert ds.truncated == {"train": 1, "val": 1, "test": 1}
    b = ds.batch(0, "val")
    check_format(ds, b)
    prem, hyp = ds.decode(b["inputs"][0])
    assert prem == ["one", "two", "three"] and hyp == ["short", "one"]
    sample = data.NLIFile.from_path(SAMPLE, seq_len=12, batch_size=4)
    assert sample.truncated["train"] > 0 and f"truncated {sample.truncated['train']}" in (
        sample.summary())
    for i in range(3):
        check_format(sample, sample.batch(i))


def test_file_baselines_and_argument_errors():
    ds = data.NLIFile.from_path(SAMPLE, batch_size=8)
    b = ds.batch(0)
    base = ds.baselines(b)
    np.testing.assert_allclose(base["chance_accuracy"], 1 / 3, rtol=1e-6)
    assert all(0.0 <= v <= 1.0 for v in base.values())
    np.testing.assert_allclose(base["majority_accuracy"], np.mean(b["targets"] == ds.majority_label), rtol=1e-6)
    with pytest.raises(ValueError, match="seq_len must be at least 5"):
        data.NLIFile.from_path(SAMPLE, seq_len=4)
    with pytest.raises(ValueError, match="unknown split"):
        ds.batch(0, "dev")
    with pytest.raises(ValueError, match="'train', 'val' and 'test'"):
        data.NLIFile({"train": [("a", "b", 0)]})
