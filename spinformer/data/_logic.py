"""The small logic behind the generated NLI task: a toy world (a noun hierarchy, verbs,
adjectives, places), sentences of a fixed grammar (`Sentence`, `parse_sentence`), and their
semantics, with `oracle` deciding entailment by model enumeration."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ._pairs import CONTRADICTION, ENTAILMENT, NEUTRAL

# --------------------------------------------------------------------------------------------
# The generated task: world, sentences, semantics
# --------------------------------------------------------------------------------------------

# Noun hierarchy: noun -> parent. Tops: "animal", "person".
_PARENT = {
    "dog": "animal", "cat": "animal", "horse": "animal", "cow": "animal", "pig": "animal",
    "goat": "animal", "duck": "animal", "sheep": "animal", "fox": "animal", "rabbit": "animal",
    "man": "adult", "woman": "adult", "boy": "child", "girl": "child",
    "adult": "person", "child": "person",
}
_NOUNS = tuple(sorted(set(_PARENT) | set(_PARENT.values())))
# (third person singular, base form)
_INTRANSITIVE = (("runs", "run"), ("sleeps", "sleep"), ("eats", "eat"), ("walks", "walk"),
                 ("jumps", "jump"), ("sings", "sing"), ("plays", "play"), ("sits", "sit"),
                 ("waits", "wait"), ("swims", "swim"), ("rests", "rest"),
                 ("dances", "dance"))
_TRANSITIVE = (("pushes", "push"), ("pulls", "pull"), ("sees", "see"), ("follows", "follow"),
               ("helps", "help"), ("chases", "chase"), ("calls", "call"),
               ("watches", "watch"), ("greets", "greet"), ("carries", "carry"))
_ADJECTIVES = ("small", "big", "old", "young", "happy", "lazy", "clever", "sleepy", "tired",
               "hungry")
_ADVERBS = ("quickly", "slowly", "quietly", "happily", "loudly", "calmly")
_PLACES = ("in the park", "in the garden", "near the river", "at the school", "on the hill",
           "in the kitchen", "by the lake", "at the station")
# Held out of the training split when held_out=True (see GeneratedNLI).
_HELD = {
    "noun": ("fox", "rabbit"),
    "intransitive": ("swim", "rest", "dance"),
    "transitive": ("greet", "carry"),
    "adjective": ("tired", "hungry"),
    "adverb": ("loudly", "calmly"),
    "place": ("by the lake", "at the station"),
}
HELD_OUT_TEMPLATES = ("some N does not V",)
_DETS = ("a", "some", "every", "no", "the")
_STRUCTURE = ("a", "an", "some", "every", "no", "the", "does", "not")
_THIRD = {b: t for t, b in _INTRANSITIVE + _TRANSITIVE}
_BASE = {t: b for t, b in _INTRANSITIVE + _TRANSITIVE}
_IV = frozenset(b for _, b in _INTRANSITIVE)
_TV = frozenset(b for _, b in _TRANSITIVE)
_PLACE_BY_PREP = {}
for _pl in _PLACES:
    _PLACE_BY_PREP.setdefault(_pl.split()[0], set()).add(_pl)


def _ancestors(noun: str) -> tuple[str, ...]:
    """`noun` and its hypernyms, nearest first."""
    out = [noun]
    while out[-1] in _PARENT:
        out.append(_PARENT[out[-1]])
    return tuple(out)


def _is_a(n1: str, n2: str) -> bool:
    return n2 in _ancestors(n1)


def _disjoint(n1: str, n2: str) -> bool:
    """Nouns neither of which is a hypernym of the other denote disjoint sets."""
    return not _is_a(n1, n2) and not _is_a(n2, n1)


@dataclass(frozen=True)
class Sentence:
    """One generated sentence, parsed.

    - `det`: `"a"` (also "an") or `"some"` (existential), `"every"`, `"no"`, `"the"`.
    - `noun`, `adjs`: the subject noun phrase (adjectives are intersective).
    - `verb`: the verb's base form; `neg`: "does not" (allowed with a/some/the only).
    - `obj`, `obj_adjs`: a definite object "the [adjs] obj" (transitive verbs).
    - `mods`: verb-phrase modifiers (adverbs, place phrases like "in the park"); inside the
      negation.
    """

    det: str
    noun: str
    verb: str
    neg: bool = False
    adjs: tuple = ()
    obj: Optional[str] = None
    obj_adjs: tuple = ()
    mods: tuple = ()

    def words(self) -> list[str]:
        np_ = list(self.adjs) + [self.noun]
        det = self.det
        if det == "a" and np_[0][0] in "aeiou":
            det = "an"
        out = [det, *np_]
        out += ["does", "not", self.verb] if self.neg else [_THIRD[self.verb]]
        if self.obj is not None:
            out += ["the", *self.obj_adjs, self.obj]
        for m in self.mods:
            out += m.split()
        return out

    def __str__(self) -> str:
        return " ".join(self.words())


def parse_sentence(words: Union[str, Sequence[str]]) -> Sentence:
    """Parses a sentence of the generated language (a string or a list of words) into a
    `Sentence`; anything outside the grammar is a `ValueError` saying where."""
    ws = words.split() if isinstance(words, str) else list(words)
    text = " ".join(ws)

    def fail(why):
        raise ValueError(f"cannot parse {text!r}: {why}.")

    def noun_phrase(i):
        adjs = []
        while i < len(ws) and ws[i] in _ADJECTIVES:
            adjs.append(ws[i])
            i += 1
        if i >= len(ws) or ws[i] not in _NOUNS:
            fail(f"expected a noun at word {i}")
        return ws[i], tuple(adjs), i + 1

    if not ws:
        fail("empty sentence")
    det = {"an": "a"}.get(ws[0], ws[0])
    if det not in _DETS:
        fail(f"expected a determiner {list(_DETS)} first")
    noun, adjs, i = noun_phrase(1)
    if det == "a" and ws[0] != ("an" if (list(adjs) + [noun])[0][0] in "aeiou" else "a"):
        fail("wrong article (a/an)")
    neg = i < len(ws) and ws[i] == "does"
    if neg:
        if ws[i + 1 : i + 2] != ["not"] or i + 2 >= len(ws) or ws[i + 2] not in _THIRD:
            fail("expected 'does not' and a verb's base form")
        if det in ("every", "no"):
            fail(f"'{det} ... does not' is outside the language (ambiguous scope)")
        verb, i = ws[i + 2], i + 3
    else:
        if i >= len(ws) or ws[i] not in _BASE:
            fail(f"expected a verb at word {i}")
        verb, i = _BASE[ws[i]], i + 1
    obj, obj_adjs = None, ()
    if verb in _TV:
        if ws[i : i + 1] != ["the"]:
            fail(f"transitive '{verb}' needs a definite object 'the N'")
        obj, obj_adjs, i = noun_phrase(i + 1)
    mods = []
    while i < len(ws):
        if ws[i] in _ADVERBS:
            mods.append(ws[i])
            i += 1
        elif " ".join(ws[i : i + 3]) in _PLACES:
            mods.append(" ".join(ws[i : i + 3]))
            i += 3
        else:
            fail(f"unexpected {ws[i]!r} at word {i}")
    return Sentence(det, noun, verb, neg, adjs, obj, obj_adjs, tuple(mods))


def _np_relation(n1, a1, n2, a2) -> str:
    """How noun phrase 1 relates to noun phrase 2 as sets: eq, sub, sup, disjoint, overlap."""
    if n1 == n2 and set(a1) == set(a2):
        return "eq"
    if _is_a(n1, n2) and set(a2) <= set(a1):
        return "sub"
    if _is_a(n2, n1) and set(a1) <= set(a2):
        return "sup"
    if _disjoint(n1, n2):
        return "disjoint"
    return "overlap"


def _vp_relation(v1, m1, v2, m2) -> str:
    """Verb phrases: a modified VP is a subset of the same verb with fewer modifiers; different
    verbs are unrelated."""
    if v1 != v2:
        return "overlap"
    if set(m1) == set(m2):
        return "eq"
    if set(m2) <= set(m1):
        return "sub"
    if set(m1) <= set(m2):
        return "sup"
    return "overlap"


def _allowed(x: bool, y: bool, rel: str) -> bool:
    return {"eq": x == y, "sub": not (x and not y), "sup": not (y and not x),
            "disjoint": not (x and y), "overlap": True}[rel]


_QUANT = {"a": "exists", "some": "exists", "every": "every", "no": "no", "the": "the"}


@functools.lru_cache(maxsize=None)
def _monadic_label(pform: tuple, hform: tuple, np_rel: str, vp_rel: str) -> int:
    """The label by model enumeration. An individual is a cell `(in NP_p, in NP_h, in VP_p,
    in VP_h)` allowed by the lexical relations; a scene is a multiset of at most 4 cells
    (enough: every formula below is universal except for at most four existential
    requirements, and universal formulas survive passing to a sub-scene, so any scene
    satisfying them contains one of at most four individuals that does too)."""
    cells = [c for c in itertools.product((False, True), repeat=4)
             if _allowed(c[0], c[1], np_rel) and _allowed(c[2], c[3], vp_rel)]

    def presup(form, scene, k):
        n = sum(c[k] for c in scene)
        return {"every": n >= 1, "the": n == 1}.get(form[0], True)

    def holds(form, scene, k):
        q, neg = form
        sat = [c[2 + k] != neg for c in scene if c[k]]
        if q == "exists":
            return any(sat)
        if q == "every":
            return all(sat)
        if q == "no":
            return not any(sat)
        return len(sat) == 1 and sat[0]  # the

    outcomes = set()
    for size in range(5):
        for scene in itertools.combinations_with_replacement(cells, size):
            if presup(pform, scene, 0) and presup(hform, scene, 1) and holds(pform, scene, 0):
                outcomes.add(holds(hform, scene, 1))
    if not outcomes:
        raise ValueError("the premise cannot hold together with what the two sentences take "
                         "for granted; such a pair has no label.")
    return ENTAILMENT if outcomes == {True} else CONTRADICTION if outcomes == {False} else NEUTRAL


def _transitive_label(p: Sentence, h: Sentence) -> int:
    nps = [(p.noun, p.adjs), (p.obj, p.obj_adjs), (h.noun, h.adjs), (h.obj, h.obj_adjs)]
    if p.det != "the" or h.det != "the":
        raise ValueError("the oracle covers transitive sentences with a definite ('the') "
                         "subject and object only.")
    ids: list[int] = []
    reps: list[tuple] = []
    for n, a in nps:
        for j, (rn, ra) in enumerate(reps):
            rel = _np_relation(n, a, rn, ra)
            if rel == "eq":
                ids.append(j)
                break
            if rel != "disjoint":
                raise ValueError("the oracle covers transitive pairs whose noun phrases are "
                                 "identical or disjoint (distinct individuals) only.")
        else:
            ids.append(len(reps))
            reps.append((n, a))
    # Each definite picks out the unique such individual; atoms: VP(subject, object).
    atoms = sorted({((p.verb, p.mods), ids[0], ids[1]), ((h.verb, h.mods), ids[2], ids[3])})

    def consistent(vals):
        for (a, x), (b, y) in itertools.permutations(zip(atoms, vals), 2):
            if a[1:] == b[1:] and not _allowed(x, y, _vp_relation(*a[0], *b[0])):
                return False
        return True

    pa = atoms.index(((p.verb, p.mods), ids[0], ids[1]))
    ha = atoms.index(((h.verb, h.mods), ids[2], ids[3]))
    outcomes = {vals[ha] != h.neg for vals in itertools.product((False, True), repeat=len(atoms))
                if consistent(vals) and vals[pa] != p.neg}
    return ENTAILMENT if outcomes == {True} else CONTRADICTION if outcomes == {False} else NEUTRAL


def oracle(premise: Union[str, Sequence[str], Sentence],
               hypothesis: Union[str, Sequence[str], Sentence]) -> int:
    """The label of a pair of the generated language, computed from the semantics
    `GeneratedNLI` documents by enumerating scenes (not from the generator's table).

    Takes sentences as strings, word lists or `Sentence`s; returns 0, 1 or 2
    (`NLI_LABELS`). Intransitive pairs are decided by enumerating small scenes; transitive
    pairs (definite subject and object) by enumerating the truth of the verb relations
    between the individuals named."""
    p = premise if isinstance(premise, Sentence) else parse_sentence(premise)
    h = hypothesis if isinstance(hypothesis, Sentence) else parse_sentence(hypothesis)
    if (p.obj is None) != (h.obj is None):
        raise ValueError("the oracle covers pairs of two intransitive or two transitive "
                         "sentences.")
    if p.obj is not None:
        return _transitive_label(p, h)
    return _monadic_label((_QUANT[p.det], p.neg), (_QUANT[h.det], h.neg),
                          _np_relation(p.noun, p.adjs, h.noun, h.adjs),
                          _vp_relation(p.verb, p.mods, h.verb, h.mods))
