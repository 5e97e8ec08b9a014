"""Every notebook in notebooks/ runs top to bottom without an error.

By default at small sizes (SPINFORMER_NOTEBOOK_SMALL=1), except the notebooks in `HEAVY`, whose
small runs take half a minute or more each and whose pieces the unit tests cover: they run at
small size with `pytest -m slow`, like every notebook at the sizes of the committed outputs
(minutes per notebook). Notebooks are executed in memory: the files in
notebooks/ are never written.
"""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# 20-90 s each at small size on 2 cores (training runs, many compilations): `-m slow` only,
# to keep the default run short (spin_physics, the quickest, stays as the default
# run's check of the notebook machinery)
HEAVY = {"spin_transformer.ipynb", "implicit_attention.ipynb", "neurogame.ipynb",
         "boltzmann_attention.ipynb", "energy_views.ipynb", "nonequilibrium.ipynb",
         "hopfield_energy_transformer.ipynb"}
SMALL_RUNS = [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in HEAVY else [])
              for p in NOTEBOOKS]


def _execute(path, tmp_path, monkeypatch, *, small, timeout):
    if small:
        monkeypatch.setenv("SPINFORMER_NOTEBOOK_SMALL", "1")
    else:
        monkeypatch.delenv("SPINFORMER_NOTEBOOK_SMALL", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    before = path.read_bytes()
    nb = nbformat.reads(before.decode("utf-8"), as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors, errors
    assert path.read_bytes() == before, f"{path.name} was modified by its execution"


@pytest.mark.parametrize("path", SMALL_RUNS)
def test_notebook_executes(path, tmp_path, monkeypatch):
    _execute(path, tmp_path, monkeypatch, small=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_full_size(path, tmp_path, monkeypatch):
    _execute(path, tmp_path, monkeypatch, small=False, timeout=3600)


def _draws(source: str) -> bool:
    return any(s in source for s in ("plt.show()", "plt.subplots", "plt.figure"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_notebook_has_its_outputs_and_figures(path):
    """A notebook is committed executed: every code cell ran (in order, no errors), and every
    cell that draws a figure shows it (a PNG output), so the notebook reads on GitHub without
    running it."""
    nb = nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    counts = [c.get("execution_count") for c in code]
    assert None not in counts, f"{path.name}: cells never executed: {counts}"
    assert counts == sorted(counts), f"{path.name}: cells executed out of order: {counts}"
    for i, c in enumerate(code):
        outputs = c.get("outputs", [])
        assert not [o for o in outputs if o.get("output_type") == "error"], (path.name, i)
        if _draws(c.source):
            pngs = [o for o in outputs if "image/png" in o.get("data", {})]
            assert pngs, f"{path.name}: code cell {i} draws a figure but shows none"
