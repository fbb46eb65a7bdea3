"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) and Qwen3's q/k norms in the CPU
engine, against the float64 reference (tests/reference_model.py), from random checkpoints these
tests write. Tolerance policy as test_engine.py's: logits within 1e-4 of the largest reference
logit (fp32 accumulation); tokens, and the bit-exactness promised across KV layouts, batch
compositions and TP degrees, compared exactly."""
import dataclasses

import numpy as np
import pytest
from gguf_writer import write_gguf
from reference_model import ReferenceModel
from worker_logits import paged_logits

import gyges
from gyges import testing
from gyges.models.config import ConfigError, ModelConfig
from gyges.runtime.worker import Worker

RTOL = 1e-4
VOCAB = 256
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             max_position_embeddings=512, bos_token_id=None, eos_token_id=None)
# Odd expert counts and widths; Qwen2-MoE with a dense layer (mlp_only_layers) among sparse ones.
CONFIGS = {
    "mixtral": ModelConfig(**_BASE, model_type="mixtral", num_experts=5, num_experts_per_tok=2,
                           moe_intermediate_size=96, norm_topk_prob=True),
    "qwen2_moe": ModelConfig(**_BASE, model_type="qwen2_moe", attention_bias=True, num_experts=6,
                             num_experts_per_tok=3, moe_intermediate_size=32,
                             shared_expert_intermediate_size=80, mlp_only_layers=(1,)),
    "qwen3_moe": ModelConfig(**_BASE, model_type="qwen3_moe", num_experts=7,
                             num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    "qwen3": ModelConfig(**_BASE, model_type="qwen3"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(family, dtype): the model loaded back from a random checkpoint saved in that dtype}."""
    out = {}
    for family, config in CONFIGS.items():
        model = gyges.Model.random(config, seed=11)
        for dtype in ("f32", "bf16"):
            path = tmp_path_factory.mktemp(f"{family}-{dtype}")
            model.save(path, dtype=dtype)
            out[(family, dtype)] = gyges.Model.load(path, dtype=dtype)
    return out


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_hf_config_keys_of_each_family():
    common = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)
    mixtral = ModelConfig.from_dict(dict(common, model_type="mixtral", num_local_experts=4,
                                         num_experts_per_tok=2))
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (4, 24, True)
    qwen2 = ModelConfig.from_dict(dict(common, model_type="qwen2_moe", num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=8,
                                       shared_expert_intermediate_size=16, decoder_sparse_step=2))
    assert qwen2.attention_bias and not qwen2.norm_topk_prob
    assert [qwen2.is_sparse_layer(i) for i in range(2)] == [False, True]
    qwen3 = ModelConfig.from_dict(dict(common, model_type="qwen3_moe", num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=8,
                                       norm_topk_prob=True, mlp_only_layers=[0]))
    assert qwen3.qk_norm and qwen3.mlp_only_layers == (0,) and qwen3.is_sparse_layer(1)
    for config in (mixtral, qwen2, qwen3, *CONFIGS.values()):
        assert ModelConfig.from_dict(config.to_dict()) == config
    for bad, match in ((dict(num_experts_per_tok=5), "num_experts_per_tok"),
                       (dict(num_experts=0), "num_experts"),
                       (dict(moe_intermediate_size=0), "moe_intermediate_size"),
                       (dict(mlp_only_layers=[2]), "mlp_only_layers")):
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_dict({**common, "model_type": "qwen3_moe", "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 8, **bad})


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_tokens_and_logits_equal_the_reference(checkpoints, family, dtype):
    model = checkpoints[(family, dtype)]
    ref = ReferenceModel(model.config, model.tensors)  # the checkpoint's values, as loaded
    ps = prompts(3, seed=2)
    outs = gyges.Engine(model, memory="64MiB").generate(
        ps, gyges.SamplingParams(max_tokens=12, ignore_eos=True))
    for p, out in zip(ps, outs):
        assert out.output_tokens == ref.generate_greedy(p, 12)
    # Logits of a prefill then decode steps, in every KV layout: the same bits in each.
    tokens = prompts(1, seed=3, lo=30, hi=31)[0]
    want = ref.prefill_logits(tokens)
    results = []
    for layout in ("raw", "page", "header"):
        worker = Worker(model, memory="64MiB", page_size="64KiB", kv_layout=layout, block_size=8)
        results.append(paged_logits(worker, tokens, [20, 7, 1, 1, 1]))
        err = np.abs(results[-1] - want).max() / np.abs(want).max()
        assert err < RTOL, f"{layout}: largest relative error {err:.2e}"
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_token_s_bits_do_not_depend_on_its_batch(checkpoints, family):
    """The same sequence alone and beside three others (which route their tokens to other
    experts and change every expert's group of rows) gives the same logits to the bit."""
    model = checkpoints[(family, "f32")]
    worker = Worker(model, memory="64MiB", page_size="64KiB")
    seqs = prompts(4, seed=4, lo=9, hi=30)
    alone = paged_logits(worker, seqs[0], [len(seqs[0])])
    worker.kv.grow(max(worker.kv_pages_free() // 2, 1))
    ids = [worker.kv.new_sequence() for _ in seqs]
    for seq, tokens in zip(ids, seqs):
        worker.kv.reserve(seq, len(tokens))
    order = [2, 0, 3, 1]  # sequence 0 in the middle of the batch
    tokens = [t for i in order for t in seqs[i]]
    token_seq = [i for i in order for _ in seqs[i]]
    pos = [p for i in order for p in range(len(seqs[i]))]
    first = sum(len(seqs[i]) for i in order[:order.index(0)])
    batched = worker.forward(tokens, token_seq, pos, [worker.kv.block_table(s) for s in ids],
                             range(first, first + len(seqs[0])))
    np.testing.assert_array_equal(batched, alone)
    params = gyges.SamplingParams(max_tokens=10, ignore_eos=True)
    ps = prompts(8, seed=5)
    one = gyges.Engine(model, memory="64MiB").generate([ps[3]], params)[0].output_tokens
    many = gyges.Engine(model, memory="64MiB", max_batch_tokens=96).generate(ps, params)
    assert many[3].output_tokens == one


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_tp2_gives_tp1_s_tokens_and_logprobs_to_the_bit(checkpoints, family):
    model = checkpoints[(family, "bf16")]
    params = gyges.SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=3,
                                  ignore_eos=True)
    ps = prompts(4, seed=6)
    got = {}
    for layout in ("2xTP1", "TP2"):
        host = gyges.Host(model, workers=2, memory_per_worker="32MiB", layout=layout)
        assert host.layout() == layout
        got[layout] = [(r.output_tokens, r.logprobs) for r in host.generate(ps, params)]
        host.close()
    assert all(len(logprobs) == 10 for _, logprobs in got["TP2"])
    assert got["TP2"] == got["2xTP1"]


def test_each_expert_s_pages_are_its_own_and_tp_halves_them(checkpoints):
    model = checkpoints[("qwen2_moe", "f32")]
    config = model.config
    worker = Worker(model, memory="64MiB", page_size="64KiB", max_tp=2)
    w = worker.weights
    runs = [w.expert_slots(0, e) for e in range(config.num_experts)]
    for a, b in zip(runs, runs[1:]):
        assert a.stop <= b.start  # disjoint runs, in expert order
    assert w.kinds(0)[:3] == ["e0.gate", "e0.up", "e0.down"] and w.kinds(0)[-1] == "shared.down"
    assert w.kinds(1) == ["gate", "up", "down"]  # the dense layer of mlp_only_layers
    expert = sum(len(w.shard_slots_of(0, k, s)) for k in w.kinds(0)[:3] for s in range(2))
    assert expert == len(runs[0])  # the expert is exactly its padded shards
    # The down projection of expert 4, read back from its shards, is the checkpoint's.
    np.testing.assert_array_equal(
        w.read_ffn(0, "e4.down"), model.tensors["model.layers.0.mlp.experts.4.down_proj.weight"].T)
    before = worker.arena.stats()["bytes_in_use"]
    worker.join_tp(2, 1)
    freed = before - worker.arena.stats()["bytes_in_use"]
    assert freed == w.ffn_slots(1) * w.page_size  # one of two shards of every FFN matrix
    assert w.shard_offset(0, "e4.gate", 1) // w.page_size in w.expert_slots(0, 4)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3"])
def test_gguf_files_of_each_family_load_as_the_checkpoint(tmp_path, family):
    """A GGUF holds what the HF checkpoint holds (stacked experts cut per expert, Mixtral's q/k
    rows put back in rotate-half order, Qwen2-MoE's 1-D shared gate): the same config, the same
    tensors to the bit."""
    config = CONFIGS[family].replace(mlp_only_layers=(), max_position_embeddings=512)
    model = gyges.Model.random(config, seed=12)
    loaded = gyges.Model.load(write_gguf(tmp_path / "m.gguf", model))
    assert loaded.config == config
    assert list(loaded.tensors) == list(model.tensors)
    for name, t in model.tensors.items():
        np.testing.assert_array_equal(loaded.tensors[name], t, err_msg=name)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_expert_parallelism_gives_tp1_s_tokens_and_logprobs_to_the_bit(checkpoints, family):
    """EP2: each worker of a TP2 group holds its block of experts whole (Mixtral's 5 split 2 and
    3), attention and the shared expert TP-sharded; the experts' outputs go through the
    all-reduce and are combined in TP1's order."""
    model = checkpoints[(family, "f32")]
    params = gyges.SamplingParams(max_tokens=10, temperature=0.8, seed=4, logprobs=3,
                                  ignore_eos=True)
    ps = prompts(4, seed=7)
    tp1 = gyges.Host(model, workers=2, memory_per_worker="32MiB", layout="2xTP1")
    want = [(r.output_tokens, r.logprobs) for r in tp1.generate(ps, params)]
    host = gyges.Host(model, workers=2, memory_per_worker="32MiB", layout="TP2",
                      expert_parallel=True)
    n = model.config.num_experts
    for rank in range(2):
        worker = host.worker(rank)
        assert worker.weights.held_experts == set(range(rank * n // 2, (rank + 1) * n // 2))
        # half the memory of TP1's experts, give or take the uneven split
        assert worker.arena.stats()["bytes_in_use"] < tp1.worker(rank).arena.stats()["bytes_in_use"]
    assert [(r.output_tokens, r.logprobs) for r in host.generate(ps, params)] == want
    with pytest.raises(gyges.InvalidArgumentError, match="moves no experts"):
        host.buddy([0])   # only the TP transformations move experts
    tp1.close()
    host.close()
    with pytest.raises(gyges.InvalidArgumentError, match="mixture-of-experts model"):
        Worker(checkpoints[("qwen3", "f32")], memory="64MiB", expert_parallel=True)


def test_unpadded_experts_give_the_padded_bits_at_tp1_and_tp2(checkpoints):
    """pad_ffn=False packs each expert's shards together (the reference layout of Gyges 4.2,
    whose TP2 keeps a rank's shards by a partial swap of every matrix, experts' included): the
    same logits at TP1, and TP1's tokens at TP2."""
    model = checkpoints[("qwen2_moe", "f32")]
    tokens = prompts(1, seed=8, lo=25, hi=26)[0]
    padded = paged_logits(Worker(model, memory="64MiB", pad_ffn=True), tokens, [25])
    packed = paged_logits(Worker(model, memory="64MiB", pad_ffn=False), tokens, [25])
    np.testing.assert_array_equal(padded, packed)
    params = gyges.SamplingParams(max_tokens=8, ignore_eos=True)
    ps = prompts(3, seed=9)
    got = []
    for layout, pad in (("2xTP1", True), ("TP2", True), ("TP2", False)):
        # 4 shards on small pages: a TP2 rank keeps two, which the partial swap packs together
        # before it releases the pages past them
        host = gyges.Host(model, workers=2, memory_per_worker="32MiB", layout=layout,
                          pad_ffn=pad, max_tp=4, page_size="4KiB")
        got.append([r.output_tokens for r in host.generate(ps, params)])
        host.close()
    assert got[1] == got[0] and got[2] == got[0]


# ---- live expert-parallel transformation (AMOEBAs: 4x(TP1EP1) -> TP4EP4 and back) ----

def four_way(family):
    """A random model of `family` with 4 KV heads (so TP4 divides them)."""
    return gyges.Model.random(dataclasses.replace(CONFIGS[family], num_key_value_heads=4),
                              seed=11)


def weight_bytes(host):
    return [host.worker(w).arena.stats()["bytes_by_tag"]["weights"] for w in range(4)]


@pytest.mark.parametrize("family, dtype, params, split_to, layers_per_step", [
    ("mixtral", "f32", dict(temperature=0.0), 1, 1),
    ("qwen2_moe", "bf16", dict(temperature=0.8, top_p=0.9, seed=3, logprobs=2), 2, 1),
    ("qwen3_moe", "f32", dict(temperature=0.7, seed=5), 1, 1),
    ("qwen2_moe", "f32", dict(temperature=0.0), 2, None)])   # at once, between two steps
def test_a_live_expert_parallel_merge_and_split_keep_every_token(family, dtype, params, split_to,
                                                                 layers_per_step):
    """4x(TP1EP1) -> TP4EP4 -> 4x(TP1EP1) (or 2x(TP2EP2)), layer-staggered or at once, while
    eight requests decode: each worker of the merge keeps its block of experts whole and its
    dense shards, dropping the rest (no weight byte copied; its weights are then a TP4EP4
    host's to the byte), and the split gets the experts of its new rank back from the ranks that
    hold them (and, to TP2, gives back those it no longer owns). Every request's tokens (and
    logprobs) equal a 4xTP1 host's that never transformed, and each worker ends holding what a
    fresh host's does."""
    model = four_way(family)
    params = gyges.SamplingParams(max_tokens=20, ignore_eos=True, **params)
    ps = prompts(8, seed=3)
    kw = dict(workers=4, memory_per_worker="32MiB", weight_dtype=dtype)
    with gyges.Host(model, layout="4xTP1", **kw) as plain:
        want = [(r.output_tokens, r.logprobs) for r in plain.generate(ps, params)]
    fresh = {}
    final = "4xTP1EP1" if split_to == 1 else "2xTP2EP2"
    for layout in ("4xTP1EP1", "TP4EP4", final):   # (the layout says expert_parallel=True)
        with gyges.Host(model, layout=layout, **kw) as h:
            assert h.expert_parallel and h.layout() == layout
            fresh[layout] = weight_bytes(h)
    host = gyges.Host(model, layout="4xTP1", expert_parallel=True, **kw)
    reqs = [host.submit(p, params) for p in ps]
    host.step()
    n = model.config.num_experts
    merge = host.transform((0, 1, 2, 3), 4, layers_per_step=layers_per_step)
    while not merge.done:
        host.step()
    assert merge.committed and host.layout() == "TP4EP4"
    assert sum(merge.stats["weight_bytes_copied"].values()) == 0
    assert [merge.stats["weight_bytes_released"][w] for w in range(4)] == [
        a - b for a, b in zip(fresh["4xTP1EP1"], fresh["TP4EP4"])]
    assert [host.worker(w).weights.held_experts for w in range(4)] == [
        set(range(r * n // 4, (r + 1) * n // 4)) for r in range(4)]
    assert weight_bytes(host) == fresh["TP4EP4"]
    host.step()
    split = host.transform((0, 1, 2, 3), split_to, layers_per_step=layers_per_step)
    while not split.done:
        host.step()
    assert split.committed and host.layout() == final
    assert [host.worker(w).weights.held_experts for w in range(4)] == [
        set(range(r * n // split_to, (r + 1) * n // split_to))
        for r in (w % split_to for w in range(4))]
    assert weight_bytes(host) == fresh[final]
    host.run()
    assert [(r.output_tokens, r.logprobs) for r in reqs] == want
    host.close()


@pytest.mark.parametrize("site", list(testing.SITES))
@pytest.mark.parametrize("kind", ["merge", "split", "merge, staggered", "split, staggered"])
def test_a_fault_in_a_live_expert_parallel_transformation_loses_nothing(kind, site):
    """gyges.testing's fault sweep on an expert-parallel host (4xTP1 -> TP4EP4 and TP4EP4 ->
    4xTP1 at once; 4xTP1 -> TP4EP4 and 2xTP2EP2, one split to TP1, layer-staggered): refused
    with nothing changed, rolled back (each layer's experts as they were, the dropped ones
    refilled from the host copy), or done; every request with the tokens it has alone, no page
    left behind."""
    r = testing.sweep_transformation(four_way("qwen2_moe"), kind, site, most=6, memory="32MiB",
                                     expert_parallel=True)
    if r["events"] == 0:
        pytest.skip(f"{kind} has no {site} event")
    assert r["runs"] == r["refused"] + r["rolled_back"] + r["done"] > 0, r
    assert (r["changed"], r["wrong_layout"], r["lost"], r["mismatches"], r["leaked_pages"]) == \
           (0, 0, 0, 0, 0), r


def test_the_layout_grammar_names_expert_parallel_groups():
    """'TP4EP4' and '4xTP1EP1' make an expert-parallel host (as expert_parallel=True does); EP
    is the TP group's own degree, and a host's TP groups are all expert-parallel or none."""
    from gyges.runtime.layout import expert_parallel, parse
    assert parse("TP2EP2+2xTP1EP1", 4) == parse("TP2+2xTP1", 4)
    assert expert_parallel("TP2EP2+2xTP1EP1") and not expert_parallel("TP2+2xTP1")
    with pytest.raises(gyges.InvalidArgumentError, match="EP equals TP"):
        parse("TP4EP2", 4)
    with pytest.raises(gyges.InvalidArgumentError, match="mixes expert-parallel"):
        gyges.Host(four_way("mixtral"), workers=4, memory_per_worker="32MiB",
                   layout="TP2EP2+2xTP1")
    with pytest.raises(gyges.InvalidArgumentError, match="mixture-of-experts model"):
        gyges.Host(gyges.Model.random(CONFIGS["qwen3"]), workers=2, memory_per_worker="32MiB",
                   layout="TP2EP2")
    with gyges.Host(four_way("mixtral"), workers=4, memory_per_worker="32MiB",
                    layout="TP2EP2+2xTP1EP1") as host:
        assert host.expert_parallel and host.layout() == "TP2EP2+2xTP1EP1"
        assert host.worker(1).weights.held_experts == {2, 3, 4}
