"""The sampler (csrc/sched/sampler.h) against a NumPy reference written here: greedy is argmax
with ties to the lowest index; top-k and top-p keep exactly the reference's sets with the
reference's probabilities; empirical frequencies over many seeds match the distribution; a token
depends only on (seed, token index) and the logits, never on the batch; bad input is refused.

Tolerances: token ids and kept sets are exact. Probabilities are compared at rtol 1e-12 (both
sides compute exp in float64; libm and NumPy may differ by an ulp or two). A top-p set whose
cumulative sum lies within 1e-9 of the threshold could legitimately differ by that ulp, so such
draws are redrawn (and counted, to show they are rare)."""
import numpy as np
import pytest

from gyges import _C, _C_test


def ref_probs(x, temperature, top_k, top_p, min_p=0.0):
    """float64 reference: temperature, then min-p, then top-k, then top-p (vLLM's order)."""
    x = np.asarray(x, np.float32).astype(np.float64)
    V = x.size
    if temperature == 0:
        out = np.zeros(V)
        out[np.argmax(x)] = 1.0  # np.argmax returns the first maximum
        return out, False
    w = np.exp((x - x[np.isfinite(x)].max()) / temperature)
    w[w < min_p] = 0.0  # below min_p times the largest probability (whose w is 1)
    order = np.lexsort((np.arange(V), -x))  # logit descending, then index ascending
    if 0 < top_k < V:
        order = order[:top_k]
    near = False
    if top_p < 1:
        c = np.cumsum(w[order])
        target = top_p * c[-1]
        near = bool(np.any(np.abs(c - target) <= 1e-9 * c[-1]))
        order = order[:int(np.argmax(c >= target)) + 1]
    kept = np.zeros(V, bool)
    kept[order] = True
    w = np.where(kept, w, 0.0)
    return w / w.sum(), near


def c_probs(x, temperature, top_k, top_p, min_p=0.0):
    out = np.empty(len(x))
    _C_test.sampler_probs(np.ascontiguousarray(x, np.float32), temperature, top_k, top_p, out,
                          min_p)
    return out


def random_row(rng, V, ties):
    x = rng.normal(0, 3, V).astype(np.float32)
    if ties:
        x = np.round(x).astype(np.float32)  # many equal logits
    if rng.random() < 0.3:
        x[rng.integers(0, V, max(1, V // 10))] = -np.inf
    return x


def test_greedy_is_argmax_with_ties_to_lowest_index():
    rng = np.random.default_rng(0)
    for V in (1, 2, 7, 1001):
        n = 40
        x = np.stack([random_row(rng, V, ties=bool(i % 2)) for i in range(n)])
        x[:, 0] = np.where(np.isinf(x).all(axis=1), 0.0, x[:, 0])
        params = [(0.0, int(rng.integers(0, V + 1)), 0.5, i, i) for i in range(n)]
        tokens = _C_test.sample(x, n, V, params)
        assert tokens == [int(np.argmax(row)) for row in x]
        for row in x[:5]:
            assert np.array_equal(c_probs(row, 0.0, 0, 1.0), ref_probs(row, 0.0, 0, 1.0)[0])


@pytest.mark.parametrize("V", [1, 3, 17, 256, 5003])
def test_top_k_top_p_keep_exactly_the_reference_sets(V):
    rng = np.random.default_rng(V)
    checked = near = 0
    while checked < 150:
        x = random_row(rng, V, ties=rng.random() < 0.5)
        if np.isinf(x).all():
            continue
        T = float(rng.choice([0.3, 0.7, 1.0, 2.5]))
        k = min(V, int(rng.choice([0, 1, 2, V // 2, V, rng.integers(0, V + 1)])))
        p = float(rng.choice([1.0, 0.9, 0.5, 0.05, rng.random()]))
        if p == 0:
            continue
        ref, ambiguous = ref_probs(x, T, k, p)
        if ambiguous:
            near += 1
            continue
        got = c_probs(x, T, k, p)
        assert np.array_equal(got > 0, ref > 0), (T, k, p)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0)
        checked += 1
    assert near < 15


def test_top_k_top_p_by_hand():
    x = np.array([1, 3, 3, 2, 0], np.float32)
    assert np.flatnonzero(c_probs(x, 1.0, 2, 1.0)).tolist() == [1, 2]
    assert np.flatnonzero(c_probs(x, 1.0, 1, 1.0)).tolist() == [1]  # tie: lower index
    assert np.flatnonzero(c_probs(x, 1.0, 3, 1.0)).tolist() == [1, 2, 3]
    y = np.log(np.array([0.1, 0.5, 0.15, 0.25], np.float32))
    assert np.flatnonzero(c_probs(y, 1.0, 0, 0.45)).tolist() == [1]
    assert np.flatnonzero(c_probs(y, 1.0, 0, 0.7)).tolist() == [1, 3]
    assert np.flatnonzero(c_probs(y, 1.0, 0, 0.8)).tolist() == [1, 2, 3]
    assert np.flatnonzero(c_probs(y, 1.0, 2, 0.6)).tolist() == [1]  # 0.5/0.75 = 0.67 >= 0.6
    # exact ties and an exactly reached threshold: 4 weights of 1, p*Z = 2 is reached by 2 tokens
    z = np.zeros(4, np.float32)
    assert np.flatnonzero(c_probs(z, 1.0, 0, 0.5)).tolist() == [0, 1]
    assert np.flatnonzero(c_probs(z, 1.0, 0, 0.75)).tolist() == [0, 1, 2]
    assert np.flatnonzero(c_probs(z, 1.0, 3, 1.0)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("V", [1, 17, 5003])
def test_min_p_keeps_exactly_the_reference_sets(V):
    """min-p before top-k and top-p: the kept set and the probabilities of the reference."""
    rng = np.random.default_rng(50 + V)
    checked = 0
    while checked < 100:
        x = random_row(rng, V, ties=rng.random() < 0.5)
        if np.isinf(x).all():
            continue
        T = float(rng.choice([0.3, 1.0, 2.5]))
        k = min(V, int(rng.choice([0, 1, V // 2, rng.integers(0, V + 1)])))
        p = float(rng.choice([1.0, 0.9, 0.5]))
        m = float(rng.choice([0.0, 0.01, 0.1, 0.5, 1.0, rng.random()]))
        ref, ambiguous = ref_probs(x, T, k, p, m)
        w = np.exp((x.astype(np.float64) - x[np.isfinite(x)].max()) / T)
        if ambiguous or np.any(np.abs(w - m) <= 1e-12 * max(m, 1e-300)):
            continue  # an exp within an ulp of the threshold may go either way
        got = c_probs(x, T, k, p, m)
        assert np.array_equal(got > 0, ref > 0), (T, k, p, m)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0)
        checked += 1


def test_min_p_by_hand():
    y = np.log(np.array([0.1, 0.5, 0.15, 0.25], np.float32))  # relative to the max: .2 1 .3 .5
    assert np.flatnonzero(c_probs(y, 1.0, 0, 1.0, 0.25)).tolist() == [1, 2, 3]
    assert np.flatnonzero(c_probs(y, 1.0, 0, 1.0, 0.4)).tolist() == [1, 3]
    assert np.flatnonzero(c_probs(y, 1.0, 0, 1.0, 1.0)).tolist() == [1]
    assert np.flatnonzero(c_probs(y, 1.0, 0, 1.0, 0.0)).tolist() == [0, 1, 2, 3]
    # top-p then works on what min-p left: 0.5 / (0.5 + 0.25) = 0.67 >= 0.6
    assert np.flatnonzero(c_probs(y, 1.0, 0, 0.6, 0.4)).tolist() == [1]
    tokens = _C_test.sample(np.tile(y, (50, 1)), 50, 4,
                            [(1.0, 0, 1.0, s, 0, 0.4) for s in range(50)])
    assert set(tokens) == {1, 3}


def chi2(counts, probs):
    n = counts.sum()
    m = probs > 0
    assert counts[~m].sum() == 0, "sampled a token outside the kept set"
    expected = n * probs[m]
    return float(((counts[m] - expected) ** 2 / expected).sum()), int(m.sum()) - 1


# 99.99% quantiles of chi-square by degrees of freedom: deterministic seeds, so a pass is stable.
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88, 8: 31.83,
             9: 33.72}


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.6, 0, 1.0), (1.0, 4, 1.0),
                                   (1.0, 0, 0.8), (0.8, 6, 0.9)])
def test_frequencies_match_the_distribution(T, k, p):
    V, n = 10, 20000
    x = np.array([0.3, -1.0, 2.0, 0.0, 1.1, -0.4, 0.9, 1.7, -2.2, 0.5], np.float32)
    ref, _ = ref_probs(x, T, k, p)
    if k == 0 and p == 1.0:  # the plain case against softmax itself
        e = np.exp(x.astype(np.float64) / T)
        np.testing.assert_allclose(ref, e / e.sum(), rtol=1e-12)
    logits = np.tile(x, (n, 1))
    # over seeds at one token index, and over token indices of one seed
    for params in ([(T, k, p, seed, 3) for seed in range(n)],
                   [(T, k, p, 12345, i) for i in range(n)]):
        tokens = np.array(_C_test.sample(logits, n, V, params))
        stat, df = chi2(np.bincount(tokens, minlength=V), ref)
        assert stat < CHI2_9999[df], (stat, df)


def test_draw_is_the_inverse_cdf_of_the_counter_uniform():
    rng = np.random.default_rng(5)
    V, n = 50, 300
    x = np.stack([random_row(rng, V, ties=False) for _ in range(n)])
    x[:, 0] = 1.0
    params = [(0.9, 20, 0.95, int(rng.integers(0, 2**63)), int(rng.integers(0, 2**40)))
              for _ in range(n)]
    tokens = _C_test.sample(x, n, V, params)
    for row, prm, tok in zip(x, params, tokens):
        probs = c_probs(row, prm[0], prm[1], prm[2])
        u = _C_test.rng_uniform(prm[3], prm[4])
        assert 0.0 <= u < 1.0
        assert tok == int(np.argmax(np.cumsum(probs) > u * probs.sum()))


def test_same_seed_and_index_same_token_in_any_batch():
    rng = np.random.default_rng(9)
    V, n = 97, 64
    x = np.stack([random_row(rng, V, ties=i % 3 == 0) for i in range(n)])
    x[:, 1] = 0.5
    params = [(float(rng.choice([0.5, 1.0, 2.0])), int(rng.choice([0, 5, 50])),
               float(rng.choice([1.0, 0.9, 0.3])), int(rng.integers(0, 2**64, dtype=np.uint64)),
               int(rng.integers(0, 1000))) for _ in range(n)]
    tokens = _C_test.sample(x, n, V, params)
    perm = rng.permutation(n)
    shuffled = _C_test.sample(np.ascontiguousarray(x[perm]), n, V, [params[i] for i in perm])
    assert shuffled == [tokens[i] for i in perm]
    for i in range(0, n, 7):
        assert _C_test.sample(x[i], 1, V, [params[i]]) == [tokens[i]]
    # a different seed or token index changes some tokens
    other = _C_test.sample(x, n, V, [(t, k, p, s + 1, i) for t, k, p, s, i in params])
    assert other != tokens


def test_extreme_temperatures():
    x = np.array([0.0, 3.0, 1.0, 2.9], np.float32)
    assert np.flatnonzero(c_probs(x, 1e-30, 0, 1.0)).tolist() == [1]  # no NaN from overflow
    flat = c_probs(x, 1e30, 0, 1.0)
    np.testing.assert_allclose(flat, 0.25, rtol=1e-12)


def test_bad_parameters_raise_value_errors():
    x = np.zeros((2, 4), np.float32)
    ok = (1.0, 0, 1.0, 0, 0)
    bad = [((-0.5, 0, 1.0, 0, 0), "temperature"), ((float("nan"), 0, 1.0, 0, 0), "temperature"),
           ((float("inf"), 0, 1.0, 0, 0), "temperature"), ((1.0, -1, 1.0, 0, 0), "top_k"),
           ((1.0, 5, 1.0, 0, 0), "top_k"), ((1.0, 0, 0.0, 0, 0), "top_p"),
           ((1.0, 0, 1.01, 0, 0), "top_p"), ((1.0, 0, float("nan"), 0, 0), "top_p"),
           ((1.0, 0, -0.2, 0, 0), "top_p"), ((1.0, 0, 1.0, 0, 0, -0.1), "min_p"),
           ((1.0, 0, 1.0, 0, 0, 1.5), "min_p"), ((1.0, 0, 1.0, 0, 0, float("nan")), "min_p")]
    for params, word in bad:
        with pytest.raises(_C.InvalidArgumentError, match=f"row 1: {word}"):
            _C_test.sample(x, 2, 4, [ok, params])
        with pytest.raises(ValueError, match=word):
            c_probs(x[0], params[0], params[1], params[2], *params[5:])
    for value, word in [(np.nan, "NaN"), (np.inf, r"\+inf")]:
        y = x.copy()
        y[1, 2] = value
        with pytest.raises(ValueError, match=f"row 1: logit 2 is {word}"):
            _C_test.sample(y, 2, 4, [ok, ok])
    with pytest.raises(ValueError, match="-inf"):
        _C_test.sample(np.full((1, 4), -np.inf, np.float32), 1, 4, [ok])
    with pytest.raises(ValueError, match="float32"):
        _C_test.sample(x.astype(np.float64), 2, 4, [ok, ok])
    with pytest.raises(ValueError, match="values, expected"):
        _C_test.sample(x, 2, 5, [ok, ok])
    with pytest.raises(ValueError, match="rows"):
        _C_test.sample(x, 2, 4, [ok])
    with pytest.raises(TypeError):
        _C_test.sample(x, 2, 4, [ok, (1.0, 0)])
    assert _C_test.sample(np.zeros((0, 4), np.float32), 0, 4, []) == []
