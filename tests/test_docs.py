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
         "config": ["spinformer.config"],
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


def test_python_blocks_of_the_readme_and_the_docs_run(tmp_path):
    """Every ```python block of the README and of every page runs as written, each in a fresh
    interpreter from the repository root (so that what a block registers stays there)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert "```python" in pages[0].read_text()
    for page in pages:
        for i, code in enumerate(b.split("```", 1)[0]
                                 for b in page.read_text().split("```python\n")[1:]):
            script = tmp_path / f"{page.stem}_{i}.py"
            script.write_text(code)
            proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, f"{page.name} block {i}:\n{proc.stderr[-3000:]}"


def test_notebooks_rendered_with_their_figures(site):
    """Every notebook is a page of the site, with every figure of its committed outputs."""
    import json

    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        html = (site / "notebooks" / nb.stem / "index.html").read_text()
        cells = json.loads(nb.read_text())["cells"]
        pngs = sum("image/png" in o.get("data", {}) for c in cells for o in c.get("outputs", []))
        assert html.count("data:image/png") >= pngs > 0, nb.name
