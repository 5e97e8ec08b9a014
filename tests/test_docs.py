"""The documentation site builds in strict mode (a dead reference or a renamed function is an
error), its API reference has every public name, and the pages' Python blocks run."""

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

import spinformer

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = {"solvers": ["spinformer.solvers"], "nn": ["spinformer.nn", "spinformer.nn.options"],
         "train": ["spinformer.train"], "data": ["spinformer.data"],
         "config": ["spinformer.config"], "grid": ["spinformer.grid"],
         "spins": [f"spinformer.spins.{m}" for m in spinformer.spins.__all__]}
# names a module provides through its module-level __getattr__ (computed when asked); the
# pages say so in prose
DYNAMIC = {"spinformer.nn": {"ATTENTIONS"}}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    return out


def test_api_reference_has_every_public_name(site):
    for page, modules in PAGES.items():
        html = (site / "api" / page / "index.html").read_text()
        ids = set(re.findall(r'id="([\w.]+)"', html))
        for name in modules:
            module = importlib.import_module(name)
            missing = [n for n in module.__all__ if f"{name}.{n}" not in ids
                       and n not in DYNAMIC.get(name, set())]
            assert not missing, f"api/{page}.md lacks {name}: {missing}"


def test_site_holds_pages_not_build_scripts(site):
    assert (site / "index.html").exists()
    scripts = sorted(str(p.relative_to(site)) for p in site.rglob("*.py"))
    assert not scripts, f"the site copies build scripts: {scripts}"


def _doc_texts():
    """The README's and the docs' text, without the changes page's tables of old names."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in pages}
    project = texts["docs/project.md"]
    start, end = project.index("## Changes"), project.index("## Contributing")
    texts["docs/project.md"] = project[:start] + project[end:]
    return texts


def test_every_solver_name_the_docs_mention_exists():
    """`RESULTS.<code>` and `solvers.<name>` in the README and the docs are real names (a
    guide once listed `RESULTS.diverged`, which does not exist)."""
    from spinformer import solvers

    missing = []
    for where, text in _doc_texts().items():
        for code in re.findall(r"\bRESULTS\.([A-Za-z_]\w*)", text):
            if not hasattr(solvers.RESULTS, code):
                missing.append(f"{where}: RESULTS.{code}")
        for name in re.findall(r"(?<![/\w.])solvers\.([A-Za-z_]\w*)", text):
            if name not in ("md", "py") and not hasattr(solvers, name):
                missing.append(f"{where}: solvers.{name}")
    assert not missing, missing


def test_config_reference_is_generated_from_the_schema(site):
    html = (site / "guides" / "command_line" / "index.html").read_text()
    for key in spinformer.config.describe().splitlines():
        name = key.split(" ", 1)[0].rstrip(":")
        assert f"<code>{name}</code>" in html, name


def test_options_all_is_every_option():
    """`nn.options.__all__` is written out (documentation tools read it without importing):
    it must list every option class the module imports."""
    from spinformer.nn import options

    public = {n for n in dir(options) if not n.startswith("_") and n[0].isupper()}
    assert set(options.__all__) == public | {"choice", "choice_names", "register_choice"}


def _python_blocks(page: pathlib.Path) -> list[str]:
    return [b.split("```", 1)[0] for b in page.read_text().split("```python\n")[1:]]


# blocks that a test below runs with checks of what their page says about them
CHECKED_BLOCKS = {("own_attention", 0)}

# Runs each script named on its command line as `python SCRIPT` would, each in a child forked
# from this interpreter once it has imported JAX and Equinox (2.2 s of a block's 2.5 s start;
# every block imports both, itself or through spinformer, and importing JAX starts no thread
# and no backend, so the fork is safe); SCRIPT.out, .err and .rc get its output and exit
# status. Each child starts as a fresh interpreter plus those imports: nothing a block
# registers or builds reaches the next one.
FORKING_RUNNER = """
import os, runpy, sys, traceback
import equinox, jax
for path in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        with open(path + ".out", "w") as out, open(path + ".err", "w") as err:
            os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
            sys.argv, code = [path], 1
            try:
                runpy.run_path(path, run_name="__main__")
                code = 0
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    with open(path + ".rc", "w") as rc:
        rc.write(str(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
"""


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """`{(page, i): (exit status, stdout, stderr)}` of every ```python block of the README and
    of every page, each run as written (a checked block with its checks appended) in a fresh
    interpreter (`FORKING_RUNNER`) from the repository root, so that what a block registers
    stays there."""
    tmp = tmp_path_factory.mktemp("blocks")
    scripts = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, code in enumerate(_python_blocks(page)):
            checks = OWN_ATTENTION_CHECKS if (page.stem, i) in CHECKED_BLOCKS else ""
            scripts[page.stem, i] = script = tmp / f"{page.stem}_{i}.py"
            script.write_text(code + checks)
    (tmp / "runner.py").write_text(FORKING_RUNNER)
    subprocess.run([sys.executable, str(tmp / "runner.py"), *map(str, scripts.values())],
                   cwd=ROOT, check=True, timeout=600)

    def read(script, ext):
        return script.with_name(script.name + ext).read_text()

    return {key: (int(read(script, ".rc")), read(script, ".out"), read(script, ".err"))
            for key, script in scripts.items()}


def test_python_blocks_of_the_readme_and_the_docs_run(blocks):
    """Every ```python block of the README and of every page runs as written, each in a fresh
    interpreter from the repository root (so that what a block registers stays there)."""
    assert "```python" in (ROOT / "README.md").read_text() and ("README", 0) in blocks
    for (page, i), (returncode, _, stderr) in blocks.items():
        if (page, i) not in CHECKED_BLOCKS:
            assert returncode == 0, f"{page} block {i}:\n{stderr[-3000:]}"


def test_notebooks_rendered_with_their_figures(site):
    """Every notebook is a page of the site, with every figure of its committed outputs."""
    import json

    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        html = (site / "notebooks" / nb.stem / "index.html").read_text()
        cells = json.loads(nb.read_text())["cells"]
        pngs = sum("image/png" in o.get("data", {}) for c in cells for o in c.get("outputs", []))
        assert html.count("data:image/png") >= pngs > 0, nb.name


# appended to the own-attention guide's example: what its text says is true
OWN_ATTENTION_CHECKS = """
# the map contracts: at the fixed point of any instance, with sharp (scaled-up) scores too,
# the Jacobian of m -> tanh(beta (x + A m)) has absolute row sums <= beta/2 < 1
beta = cfg.model.attention.beta
assert beta < 2, beta
for seed, scale in [(0, 1.0), (1, 10.0), (2, 100.0)]:
    kx, ka = jax.random.split(jax.random.key(seed))
    attn = MyAttention(16, causal=True, beta=beta, key=ka)
    attn = eqx.tree_at(lambda a: (a.to_q.weight, a.to_k.weight), attn,
                       (scale * attn.to_q.weight, scale * attn.to_k.weight))
    x = 3.0 * jax.random.normal(kx, (12, 16))
    m, diag = attn(x, return_diagnostics=True)
    A = diag.weights[0]
    assert jnp.allclose(A.sum(-1), 0.5, atol=1e-5)
    assert bool(jnp.all(diag.solver.result == solvers.RESULTS.successful))
    jac = jax.jacobian(lambda m: jnp.tanh(beta * (x + A @ m)))(m).reshape(m.size, m.size)
    bound = float(jnp.abs(jac).sum(-1).max())
    assert bound <= beta / 2 + 1e-5, (seed, scale, bound)
# it trains: the loss falls, every solve converges, no step is skipped
assert summary["steps"] == cfg.train.steps and summary["bad_steps"] == 0, summary
assert all(r["bad_steps"] == 0 and r["solver_failures"] == 0 for r in train), train
assert max(r["solver_steps"] for r in train) < 20, train
assert train[-1]["loss"] < train[0]["loss"] - 0.2, (train[0]["loss"], train[-1]["loss"])
val = [r for r in records if r["split"] == "val"]
assert val[-1]["loss"] < val[0]["loss"], val
print("checks passed")
"""


def test_own_attention_example_contracts_and_trains(blocks):
    """The own-attention guide's example is what its text says: its fixed-point map contracts
    (the Jacobian's row sums are at most β/2 < 1, for any weights), and trained from a config
    its loss falls with every solve converged and no step skipped."""
    code = _python_blocks(ROOT / "docs" / "guides" / "own_attention.md")[0]
    assert "spinformer.train.run(" in code
    returncode, stdout, stderr = blocks["own_attention", 0]  # (run with OWN_ATTENTION_CHECKS)
    assert returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "checks passed" in stdout


# characters of a formula: an emphasis (<em>, <strong>) holding one outside a code span is a
# formula whose `*` or `_` Markdown read as a delimiter (`x* = g(x*)`, `[𝛘]_ii ... 𝐉_{i}`)
FORMULA_CHARS = re.compile(r"[=<>{}\[\]^|_*+−∖⁻¹²∫Σ∂]")


def _public_docstrings():
    """(dotted name, docstring) of every module, public name and public member the API pages
    render, read as mkdocstrings reads them (griffe, from the source)."""
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)])
    package = loader.load("spinformer")
    loader.resolve_aliases(implicit=False, external=False)
    seen = set()

    def walk(obj, path, top):
        if obj.is_alias:
            try:
                obj = obj.final_target
            except Exception:  # an alias to something outside the package
                return
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            yield path, obj.docstring.value
        if not (obj.is_class or (obj.is_module and top)):
            return
        exports = None
        if obj.is_module and obj.exports is not None:
            exports = {e if isinstance(e, str) else e.name for e in obj.exports}
        for name, member in obj.members.items():
            if not name.startswith("_") and (exports is None or name in exports):
                yield from walk(member, f"{path}.{name}", False)

    for modules in PAGES.values():
        for name in modules:
            yield from walk(package[name.removeprefix("spinformer.")], name, True)


def _garbled_emphasis(doc: str, md) -> list[str]:
    """The emphases of `doc` rendered as Markdown that hold a formula's characters outside
    code spans, or start inside one (`x* = g(x*, θ)` gives <em>, θ) ... x</em>)."""
    import html as _html

    md.reset()
    bad = []
    for _, content in re.findall(r"<(em|strong)>(.*?)</\1>", md.convert(doc), flags=re.S):
        text = _html.unescape(re.sub(r"<code>.*?</code>", "", content, flags=re.S))
        if FORMULA_CHARS.search(text) or not re.match(r"[\w(\"'“‘]", text):
            bad.append(content)
    return bad


def test_docstring_formulas_are_not_read_as_emphasis():
    """The API pages render docstrings as Markdown, where the `*` and `_` of a formula written
    as plain text pair up into emphasis and the formula is lost; formulas go in code spans."""
    markdown = pytest.importorskip("markdown")
    md = markdown.Markdown(extensions=["admonition", "tables", "pymdownx.highlight",
                                       "pymdownx.superfences"])
    assert _garbled_emphasis("For a fixed point x* = g(x*, θ) the cotangent of x* is", md)
    assert _garbled_emphasis("agree, [𝛘]_ii⁻¹ = Λ_i − 𝐉_{i,∖i} [(𝚲 − 𝐉)_{∖i∖i}]⁻¹ 𝐉_{∖i,i}", md)
    assert not _garbled_emphasis("`x* = g(x*)`, *its own* energy; **Returns:** `(n, d)`", md)
    docs = dict(_public_docstrings())
    assert "spinformer.solvers.Implicit" in docs and "spinformer.spins.ising" in docs
    garbled = {name: bad for name, doc in docs.items() if (bad := _garbled_emphasis(doc, md))}
    assert not garbled, f"put these formulas in code spans (backticks): {garbled}"
