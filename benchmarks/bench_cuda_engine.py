"""Decode step time of the CUDA engine on a random 1B-class Llama (Llama-3.2-1B's shapes: hidden
2048, 16 layers, 32 heads / 8 KV heads of 64, FFN 8192, vocab 128256, tied embeddings, bf16), at
batch 1 and 64 and a few context lengths, against:

  - the HBM roofline: the bytes a decode step must read (every weight once, the LM head included,
    plus the KV of every context token of every sequence) over the copy bandwidth measured on the
    same GPU (a 1 GiB device-to-device copy inside a CUDA arena; read + write bytes over time);
  - PyTorch eager on the same GPU, when torch is importable there: the same weights in bf16, a
    preallocated KV cache per layer and F.scaled_dot_product_attention (GQA), one token per
    sequence; otherwise a row saying it was not available.

What a step is, on both sides: one token per sequence at position `context` (the context's KV is
allocated but not computed: its values do not change the work of a step), the whole forward pass,
and the logits of every sequence copied to the host as fp32 (the gyges engine samples there). The
gyges side is Worker.forward, i.e. the C forward pass behind the engine's step without the
scheduler and sampler. Times are medians of STEPS steps after WARMUP steps, measured on the host
(the forward waits for its stream). Memory: about 2.5 GB of weights plus at most 8.6 GB of KV
(batch 64 at context 4096) per side, and the two sides never hold theirs at the same time.

Without a GPU (or a build without the CUDA forward pass) it prints "skipped: <reason>" and exits 0.

`--model tiny` (Model.tiny's shapes) is for trying the script on the emulated GPU of tests/gpu_emu.

With `--model llama3-8b` the same steps run on Llama-3-8B's shapes (hidden 4096, 32 layers, 32 heads
/ 8 KV heads of 128, FFN 14336, vocab 128256, untied head: 16 GB of bf16 weights) at batch 1 and 32,
context 1024 (`--batches`, `--contexts` change them). Its random weights are one layer's arrays
shared by every layer, each tiled from 2^20 normal values (the values change no timing, and
8e9 normal draws would take a minute of the GPU check's few); the arena still holds 32
distinct copies.

Run: .venv/bin/python benchmarks/bench_cuda_engine.py [--model llama3-8b] [--batches 1,32]
[--contexts 1024] [--no-torch]
"""
import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402
from gyges import _C_test  # noqa: E402
from gyges.models import checkpoint  # noqa: E402
from gyges.models.config import ModelConfig  # noqa: E402
from gyges.runtime.worker import Worker, cuda_unavailable  # noqa: E402

# Llama-3.2-1B's and Llama-3-8B's shapes (their llama3 rope scaling is left out: it changes no
# timing). name -> (config, batches, contexts, title)
MODELS = {
    "llama3.2-1b": (dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
                    (1, 64), (128, 1024, 4096), "Llama-3.2-1B"),
    "llama3-8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False),
                  (1, 32), (1024,), "Llama-3-8B"),
    # Model.tiny's shapes: the script's plumbing on the emulated GPU (gpu_check.sh's dry run)
    "tiny": (ModelConfig.tiny().to_dict(), (1, 4), (64,), "tiny"),
}
CONFIG, BATCHES, CONTEXTS, TITLE = MODELS["llama3.2-1b"]
# HBM bandwidth by the vendors' datasheets (bytes/s), by a word of the device's name: the anchor
# a reader knows, beside the copy bandwidth measured here (which is what a step can reach)
DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}
BLOCK_SIZE = 16
WARMUP, STEPS = 3, 20
SEED = 0
GiB = 1 << 30


def copy_bandwidth(nbytes=GiB):
    """HBM bytes/s of a device-to-device copy inside a CUDA arena (read + write), best of 5."""
    arena = gyges.Arena(budget=2 * nbytes, page_size="2MiB", backend="cuda")
    arena.grow(0, 2 * nbytes // arena.page_size, "staging")
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        arena.copy(nbytes, 0, nbytes)  # synchronous: the arena waits for the copy
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def step_bytes(config, batch, context):
    """Bytes one decode step must read: every matrix once (the LM head, tied or not; of the
    embedding only the batch's rows, which is nothing beside it) and the K and V of the context
    and the new token, in bf16."""
    c = config
    h, kvd, qd = c.hidden_size, c.num_key_value_heads * c.head_dim, c.num_attention_heads * c.head_dim
    per_layer = 2 * h * qd + 2 * h * kvd + 3 * h * c.intermediate_size
    weights = 2 * (c.num_hidden_layers * per_layer + c.vocab_size * h)
    kv = 2 * batch * (context + 1) * c.num_hidden_layers * 2 * kvd
    return weights, kv


def timed_steps(step):
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- gyges ----

def gyges_times(model, config):
    kv_bytes = max(step_bytes(config, b, c)[1] for b in BATCHES for c in CONTEXTS)
    weights = 2 * config.param_count()  # bf16, with room for page padding and the workspace
    budget = (int(weights * 1.1) + int(kv_bytes * 1.05) + GiB) // (2 << 20) * (2 << 20)
    worker = Worker(model, backend="cuda", weight_dtype="bf16", memory=budget,
                    block_size=BLOCK_SIZE, max_pos=max(CONTEXTS) + 8)
    out = {}
    kv = worker.kv
    for batch in BATCHES:
        for context in CONTEXTS:
            seqs = [kv.new_sequence() for _ in range(batch)]
            need = batch * -(-(context + 1) // BLOCK_SIZE)
            while kv.free_blocks < need:
                kv.grow(max(1, (need - kv.free_blocks) // int(kv.blocks_per_page()) + 1))
            for s in seqs:
                kv.reserve(s, context + 1)
            tables = [kv.block_table(s) for s in seqs]
            tokens = [(7 * i + 1) % config.vocab_size for i in range(batch)]
            rows = list(range(batch))
            positions = [context] * batch
            out[(batch, context)] = timed_steps(
                lambda: worker.forward(tokens, rows, positions, tables, rows))
            for s in seqs:
                kv.free(s)
            kv.shrink(kv.stats()["pages_per_layer"])
    weights_bytes = worker.weights_bytes
    del worker, kv
    gc.collect()
    return out, weights_bytes


# ---- PyTorch eager ----

def torch_times(model, config, dev="cuda"):
    """Step times of a plain PyTorch eager decoder, or a reason string when torch is missing."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        return f"torch is not importable here ({e})"
    if dev == "cuda" and not torch.cuda.is_available():
        return "torch has no CUDA device here"
    bf16 = torch.bfloat16
    c = config
    L, H, nh, kvh, D = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                        c.num_key_value_heads, c.head_dim)
    t = {k: torch.from_numpy(v).to(dev, bf16) for k, v in model.tensors.items()}
    layer = [{n: t[f"model.layers.{i}.{n}"] for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")} for i in range(L)]
    embed, norm = t["model.embed_tokens.weight"], t["model.norm.weight"]
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))

    def rmsnorm(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(bf16) * w

    def rope(x, cos, sin):
        a, b = x[..., : D // 2], x[..., D // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    try:
        F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 8, device=dev, dtype=bf16),
                                       torch.zeros(1, 1, 3, 8, device=dev, dtype=bf16),
                                       torch.zeros(1, 1, 3, 8, device=dev, dtype=bf16),
                                       enable_gqa=True)
        gqa = True
    except (TypeError, RuntimeError):
        gqa = False  # older torch: the KV heads are repeated (extra copies, noted in the JSON)

    out = {}
    with torch.inference_mode():
        for batch in BATCHES:
            for context in CONTEXTS:
                cache_k = [torch.zeros(batch, kvh, context + 1, D, device=dev, dtype=bf16)
                           for _ in range(L)]
                cache_v = [torch.zeros_like(k) for k in cache_k]
                ids = torch.tensor([(7 * i + 1) % c.vocab_size for i in range(batch)], device=dev)
                angle = context * inv_freq
                cos, sin = angle.cos().to(bf16), angle.sin().to(bf16)

                def step():
                    x = embed[ids]
                    for i, w in enumerate(layer):
                        h = rmsnorm(x, w["input_layernorm.weight"])
                        q = (h @ w["self_attn.q_proj.weight"].T).view(batch, nh, 1, D)
                        k = (h @ w["self_attn.k_proj.weight"].T).view(batch, kvh, 1, D)
                        v = (h @ w["self_attn.v_proj.weight"].T).view(batch, kvh, 1, D)
                        q, k = rope(q, cos, sin), rope(k, cos, sin)
                        cache_k[i][:, :, context:context + 1] = k
                        cache_v[i][:, :, context:context + 1] = v
                        ks, vs = cache_k[i], cache_v[i]
                        if gqa:
                            a = F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True)
                        else:
                            a = F.scaled_dot_product_attention(
                                q, ks.repeat_interleave(nh // kvh, 1),
                                vs.repeat_interleave(nh // kvh, 1))
                        x = x + a.reshape(batch, nh * D) @ w["self_attn.o_proj.weight"].T
                        h = rmsnorm(x, w["post_attention_layernorm.weight"])
                        g = F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
                        x = x + g @ w["mlp.down_proj.weight"].T
                    logits = rmsnorm(x, norm) @ embed.T
                    return logits.float().cpu()  # like gyges: the logits reach the host

                out[(batch, context)] = timed_steps(step)
                del cache_k, cache_v
                torch.cuda.empty_cache()
    out["gqa"] = gqa
    out["version"] = torch.__version__
    del t, layer, embed, norm
    torch.cuda.empty_cache()
    return out


def shared_layer_model(config, seed):
    """A random model whose layers are all one layer's arrays, each array tiled from one block
    of 2^20 seeded normal values (timing only; see the docstring)."""
    one = ModelConfig.from_dict({**config.to_dict(), "num_hidden_layers": 1})
    block = np.random.default_rng(seed).standard_normal(1 << 20, dtype=np.float32)
    tensors = checkpoint.random_weights(
        one, normal=lambda shape: np.resize(block, int(np.prod(shape))).reshape(shape))
    out = {n: a for n, a in tensors.items() if not n.startswith("model.layers.")}
    for i in range(config.num_hidden_layers):
        for n, a in tensors.items():
            if n.startswith("model.layers.0."):
                out[f"model.layers.{i}." + n[len("model.layers.0."):]] = a
    return gyges.Model(config, out)


def parse_ints(text):
    return tuple(int(x) for x in text.split(","))


def main():
    global CONFIG, BATCHES, CONTEXTS, TITLE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama3.2-1b")
    parser.add_argument("--batches", type=parse_ints)
    parser.add_argument("--contexts", type=parse_ints)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager side")
    args = parser.parse_args()
    CONFIG, BATCHES, CONTEXTS, TITLE = MODELS[args.model]
    BATCHES, CONTEXTS = args.batches or BATCHES, args.contexts or CONTEXTS
    reason = cuda_unavailable() or _C_test.cuda_blas_available()
    if reason:
        print(f"skipped: {reason}")
        return
    info = _C_test.cuda_device_info(0)
    config = ModelConfig.from_dict(CONFIG)
    print(f"device: {info['name']}; building a random {config.param_count() / 1e9:.2f}B-parameter "
          f"model (seed {SEED})...", flush=True)
    model = (gyges.Model.random(config, seed=SEED) if args.model == "llama3.2-1b" else
             shared_layer_model(config, SEED))
    bandwidth = copy_bandwidth()
    datasheet = next((bw for word, bw in DATASHEET_BANDWIDTH.items() if word in info["name"]),
                     None)
    ours, weights_in_arena = gyges_times(model, config)
    theirs = "not asked for (--no-torch)" if args.no_torch else torch_times(model, config)
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            w_bytes, kv_bytes = step_bytes(config, batch, context)
            roofline = (w_bytes + kv_bytes) / bandwidth
            t = ours[(batch, context)]
            row = {"batch": batch, "context": context, "gyges_ms": 1e3 * t,
                   "tokens_per_s": batch / t, "bytes_gb": (w_bytes + kv_bytes) / 1e9,
                   "roofline_ms": 1e3 * roofline, "of_roofline": roofline / t,
                   "of_datasheet": (w_bytes + kv_bytes) / t / datasheet if datasheet else None}
            if isinstance(theirs, dict):
                row["torch_ms"] = 1e3 * theirs[(batch, context)]
                row["vs_torch"] = theirs[(batch, context)] / t
            rows.append(row)
    print_table(f"Decode step, random {TITLE} shapes in bf16 on {info['name']} "
                f"(copy bandwidth {bandwidth / 1e9:.0f} GB/s)", rows, [
                    ("batch", "batch", "{}"), ("context", "context", "{}"),
                    ("gyges_ms", "gyges ms", "{:.3f}"), ("tokens_per_s", "tok/s", "{:.0f}"),
                    ("bytes_gb", "GB read", "{:.2f}"), ("roofline_ms", "roofline ms", "{:.3f}"),
                    ("of_roofline", "of roofline", "{:.0%}"),
                    ("of_datasheet", "of datasheet HBM", "{:.0%}"), ("torch_ms", "torch ms", "{:.3f}"),
                    ("vs_torch", "speed-up vs torch", "{:.2f}x")])
    if not isinstance(theirs, dict):
        print(f"PyTorch eager: not available ({theirs})")
    write_json("bench_cuda_engine" + ("" if args.model == "llama3.2-1b" else f"_{args.model}"), {
        "model": args.model,
        "device": info, "config": CONFIG, "dtype": "bf16", "block_size": BLOCK_SIZE,
        "warmup": WARMUP, "steps": STEPS, "copy_bandwidth_bytes_per_s": bandwidth,
        "datasheet_bandwidth_bytes_per_s": datasheet,
        "weights_bytes_in_arena": weights_in_arena, "rows": rows,
        "torch": ({"available": True, "version": theirs["version"], "sdpa_gqa": theirs["gqa"]}
                  if isinstance(theirs, dict) else {"available": False, "reason": theirs}),
    })


if __name__ == "__main__":
    main()
