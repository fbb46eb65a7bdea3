"""A campaign: the corpus written once, then mutants (seed, 0..n-1) for each seed through the
fork-server, summarised. Also the foreground replay of one mutant and the probe run."""
import os
import tempfile
import time

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "RAYON_NUM_THREADS")


def pin_threads():
    """One thread for every math library, before numpy is imported: the fork-server forks."""
    for var in THREAD_VARS:
        os.environ[var] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _corpus(root):
    from .corpus import Corpus
    corpus = Corpus(root)
    corpus.hf_dir(), corpus.sharded_dir(), corpus.gguf_file()  # written before any fork
    return corpus


def run(seeds, mutants, timeout_s=10.0, jobs=1, memory_bytes=2 << 30, on_record=None):
    """Runs `mutants` mutants spread over `seeds`; returns the summary (report.summarize)."""
    from . import child, report
    from .runner import ForkServer
    per_seed = [mutants // len(seeds) + (i < mutants % len(seeds)) for i in range(len(seeds))]
    pairs = [(s, i) for s, n in zip(seeds, per_seed) for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="gyges-fuzz-") as root:
        corpus = _corpus(os.path.join(root, "corpus"))
        server = ForkServer(lambda s, i, w, note: child.run(corpus, s, i, w, note), os.path.join(root, "m"),
                            timeout_s=timeout_s, memory_bytes=memory_bytes, jobs=jobs)
        start = time.monotonic()
        records = server.run(pairs, on_record=on_record)
        seconds = time.monotonic() - start
    settings = {"seeds": list(seeds), "timeout_s": timeout_s, "jobs": jobs,
                "memory_bytes_over_parent": memory_bytes}
    return report.summarize(records, seconds, settings), records


def probe(timeout_s=3.0, jobs=2):
    """Each probe of probes.PROBES through the fork-server: [(name, expected, record)]."""
    from . import probes
    from .runner import ForkServer
    with tempfile.TemporaryDirectory(prefix="gyges-fuzz-probe-") as root:
        corpus = _corpus(os.path.join(root, "corpus"))
        server = ForkServer(lambda s, i, w, note: probes.run(corpus, i, w), os.path.join(root, "m"),
                            timeout_s=timeout_s, jobs=jobs)
        records = server.run([(-1, i) for i in range(len(probes.PROBES))])
    by_index = {r["index"]: r for r in records}
    return [(name, probes.EXPECTED[name], by_index[i]) for i, name in enumerate(probes.PROBES)]


def replay(seed, index, keep=None, timeout_s=None, memory_bytes=2 << 30):
    """Rebuilds mutant (seed, index) and runs it here, in the foreground (no fork): a crash
    crashes this process, where a debugger can see it. The campaign's address-space limit
    holds here too (memory_bytes None: none), and timeout_s (SIGALRM) ends a hang."""
    import resource
    import signal
    from . import child
    from .runner import vm_bytes
    root = keep or tempfile.mkdtemp(prefix="gyges-fuzz-replay-")
    corpus = _corpus(os.path.join(root, "corpus"))
    if memory_bytes is not None:
        limit = vm_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    if timeout_s:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(int(timeout_s))
    return child.run(corpus, seed, index, os.path.join(root, f"{seed}_{index}")), root
