"""Natural language inference: is a hypothesis entailed by, neutral to, or contradicted by a
premise? Two sources share one batch format: `NLIFile` reads SNLI/MultiNLI-style JSON-lines
files the user supplies; `GeneratedNLI` generates pairs from a small logic over a toy world,
with the label computed from the documented semantics (`oracle` checks it by model
enumeration).

**Batch format** (`kind = "pair_classification"`): `batch(index, split)` returns numpy arrays

- `inputs (B, 2, T) int32`: row 0 holds the token ids of `[CLS] premise [SEP] hypothesis [SEP]`
  followed by `[PAD]` (id 0, only at padded positions); row 1 the segment ids: 1 for `[CLS]`,
  the premise and its `[SEP]`, 2 for the hypothesis and its `[SEP]`, 0 for padding.
  Ids 1, 2, 3 are `[CLS]`, `[SEP]`, `[UNK]`.
- `targets (B,) int32`: the label id, 0 = entailment, 1 = neutral, 2 = contradiction
  (`NLI_LABELS`).
- `mask (B,) float32`: ones (every example counts).
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Optional, Sequence, Union

import numpy as np

from ._logic import (_ADJECTIVES, _ADVERBS, _HELD, _INTRANSITIVE, _NOUNS, _PARENT, _PLACES,
                     _STRUCTURE, _THIRD, _TRANSITIVE, Sentence, _ancestors, _disjoint)
from ._pairs import (CLS, CONTRADICTION, ENTAILMENT, NEUTRAL, NLI_LABELS, SEP, SPECIAL_TOKENS,
                     _SPLITS, _OverlapRule, _baselines, _check_index, _decode_row, _segments,
                     _split_id, save_vocab)

# The generator's label table, written out by hand from the semantics (the tests check every
# row against oracle). Forms: A = a/some, A- = a/some ... does not, THE- = the ... does not.
# Relations: same noun; up = the hypothesis's noun is a hypernym of the premise's; down = the
# reverse; other = disjoint nouns (dog/cat, boy/woman, dog/man).
_E, _N, _C = ENTAILMENT, NEUTRAL, CONTRADICTION
_SCHEMAS = (
    # negation
    ("negation", "A", "NO", "same", _C), ("negation", "NO", "A", "same", _C),
    ("negation", "THE", "THE-", "same", _C), ("negation", "THE-", "THE", "same", _C),
    ("negation", "THE", "NO", "same", _C), ("negation", "NO", "THE", "same", _C),
    ("negation", "THE-", "A", "same", _C), ("negation", "A", "THE-", "same", _C),
    ("negation", "THE-", "NO", "same", _E), ("negation", "NO", "THE-", "same", _E),
    ("negation", "THE-", "A-", "same", _E), ("negation", "A-", "THE-", "same", _E),
    ("negation", "A", "A-", "same", _N), ("negation", "A-", "A", "same", _N),
    ("negation", "A-", "NO", "same", _N), ("negation", "NO", "A-", "same", _N),
    # quantifiers
    ("quantifier", "EVERY", "A", "same", _E), ("quantifier", "EVERY", "THE", "same", _E),
    ("quantifier", "THE", "EVERY", "same", _E),
    ("quantifier", "EVERY", "NO", "same", _C), ("quantifier", "NO", "EVERY", "same", _C),
    ("quantifier", "EVERY", "A-", "same", _C), ("quantifier", "A-", "EVERY", "same", _C),
    ("quantifier", "EVERY", "THE-", "same", _C), ("quantifier", "THE-", "EVERY", "same", _C),
    ("quantifier", "A", "EVERY", "same", _N),
    # lexical entailment through the hypernym hierarchy
    ("lexical", "A", "A", "up", _E), ("lexical", "EVERY", "A", "up", _E),
    ("lexical", "EVERY", "EVERY", "down", _E), ("lexical", "NO", "NO", "down", _E),
    ("lexical", "THE", "A", "up", _E), ("lexical", "A-", "A-", "up", _E),
    ("lexical", "THE-", "A-", "up", _E),
    ("lexical", "NO", "A", "down", _C), ("lexical", "A", "NO", "up", _C),
    ("lexical", "EVERY", "A-", "down", _C), ("lexical", "A-", "EVERY", "up", _C),
    ("lexical", "THE", "NO", "up", _C), ("lexical", "NO", "THE", "down", _C),
    ("lexical", "A", "A", "down", _N), ("lexical", "A", "A", "other", _N),
    ("lexical", "EVERY", "EVERY", "up", _N), ("lexical", "NO", "NO", "up", _N),
    ("lexical", "NO", "A", "up", _N), ("lexical", "A", "NO", "other", _N),
    ("lexical", "EVERY", "A", "down", _N), ("lexical", "A", "NO", "down", _N),
    # word order: "the X [does not] V the Y" against the same or swapped roles
    ("order", "POS", "POS", "same", _E), ("order", "NEG", "NEG", "same", _E),
    ("order", "POS", "NEG", "same", _C), ("order", "NEG", "POS", "same", _C),
    ("order", "POS", "POS", "swap", _N), ("order", "NEG", "NEG", "swap", _N),
    ("order", "POS", "NEG", "swap", _N), ("order", "NEG", "POS", "swap", _N),
)
_FORMS = {"A": ("a", False), "A-": ("a", True), "EVERY": ("every", False),
          "NO": ("no", False), "THE": ("the", False), "THE-": ("the", True),
          "POS": ("the", False), "NEG": ("the", True)}
PHENOMENA = ("negation", "quantifier", "order", "lexical")


def _pick(seq, u: float):
    return seq[int(u * len(seq))]


class GeneratedNLI:
    """A generated NLI task over a small world, where every label follows from the sentences
    by the semantics below (no download).

    **Arguments:**

    - `seq_len`: T (32 suffices for every setting; a smaller T that a pair could exceed is
      refused at construction, saying the length needed).
    - `batch_size`: B; each batch holds `B // 3` pairs of each label, the remaining `B % 3`
      pairs get distinct labels at random.
    - `seed`: batch `i` of split `s` depends only on `(seed, s, i)`.
    - `distractors` (0–3): how many label-irrelevant modifiers each pair carries, of distinct
      kinds drawn at random among: one adjective put before every noun ("a small dog runs" /
      "no small animal runs"), one adverb and one place phrase ("quickly", "in the park")
      after the verb phrase. A modifier is added to both sentences alike, which leaves the
      label unchanged (an intersective adjective on every noun phrase restricts the whole
      scene to small things; a verb-phrase modifier replaces the verb by a narrower one
      throughout); with the same seed the underlying pairs and labels are those of
      `distractors=0`. Difficulty knob: longer inputs with more words to ignore.
    - `phenomena`: which constructions appear, any of `"negation"` (a/the/no with and without
      "does not"), `"quantifier"` (every/a/the/no on one noun), `"order"` (transitive
      sentences with swapped roles) and `"lexical"` (hypernyms with monotone quantifiers);
      each batch draws a phenomenon uniformly per pair.
    - `held_out`: keep some words and a template out of training (below).

    **Semantics.** The two sentences describe one scene. "a/an N V" and "some N V": some N in
    the scene Vs. "every N V": every N does, and (taken for granted) there is at least one N.
    "no N V": no N does. "the N V": the scene holds exactly one N (taken for granted) and it
    Vs. "does not" negates the whole verb phrase, modifiers included; it occurs with
    a/some/the only. What either sentence takes for granted holds in the scene. Nouns form a
    hierarchy (dog, cat, ... ⊂ animal; man, woman ⊂ adult; boy, girl ⊂ child; adult, child ⊂
    person); a hypernym may have members beyond the listed nouns; two nouns neither of which
    is a hypernym of the other are disjoint (nothing is both a dog and a cat; a man is not a
    boy). Verbs are independent. The label is entailment if the hypothesis holds in every scene
    where the premise holds, contradiction if in none, neutral otherwise. So "every dog runs"
    ⇒ "a dog runs"; "a dog runs" / "a dog does not run" is neutral (two dogs) but "the dog
    runs" / "the dog does not run" a contradiction; "a dog runs" ⇒ "an animal runs", the
    reverse is neutral, "a dog runs" / "a cat runs" neutral; "no animal runs" contradicts "a
    dog runs". Word order: "the man pushes the boy" and "the boy pushes the man" are
    independent facts, so swapping the roles gives neutral (whatever the negations), the same
    roles with one "does not" a contradiction. `data._logic.oracle` decides any pair of the
    language by enumerating scenes; the generator's hand-written table agrees with it.

    **Held out** (`held_out=True`): the training split never contains the nouns fox and
    rabbit, the verbs swim, rest, dance, greet, carry, the adjectives tired, hungry, the
    adverbs loudly, calmly, the place phrases "by the lake", "at the station"
    (`held_out_words`), nor the template "some N does not V" (`HELD_OUT_TEMPLATES`; training
    negates existentials as "a N does not V" only). In val and test every pair uses a
    held-out verb, every distractor is a held-out word, half the single-noun and word-order
    pairs use a held-out noun, and "some" negations appear. Held-out nouns occur only where
    the label does not depend on their place in the hierarchy (the same noun in both
    sentences, or one of two definite roles), since nothing in training could teach it;
    hypernym reasoning in val/test uses the training nouns. The vocabulary is fixed and shared
    by all splits, so held-out words have ids (and embeddings that training never updates):
    a model must rely on the structure words (determiners, "does not", word order), which is
    all the label depends on. `held_out=False`: every split draws from everything.

    `batch(i, split)`, `decode(row)`, `baselines(batch)` as for `NLIFile`; `examples(i,
    split)` gives the same batch as readable dicts with each pair's phenomenon.
    """

    kind = "pair_classification"
    num_classes = 3

    def __init__(self, seq_len: int = 32, batch_size: int = 32, seed: int = 0, *,
                 distractors: int = 0, phenomena: Sequence[str] = PHENOMENA,
                 held_out: bool = True):
        if isinstance(phenomena, str):
            phenomena = (phenomena,)
        phenomena = tuple(phenomena)
        unknown = [p for p in phenomena if p not in PHENOMENA]
        if unknown or not phenomena:
            raise ValueError(f"phenomena must be a non-empty selection of {list(PHENOMENA)}; "
                             f"got {list(phenomena)}.")
        if not isinstance(distractors, (int, np.integer)) or not 0 <= distractors <= 3:
            raise ValueError(f"distractors must be 0, 1, 2 or 3 (an adjective, an adverb, a "
                             f"place phrase); got {distractors!r}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive; got {batch_size}.")
        # Longest pair: [CLS] + 2 sentences + 2 [SEP]; negated intransitive 5 words, negated
        # transitive 7; distractors add 3 (place), 1 per noun phrase (adjective), 1 (adverb).
        need = 0
        for ph in phenomena:
            base, incs = (7, [3, 2, 1]) if ph == "order" else (5, [3, 1, 1])
            need = max(need, 3 + 2 * (base + sum(incs[:distractors])))
        if seq_len < need:
            raise ValueError(f"GeneratedNLI with phenomena {list(phenomena)} and "
                             f"distractors={distractors} makes pairs of up to {need} tokens "
                             f"([CLS] premise [SEP] hypothesis [SEP]); raise seq_len to at "
                             f"least {need} (got {seq_len}).")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.distractors = int(distractors)
        self.phenomena = phenomena
        self.held_out = bool(held_out)
        words = set(_STRUCTURE) | set(_NOUNS) | set(_ADJECTIVES) | set(_ADVERBS)
        words |= {w for pair in _INTRANSITIVE + _TRANSITIVE for w in pair}
        words |= {w for pl in _PLACES for w in pl.split()}
        self.vocab = list(SPECIAL_TOKENS) + sorted(words)
        self.vocab_size = len(self.vocab)
        self.truncated = {s: 0 for s in _SPLITS}
        self._ids = {w: i for i, w in enumerate(self.vocab)}
        self._by_key = {}
        for row in _SCHEMAS:
            self._by_key.setdefault((row[0], row[4]), []).append(row)
        seen_words = self._words_of(held=False)
        held_words = self._words_of(held=True)
        self.held_out_words = frozenset(held_words - seen_words) if held_out else frozenset()
        self.majority_label = ENTAILMENT  # labels are balanced; ties go to the lowest id
        self._rule = None

    @staticmethod
    def _pools(held: Optional[bool]) -> dict:
        """Word lists: held=False the training words, True the held-out ones, None all."""
        def sel(items, key, get=lambda x: x):
            if held is None:
                return tuple(items)
            return tuple(x for x in items if (get(x) in _HELD[key]) == held)
        nouns = sel(_NOUNS, "noun")
        return {
            "noun": nouns,
            "iv": sel([b for _, b in _INTRANSITIVE], "intransitive"),
            "tv": sel([b for _, b in _TRANSITIVE], "transitive"),
            "adj": sel(_ADJECTIVES, "adjective"),
            "adv": sel(_ADVERBS, "adverb"),
            "place": sel(_PLACES, "place"),
        }

    def _words_of(self, held: bool) -> set:
        pools = self._pools(held)
        out = set(pools["noun"]) | set(pools["adj"]) | set(pools["adv"])
        out |= {w for b in pools["iv"] + pools["tv"] for w in (b, _THIRD[b])}
        out |= {w for pl in pools["place"] for w in pl.split()}
        if not held:
            out |= set(_STRUCTURE)
        return out

    # -- generation -----------------------------------------------------------------------

    def _pair(self, label: int, u: np.ndarray, v: np.ndarray, split: str):
        """One pair: (phenomenon, premise Sentence, hypothesis Sentence). Structure draws use
        `u` only and modifier draws `v` only, so distractors never change the pair."""
        test_like = self.held_out and split != "train"
        train_like = self.held_out and split == "train"
        seen = self._pools(False if self.held_out else None)
        held = self._pools(True)
        phen = _pick(self.phenomena, u[0])
        _, pf, hf, rel, _ = _pick(self._by_key[(phen, label)], u[1])
        (pdet, pneg), (hdet, hneg) = _FORMS[pf], _FORMS[hf]
        if not train_like:  # "some N does not V" only outside training when held out
            if pdet == "a" and pneg and u[8] < 0.5:
                pdet = "some"
            if hdet == "a" and hneg and u[9] < 0.5:
                hdet = "some"
        if pdet == "a" and not pneg and u[8] < 0.5:
            pdet = "some"
        if hdet == "a" and not hneg and u[9] < 0.5:
            hdet = "some"
        all_nouns = seen["noun"] + (held["noun"] if test_like else ())
        if rel in ("same", "swap"):
            pool = held["noun"] if test_like and u[2] < 0.5 else seen["noun"]
            pn = _pick(pool, u[3])
            hn = pn
        elif rel in ("up", "down"):
            lower = _pick([n for n in seen["noun"] if n in _PARENT], u[3])
            upper = _pick(_ancestors(lower)[1:], u[4])
            pn, hn = (lower, upper) if rel == "up" else (upper, lower)
        else:  # other: disjoint nouns, within the same top category three times in four
            pn = _pick(seen["noun"], u[3])
            others = [n for n in seen["noun"] if _disjoint(pn, n)]
            close = [n for n in others if _ancestors(n)[-1] == _ancestors(pn)[-1]]
            hn = _pick(close if close and u[5] < 0.75 else others, u[4])
        verbs = held if test_like else seen
        if phen == "order":
            obj = _pick([n for n in all_nouns if _disjoint(pn, n)], u[5])
            if u[6] < 0.5:
                pn, obj = obj, pn
            verb = _pick(verbs["tv"], u[7])
            hs, ho = (pn, obj) if rel == "same" else (obj, pn)
        else:
            obj = hs = ho = None
            verb = _pick(verbs["iv"], u[7])
            hs = hn
        # distractors: `d` distinct kinds, same modifiers in both sentences
        mods_pool = held if test_like else seen
        kinds = [("adj", "adv", "place")[k] for k in np.argsort(v[:3])[: self.distractors]]
        adjs = (_pick(mods_pool["adj"], v[3]),) if "adj" in kinds else ()
        mods = tuple(_pick(mods_pool[k], v[4 + i]) for i, k in enumerate(("adv", "place"))
                     if k in kinds)
        oadjs = adjs if obj is not None else ()
        p = Sentence(pdet, pn, verb, pneg, adjs, obj, oadjs, mods)
        h = Sentence(hdet, hs, verb, hneg, adjs, ho, oadjs, mods)
        return phen, p, h

    def _generate(self, index: int, split: str):
        index, sid = _check_index(index), _split_id(split)
        B = self.batch_size
        rng = np.random.default_rng([self.seed, sid, index, 0])
        labels = np.concatenate([np.repeat(np.arange(3), B // 3),
                                 rng.permutation(3)[: B % 3]]).astype(np.int32)
        labels = rng.permutation(labels)
        U = rng.random((B, 10))
        V = np.random.default_rng([self.seed, sid, index, 1]).random((B, 6))
        return labels, [self._pair(int(y), U[b], V[b], split) for b, y in enumerate(labels)]

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        """`{"inputs" (B, 2, T) int32, "targets" (B,) int32, "mask" (B,) float32}`."""
        labels, pairs = self._generate(index, split)
        T = self.seq_len
        tokens = np.zeros((len(pairs), T), np.int32)
        lens = np.zeros((len(pairs), 2), np.int32)
        ids = self._ids
        for b, (_, p, h) in enumerate(pairs):
            pw, hw = [ids[w] for w in p.words()], [ids[w] for w in h.words()]
            if len(pw) + len(hw) + 3 > T:
                raise ValueError(f"the pair {str(p)!r} / {str(h)!r} needs "
                                 f"{len(pw) + len(hw) + 3} tokens; raise seq_len.")
            row = [CLS, *pw, SEP, *hw, SEP]
            tokens[b, : len(row)] = row
            lens[b] = len(pw), len(hw)
        inputs = np.stack([tokens, _segments(lens, T)], axis=1)
        return {"inputs": inputs, "targets": labels,
                "mask": np.ones(len(pairs), np.float32)}

    def examples(self, index: int, split: str = "train") -> list[dict]:
        """Batch `index` of `split` as dicts `{"premise", "hypothesis", "label",
        "phenomenon"}` (strings), in batch order."""
        labels, pairs = self._generate(index, split)
        return [{"premise": str(p), "hypothesis": str(h), "label": NLI_LABELS[y],
                 "phenomenon": ph} for y, (ph, p, h) in zip(labels, pairs)]

    def decode(self, inputs_row: np.ndarray) -> tuple[list[str], list[str]]:
        """`(premise_words, hypothesis_words)` of one example's `inputs (2, T)`."""
        return _decode_row(inputs_row, self.vocab)

    def save(self, out_dir: Union[str, os.PathLike]) -> pathlib.Path:
        """Writes `vocab.json` (the fixed vocabulary) into `out_dir`."""
        return save_vocab(self.vocab, pathlib.Path(out_dir) / "vocab.json")

    def _overlap_rule(self) -> _OverlapRule:
        if self._rule is None:
            n = math.ceil(2048 / self.batch_size)
            bs = [self.batch(i, "train") for i in range(n)]
            neg = [self._ids[w] for w in ("no", "not")]
            self._rule = _OverlapRule(neg).fit(np.concatenate([b["inputs"] for b in bs]),
                                               np.concatenate([b["targets"] for b in bs]))
        return self._rule

    def baselines(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """Accuracies on `batch` of shallow references: `chance_accuracy` (1/3),
        `majority_accuracy` (always answering entailment, the majority of the balanced
        training labels), and `overlap_accuracy`: a lookup table fitted on 2048 training
        pairs, keyed by the share of the hypothesis's words found in the premise (five bins)
        and by whether each sentence holds "no" or "not"; each key answers its most frequent
        training label."""
        return _baselines(batch, self.majority_label, self._overlap_rule())
