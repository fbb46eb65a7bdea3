"""Runs every notebook here top to bottom in this interpreter (the .venv's python) and writes the
outputs into the files, so that they read on a code host with their results:

    .venv/bin/python notebooks/execute.py [name.ipynb ...]

tests/test_notebooks.py runs them again in `make test` and checks that each committed notebook
carries the outputs of a full run."""
import json
import sys
import tempfile
from pathlib import Path

import nbclient
import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

HERE = Path(__file__).resolve().parent


def kernel_manager(root):
    spec = Path(root) / "gyges-venv"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gyges .venv", "language": "python",
        # PYTHONPATH: this checkout's gyges, whichever gyges .venv has installed (make test
        # installs this one, editable; a .venv shared between checkouts may hold another's)
        "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline",
                "PYTHONPATH": str(HERE.parent)}}))
    ksm = KernelSpecManager(kernel_dirs=[str(root)], ensure_native_kernel=False)
    return KernelManager(kernel_name="gyges-venv", kernel_spec_manager=ksm)


def execute(path):
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as root:
        client = nbclient.NotebookClient(nb, km=kernel_manager(root), timeout=300,
                                         allow_errors=False,
                                         resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (gyges .venv)", "language": "python",
                                 "name": "python3"}
    nbformat.write(nb, path)


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.name for p in HERE.glob("*.ipynb"))
    for name in names:
        print(f"running {name}", flush=True)
        execute(HERE / name)
