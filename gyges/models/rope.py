"""The rotary embedding's frequencies of a model: one function, `rope_frequencies`, the only place
that reads `ModelConfig.rope_scaling`.

The engine treats the frequencies as data: the C model gets inv_freq [head_dim/2] (float64) and a
magnitude factor (YaRN's attention factor, which multiplies cos and sin; 1.0 otherwise) when it is
made, and both backends rotate by them (the CPU's cos/sin table, the CUDA kernel's angles). The
float64 reference (tests/reference_model.py) implements every type again on its own.

Unscaled frequencies are theta ** (-2i / head_dim), computed with the C library's pow on doubles
exactly as csrc/cpu/rope.c always did (Python's float ** is that pow), so the tables, and the
tokens, of an unscaled model are bit for bit what they were before scaling existed.
"""

from __future__ import annotations

import math

import numpy as np

from .config import ConfigError, ModelConfig

__all__ = ["rope_frequencies"]


def rope_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim/2] float64, mscale) of the config's RoPE, with its rope_scaling:

    - None: inv_freq[i] = theta ** (-2i/d), mscale 1.
    - linear: inv_freq / factor (positions interpolated).
    - dynamic (NTK-aware): transformers recomputes the base from each call's sequence length,
      which a KV cache cannot follow (keys cached at one base would be read with queries at
      another). As vLLM does, the base is fixed once, for the scaled context
      L = max_position_embeddings * factor:
      base = theta * (factor * L / max_position_embeddings - (factor - 1)) ** (d / (d - 2)).
    - llama3: Llama 3.1's wavelength bands (long ones slowed by factor, short ones kept, a smooth
      ramp between), transformers' _compute_llama3_parameters.
    - yarn: transformers' _compute_yarn_parameters: a linear ramp between the interpolated
      (inv_freq / factor) and the original frequencies over the dimensions whose rotations in
      original_max_position_embeddings (default: max_position_embeddings) lie between beta_slow
      (default 1) and beta_fast (default 32), bounds floored/ceiled unless truncate is false;
      mscale = attention_factor, else get_mscale(factor, mscale) / get_mscale(factor,
      mscale_all_dim) when both are given, else get_mscale(factor) = 0.1 ln(factor) + 1 (1 for
      factor <= 1). factor is taken as given (some transformers versions replaced it by
      max_position_embeddings / original_max_position_embeddings; vLLM and the current
      transformers use it as given).

    Raises ConfigError if the result is not finite and positive (a dynamic base that overflows,
    dynamic with head_dim 2).
    """
    d = config.head_dim
    theta = float(config.rope_theta)
    scaling = config.rope_scaling
    kind = None if scaling is None else scaling["rope_type"]
    mscale = 1.0
    if kind == "dynamic":
        if d <= 2:
            raise ConfigError(f"rope_scaling.rope_type 'dynamic' needs head_dim > 2, got {d}")
        factor = scaling["factor"]
        length = config.max_position_embeddings * factor
        try:
            theta = theta * (factor * length / config.max_position_embeddings
                             - (factor - 1.0)) ** (d / (d - 2))
        except OverflowError:
            theta = math.inf
    inv_freq = _default(theta, d)
    if kind == "linear":
        inv_freq = [f / scaling["factor"] for f in inv_freq]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, mscale = _yarn(inv_freq, theta, d, config.max_position_embeddings, scaling)
    out = np.array(inv_freq, dtype=np.float64)
    if not (np.all(np.isfinite(out)) and np.all(out > 0) and math.isfinite(mscale)
            and mscale > 0):
        raise ConfigError(f"rope_scaling {scaling!r} with rope_theta={config.rope_theta} and "
                          f"head_dim={d} gives frequencies that are not finite and positive")
    return out, float(mscale)


def _default(theta: float, d: int) -> list[float]:
    # Exactly csrc/cpu/rope.c's old pow(theta, -(double)(2 * i) / (double)head_dim): the int
    # division is correctly rounded, and float ** is the C library's pow.
    try:
        return [theta ** (-(2 * i) / d) for i in range(d // 2)]
    except OverflowError:
        return [math.inf] * (d // 2)


def _llama3(inv_freq: list[float], s: dict) -> list[float]:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    out = []
    for f in inv_freq:
        wavelen = 2.0 * math.pi / f
        if wavelen < old_len / high:
            out.append(f)
        elif wavelen > old_len / low:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1.0 - smooth) * f / factor + smooth * f)
    return out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv_freq: list[float], theta: float, d: int, max_pos: int,
          s: dict) -> tuple[list[float], float]:
    factor = s["factor"]
    if "attention_factor" in s:
        mscale = s["attention_factor"]
    elif "mscale" in s and "mscale_all_dim" in s:
        mscale = _yarn_mscale(factor, s["mscale"]) / _yarn_mscale(factor, s["mscale_all_dim"])
    else:
        mscale = _yarn_mscale(factor)
    old_len = s.get("original_max_position_embeddings", max_pos)

    def dim_of(rotations: float) -> float:
        # The dimension whose wavelength makes `rotations` turns in old_len positions.
        return d * math.log(old_len / (rotations * 2.0 * math.pi)) / (2.0 * math.log(theta))

    low, high = dim_of(s.get("beta_fast", 32.0)), dim_of(s.get("beta_slow", 1.0))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    out = []
    for i, f in enumerate(inv_freq):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: original, 1: interpolated
        out.append(f / factor * ramp + f * (1.0 - ramp))
    return out, mscale
