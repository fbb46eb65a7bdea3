"""Test hooks of the C core, for the reliability tests and the soak benchmark.

Fault injection (csrc/core/fault.h): every host allocation of the core, every physical page it
creates or maps, every KV or weight copy between caches or workers and every collective passes a
site; `inject(site, n)` makes the n-th event of that site fail, once, as the real resource would.
Sweeping n from 1 to `count(site, operation)` fails each resource an operation uses in turn.

    with gyges.testing.inject("page_create", 3):
        host.step()        # the third page created during the step fails
"""
from contextlib import contextmanager

from . import _C

SITES = {"alloc": _C.FAULT_ALLOC, "page_create": _C.FAULT_PAGE_CREATE,
         "page_map": _C.FAULT_PAGE_MAP, "copy": _C.FAULT_COPY, "comm": _C.FAULT_COMM}


def _site(site):
    if site not in SITES:
        raise ValueError(f"unknown fault site {site!r}; expected one of {', '.join(SITES)}")
    return SITES[site]


@contextmanager
def inject(site, n):
    """Within the block, the n-th event (n >= 1) of `site` fails; yields a function telling how
    many faults fired so far in the block."""
    fired = _C.fault_fired()
    _C.fault_arm(_site(site), n)
    try:
        yield lambda: _C.fault_fired() - fired
    finally:
        _C.fault_disarm()


def count(site, operation):
    """Runs operation() counting the events of `site` (nothing fails); returns (count, result)."""
    _C.fault_arm(_site(site), 0)
    try:
        result = operation()
        return _C.fault_count(_site(site)), result
    finally:
        _C.fault_disarm()


# ---- the soak: random live transformations with requests arriving all the time ----

def _legal_targets(host):
    """(workers, tp) pairs a transformation may take from the host's layout: merging the
    instances of an aligned group of one degree, or splitting one instance."""
    out = []
    n = host.n_workers
    size = 2
    while size <= n:
        for first in range(0, n, size):
            group = tuple(range(first, first + size))
            inside = [i for i in host.instances if set(i.workers) & set(group)]
            if any(not set(i.workers) <= set(group) for i in inside):
                continue
            tps = {i.tp for i in inside}
            if len(tps) == 1 and tps.pop() < size:
                out.append((group, size))
            if len(inside) == 1 and inside[0].tp == size:
                t = size // 2
                while t >= 1:
                    out.append((group, t))
                    t //= 2
        size *= 2
    return out


def soak(model, seed=0, transformations=100, workers=4, memory="48MiB", faults=False,
         max_steps=100000):
    """Serves random requests on a Host while it makes `transformations` random live
    transformations (merges and splits of random aligned groups, at once or layer-staggered, with
    and without overlap), then checks every request against the same request served by a plain
    Engine. faults=True also fails a random resource (fault site and event) inside about half of
    the transformations. Returns the counts: done, refused, recovered, requests, lost, mismatches
    and, per worker, the bytes it holds beyond a fresh host of the same layout (page_delta)."""
    import numpy as np

    from .engine import Engine, SamplingParams
    from .errors import Error
    from .host import Host

    rng = np.random.default_rng(seed)
    host = Host(model, workers=workers, memory_per_worker=memory)
    vocab = model.config.vocab_size
    handles, params_of = [], []
    done = refused = recovered = failed_steps = steps = 0
    t = None
    site_names = list(SITES)
    while (done < transformations or (t is not None and not t.done)) and steps < max_steps:
        for _ in range(int(rng.integers(0, 3))):
            p = SamplingParams(max_tokens=int(rng.integers(2, 10)),
                               temperature=float(rng.choice([0.0, 0.8])),
                               top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(1 << 30)),
                               ignore_eos=True)
            prompt = rng.integers(0, vocab, size=int(rng.integers(2, 40))).tolist()
            handles.append(host.submit(prompt, p))
            params_of.append(p)
        if (t is None or t.done) and done < transformations and rng.random() < 0.5:
            group, tp = _legal_targets(host)[int(rng.integers(len(_legal_targets(host))))]
            lps = [None, None, 1, 2, model.config.num_hidden_layers][int(rng.integers(5))]
            overlap = bool(rng.integers(2)) if lps is not None else False
            armed = faults and rng.random() < 0.5
            site, nth = site_names[int(rng.integers(len(site_names)))], int(rng.integers(1, 60))
            with inject(site, nth if armed else 1 << 60):
                try:
                    t = host.transform(workers=group, tp=tp, layers_per_step=lps, overlap=overlap)
                except Error:
                    refused += 1  # refused (nothing changed): memory, or a fault before a change
                    t = None
                while armed and t is not None and not t.done:  # it may fire as layers move
                    try:
                        host.step()
                    except Error:
                        failed_steps += 1  # a failed step changes nothing: the next one retries
                    steps += 1
            if t is not None:
                done += 1
                recovered += bool(t.recovered)
        try:
            host.step()
        except Error:
            failed_steps += 1
        steps += 1
    host.run()
    # The reference: every request served by a plain engine (tokens do not depend on the batch).
    ref = Engine(model, memory="256MiB")
    want = [ref.submit(h.prompt, p) for h, p in zip(handles, params_of)]
    ref.run()
    lost = sum(1 for h in handles if not h.finished or h.finish_reason not in ("length", "stop"))
    mismatches = sum(1 for h, w in zip(handles, want) if h.output_tokens != w.output_tokens)
    fresh = Host(model, workers=workers, memory_per_worker=memory, layout=host.layout())
    page_delta = [host.worker(w).arena.stats()["bytes_in_use"] -
                  fresh.worker(w).arena.stats()["bytes_in_use"] for w in range(workers)]
    result = {"seed": seed, "transformations": done, "refused": refused, "recovered": recovered,
              "requests": len(handles), "lost": lost, "mismatches": mismatches,
              "page_delta": page_delta, "steps": steps, "failed_steps": failed_steps,
              "layout": host.layout()}
    host.close()
    fresh.close()
    ref.close()
    return result
