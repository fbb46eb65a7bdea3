"""Every notebook in notebooks/ runs from top to bottom without an error, in a kernel that is this
interpreter (the .venv's python, where gyges was built), in under a minute each."""
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -r "
                                                  "requirements.txt)")
nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
pytest.importorskip("ipykernel", reason="ipykernel is not installed")


@pytest.fixture(scope="module")
def kernel_spec_manager(tmp_path_factory):
    """A kernel spec that launches exactly sys.executable, so that a `python3` kernel
    installed elsewhere on the machine cannot stand in for the venv."""
    from jupyter_client.kernelspec import KernelSpecManager
    root = tmp_path_factory.mktemp("kernels")
    spec = root / "gyges-venv"
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gyges .venv", "language": "python",
        # PYTHONPATH: this checkout's gyges, whichever gyges .venv has installed (make test
        # installs this one, editable; a .venv shared between checkouts may hold another's)
        "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline",
                "PYTHONPATH": str(ROOT)}}))
    return KernelSpecManager(kernel_dirs=[str(root)], ensure_native_kernel=False)


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:4] == ["01_quickstart.ipynb", "02_transformation.ipynb",
                                               "03_paper_scale_simulation.ipynb",
                                               "04_real_model.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebooks_carry_the_outputs_of_a_full_run(path):
    """So that they read on a code host (notebooks/execute.py writes them)."""
    nb = nbformat.read(path, as_version=4)
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"{path.name}: run notebooks/execute.py"
    assert any(c.outputs for c in nb.cells if c.cell_type == "code")
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
                if o.output_type == "error"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_spec_manager):
    from jupyter_client.manager import KernelManager
    nb = nbformat.read(path, as_version=4)
    # the last cell reports which interpreter ran the notebook
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    km = KernelManager(kernel_name="gyges-venv", kernel_spec_manager=kernel_spec_manager)
    client = nbclient.NotebookClient(nb, km=km, timeout=120, allow_errors=False,
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    seconds = time.perf_counter() - start
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("name") == "stdout")
    assert Path(out.strip()) == Path(sys.executable), f"the kernel ran {out.strip()!r}"
    assert seconds < 60, f"{path.name} took {seconds:.0f} s (keep notebooks under ~30 s)"
