"""The notebooks under notebooks/ execute without error on small settings (HF_KVCOMPRESS_NOTEBOOK_SMALL=1),
and are stored without outputs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_at_least_three_notebooks():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    book = nbformat.read(path, as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear the outputs"


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory) -> dict[Path, tuple[nbformat.NotebookNode, BaseException | None]]:
    """Every notebook the session runs `test_notebook_executes` for, each in its own kernel and folder, all at
    once: each kernel is one thread of Python (the notebooks set torch to one thread), so two cores run two
    notebooks in the time of one. ``{path: (executed book, what execution raised or None)}``."""
    wanted = {item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_notebook_executes"}
    books = {path: nbformat.read(path, as_version=4) for path in NOTEBOOKS if path in wanted}

    async def run_all() -> list:
        clients = [nbclient.NotebookClient(book, timeout=900, kernel_name="python3",
                                           resources={"metadata": {"path": str(tmp_path_factory.mktemp(path.stem))}})
                   for path, book in books.items()]
        return await asyncio.gather(*(client.async_execute() for client in clients), return_exceptions=True)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_KVCOMPRESS_NOTEBOOK_SMALL", "1")  # the kernels inherit it
        results = asyncio.run(run_all())
    return {path: (book, err if isinstance(err, BaseException) else None)
            for (path, book), err in zip(books.items(), results)}


@pytest.mark.real_model
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, executed):
    book, raised = executed[path]
    if raised is not None:
        raise raised
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
