"""The shipped notebook runs top to bottom (small size) and shows its figures.

Which kernel runs it: the notebook's metadata names ``python3``, and a plain
``NotebookClient(kernel_name="python3")`` takes the first ``python3``
kernelspec on Jupyter's search path, which may be a user-wide one pointing at
another interpreter (without this project's ``sim`` or vLLM). So the test
writes a ``python3`` kernelspec whose argv is *this* interpreter
(``ipykernel.kernelspec.write_kernel_spec`` uses ``sys.executable``) into a
temporary directory and puts that directory first on ``JUPYTER_PATH``;
Jupyter takes the first match, and nbclient still owns (and shuts down) the
kernel. Nothing is installed into the user's Jupyter directories.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
kernelspec = pytest.importorskip("ipykernel.kernelspec")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "concurrency_gains.ipynb"


@pytest.fixture
def this_interpreter_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    spec_dir = Path(kernelspec.write_kernel_spec(tmp_path / "kernels" / "python3"))
    argv = json.loads((spec_dir / "kernel.json").read_text())["argv"]
    assert argv[0] == sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "python3"


def test_notebook_runs_small_and_shows_its_figures(
    this_interpreter_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSIM_NOTEBOOK_SMALL", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=this_interpreter_kernel,
        timeout=120,  # per cell; the whole notebook takes ~35 s on two cores
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError on any failing cell
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    outputs = [out for cell in code for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 4  # admission, eviction, gain, sweep
    data = [out.get("data", {}) for out in outputs]
    tables = [item["text/plain"] for item in data if "text/html" in item]
    assert any("gain_perc" in table for table in tables)  # result.comparison()
    assert any("workload.rate_scale" in table for table in tables)  # the sweep frame
    assert "window 0-120 s" in "".join(out.get("text", "") for out in outputs)


def test_the_shipped_notebook_has_no_outputs() -> None:
    """Outputs are produced by running it, never committed."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
