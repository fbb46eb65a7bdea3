"""gyges.LLM as a vLLM user meets it: a vLLM script that changes only its import runs, with
vLLM's engine arguments, prompt forms and sampling (n, best_of, logprobs, penalties, min_p), and
what gyges cannot do is refused by name before the model loads."""
import math
import os
import time

import numpy as np
import pytest

import gyges
from gyges.runtime.worker import model_memory
from packaged import NAME, needs_packaged_model


@pytest.fixture(scope="module")
def llm():
    # vLLM's own script, the import aside (vllm.LLM takes these very arguments)
    from gyges import LLM
    with LLM(model=NAME, max_model_len=2048, gpu_memory_utilization=0.05, seed=0,
             enforce_eager=True, max_num_seqs=16, dtype="float32") as llm:
        yield llm


@needs_packaged_model
def test_a_vllm_script_runs_with_n_logprobs_penalties_and_min_p(llm):
    from gyges import SamplingParams
    prompts = ["Hello, my name is", "The capital of France is"]
    params = SamplingParams(n=4, logprobs=5, presence_penalty=0.5, min_p=0.05, temperature=1.0,
                            max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for out in outputs:
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert out.finished and out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)
        for c in out.outputs:
            assert len(c.token_ids) == 8 and c.finish_reason == "length"
            assert len(c.logprobs) == 8
            total = 0.0
            for token, entry in zip(c.token_ids, c.logprobs):
                # the sampled token and the top 5, ranks 1..5 among them, most likely first
                assert token in entry and len(entry) in (5, 6)
                top = sorted((lp for t, lp in entry.items() if lp.rank <= 5), key=lambda x: x.rank)
                assert [lp.rank for lp in top] == [1, 2, 3, 4, 5]
                assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
                assert sum(math.exp(lp.logprob) for lp in top) <= 1 + 1e-6
                assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
                # min_p keeps only tokens at least 0.05 as likely as the most likely one, after a
                # presence penalty of at most 0.5 on the logits
                assert entry[token].logprob >= math.log(0.05) + top[0].logprob - 0.5 - 1e-4
                total += entry[token].logprob
            assert c.cumulative_logprob == pytest.approx(total, abs=1e-9)
        # four samples of one prompt at temperature 1 draw four streams
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # a pinned seed repeats exactly, its n samples still differing
    pinned = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1234, ignore_eos=True)
    a, b = (llm.generate(prompts[0], pinned, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids


@needs_packaged_model
def test_the_engine_seed_makes_a_script_repeat(llm):
    """LLM(seed=s) and the same script: the same tokens; another seed: others."""
    params = gyges.SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True)
    runs = []
    for seed in (0, 0, 1):
        with gyges.LLM(llm.model, seed=seed) as fresh:
            out = fresh.generate(["Hello, my name is", "Hi"], params, use_tqdm=False)
            runs.append([c.token_ids for o in out for c in o.outputs])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len(set(map(tuple, runs[0]))) == 6   # every sample of every prompt its own stream


@needs_packaged_model
def test_best_of_keeps_the_n_most_likely_samples(llm):
    params = gyges.SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=5, seed=7,
                                  ignore_eos=True)
    (out,) = llm.generate("Once upon a time", params, use_tqdm=False)
    every = llm.generate("Once upon a time", gyges.SamplingParams(
        n=5, temperature=1.0, max_tokens=5, seed=7, ignore_eos=True), use_tqdm=False)[0]
    best = sorted((c.cumulative_logprob for c in every.outputs), reverse=True)[:2]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(best, abs=1e-12)
    assert [c.index for c in out.outputs] == [0, 1]


@needs_packaged_model
def test_prompts_come_as_strings_token_lists_and_vllms_dicts(llm):
    greedy = gyges.SamplingParams(max_tokens=4, temperature=0.0)
    ids = llm.get_tokenizer().encode("The capital of France is")
    forms = ["The capital of France is", {"prompt": "The capital of France is"},
             {"prompt_token_ids": ids}, ids]
    outs = [llm.generate(p, greedy, use_tqdm=False)[0] for p in forms]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[1].prompt == "The capital of France is" and outs[2].prompt_token_ids == ids
    with pytest.raises(gyges.InvalidArgumentError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, greedy)


@needs_packaged_model
def test_max_model_len_bounds_the_output_as_vllm_does(llm):
    prompt = list(range(100, 150))
    with gyges.LLM(llm.model, max_model_len=64) as short:
        (out,) = short.generate([prompt], gyges.SamplingParams(max_tokens=None, ignore_eos=True),
                                use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 64 - len(prompt) == 14
        (out,) = short.generate([prompt], gyges.SamplingParams(max_tokens=30, ignore_eos=True),
                                use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 14 and out.outputs[0].finish_reason == "length"
        with pytest.raises(gyges.InvalidArgumentError, match="max_model_len=64"):
            short.generate([list(range(100, 164))], use_tqdm=False)


@needs_packaged_model
def test_use_tqdm_shows_progress(llm, capsys):
    llm.generate(["a", "b"], gyges.SamplingParams(max_tokens=2), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a"], gyges.SamplingParams(max_tokens=2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, match", [
    ({"max_model_len_typo": 5}, "max_model_len_typo"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"dtype": "float8"}, "dtype='float8'"),
    ({"quantization": "awq"}, "quantization='awq'"),
    ({"seed": -1}, "seed"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
])
def test_unknown_or_unsupported_arguments_are_refused_before_loading(kwargs, match):
    start = time.perf_counter()
    with pytest.raises(gyges.Error, match=match):
        gyges.LLM("a-model-file-that-does-not-exist.gguf", **kwargs)
    assert time.perf_counter() - start < 1.0   # nothing was loaded


def test_gpu_memory_utilization_is_a_share_of_the_workers_memory():
    """On the CPU backend a worker's device is its share of this machine's memory."""
    tiny = gyges.Model.tiny()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with gyges.LLM(tiny, gpu_memory_utilization=0.01, tensor_parallel_size=2) as llm:
        assert llm.host.memory_per_worker == int(0.01 * ram / 2)
    share = model_memory(tiny, kv_tokens=0) / ram / 2   # half the weights
    with pytest.raises(gyges.InvalidArgumentError, match="gpu_memory_utilization=.* less than"):
        gyges.LLM(tiny, gpu_memory_utilization=share)


def test_dtype_takes_vllms_spellings_and_notes_what_does_nothing(caplog):
    tiny = gyges.Model.tiny()
    with caplog.at_level("INFO", logger="gyges"):
        with gyges.LLM(tiny, dtype="bfloat16", enforce_eager=True, trust_remote_code=True,
                       max_num_seqs=3) as llm:
            assert llm.host.worker(0).weight_dtype == "bf16"
            assert llm.host.max_running == 3
            out = llm.generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=3), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 3
    assert "enforce_eager=True has no effect" in caplog.text
    assert "trust_remote_code=True has no effect" in caplog.text
    np.testing.assert_equal(gyges.serve.llm.DTYPES["half"], "f16")
