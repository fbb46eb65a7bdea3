"""vLLM's sampling surface (issue 34, part 3): penalties and min_tokens (csrc/sched/logits.h)
against a NumPy reference written here, logprobs and prompt_logprobs against the float64
reference model, determinism across a live reconfiguration and a move between hosts, the engine
seed, and every bad value refused by name.

Tolerance policy: processed logits are exact (the C code rounds a double to float once, as the
reference does); logprobs are within 2e-4 of the largest reference logit's magnitude (the fp32
forward's logits are within 1e-4 relative, tests/test_engine.py, and a log-softmax adds at most
the error of the max and of the log-sum-exp); tokens and promised bit-exactness are exact."""
import dataclasses

import numpy as np
import pytest
from reference_model import ReferenceModel
from test_sampler import ref_probs

import gyges
from gyges import _C_test
from gyges.runtime.engine import mix_seed


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def prompts(n, seed, lo, hi, vocab=4096):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, vocab, rng.integers(lo, hi))] for _ in range(n)]


# ---- penalties and min_tokens: the C row against NumPy ----

def ref_process(x, tokens, prompt_len, rp, fp, pp, min_tokens=0, stop=()):
    """vLLM's apply_penalties then min_tokens, in float64, rounded to float32 once."""
    y = x.astype(np.float64)
    V = x.size
    seen = np.zeros(V, bool)
    seen[np.asarray(tokens, int)] = True
    counts = np.bincount(np.asarray(tokens[prompt_len:], int), minlength=V)
    y = np.where(seen, np.where(y > 0, y / rp, y * rp), y)
    y = y - fp * counts - pp * (counts > 0)
    y = y.astype(np.float32)
    if len(tokens) - prompt_len < min_tokens:
        y[list(stop)] = -np.inf
    return y


def c_process(x, tokens, prompt_len, rp, fp, pp, min_tokens=0, stop=()):
    y = np.array(x, np.float32)
    _C_test.logits_process(y, np.array(tokens, np.int32), prompt_len, rp, fp, pp, min_tokens,
                           np.array(stop, np.int32))
    return y


@pytest.mark.parametrize("V", [7, 97, 1001])
def test_penalties_give_the_reference_logits_and_distribution(V):
    rng = np.random.default_rng(V)
    for trial in range(20):
        x = (rng.standard_normal(V) * 3).astype(np.float32)
        n = int(rng.integers(1, 3 * V))
        tokens = rng.integers(0, V, n).tolist()
        prompt_len = int(rng.integers(0, n + 1))
        rp, fp, pp = float(rng.uniform(0.5, 2)), float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2))
        got = c_process(x, tokens, prompt_len, rp, fp, pp)
        want = ref_process(x, tokens, prompt_len, rp, fp, pp)
        np.testing.assert_array_equal(got, want)
        # what the sampler then draws from: the reference distribution of the reference row
        T, k, p = float(rng.uniform(0.3, 2)), int(rng.integers(0, V)), float(rng.uniform(0.5, 1))
        out = np.empty(V)
        _C_test.sampler_probs(got, T, k, p, out)
        probs, near = ref_probs(want, T, k, p)
        if not near:  # (a top-p cut within rounding of the target may fall either way)
            np.testing.assert_allclose(out, probs, rtol=1e-12, atol=1e-15)


def test_penalties_count_output_tokens_only_for_frequency_and_presence():
    x = np.array([1.0, 1.0, 1.0, -1.0], np.float32)
    # token 0 in the prompt only, 1 in the output twice, 2 in both
    got = c_process(x, [0, 2, 1, 1, 2], 2, 1.0, 0.5, 0.25)
    np.testing.assert_array_equal(got, np.float32([1.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25, -1.0]))
    got = c_process(x, [0, 2, 1, 1, 2], 2, 2.0, 0.0, 0.0)  # repetition: prompt and output
    np.testing.assert_array_equal(got, np.float32([0.5, 0.5, 0.5, -1.0]))


def test_min_tokens_masks_every_stop_token_until_the_count():
    x = np.zeros(6, np.float32)
    got = c_process(x, [1, 2, 5], 2, 1.0, 0.0, 0.0, min_tokens=2, stop=(3, 4))
    assert np.isneginf(got[[3, 4]]).all() and (got[[0, 1, 2, 5]] == 0).all()
    got = c_process(x, [1, 2, 5, 5], 2, 1.0, 0.0, 0.0, min_tokens=2, stop=(3, 4))
    assert (got == 0).all()


def test_min_tokens_holds_back_eos_and_stop_tokens_in_the_engine(tiny):
    p = prompts(1, 4, 8, 9)[0]
    with gyges.Engine(tiny, memory="64MiB") as e:
        first = e.generate([p], gyges.SamplingParams(max_tokens=8, ignore_eos=True))[0]
        t0 = first.output_tokens[0]
        stopped = e.generate([p], gyges.SamplingParams(max_tokens=8, stop_token_ids=[t0],
                                                       ignore_eos=True))[0]
        held = e.generate([p], gyges.SamplingParams(max_tokens=8, stop_token_ids=[t0],
                                                    ignore_eos=True, min_tokens=3))[0]
    assert stopped.output_tokens == [t0] and stopped.finish_reason == "stop"
    assert len(held.output_tokens) >= 3 and t0 not in held.output_tokens[:3]


def test_min_p_one_keeps_only_the_most_likely_token(tiny):
    ps = prompts(3, 5, 5, 30)
    with gyges.Engine(tiny, memory="64MiB") as e:
        greedy = e.generate(ps, gyges.SamplingParams(max_tokens=6, ignore_eos=True))
        hot = e.generate(ps, gyges.SamplingParams(max_tokens=6, ignore_eos=True, temperature=5.0,
                                                  min_p=1.0))
    assert [r.output_tokens for r in hot] == [r.output_tokens for r in greedy]


def test_greedy_with_penalties_follows_the_reference_model(tiny):
    """The engine's penalties on its own logits give the tokens the reference model gives with
    the reference penalties, wherever the reference's top two are not a near tie."""
    ref = ReferenceModel(tiny.config, tiny.tensors)
    p = prompts(1, 6, 12, 13)[0]
    params = gyges.SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                                  frequency_penalty=1.5, presence_penalty=0.5)
    with gyges.Engine(tiny, memory="64MiB") as e:
        got = e.generate([p], params)[0].output_tokens
    with gyges.Engine(tiny, memory="64MiB") as e:
        e_plain = e.generate([p], dataclasses.replace(params, repetition_penalty=1.0,
                                                      frequency_penalty=0.0,
                                                      presence_penalty=0.0))[0].output_tokens
    assert got != e_plain  # the penalties changed something
    cache = ref.new_cache()
    logits = ref.forward(p, np.arange(len(p)), cache)[-1]
    seq = list(p)
    for i in range(12):
        y = ref_process(logits.astype(np.float32), seq, len(p), 1.8, 1.5, 0.5).astype(np.float64)
        top2 = np.sort(y)[-2:]
        if (top2[1] - top2[0]) < 1e-3 * abs(top2[1]):
            break  # fp32 may pick either
        assert got[i] == int(np.argmax(y)), f"token {i}"
        seq.append(got[i])
        logits = ref.forward([got[i]], [len(seq) - 1], cache)[-1]


# ---- logprobs ----

def log_softmax(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_c_logprobs_of_a_row_match_numpy():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(301) * 4).astype(np.float32)
    x[7] = x[9]  # a tie
    lp = log_softmax(x.astype(np.float64))
    for token in (0, 7, 9, int(np.argmax(x)), 300):
        got, rank, top = _C_test.logits_logprobs(x, token, 20)
        assert abs(got - lp[token]) < 1e-12
        assert rank == 1 + int((x > x[token]).sum())
        order = sorted(range(301), key=lambda i: (-x[i], i))[:20]
        assert [t for t, _ in top] == order
        np.testing.assert_allclose([v for _, v in top], lp[order], atol=1e-12)


@pytest.mark.parametrize("chunk", [0, 5])
def test_output_and_prompt_logprobs_match_the_reference_model(tiny, chunk):
    ref = ReferenceModel(tiny.config, tiny.tensors)
    ps = prompts(2, 7, 17, 23)
    params = gyges.SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                                  logprobs=5, prompt_logprobs=4, repetition_penalty=1.2)
    with gyges.Engine(tiny, memory="64MiB", max_prefill_chunk=chunk) as e:
        rs = e.generate(ps, params)
    for p, r in zip(ps, rs):
        out = r.output_tokens
        want = log_softmax(ref.prefill_logits(p + out[:-1]))  # [P + G - 1, vocab]
        tol = 2e-4 * np.abs(ref.prefill_logits(p)).max()
        assert len(r.logprobs) == len(out) and len(r.prompt_logprobs) == len(p)
        assert r.prompt_logprobs[0] is None
        rows = [(r.prompt_logprobs[i], p[i], want[i - 1], 4) for i in range(1, len(p))]
        rows += [(r.logprobs[i], out[i], want[len(p) - 1 + i], 5) for i in range(len(out))]
        for scored, token, lp, k in rows:
            assert next(iter(scored)) == token  # the scored token leads, as in vLLM
            assert len(scored) in (k, k + 1)
            assert all(abs(v.logprob - lp[t]) < tol for t, v in scored.items())
            ranks = 1 + (lp > lp[token] + tol).sum(), 1 + (lp > lp[token] - tol).sum()
            assert ranks[0] <= scored[token].rank <= ranks[1]
            kth = np.sort(lp)[-k]
            assert all(lp[t] >= kth - tol for t in list(scored)[1:])  # the top k, up to ties
            assert scored[token].decoded_token is None  # Model.tiny() has no tokenizer
        assert r.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in
                                                         zip(r.logprobs, out)), rel=1e-12)


def test_prompt_logprobs_do_not_depend_on_chunking_or_batch(tiny):
    ps = prompts(3, 8, 20, 40)
    params = gyges.SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=1, ignore_eos=True)
    runs = []
    for chunk, batch in ((0, 512), (7, 512), (3, 16)):
        with gyges.Engine(tiny, memory="64MiB", max_prefill_chunk=chunk,
                          max_batch_tokens=batch) as e:
            runs.append([(r.output_tokens, r.prompt_logprobs, r.logprobs, r.cumulative_logprob)
                         for r in e.generate(ps, params)])
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_logprobs_are_none_unless_asked_and_cumulative_is_always_kept(tiny):
    with gyges.Engine(tiny, memory="64MiB") as e:
        r = e.generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=4, ignore_eos=True))[0]
        z = e.generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=4, ignore_eos=True,
                                                         logprobs=0, prompt_logprobs=0))[0]
    assert r.logprobs is None and r.prompt_logprobs is None
    assert r.cumulative_logprob < 0 and r.cumulative_logprob == z.cumulative_logprob
    assert [list(d) for d in z.logprobs] == [[t] for t in z.output_tokens]
    assert [None if d is None else list(d) for d in z.prompt_logprobs] == [None, [2], [3]]
    assert isinstance(z.logprobs[0][z.output_tokens[0]], gyges.Logprob)


# ---- determinism across moves ----

def snapshot(reqs):
    return [(r.output_tokens, r.logprobs, r.prompt_logprobs, r.cumulative_logprob)
            for r in reqs]


def test_tokens_and_logprobs_are_bit_identical_across_a_live_transform(tiny):
    """Down from TP2 to two TP1 instances and back up, live a layer at a time (the way down
    computes the logits in the transformation's groups, stage.c), penalties on."""
    ps = prompts(4, 9, 10, 40)
    params = gyges.SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, ignore_eos=True,
                                  repetition_penalty=1.3, frequency_penalty=0.4,
                                  presence_penalty=0.3, min_tokens=2, logprobs=3,
                                  prompt_logprobs=2)

    def host(layout="TP2"):
        return gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout=layout,
                          max_batch_tokens=64, max_prefill_chunk=16, seed=21)
    with host() as h:
        want = snapshot(h.generate(ps, params))
    with host() as h:
        reqs = [h.submit(p, params) for p in ps]
        for tp in (1, 2):
            for _ in range(2):
                h.step()
            t = h.transform((0, 1), tp, layers_per_step=1)
            while not t.done:
                h.step()
        assert not all(r.finished for r in reqs)
        h.run()
        assert snapshot(reqs) == want
    # and out of one host into another with its KV (a Cluster's migration)
    with host("2xTP1") as a, host("2xTP1") as b:
        reqs = [a.submit(p, params) for p in ps]
        for _ in range(4):
            a.step()
        moved = b.import_request(a.export_request(reqs[1]))
        a.run()
        b.run()
        reqs[1] = moved
        assert snapshot(reqs) == want


# ---- seeds ----

def test_the_engine_seed_repeats_runs_and_makes_copies_differ(tiny):
    p = prompts(1, 10, 6, 7)[0]
    hot = gyges.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)

    def run(seed, params=hot, n=3):
        with gyges.Engine(tiny, memory="64MiB", seed=seed) as e:
            return [r.output_tokens for r in e.generate([p] * n, params)]
    a, b = run(0), run(0)
    assert a == b  # same submission order, same tokens
    assert len({tuple(t) for t in a}) == 3  # copies differ
    assert run(1) != a
    pinned = dataclasses.replace(hot, seed=1234)
    assert run(0, pinned) == run(7, pinned) and len({tuple(t) for t in run(0, pinned)}) == 1


def test_sample_params_fan_out_with_distinct_seeds(tiny):
    sp = gyges.SamplingParams(n=2, best_of=3, seed=9, temperature=1.0).sample_params()
    assert [(q.n, q.best_of) for q in sp] == [(1, None)] * 3
    assert len({q.seed for q in sp}) == 3 and sp[0].seed == mix_seed(9, 0)
    assert [q.seed for q in gyges.SamplingParams(n=3).sample_params()] == [None] * 3
    assert gyges.SamplingParams(seed=4).sample_params()[0].seed == 4
    with gyges.Engine(tiny, memory="64MiB") as e:
        with pytest.raises(gyges.Error, match="sample_params"):
            e.submit([1, 2], gyges.SamplingParams(n=2))
        with pytest.raises(gyges.Error, match="sample_params"):
            e.submit([1, 2], gyges.SamplingParams(best_of=2))
        with gyges.Host(tiny, workers=1, memory_per_worker="32MiB") as h:
            with pytest.raises(gyges.Error, match="sample_params"):
                h.submit([1, 2], gyges.SamplingParams(n=2, best_of=4))
            assert not h.has_unfinished()
        rs = [e.submit([1, 2, 3], q) for q in gyges.SamplingParams(
            n=2, max_tokens=6, temperature=1.0, ignore_eos=True).sample_params()]
        e.run()
    assert rs[0].output_tokens != rs[1].output_tokens


def test_max_tokens_none_runs_to_the_context(tiny):
    with gyges.Engine(tiny, memory="64MiB", max_pos=40) as e:
        r = e.generate([[1, 2, 3, 4, 5]], gyges.SamplingParams(max_tokens=None, ignore_eos=True))[0]
        assert r.params.max_tokens == 35 and len(r.output_tokens) == 35
        with pytest.raises(gyges.Error, match="max_tokens"):
            e.submit(list(range(1, 41)), gyges.SamplingParams(max_tokens=None))
        with pytest.raises(gyges.Error, match="min_tokens"):
            e.submit(list(range(1, 31)), gyges.SamplingParams(max_tokens=None, min_tokens=20))


# ---- refusals ----

@pytest.mark.parametrize("field, value", [
    ("n", 0), ("best_of", 0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("min_p", 1.5), ("min_p", -0.1),
    ("min_tokens", -1), ("min_tokens", 17), ("logprobs", 21), ("logprobs", -1),
    ("prompt_logprobs", 21), ("top_k", -2), ("max_tokens", 0), ("seed", -1), ("seed", 2**64),
    ("include_stop_str_in_output", "yes"), ("skip_special_tokens", 1), ("temperature", -1.0),
])
def test_every_bad_value_is_refused_by_name(field, value):
    with pytest.raises(gyges.Error, match=field):
        gyges.SamplingParams(**{field: value})


def test_best_of_below_n_and_bad_engine_seeds_are_refused(tiny):
    with pytest.raises(gyges.Error, match="best_of"):
        gyges.SamplingParams(n=3, best_of=2)
    with pytest.raises(gyges.Error, match="seed"):
        gyges.Engine(tiny, memory="64MiB", seed=-1)
    assert gyges.SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"


# ---- text: stop strings kept, special tokens, decoded tokens ----

class FakeTokenizer:
    """Token i is the text WORDS[i]; token 0 is special (left out unless asked)."""
    WORDS = ["<eos>", "a", "b", "STOP", "c"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.WORDS[i] for i in ids if i or not skip_special_tokens)

    def detokenizer(self, prompt_ids=(), skip_special_tokens=True):
        tok = self

        class Piecewise:
            def add(self, token):
                return tok.decode([token], skip_special_tokens)
        return Piecewise()


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_stop_strings_special_tokens_and_decoded_tokens(keep, skip):
    from gyges.runtime.engine import new_request
    params = gyges.SamplingParams(stop=["STOP"], include_stop_str_in_output=keep,
                                  skip_special_tokens=skip, logprobs=1, seed=0)
    r = new_request(0, [1, 2], params, 0.0, FakeTokenizer())
    ended = [r._append(t, 0.0, (-1.0, 1, ((t, -1.0),))) for t in (1, 0, 3)]
    assert ended == [False, False, True]  # the loop then ends the request (reason "stop")
    assert r.text == ("a" if skip else "a<eos>") + ("STOP" if keep else "")
    assert r.stop_reason == "STOP"
    assert r.logprobs[1][0].decoded_token == "<eos>"  # a token's own text, special or not
    assert r.cumulative_logprob == -3.0
