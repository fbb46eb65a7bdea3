"""Single-worker engine speed on the 15M and 110M "stories" shapes, against llama2.c and against
the machine's rooflines, measured in one run.

For each shape (random weights, fp32 compute, 2 threads):
  decode tokens/s at batch 1 (fp32 and bf16 weights) and batch 32, prefill tokens/s;
  batch 1 as a fraction of the read-bandwidth roofline (weights bytes per token / bandwidth),
  batch 32 as a fraction of the FMA peak (2 * params FLOPs per token);
  llama2.c's run.c on the same weights, when LLAMA2C_RUN names a built binary
  (gcc -Ofast -march=native -fopenmp run.c -o run -lm; kept outside this repository).

Run: LLAMA2C_RUN=/tmp/llama2c/run .venv/bin/python benchmarks/bench_engine.py
"""
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402
from gyges import _C_test  # noqa: E402
from gyges.models.config import ModelConfig  # noqa: E402

THREADS = 2
DECODE_TOKENS = 128


def read_bandwidth(threads=THREADS, nbytes=512 << 20):
    """Bytes/s of a streaming read of a buffer far larger than the caches (best of 5)."""
    x = np.ones(nbytes // 4, dtype=np.float32)
    best = min(_timed(lambda: _C_test.kernel_stream_read(x, x.size, threads)) for _ in range(5))
    return nbytes / best


def fma_peak(threads=THREADS):
    """FLOP/s of independent fp32 FMA chains on every thread (2 FLOPs per lane per FMA)."""
    return _C_test.kernel_fma_peak(threads)


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_rate(engine, batch, prompt_len=8, max_tokens=DECODE_TOKENS):
    """Output tokens/s in steady decode: tokens after each request's first, over that time."""
    params = gyges.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(prompt_len)] for i in range(batch)]
    requests = engine.generate(prompts, params)
    start = max(r.metrics.token_times[0] for r in requests)
    end = max(r.metrics.token_times[-1] for r in requests)
    return batch * (max_tokens - 1) / (end - start)


def prefill_rate(engine, prompt_len=512):
    prompt_len = min(prompt_len, engine.model.config.max_position_embeddings - 2)
    params = gyges.SamplingParams(max_tokens=1, ignore_eos=True)
    prompt = [(3 * j) % 1000 + 1 for j in range(prompt_len)]
    best = min(_timed(lambda: engine.generate([prompt], params)) for _ in range(3))
    return prompt_len / best


def weight_bytes_per_token(config, elem):
    """Bytes a decode step streams: every matrix once (embedding row lookups are negligible)."""
    c = config
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    return (c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size) * elem


def write_llama2c_model(path, config, tensors):
    """The model in llama2.c's legacy format (a negative vocab size marks an unshared classifier)."""
    c = config
    L = c.num_hidden_layers
    layer = lambda name: np.stack([tensors[f"model.layers.{i}.{name}"] for i in range(L)])
    head = c.head_dim
    with open(path, "wb") as f:
        f.write(struct.pack("7i", c.hidden_size, c.intermediate_size, L, c.num_attention_heads,
                            c.num_key_value_heads,
                            c.vocab_size if c.tie_word_embeddings else -c.vocab_size, 1024))
        classifier = [] if c.tie_word_embeddings else [tensors["lm_head.weight"]]
        for array in (tensors["model.embed_tokens.weight"], layer("input_layernorm.weight"),
                      layer("self_attn.q_proj.weight"), layer("self_attn.k_proj.weight"),
                      layer("self_attn.v_proj.weight"), layer("self_attn.o_proj.weight"),
                      layer("post_attention_layernorm.weight"), layer("mlp.gate_proj.weight"),
                      layer("mlp.down_proj.weight"), layer("mlp.up_proj.weight"),
                      tensors["model.norm.weight"], np.zeros(1024 * head // 2),
                      np.zeros(1024 * head // 2), *classifier):
            f.write(np.ascontiguousarray(array, dtype=np.float32).tobytes())


def write_llama2c_tokenizer(path, vocab):
    with open(path, "wb") as f:
        f.write(struct.pack("i", 16))
        for i in range(vocab):
            piece = f"<{i}>".encode()
            f.write(struct.pack("fi", 0.0, len(piece)) + piece)


def llama2c_rate(binary, config, tensors):
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = Path(tmp) / "model.bin", Path(tmp) / "tok.bin"
        write_llama2c_model(model, config, tensors)
        write_llama2c_tokenizer(tok, config.vocab_size)
        rates = []
        for _ in range(3):
            run = subprocess.run([binary, str(model), "-z", str(tok), "-t", "0", "-n",
                                  str(DECODE_TOKENS + 1)], capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": str(THREADS)}, timeout=600)
            match = re.search(r"achieved tok/s: ([0-9.]+)", run.stderr)
            if match:
                rates.append(float(match.group(1)))
        return max(rates) if rates else None


def main():
    bandwidth = read_bandwidth()
    peak = fma_peak()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, FMA peak {peak / 1e9:.1f} GFLOP/s "
          f"({THREADS} threads)")
    binary = os.environ.get("LLAMA2C_RUN")
    rows = []
    for name in ("stories15m", "stories110m"):
        config = getattr(ModelConfig, name)()
        model = gyges.Model.random(config, seed=0)
        row = {"shape": name}
        flops_per_token = 2 * weight_bytes_per_token(config, 1)
        for dtype, elem in (("f32", 4), ("bf16", 2)):
            engine = gyges.Engine(model, memory="2GiB", page_size="2MiB", weight_dtype=dtype,
                                  threads=THREADS, max_batch_tokens=1024)
            decode_rate(engine, 1, max_tokens=16)  # warm up
            rate = max(decode_rate(engine, 1) for _ in range(3))
            row[f"b1_{dtype}"] = rate
            row[f"b1_{dtype}_roofline"] = rate * weight_bytes_per_token(config, elem) / bandwidth
            if dtype == "f32":
                row["b32_f32"] = max(decode_rate(engine, 32) for _ in range(2))
                row["b32_f32_peak"] = row["b32_f32"] * flops_per_token / peak
                row["b32_over_b1"] = row["b32_f32"] / rate
                row["prefill_f32"] = prefill_rate(engine)
            del engine
        row["llama2c"] = llama2c_rate(binary, config, model.tensors) if binary else None
        if row["llama2c"]:
            row["f32_vs_llama2c"] = row["b1_f32"] / row["llama2c"]
            row["bf16_vs_llama2c"] = row["b1_bf16"] / row["llama2c"]
        rows.append(row)
        print(f"  {name} done", flush=True)
    print_table(f"Decode and prefill tokens/s ({THREADS} threads; roofline = fraction of the "
                f"read-bandwidth bound for batch 1, of the FMA peak for batch 32)", rows,
                [("shape", "shape", "{}"), ("b1_f32", "b1 f32", "{:.0f}"),
                 ("b1_f32_roofline", "of BW", "{:.0%}"), ("b1_bf16", "b1 bf16", "{:.0f}"),
                 ("b1_bf16_roofline", "of BW", "{:.0%}"), ("b32_f32", "b32 f32", "{:.0f}"),
                 ("b32_f32_peak", "of peak", "{:.0%}"), ("b32_over_b1", "b32/b1", "{:.1f}x"),
                 ("prefill_f32", "prefill", "{:.0f}"), ("llama2c", "llama2.c", "{:.0f}"),
                 ("f32_vs_llama2c", "f32/l2c", "{:.2f}x"), ("bf16_vs_llama2c", "bf16/l2c", "{:.2f}x")])
    write_json("bench_engine", {"threads": THREADS, "read_bandwidth": bandwidth,
                                "fma_peak": peak, "rows": rows})


if __name__ == "__main__":
    main()
