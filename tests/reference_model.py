"""Float64 NumPy reference of a Llama / Qwen2 / Qwen3 decoder, dense or a mixture of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE): what the fast kernels are tested against.

Written to be obviously right rather than fast: one sequence, loops over heads, float64 all the
way, and each step a small function that follows the HF transformers implementation:

    x = embed[tokens]
    for each layer:
        x = x + o_proj(attention(rope(q_proj(norm1(x))), rope(k_proj(..)), v_proj(..)))
        x = x + down_proj(silu(gate_proj(norm2(x))) * up_proj(norm2(x)))
    logits = lm_head(norm(x))          # lm_head = embed when tied

Qwen3 RMS-normalises each q and k head (q_norm, k_norm) before the rotation. A mixture-of-experts
layer replaces the FFN by, token by token (transformers' MixtralSparseMoeBlock and
Qwen2MoeSparseMoeBlock):

    p = softmax(router(h));  E = the k experts of highest p (ties: the lower index)
    y = sum over e in E of w_e * expert_e(h),  w_e = p_e (/ sum of p over E when norm_topk_prob)
    y += sigmoid(shared_expert_gate(h)) * shared_expert(h)        (Qwen2-MoE)

It depends on gyges only for ModelConfig and the tensor-name check (checkpoint.check_tensors).
"""

from __future__ import annotations

import math

import numpy as np

from gyges.models.checkpoint import check_tensors
from gyges.models.config import ModelConfig


# ---------------------------------------------------------------- building blocks

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of a 1-D array, largest first, ties to the lower index."""
    return np.argsort(-logits, kind="stable")[:k]


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """[head_dim/2] angular frequencies theta^(-2i/d), adjusted by the config's rope_scaling."""
    return rope_parameters(config)[0]


def rope_parameters(config: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim/2], attention scaling of cos and sin), written from transformers'
    modeling_rope_utils (vectorised NumPy in float64; gyges/models/rope.py is the engine's)."""
    d = config.head_dim
    exponents = np.arange(0, d, 2, dtype=np.float64) / d
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        # transformers' _compute_dynamic_ntk_parameters at seq_len = max_position_embeddings *
        # factor, the one fixed length a KV cache allows (vLLM's DynamicNTKScalingRotaryEmbedding).
        seq_len = config.max_position_embeddings * factor
        base = config.rope_theta * ((factor * seq_len / config.max_position_embeddings)
                                    - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** exponents), 1.0
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
        # between interpolated smoothly (transformers' _compute_llama3_parameters).
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        out = np.empty_like(inv_freq)
        for i, f in enumerate(inv_freq):
            wavelen = 2.0 * math.pi / f
            if wavelen < old_len / high:
                out[i] = f
            elif wavelen > old_len / low:
                out[i] = f / factor
            else:
                smooth = (old_len / wavelen - low) / (high - low)
                out[i] = (1.0 - smooth) * f / factor + smooth * f
        return out, 1.0
    if kind == "yarn":
        # transformers' _compute_yarn_parameters, factor as given.
        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if "attention_factor" in scaling:
            attention = scaling["attention_factor"]
        elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention = get_mscale(factor, scaling["mscale"]) / \
                get_mscale(factor, scaling["mscale_all_dim"])
        else:
            attention = get_mscale(factor)
        old_len = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
        base = config.rope_theta

        def correction_dim(rotations):
            return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low = correction_dim(scaling.get("beta_fast", 32))
        high = correction_dim(scaling.get("beta_slow", 1))
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        extrapolation = 1.0 - ramp
        pos_freqs = base ** exponents
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, attention
    raise ValueError(f"rope_scaling {scaling!r} not implemented in the reference")


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
               attention_scaling: float = 1.0) -> np.ndarray:
    """Rotates x [tokens, heads, head_dim] by position, HF convention.

    HF pairs element i with element i + head_dim/2 (rotate_half), not adjacent elements:
    out = x * cos + rotate_half(x) * sin with rotate_half(x) = concat(-x2, x1); cos and sin are
    multiplied by attention_scaling (YaRN's; 1 for the other types).
    """
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [tokens, d/2]
    cos = attention_scaling * np.concatenate([np.cos(angles), np.cos(angles)], axis=-1)[:, None, :]
    sin = attention_scaling * np.concatenate([np.sin(angles), np.sin(angles)], axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, group: int) -> np.ndarray:
    """Causal grouped-query attention for the last q.shape[0] tokens of a sequence.

    q: [n, heads, head_dim], the n newest tokens; k, v: [t, kv_heads, head_dim], all t tokens
    including those n. Query i (sequence index t - n + i) sees keys 0 .. t - n + i. Query head h
    reads KV head h // group. Returns [n, heads, head_dim].
    """
    n, heads, head_dim = q.shape
    t = k.shape[0]
    allowed = np.arange(t)[None, :] <= (t - n + np.arange(n))[:, None]  # [n, t]
    out = np.empty_like(q)
    for h in range(heads):
        g = h // group
        scores = q[:, h, :] @ k[:, g, :].T / math.sqrt(head_dim)  # [n, t]
        scores = np.where(allowed, scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[:, h, :] = p @ v[:, g, :]
    return out


# ---------------------------------------------------------------- cache and model

class KVCache:
    """Per-layer K and V of every token seen so far, each [tokens, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig):
        empty = np.zeros((0, config.num_key_value_heads, config.head_dim))
        self.k = [empty.copy() for _ in range(config.num_hidden_layers)]
        self.v = [empty.copy() for _ in range(config.num_hidden_layers)]

    def __len__(self) -> int:
        return self.k[0].shape[0]

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])
        return self.k[layer], self.v[layer]


class ReferenceModel:
    """Float64 decoder over HF-named tensors (any float dtype; cast to float64 here)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray]):
        check_tensors(config, tensors)
        self.config = config
        self.w = {name: np.asarray(t, dtype=np.float64) for name, t in tensors.items()}
        self.inv_freq, self.attention_scaling = rope_parameters(config)
        self.lm_head = self.w["model.embed_tokens.weight"] if config.tie_word_embeddings \
            else self.w["lm_head.weight"]

    def new_cache(self) -> KVCache:
        return KVCache(self.config)

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T (+ b): HF stores W as [out, in]."""
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def _swiglu(self, h: np.ndarray, prefix: str, names=("gate_proj", "up_proj", "down_proj")):
        gate, up, down = (prefix + n for n in names)
        return self._linear(silu(self._linear(h, gate)) * self._linear(h, up), down)

    def _ffn(self, h: np.ndarray, i: int) -> np.ndarray:
        """Layer i's FFN on h [n, hidden]: dense, or a mixture of experts (HF's sparse-layer
        rule: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
        c, p = self.config, f"model.layers.{i}."
        if not c.num_experts or i in c.mlp_only_layers or (i + 1) % c.decoder_sparse_step:
            return self._swiglu(h, p + "mlp.")
        mixtral = c.model_type == "mixtral"
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        logits = self._linear(h, moe + "gate")  # [n, experts]
        probs = softmax(logits)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            chosen = top_k(logits[t], c.num_experts_per_tok)
            weights = probs[t, chosen]
            if c.norm_topk_prob:
                weights = weights / weights.sum()
            for e, weight in zip(chosen, weights):
                out[t] += weight * self._swiglu(h[t:t + 1], f"{moe}experts.{e}.", names)[0]
        if moe + "shared_expert_gate.weight" in self.w:
            gate = 1.0 / (1.0 + np.exp(-self._linear(h, moe + "shared_expert_gate")))  # [n, 1]
            out += gate * self._swiglu(h, moe + "shared_expert.")
        return out

    def forward(self, tokens, positions, cache: KVCache) -> np.ndarray:
        """Logits [n, vocab] for n new tokens of one sequence, appending their K/V to cache."""
        c = self.config
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if tokens.shape != positions.shape:
            raise ValueError(f"{tokens.size} tokens but {positions.size} positions")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= c.vocab_size):
            raise ValueError(f"token ids must be in [0, {c.vocab_size})")
        if positions.size and positions.min() < 0:
            raise ValueError("positions must be non-negative")
        n = tokens.size
        x = self.w["model.embed_tokens.weight"][tokens]  # [n, hidden]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
            heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            q = self._linear(h, p + "self_attn.q_proj").reshape(n, heads, d)
            k = self._linear(h, p + "self_attn.k_proj").reshape(n, kv_heads, d)
            if p + "self_attn.q_norm.weight" in self.w:  # Qwen3: per head, before RoPE
                q = rms_norm(q, self.w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
                k = rms_norm(k, self.w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
            v = self._linear(h, p + "self_attn.v_proj").reshape(n, kv_heads, d)
            q = apply_rope(q, positions, self.inv_freq, self.attention_scaling)
            k = apply_rope(k, positions, self.inv_freq, self.attention_scaling)
            keys, values = cache.append(i, k, v)
            a = attention(q, keys, values, c.kv_group_size).reshape(n, c.q_size)
            x = x + self._linear(a, p + "self_attn.o_proj")
            h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            x = x + self._ffn(h, i)
        x = rms_norm(x, self.w["model.norm.weight"], c.rms_norm_eps)
        return x @ self.lm_head.T

    def prefill_logits(self, tokens) -> np.ndarray:
        """Logits [n, vocab] at every position of a fresh sequence."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        return self.forward(tokens, np.arange(tokens.size), self.new_cache())

    def generate_greedy(self, prompt, n_steps: int) -> list[int]:
        """The n_steps tokens that greedy decoding appends to prompt (no stop at eos).

        Ties go to the lowest token id (np.argmax), which fast engines must match.
        """
        return self.greedy_with_gaps(prompt, n_steps)[0]

    def greedy_with_gaps(self, prompt, n_steps: int) -> tuple[list[int], list[float]]:
        """(the greedy tokens, per step the gap between the two best logits relative to the
        best one's magnitude): an fp32 engine may pick either of two logits that close."""
        prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError("prompt must hold at least one token")
        cache = self.new_cache()
        logits = self.forward(prompt, np.arange(prompt.size), cache)[-1]
        tokens: list[int] = []
        gaps: list[float] = []
        for step in range(n_steps):
            top2 = np.sort(logits)[-2:]
            tokens.append(int(np.argmax(logits)))
            gaps.append(float((top2[1] - top2[0]) / max(abs(top2[1]), 1e-30)))
            if step + 1 < n_steps:
                logits = self.forward([tokens[-1]], [len(cache)], cache)[-1]
        return tokens, gaps
