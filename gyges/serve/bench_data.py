"""The requests `gyges bench serve` sends (gyges/serve/bench.py), by vLLM's dataset names:

    random      prompts of random vocabulary tokens, decoded to text (vLLM's "random"); lengths
                uniform in [L(1-r), L(1+r)] with --random-input-len/--random-output-len L and
                --random-range-ratio r, or by default uniform up to --max-input/--max-output
    azure       the Azure LLM 2023 conversation trace under ../shared/traces (or --dataset-path)
    mooncake    the Mooncake FAST'25 synthetic trace under ../shared/traces (or --dataset-path)
    burstgpt    a BurstGPT CSV given with --dataset-path
    sharegpt    a ShareGPT JSON file given with --dataset-path: real first-turn prompts, each
                asking for its reply's length in tokens
    a path      any trace file gyges.cluster.traces.load reads (Azure or BurstGPT CSV, Mooncake
                JSONL), as --trace took it

A trace gives arrival times and lengths only (no text): its prompts are random tokens of its
input lengths. Arrivals are the trace's own (times --time-scale) unless --request-rate is given;
otherwise (and for random and sharegpt) gamma-distributed gaps at --request-rate with
--burstiness, as vLLM's, or all at time 0 for a rate of inf.
"""
import json
import math
from pathlib import Path

import numpy as np

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
NAMED = {"azure": ("load_azure", "azure_llm_2023_conv.csv"),
         "mooncake": ("load_mooncake", "mooncake_synthetic.jsonl"),
         "burstgpt": ("load_burstgpt", None)}
DATASETS = ("random", "sharegpt", *NAMED)
DEFAULT_RATE = 4.0     # requests/s of random and sharegpt when --request-rate is not given
DEFAULT_MAX_INPUT = 512


class Requests:
    """What is sent: prompt text, its length in the prompt tokenizer's tokens, the output length
    asked for, and the arrival time (s from the start)."""

    def __init__(self, prompts, input_lens, output_lens, arrivals, timed_by):
        self.prompts, self.input_lens = prompts, [int(n) for n in input_lens]
        self.output_lens = [int(n) for n in output_lens]
        self.arrivals = [float(a) for a in arrivals]
        self.timed_by = timed_by   # "trace", or the request rate used

    def __len__(self):
        return len(self.prompts)


def dataset_kind(name):
    """'random', 'sharegpt', a NAMED trace, or 'file' (a trace file given by its path, --trace's
    old way); None when it is none of these."""
    if name == "synthetic":   # --trace's name for it
        return "random"
    if name in DATASETS:
        return name
    return "file" if Path(name).is_file() else None


def max_input(args):
    """--max-input, or enough for the --random-input-len range, or 512: a small model's context."""
    if args.max_input is not None:
        return args.max_input
    if args.random_input_len is not None:
        return _range(args.random_input_len, args.random_range_ratio)[1]
    return DEFAULT_MAX_INPUT


def max_output(args):
    if args.max_output is not None:
        return args.max_output
    if args.random_output_len is not None:
        return _range(args.random_output_len, args.random_range_ratio)[1]
    return 128


def build(args, kind, tokenizer):
    """The Requests of the dataset the flags name (a gyges.Error for a malformed file)."""
    n, rng = args.num_prompts, np.random.default_rng(args.seed)
    cap_in, cap_out = max_input(args), max_output(args)
    if kind == "sharegpt":
        prompts, inp, out = _sharegpt(args, tokenizer, rng, cap_in, cap_out)
        return Requests(prompts, inp, out, _arrivals(args, len(prompts)), _rate(args))
    if kind == "random":
        inp = _lengths(rng, n, args.random_input_len, args.random_range_ratio, cap_in)
        out = _lengths(rng, n, args.random_output_len, args.random_range_ratio, cap_out)
        arrivals, timed_by = _arrivals(args, n), _rate(args)
    else:
        t = _trace(args, kind)[:n]
        inp = np.clip(t["input_tokens"], 1, cap_in)
        out = np.clip(t["output_tokens"], 1, cap_out)
        if args.random_output_len is not None:   # vLLM's --output-len fixes every dataset's
            out = np.full(len(t), min(args.random_output_len, cap_out))
        if args.request_rate is None:
            arrivals, timed_by = (t["arrival"] - t["arrival"][0]) * args.time_scale, "trace"
        else:
            arrivals, timed_by = _arrivals(args, len(t)), args.request_rate
    built = [random_prompt(tokenizer, rng, int(k)) for k in inp]
    return Requests([p for p, _ in built], [k for _, k in built], out, arrivals, timed_by)


def _rate(args):
    return DEFAULT_RATE if args.request_rate is None else args.request_rate


def _range(length, ratio):
    """vLLM's random range: [L(1-r), L(1+r)], at least 1."""
    return max(1, int(length * (1 - ratio))), max(1, int(math.ceil(length * (1 + ratio))))


def _lengths(rng, n, length, ratio, cap):
    low, high = _range(length, ratio) if length is not None else (min(16, cap), cap)
    return np.minimum(rng.integers(low, high, size=n, endpoint=True), cap)


def _arrivals(args, n):
    """Gamma gaps of mean 1/rate and shape burstiness (Poisson at 1), the first at 0, as vLLM
    draws them; every arrival at 0 for a rate of inf; even gaps for a burstiness of inf."""
    rate, b = _rate(args), args.burstiness
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    if math.isinf(b):
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        gaps = np.random.default_rng([args.seed, 1]).gamma(b, 1.0 / (rate * b), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)]) * args.time_scale


def _trace(args, kind):
    from ..cluster import traces
    if kind == "file":
        return traces.load(args.dataset_name)
    loader, default = NAMED[kind]
    path = args.dataset_path or str(TRACES / default)
    return getattr(traces, loader)(path)


def random_prompt(tokenizer, rng, n):
    """(text, its length in tokens): random ordinary tokens of the vocabulary, decoded. Decoded
    text does not always encode back to the same tokens (pieces merge), so it is cut or topped
    up until it does encode to n tokens, or nearly: the length returned is the true one."""
    special = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None}
    vocab = tokenizer.vocab_size

    def draw(k):
        return [int(i) for i in rng.integers(100, vocab, size=k) if int(i) not in special]

    ids = draw(n)
    for _ in range(4):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == n:
            break
        ids = ids[:n] if len(ids) > n else ids + draw(n - len(ids))
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text))


def _sharegpt(args, tokenizer, rng, cap_in, cap_out):
    """ShareGPT's conversations (a JSON list of {"conversations": [{"from", "value"}, ...]}):
    the first turn is the prompt, the second's length in tokens the output asked for. Prompts
    longer than --max-input are skipped, as vLLM skips too-long ones; outputs are clipped."""
    from ..core.errors import FormatError
    try:
        data = json.loads(Path(args.dataset_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"--dataset-path {args.dataset_path}: not a ShareGPT JSON file "
                          f"({e})") from None
    data = data if isinstance(data, list) else []
    convs = [d.get("conversations") for d in data if isinstance(d, dict)]
    convs = [c for c in convs if isinstance(c, list) and len(c) >= 2 and
             all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in c[:2])]
    prompts, inp, out = [], [], []
    for i in rng.permutation(len(convs)):
        if len(prompts) == args.num_prompts:
            break
        prompt, reply = convs[i][0]["value"], convs[i][1]["value"]
        n_in = len(tokenizer.encode(prompt))
        n_out = args.random_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if not prompt or n_in > cap_in or n_out < 1:
            continue
        prompts.append(prompt)
        inp.append(n_in)
        out.append(min(n_out, cap_out))
    if not prompts:
        raise FormatError(f"--dataset-path {args.dataset_path}: no ShareGPT conversation with a "
                          f"prompt of at most {cap_in} tokens (--max-input) and a reply")
    return prompts, inp, out
