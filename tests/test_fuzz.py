"""The model-file fuzz harness (tests/fuzz/): a short campaign over every mutator, which must
find no crash, hang, non-gyges exception or silent misread; and the harness's own probes, which
show it classifies each of those when one happens. Both run as `python -m tests.fuzz` in a
subprocess: the fork-server must be a process with one thread, which pytest's may not be."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--seeds", "1,2", "--mutants", "240", "--timeout", "4", "--jobs", "2"]


def _fuzz(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tests.fuzz", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_the_harness_classifies_each_failure_it_claims_to_catch():
    done = _fuzz("probe", "--json", timeout=120)
    results = json.loads(done.stdout.strip().splitlines()[-1])
    got = {r["probe"]: r["record"]["class"] for r in results}
    assert got == {r["probe"]: r["expected"] for r in results}, done.stderr[-2000:]
    assert {"crash", "hang", "non-gyges", "silent", "oom", "ok", "refused"} <= set(got.values())
    crash = next(r["record"] for r in results if r["probe"] == "crash")
    assert "probes.py" in crash["where"][0]  # the Python frame the signal hit, for the report


def test_a_short_campaign_finds_no_crash_hang_non_gyges_or_silent_misread(tmp_path):
    out = tmp_path / "fuzz.json"
    done = _fuzz("run", *SHORT, "--json", str(out))
    summary = json.loads(out.read_text())
    assert summary["mutants"] == 240 and summary["per_class"]["harness"] == 0, done.stdout
    assert len(summary["per_mutator"]) >= 10  # every mutator drew some mutants
    assert summary["failing"] == 0, done.stdout


def test_a_mutant_is_rebuilt_the_same_from_its_seed_and_index(tmp_path):
    sys.path.insert(0, ROOT)
    from tests.fuzz.mutant import build
    from tests.fuzz.corpus import Corpus
    corpus = Corpus(str(tmp_path / "corpus"))
    for index in range(12):
        a = build(corpus, 5, index, str(tmp_path / f"a{index}"))
        b = build(corpus, 5, index, str(tmp_path / f"b{index}"))
        assert (a.mutator, a.detail) == (b.mutator, b.detail)
        assert _bytes(a.path) == _bytes(b.path), a.detail


def _bytes(path):
    if os.path.isfile(path):
        return open(path, "rb").read()
    return {n: _bytes(os.path.join(path, n)) for n in sorted(os.listdir(path))}


def test_the_fork_server_refuses_to_fork_a_process_that_has_threads(tmp_path):
    """A child forked beside a running thread may inherit a lock that thread held: the parent
    must start no engine (children do), and the runner checks rather than trusts it."""
    code = ("import sys, threading, time; sys.path.insert(0, '.');"
            "from tests.fuzz.runner import ForkServer;"
            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start();"
            f"ForkServer(lambda *a: {{}}, {str(tmp_path)!r}).run([(0, 0)])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "the fork-server has 2 threads" in done.stderr
