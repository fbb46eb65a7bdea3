"""`gyges bench serve`: replay a trace against any OpenAI-compatible endpoint (gyges, vLLM, ...)
with the official `openai` client, and report vLLM's serving benchmark metrics: request and
output-token throughput; TTFT, TPOT and ITL mean / median / p99.

Each request of the trace arrives at its time (scaled by --time-scale) with a prompt of its
length: random tokens of the tokenizer's vocabulary decoded to text, as vLLM's "random" dataset
does (no corpus ships with gyges), asking for its output length with ignore_eos so that every
server generates the same number of tokens. Lengths are clipped to --max-input/--max-output so a
small model's context holds them.
"""
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
NAMED = {"azure": ("load_azure", "azure_llm_2023_conv.csv"),
         "mooncake": ("load_mooncake", "mooncake_synthetic.jsonl")}


def add_arguments(p):
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--trace", default="synthetic",
                   help="azure, mooncake (from ../shared/traces), synthetic, or a trace file "
                        "(Azure or BurstGPT CSV, Mooncake JSONL)")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--rate", type=float, default=4.0, help="synthetic: Poisson requests/s")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies the trace's arrival times (< 1 compresses it)")
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--tokenizer", default="smollm2-135m-instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")


def load_trace(args):
    from ..cluster import traces
    if args.trace == "synthetic":
        t = traces.poisson(args.rate, n=args.requests,
                           input_tokens=(min(16, args.max_input), args.max_input),
                           output_tokens=(min(8, args.max_output), args.max_output),
                           seed=args.seed)
    elif args.trace in NAMED:
        loader, name = NAMED[args.trace]
        t = getattr(traces, loader)(str(TRACES / name))
    else:
        t = traces.load(args.trace)
    t = t[:args.requests].copy()
    t["arrival"] = (t["arrival"] - t["arrival"][0]) * args.time_scale
    t["input_tokens"] = np.clip(t["input_tokens"], 1, args.max_input)
    t["output_tokens"] = np.clip(t["output_tokens"], 1, args.max_output)
    return t


def random_prompts(tokenizer, lengths, seed):
    """Text of about each length: random ordinary tokens of the vocabulary, decoded."""
    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab_size
    special = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None}
    out = []
    for n in lengths:
        ids = [int(i) for i in rng.integers(100, vocab, size=int(n)) if int(i) not in special]
        out.append(tokenizer.decode(ids))
    return out


def percentiles(values):
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99))}


async def one(client, model, prompt, max_tokens, at, start):
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    sent = time.perf_counter()
    times, n_out, error = [], 0, None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=int(max_tokens), temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
            if chunk.usage is not None:
                n_out = chunk.usage.completion_tokens
    except Exception as e:  # reported, not raised: one failed request does not end the run
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    return {"sent": sent, "times": times, "end": end, "output_tokens": n_out, "error": error}


async def replay(args, trace, prompts):
    import openai
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                                timeout=600.0)
    model = args.model or (await client.models.list()).data[0].id
    start = time.perf_counter()
    results = await asyncio.gather(*[one(client, model, p, r["output_tokens"], r["arrival"], start)
                                     for p, r in zip(prompts, trace)])
    duration = time.perf_counter() - start
    await client.close()
    return model, results, duration


def summarize(results, duration):
    ok = [r for r in results if r["error"] is None and r["times"]]
    ttft = [r["times"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    tpot = [(r["end"] - r["times"][0]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
            "output_tokens": out_tokens, "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot),
            "itl_ms": percentiles(itl),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5]}


def print_summary(model, s):
    print(f"model {model}: {s['completed']} completed, {s['failed']} failed in "
          f"{s['duration_s']:.1f} s")
    print(f"  request throughput   {s['request_throughput']:.2f} req/s")
    print(f"  output throughput    {s['output_throughput']:.1f} tok/s")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        v = s[key]
        print(f"  {name:5s} ms  mean {v['mean']:8.1f}  median {v['median']:8.1f}  p99 {v['p99']:8.1f}")
    for e in s["errors"]:
        print(f"  error: {e}")


def check_args(args):
    """Every flag checked before anything is sent: one line and exit status 2 for a bad one."""
    for flag, value in (("--requests", args.requests), ("--max-input", args.max_input),
                        ("--max-output", args.max_output)):
        if value < 1:
            fail(f"{flag} must be at least 1, got {value}")
    for flag, value in (("--rate", args.rate), ("--time-scale", args.time_scale)):
        if not value > 0:
            fail(f"{flag} must be > 0, got {value}")


def fail(message, status=2):
    sys.stderr.write(f"gyges bench serve: error: {message}\n")
    sys.exit(status)


def main(args):
    import openai
    from ..models.model import load_tokenizer
    check_args(args)
    trace = load_trace(args)
    tokenizer = load_tokenizer(args.tokenizer)
    prompts = random_prompts(tokenizer, trace["input_tokens"], args.seed)
    try:
        model, results, duration = asyncio.run(replay(args, trace, prompts))
    except openai.AuthenticationError:
        fail(f"{args.base_url} refused the API key: give the server's key with --api-key", 1)
    except openai.APIConnectionError as e:
        fail(f"cannot reach {args.base_url} ({e}); is the server up?", 1)
    summary = summarize(results, duration)
    print_summary(model, summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "trace": args.trace, **summary},
                                              indent=2))
    return 0 if summary["failed"] == 0 else 1
