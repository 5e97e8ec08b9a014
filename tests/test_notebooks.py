"""Every notebook in notebooks/ runs top to bottom without an error.

By default at small sizes (SPINFORMER_NOTEBOOK_SMALL=1); at the sizes of the committed outputs
with `pytest -m slow` (minutes per notebook). Notebooks are executed in memory: the files in
notebooks/ are never written.
"""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    _execute(path, tmp_path, monkeypatch, small=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_full_size(path, tmp_path, monkeypatch):
    _execute(path, tmp_path, monkeypatch, small=False, timeout=3600)
