"""Options that select behaviour are objects (`spinformer._schema`): one function turns
names into them, config fields that name one list the registered names, and no module in
`spinformer.nn` compares an option with a string."""

import ast
import dataclasses
import pathlib

import pytest

import spinformer
from spinformer import config as C
from spinformer import nn
from spinformer._schema import Choice, choice, choice_names, register_choice
from spinformer.config import keys

NN = pathlib.Path(spinformer.__file__).parent / "nn"
# string comparisons in spinformer/nn that are not about options: a module attribute's name
# (`__getattr__`) and a pytree path key's name (`param_labels`)
_NOT_OPTIONS = {("__init__.py", "name"), ("_groups.py", "getattr")}


def _string_comparisons(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        # `"key" in mapping` looks a key up: only a string compared with `==`/`!=`, or a
        # collection of strings on the right of `in`, compares a value with names
        sides = [node.left, *node.comparators]
        if all(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            sides = node.comparators
        strings = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)
                   and not isinstance(node.ops[0], (ast.In, ast.NotIn))]
        strings += [e for s in sides if isinstance(s, (ast.Tuple, ast.Set, ast.List))
                    for e in s.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if strings:
            left = node.left
            what = (left.id if isinstance(left, ast.Name)
                    else left.func.id if isinstance(left, ast.Call)
                    and isinstance(left.func, ast.Name) else ast.unparse(left))
            yield node.lineno, what, ast.unparse(node)


def _literal_values(path: pathlib.Path) -> set:
    """The strings of every `Literal[...]` written in a source file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == "Literal"):
            out |= {c.value for c in ast.walk(node.slice)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return out


def test_strings_compared_in_nn_are_declared_literal_values():
    """A choice that only switches a term is a `Literal[...]` field; a string compared in
    `spinformer.nn` must be one of the values some `Literal` there declares (a misspelled
    branch would never run). Algorithms are objects and are never compared with strings."""
    declared = set().union(*(_literal_values(p) for p in NN.glob("*.py")))
    found = []
    for p in sorted(NN.glob("*.py")):
        for line, what, src in _string_comparisons(p):
            if (p.name, what) in _NOT_OPTIONS:
                continue
            tree = ast.parse(src)
            strings = {c.value for c in ast.walk(tree)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if not strings <= declared:
                found.append(f"{p.name}:{line}: {src} ({sorted(strings - declared)})")
    assert not found, "strings compared that no Literal declares:\n" + "\n".join(found)


def test_the_scan_finds_a_comparison(tmp_path):
    """The check above can fail: it sees `==`, `!=` and `in` against string literals."""
    src = tmp_path / "m.py"
    src.write_text("def f(self, u, d):\n    a = self.mode == 'steps'\n"
                   "    b = u in ('a', 'b')\n    c = 'key' in d\n    return a, b, c\n")
    assert [line for line, _, _ in _string_comparisons(src)] == [2, 3]


def test_every_option_field_names_registered_objects():
    """Each config field declared with `kind=` (an algorithm, a solver) lists exactly the
    registered names, its default is an object of a registered class, which a config writes
    as its name, and `Registration.kwargs_from` passes the object on."""
    seen = 0
    for reg in spinformer._schema.registrations():
        if reg.config is None:
            continue
        section = reg.config()
        built = reg.kwargs_from(section)
        for f in dataclasses.fields(reg.config):
            kind = f.metadata.get("kind")
            if kind is None:
                continue
            seen += 1
            assert keys(reg.config)[f.name].choices == choice_names(kind)
            value = getattr(section, f.name)
            assert spinformer._schema.name_of(kind, value) in choice_names(kind)
            assert built[f.name] is value
    assert seen >= 14  # spin's update, Boltzmann inference, NeuroGame's estimator, the
    # implicit family's Onsager term, and every solving family's solver and adjoint


def test_choice_resolves_names_and_refuses_the_rest():
    tap = choice("spin.update", "tap")
    assert str(tap) == "tap" and choice("spin.update", tap) is tap
    assert choice("spin.update", "tap") == tap  # options compare by value (hashable)
    assert hash(tap) == hash(choice("spin.update", "tap"))
    with pytest.raises(ValueError, match=r"update='tapp' is not one of \['mean_field', "
                       r"'tap'\]\. Did you mean 'tap'\?"):
        choice("spin.update", "tapp", where="update")
    with pytest.raises(TypeError, match="not a spin.update option"):
        choice("spin.update", choice("boltzmann.inference", "exact"))
    with pytest.raises(TypeError, match="expected one of"):
        choice("spin.update", 3)
    with pytest.raises(ValueError, match="SpinAttention: update='x' is not one of"):
        nn.SpinAttention(8, 2, update="x", key=__import__("jax").random.key(0))
    # the config refuses unknown names with the same list
    with pytest.raises(C.ConfigError, match=r"model.attention.update: 'x' is not one of"):
        C.load_config(None, ["model.attention.update=x"])


def test_register_choice_checks_its_class():
    with pytest.raises(TypeError, match="frozen dataclass"):
        register_choice("test.kind", "x")(type("X", (Choice,), {}))
    with pytest.raises(TypeError, match="not a class"):
        register_choice("test.kind", "x")(object())

    @register_choice("test.kind", "a")
    @dataclasses.dataclass(frozen=True)
    class A(Choice):
        size: int = 1

    assert choice("test.kind", "a") == A() and choice("test.kind", A(3)).size == 3
    with pytest.raises(ValueError, match="already A"):
        register_choice("test.kind", "a")(
            dataclasses.dataclass(frozen=True)(type("B", (Choice,), {})))
    spinformer._schema._TABLE.pop("test.kind")


def test_module_holds_objects_built_from_names_or_objects():
    import jax

    a = nn.SpinAttention(8, 2, mode="steps", init="learned", update="mean_field",
                         key=jax.random.key(0))
    b = nn.SpinAttention(8, 2, mode="steps", init="learned",
                         update=nn.options.MeanFieldUpdate(), key=jax.random.key(0))
    assert isinstance(a.update, nn.options.SpinUpdate) and a.update == b.update
    assert (a.mode, a.init) == ("steps", "learned") and a.m_init is not None
    assert bool(__import__("equinox").tree_equal(a, b))
