"""Execution plans on a host: pipeline instances (PP2, PP[3,1], PP4, mixed with TP instances)
give the tokens of one worker bit for bit, each stage's KV cache holds its own layers only and
gives every page back, and what plans cannot do yet is refused with the reason, changing
nothing. (The C side: tests/c/test_engine.c's engine_*plan* tests.)"""
import numpy as np
import pytest

import gyges
from gyges.runtime.engine import SamplingParams, engine_params

# A transformation that fails half-way is rebuilt and recomputes its requests (gyges.recovery),
# which keeps token streams right and would hide the failure: here none may happen.
pytestmark = pytest.mark.filterwarnings("error::gyges.reconfig.recovery.RecoveryWarning")


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def prompts(n, seed=0, lo=4, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 4096, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny):
    """Tokens of one TP1 engine, greedy and seeded sampling."""
    ps = prompts(6, seed=3)
    out = {}
    for temperature in (0.0, 0.9):
        params = gyges.SamplingParams(max_tokens=16, temperature=temperature, top_k=50, seed=11,
                                      ignore_eos=True)
        out[temperature] = [r.output_tokens for r in
                            gyges.Engine(tiny, memory="64MiB").generate(ps, params)]
    return ps, out


def test_four_stage_pipelines_at_uneven_splits_give_the_tokens_of_one_worker():
    """PP4 over a deeper model (7 layers), evenly (2,2,2,1) and unevenly split, greedy and
    seeded sampling, against one TP1 engine of the same model."""
    import dataclasses
    config = dataclasses.replace(gyges.Model.tiny().config, num_hidden_layers=7)
    model = gyges.Model.random(config, seed=5)
    ps = prompts(5, seed=4)
    for temperature in (0.0, 0.9):
        params = gyges.SamplingParams(max_tokens=12, temperature=temperature, top_k=50, seed=7,
                                      ignore_eos=True)
        want = [r.output_tokens for r in gyges.Engine(model, memory="64MiB").generate(ps, params)]
        for layout in ("PP4", "PP[1,3,1,2]", "PP[4,1,1,1]"):
            with gyges.Host(model, workers=4, memory_per_worker="32MiB", layout=layout) as host:
                assert host.layout() == layout
                assert [r.output_tokens for r in host.generate(ps, params)] == want, layout


@pytest.mark.parametrize("layout,workers", [("PP2", 2), ("PP[3,1]", 2), ("PP[1,3]", 2),
                                            ("PP4", 4), ("PP[1,2,1]", 3),
                                            ("PP[3,1]+2xTP1", 4), ("TP2+PP2", 4)])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_pipelines_give_the_tokens_of_one_worker(tiny, reference, layout, workers, temperature):
    ps, want = reference
    host = gyges.Host(tiny, workers=workers, memory_per_worker="32MiB", layout=layout)
    assert host.layout() == layout
    params = gyges.SamplingParams(max_tokens=16, temperature=temperature, top_k=50, seed=11,
                                  ignore_eos=True)
    got = [r.output_tokens for r in host.generate(ps, params)]
    assert got == want[temperature]
    host.close()


def test_a_stage_cache_holds_its_layers_and_gives_its_pages_back(tiny):
    host = gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="PP[3,1]")
    first, second = host.worker(0), host.worker(1)
    assert (first.kv.first_layer, first.kv.n_layers) == (0, 3)
    assert (second.kv.first_layer, second.kv.n_layers) == (3, 1)
    assert [i.stages for i in host.instances] == [((0, 3), (3, 4))]
    # Each stage holds its layers' weights only: the first the embedding, the last the head.
    w = first.weights
    page, ffn_layer = w.page_size, 3 * w.tensor_slots * w.page_size
    runs = {k: n * page for k, (_, n) in w.runs.items()}
    want = [runs["embed"] + sum(runs[i] for i in range(3)) + 3 * ffn_layer,
            runs[3] + runs["head"] + ffn_layer]
    weights = [m["weights"] for m in host.memory()]
    assert weights == want
    alone = gyges.Host(tiny, workers=1, memory_per_worker="32MiB").memory()[0]["weights"]
    assert sum(weights) == alone  # the pipeline holds one copy of the model, split
    assert first.weights.held_layers == {0, 1, 2} and second.weights.held_layers == {3}
    assert (first.weights.has_embed, first.weights.has_head) == (True, False)
    assert (second.weights.has_embed, second.weights.has_head) == (False, True)
    requests = [host.submit(p, gyges.SamplingParams(max_tokens=8, ignore_eos=True))
                for p in prompts(4, seed=5)]
    host.step()
    mem = host.memory()
    # One page a layer holds the same blocks on both stages: three layers' pages on the first.
    kv0, kv1 = mem[0]["kv"], mem[1]["kv"]
    assert kv0 > 0 and kv0 == 3 * kv1
    while host.has_unfinished():
        host.step()
    assert all(r.finished for r in requests)
    assert [m["kv"] for m in host.memory()] == [0, 0]
    assert [m["weights"] for m in host.memory()] == weights
    host.close()


def test_transformations_of_a_pipeline_are_refused_and_change_nothing(tiny):
    host = gyges.Host(tiny, workers=4, memory_per_worker="32MiB", layout="PP2+2xTP1")
    r = host.submit(prompts(1, seed=6)[0], gyges.SamplingParams(max_tokens=6, ignore_eos=True))
    host.step()
    before = (host.layout(), [m["in_use"] for m in host.memory()], list(r.output_tokens))
    with pytest.raises(gyges.InvalidArgumentError, match="serve a pipeline .*PipeLive"):
        host.transform(workers=(0, 1), tp=2)
    with pytest.raises(gyges.InvalidArgumentError, match="serve a pipeline"):
        host.transform(workers=(0, 1, 2, 3), tp=4)
    assert (host.layout(), [m["in_use"] for m in host.memory()], list(r.output_tokens)) == before
    host.transform(workers=(2, 3), tp=2)  # the TP instances beside it still transform
    assert host.layout() == "PP2+TP2"
    while host.has_unfinished():
        host.step()
    assert r.finished and len(r.output_tokens) == 6
    host.close()


def test_the_engine_checks_a_plan_and_its_caches(tiny):
    w = [gyges.runtime.worker.Worker(tiny, memory="32MiB") for _ in range(2)]
    models, kvs = [[x.c_model] for x in w], [[x.kv._c] for x in w]
    with pytest.raises(gyges.InvalidArgumentError, match=r"must cover layers \[0, 4\)"):
        gyges._C.Engine(models, kvs, [None, None], 64, 8, layers=[(0, 2), (3, 4)])
    w[1].join_stage(3, 4)
    with pytest.raises(gyges.InvalidArgumentError,
                       match=r"model holds layers \[3, 4\), the head, not all the stage \[2, 4\)"):
        gyges._C.Engine(models[:1] + [[w[1].c_model]], kvs, [None, None], 64, 8,
                        layers=[(0, 2), (2, 4)])
    with pytest.raises(gyges.InvalidArgumentError, match=r"holds layers \[3, 4\), not the stage's \[2, 4\)"):
        gyges._C.Engine(models, kvs[:1] + [[w[1].kv._c]], [None, None], 64, 8,
                        layers=[(0, 2), (2, 4)])
    with pytest.raises(gyges.InvalidArgumentError, match="a plan has 1 to 8 stages"):
        gyges._C.Engine(models, kvs, [None], 64, 8, layers=[(0, 2), (2, 4)])
    with pytest.raises(gyges.InvalidArgumentError, match="layers"):
        w[0].join_stage(2, 2)


def _serve_raw(engines, prompts, steps_before=3):
    """Adds the prompts to engines[0], steps it `steps_before` times, moves every request to
    engines[-1] (gy_engine_take, with its KV sequences) when there are two, then steps to the end.
    Returns each request's tokens."""
    first, last = engines[0], engines[-1]
    none = np.zeros(0, np.int32)
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=12, temperature=0.8 if i % 2 else 0.0, top_k=40, seed=7)
        first.add(i, np.array(p, np.int32), engine_params(params, none), 0.0)
    out = {i: [] for i in range(len(prompts))}
    now = 0.0
    for _ in range(steps_before):
        tokens, *_ = first.step(now)
        now += 1.0
        for rid, token, _ in tokens:
            out[rid].append(token)
    if first is not last:
        for rid in first.request_ids():
            last.take(first, rid, first.export(rid)["seqs"])
        assert first.request_ids() == []
    while last.request_ids():
        tokens, finished, *_ = last.step(now)
        now += 1.0
        for rid, token, _ in tokens:
            out[rid].append(token)
        for rid in finished:
            last.release(rid)
    return [out[i] for i in range(len(prompts))]


def test_requests_moved_in_c_continue_bit_identically(tiny):
    from gyges.runtime.worker import Worker
    ps = prompts(5, seed=8)
    ref = Worker(tiny, memory="32MiB")
    want = _serve_raw([gyges._C.Engine([ref.c_model], [ref.kv._c], None, 64, 3)], ps)
    w = Worker(tiny, memory="32MiB")
    a = gyges._C.Engine([w.c_model], [w.kv._c], None, 64, 3)  # 3 running: 2 still queued
    b = gyges._C.Engine([w.c_model], [w.kv._c], None, 64, 3)  # a new instance, same worker
    with pytest.raises(gyges.ArgumentTypeError, match="src must be a gyges._C.Engine"):
        b.take(w, 0, [-1])
    got = _serve_raw([a, b], ps)
    assert got == want and all(len(t) == 12 for t in got)
    with pytest.raises(gyges.StateError, match="no request"):
        b.take(a, 0, [-1])
    del a, b
    assert w.kv.stats()["n_sequences"] == 0 and w.arena.stats()["bytes_by_tag"]["kv"] == 0
