"""gyges as an installed package: a wheel built from this tree, installed into a fresh venv,
imports and runs its `gyges` command from outside the repository (issue 34). The wheel reuses
the extensions `make build` compiled (build/lib.*: distutils skips an up-to-date extension), so
this takes seconds, not a compile."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def clean_env():
    """The environment without anything that would put the repository on sys.path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def run(cmd, cwd, timeout=120):
    p = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The directory of a venv holding the wheel's gyges."""
    tmp = tmp_path_factory.mktemp("pkg")
    run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(tmp / "wheels")], cwd=ROOT,
        timeout=600)   # (a C source newer than the built extension: a compile)
    wheels = list((tmp / "wheels").glob("gyges-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp).strip())
    # numpy, uvicorn, ... come from this interpreter's site-packages, named in a .pth file: no
    # download. gyges cannot come from there even when an editable gyges is installed in it: a
    # .pth line appends its directory after the venv's own site-packages (where the wheel's gyges
    # lands), and .pth files inside an appended directory are not run, so the editable install's
    # finder (its own .pth) never loads. (Every site-packages on sys.path, not only ours: this
    # interpreter may itself reach its packages through such a .pth.)
    deps = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (site / "deps.pth").write_text("\n".join([sysconfig.get_paths()["purelib"], *deps]) + "\n")
    # pip of this interpreter, installing for the venv's (its shebangs, its site-packages);
    # --ignore-installed: a gyges dist-info seen through deps.pth is neither reused nor removed
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--ignore-installed", "--disable-pip-version-check", "-q",
         str(wheels[0])], cwd=tmp)
    return venv


def test_the_wheel_installs_and_imports_from_outside_the_repository(installed, tmp_path):
    venv = installed
    out = run([str(venv / "bin" / "python"), "-c",
               "import gyges; print(gyges.__file__); print(gyges._C.__file__)"], cwd=tmp_path)
    module, extension = (Path(line) for line in out.split())
    assert venv in module.parents and venv in extension.parents, out   # not the repository's


@pytest.mark.parametrize("args, says", [
    (["--help"], "usage: gyges"),
    (["serve", "--help"], "usage: gyges serve"),
    (["bench", "serve", "--help"], "usage: gyges bench serve"),
], ids=["gyges", "serve", "bench-serve"])
def test_the_installed_gyges_command_runs(installed, tmp_path, args, says):
    venv = installed
    assert says in run([str(venv / "bin" / "gyges"), *args], cwd=tmp_path)


def test_python_dash_m_gyges_runs_the_installed_package(installed, tmp_path):
    venv = installed
    assert "usage: gyges" in run([str(venv / "bin" / "python"), "-m", "gyges", "--help"],
                                 cwd=tmp_path)


def test_the_installed_gyges_serves_the_packaged_model(installed, tmp_path):
    """`gyges serve` of the wheel, from /tmp: the server answers a completion."""
    import json
    import socket
    import time
    import urllib.request
    from packaged import WHY_NOT
    if WHY_NOT is not None:
        pytest.skip(WHY_NOT)
    with socket.socket() as s:   # a free port (the server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(installed / "bin" / "gyges"), "serve", "--port", str(port),
                               "--log-level", "warning"], cwd=tmp_path, env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 3,
                           "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(request, timeout=60))
        assert answer["choices"][0]["text"].startswith(" Paris"), answer
    finally:
        server.terminate()
        server.wait(30)
