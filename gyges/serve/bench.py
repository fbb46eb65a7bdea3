"""`gyges bench serve`: vLLM's `vllm bench serve` for any OpenAI-compatible endpoint (gyges,
vLLM, ...), driven by the official `openai` client, with vLLM's flags (gyges' older names kept
as aliases), vLLM's printed table and vLLM's result JSON keys.

    gyges bench serve --base-url http://127.0.0.1:8000 --backend openai-chat \\
        --dataset-name random --random-input-len 128 --random-output-len 32 \\
        --num-prompts 100 --request-rate 8 --max-concurrency 16 --save-result

The requests (datasets, lengths, arrivals) are built by bench_data.py. Every request streams,
asking for usage (stream_options include_usage), so token counts are the server's: output tokens
from `usage.completion_tokens`, input tokens from `usage.prompt_tokens` (which counts a chat
template's tokens too); a server that sends no usage has its streamed chunks counted instead,
and the JSON says which (output_tokens_from, input_tokens_from).

Timing, per request, on the client: start when it leaves the --max-concurrency semaphore
(queue_times: how long it waited there), TTFT at the first chunk carrying text, ITL between
chunks carrying text, TPOT = (last token chunk - first) / (output tokens - 1), and E2E latency
until the stream has ended, when the semaphore is released: so start_times + latencies are
exactly the intervals a request held a slot.
"""
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from . import bench_data

BACKENDS = {"openai": "completions", "vllm": "completions", "completions": "completions",
            "openai-chat": "chat", "chat": "chat"}
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
METRICS = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
_TOKENIZERS = {}


def add_arguments(p):
    a = p.add_argument
    a("--base-url", default=None, help="the server: http://HOST:PORT (vLLM's form) or its /v1 "
                                       "URL; default http://--host:--port")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--endpoint", default=None, help="/v1/completions or /v1/chat/completions (sets --backend)")
    a("--backend", "--endpoint-type", dest="backend", default="openai",
      help="openai or completions: /v1/completions; openai-chat or chat: /v1/chat/completions")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    a("--model", default=None, help="default: the first of the server's /v1/models")
    a("--tokenizer", default="smollm2-135m-instruct",
      help="builds and counts the prompts (a packaged model, .gguf or HF directory)")
    a("--dataset-name", "--trace", dest="dataset_name", default="random",
      help="random (or synthetic), sharegpt, azure, mooncake, burstgpt, or a trace file")
    a("--dataset-path", default=None,
      help="the file of sharegpt or burstgpt (azure, mooncake: default ../shared/traces)")
    a("--num-prompts", "--requests", dest="num_prompts", type=int, default=50)
    a("--request-rate", "--rate", dest="request_rate", type=float, default=None,
      help=f"requests/s, or inf: all at once (default {bench_data.DEFAULT_RATE:g}; a trace's "
           "own arrival times)")
    a("--burstiness", type=float, default=1.0,
      help="gamma shape of the gaps between arrivals: 1 Poisson, < 1 burstier, inf even")
    a("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    a("--time-scale", type=float, default=1.0, help="multiplies the arrival times (< 1 compresses)")
    a("--random-input-len", "--input-len", dest="random_input_len", type=int, default=None)
    a("--random-output-len", "--output-len", dest="random_output_len", type=int, default=None)
    a("--random-range-ratio", type=float, default=0.0,
      help="random lengths uniform in [L*(1-r), L*(1+r)]")
    a("--max-input", type=int, default=None,
      help="caps every prompt's length (default 512, or the --random-input-len range)")
    a("--max-output", type=int, default=None,
      help="caps every output length (default 128, or the --random-output-len range)")
    a("--temperature", type=float, default=0.0)
    a("--ignore-eos", action="store_true",
      help="ask for every output's full length (always on for random and trace datasets)")
    a("--seed", type=int, default=0)
    a("--disable-tqdm", action="store_true")
    a("--percentile-metrics", default="ttft,tpot,itl,e2el", help="of ttft, tpot, itl, e2el")
    a("--metric-percentiles", default="99", help="e.g. 50,90,99")
    a("--save-result", action="store_true", help="write the result JSON (vLLM's keys)")
    a("--save-detailed", action="store_true",
      help="with per-request lists: input_lens, output_lens, ttfts, itls, start_times, ...")
    a("--result-dir", default=None)
    a("--result-filename", default=None)
    a("--json", default=None, help="write the result JSON to this file (--save-result "
                                   "--result-filename JSON)")
    a("--label", default=None, help="the result file's prefix (default: --backend)")
    a("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="saved in the JSON")
    # a bad value (`--num-prompts x`) is one line too, not argparse's usage text
    p.error = lambda message: fail(message)


def fail(message, status=2):
    sys.stderr.write(f"gyges bench serve: error: {message}\n")
    sys.exit(status)


def check_args(args):
    """Every flag checked before anything is loaded or sent: one line, exit status 2. Fills in
    args.kind (the dataset), args.api (completions or chat), args.url, args.percentiles."""
    for flag, value in (("--num-prompts/--requests", args.num_prompts),
                        ("--max-input", args.max_input), ("--max-output", args.max_output),
                        ("--random-input-len", args.random_input_len),
                        ("--random-output-len", args.random_output_len),
                        ("--max-concurrency", args.max_concurrency)):
        if value is not None and value < 1:
            fail(f"{flag} must be at least 1, got {value}")
    for flag, value, finite in (("--request-rate/--rate", args.request_rate, False),
                                ("--burstiness", args.burstiness, False),
                                ("--time-scale", args.time_scale, True)):
        if value is not None and not (value > 0 and (math.isfinite(value) or not finite)):
            fail(f"{flag} must be > 0{' and finite' if finite else ''}, got {value}")
    if not 0 <= args.random_range_ratio < 1:
        fail(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not 0 <= args.temperature <= 2:
        fail(f"--temperature must be in [0, 2], got {args.temperature}")
    if not 0 <= args.port <= 65535:
        fail(f"--port must be in 0..65535, got {args.port}")
    if args.endpoint is not None:
        api = {v: k for k, v in ENDPOINTS.items()}.get(args.endpoint.rstrip("/"))
        if api is None:
            fail("--endpoint must be /v1/completions or /v1/chat/completions, "
                 f"got {args.endpoint!r}")
        args.backend = "openai" if api == "completions" else "openai-chat"
    if args.backend not in BACKENDS:
        fail(f"--backend/--endpoint-type must be one of {', '.join(BACKENDS)}, "
             f"got {args.backend!r}")
    args.api = BACKENDS[args.backend]
    args.kind = bench_data.dataset_kind(args.dataset_name)
    if args.kind is None:
        fail(f"--dataset-name must be one of {', '.join(bench_data.DATASETS)} or a trace file, "
             f"got {args.dataset_name!r}")
    if args.kind in ("sharegpt", "burstgpt") and args.dataset_path is None:
        fail(f"--dataset-name {args.kind} needs --dataset-path (its file)")
    if args.kind in ("random", "file") and args.dataset_path is not None:
        fail("--dataset-path is for sharegpt, azure, mooncake and burstgpt, "
             f"not {args.dataset_name}")
    path = args.dataset_path or (bench_data.TRACES / bench_data.NAMED[args.kind][1]
                                 if args.kind in ("azure", "mooncake") else None)
    if path is not None and not Path(path).is_file():
        fail(f"no {args.kind} file at {path}" + ("" if args.dataset_path else
                                                 " (give one with --dataset-path)"))
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRICS]
    if bad or not metrics:
        fail(f"--percentile-metrics takes {','.join(METRICS)}, got {args.percentile_metrics!r}")
    args.metrics = metrics
    try:
        args.percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        args.percentiles = [math.nan]
    if not all(0 < p <= 100 for p in args.percentiles):
        fail(f"--metric-percentiles takes numbers in (0, 100] like 50,90,99, "
             f"got {args.metric_percentiles!r}")
    if any("=" not in kv for kv in args.metadata or ()):
        fail(f"--metadata takes KEY=VALUE pairs, got {args.metadata}")
    args.url = base_url(args)


def base_url(args):
    """The /v1 root the openai client wants. vLLM's --base-url has no /v1 (it adds the
    endpoint's path); gyges' had it: both are taken."""
    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    scheme, _, rest = url.partition("://")
    if scheme not in ("http", "https") or not rest:
        fail(f"--base-url must be an http:// or https:// URL, got {args.base_url!r}")
    return url if "/" in rest else url + "/v1"


# ---------------------------------------------------------------------------------------------
# Sending


async def one(client, args, model, prompt, max_tokens, at, t0, slots, bar):
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    arrived = time.perf_counter()
    r = {"queue": 0.0, "times": [], "text": [], "usage": None, "error": None}
    async with slots:
        r["start"] = time.perf_counter()
        r["queue"] = r["start"] - arrived
        common = dict(model=model, temperature=args.temperature, stream=True,
                      stream_options={"include_usage": True},
                      extra_body={"ignore_eos": True} if args.ignore_eos else None)
        try:
            if args.api == "chat":
                stream = await client.chat.completions.create(
                    messages=[{"role": "user", "content": prompt}],
                    max_completion_tokens=max_tokens, **common)
            else:
                stream = await client.completions.create(prompt=prompt, max_tokens=max_tokens,
                                                         **common)
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices:
                    c = chunk.choices[0]
                    text = c.delta.content if args.api == "chat" else c.text
                    if text:   # (a chat stream's first chunk carries only the role)
                        r["times"].append(now)
                        r["text"].append(text)
                if chunk.usage is not None:
                    r["usage"] = chunk.usage
        except Exception as e:  # reported, not raised: one failed request does not end the run
            r["error"] = f"{type(e).__name__}: {e}"
        r["end"] = time.perf_counter()   # the stream has ended: the slot is released next
    if r["error"] is None and not r["times"]:
        r["error"] = "the stream ended without any text"
    if bar is not None:
        bar.update(1)
    return r


def client_of(args):
    import openai
    return openai.AsyncOpenAI(base_url=args.url, api_key=args.api_key, max_retries=0,
                              timeout=600.0)


async def replay(args, model, requests):
    client = client_of(args)
    try:
        print(f"model {model} at {args.url}{ENDPOINTS[args.api][3:]}; dataset {args.dataset_name}, "
              f"{len(requests)} requests")
        rate = requests.timed_by
        print(f"Traffic request rate: {rate if rate == 'trace' else f'{rate:g}'}")
        print(f"Burstiness factor: {args.burstiness}"
              f" ({'Poisson process' if args.burstiness == 1 else 'Gamma distribution'})")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        slots = (asyncio.Semaphore(args.max_concurrency) if args.max_concurrency
                 else contextlib.nullcontext())
        bar = None
        if not args.disable_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), desc="requests", unit="req")
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            one(client, args, model, p, n, at, t0, slots, bar)
            for p, n, at in zip(requests.prompts, requests.output_lens, requests.arrivals)])
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        for r in results:
            r["start"] -= t0   # times from the benchmark's start
            r["times"] = [t - t0 for t in r["times"]]
            r["end"] -= t0
        return results, duration
    finally:
        await client.close()


async def pick_model(args):
    """--model, checked against /v1/models, or the first model listed there: a server that is
    down, refuses the key or lacks the model is one line, exit status 1 (before the prompts are
    built)."""
    import openai
    client = client_of(args)
    try:
        ids = [m.id for m in (await client.models.list()).data]
    except openai.AuthenticationError:
        fail(f"{args.url} refused the API key: give the server's key with --api-key", 1)
    except openai.APIConnectionError as e:
        fail(f"cannot reach {args.url} ({e}); is the server up?", 1)
    except openai.APIStatusError as e:
        fail(f"{args.url}/models answered {e.status_code}: is --base-url the server's?", 1)
    finally:
        await client.close()
    if not ids:
        fail(f"{args.url} serves no model", 1)
    if args.model is not None and args.model not in ids:
        fail(f"{args.url} does not serve the model {args.model!r} (it serves "
             f"{', '.join(map(repr, ids))})", 1)
    return args.model or ids[0]


# ---------------------------------------------------------------------------------------------
# Metrics, report and result


def metrics(args, requests, results, duration):
    """vLLM's result keys, in its order, from the per-request records."""
    ok = [r["error"] is None for r in results]
    in_lens, out_lens, from_in, from_out = [], [], set(), set()
    for r, expected in zip(results, requests.input_lens):
        u = r["usage"]
        in_lens.append(u.prompt_tokens if u is not None else expected)
        out_lens.append(u.completion_tokens if u is not None else len(r["times"]))
        if r["error"] is None:   # (a failed request has no usage to say anything)
            from_in.add("usage" if u is not None else "tokenizer")
            from_out.add("usage" if u is not None else "streamed chunks")
    good = [(r, n) for r, n, g in zip(results, out_lens, ok) if g]
    total_in = sum(n for n, g in zip(in_lens, ok) if g)
    total_out = sum(n for _, n in good)
    ttft = [r["times"][0] - r["start"] for r, _ in good]
    tpot = [(r["times"][-1] - r["times"][0]) / (n - 1) for r, n in good if n > 1]
    itl = [b - a for r, _ in good for a, b in zip(r["times"], r["times"][1:])]
    e2el = [r["end"] - r["start"] for r, _ in good]
    res = {"duration": duration, "completed": len(good), "failed": len(results) - len(good),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(good) / duration, "request_goodput": None,
           "output_throughput": total_out / duration,
           "total_token_throughput": (total_in + total_out) / duration,
           "input_lens": in_lens, "output_lens": [n if g else 0 for n, g in zip(out_lens, ok)],
           "ttfts": [r["times"][0] - r["start"] if g else 0.0 for r, g in zip(results, ok)],
           "itls": [[b - a for a, b in zip(r["times"], r["times"][1:])] for r in results],
           "latencies": [r["end"] - r["start"] for r in results],
           "start_times": [r["start"] for r in results],
           "queue_times": [r["queue"] for r in results],
           "generated_texts": ["".join(r["text"]) for r in results],
           "errors": [r["error"] or "" for r in results],
           "max_output_tokens_per_s": peak_output(good),
           "max_concurrent_requests": peak_concurrency([r for r, _ in good])}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        if name in args.metrics:
            a = np.asarray(values or [0.0]) * 1000.0   # (vLLM reports 0 where there is none)
            res[f"mean_{name}_ms"] = float(a.mean())
            res[f"median_{name}_ms"] = float(np.median(a))
            res[f"std_{name}_ms"] = float(a.std())
            for p in args.percentiles:
                res[f"p{p_word(p)}_{name}_ms"] = float(np.percentile(a, p))
    res["input_tokens_from"] = "+".join(sorted(from_in))
    res["output_tokens_from"] = "+".join(sorted(from_out))
    return res


def p_word(p):
    return str(int(p)) if p == int(p) else str(p)


def peak_output(good):
    """The most output tokens in one second (bins from the start), each request's tokens spread
    evenly over its text chunks (a chunk may carry several tokens, or part of one)."""
    if not good:
        return 0.0
    bins = np.zeros(int(max(t for r, _ in good for t in r["times"])) + 1)
    for r, n in good:
        np.add.at(bins, np.asarray(r["times"], dtype=int), n / len(r["times"]))
    return float(bins.max())


def peak_concurrency(rs):
    """The most requests in flight at once, over their [start, end) intervals (an end before a
    start at the same instant)."""
    events = sorted([(r["start"], 1) for r in rs] + [(r["end"], -1) for r in rs])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def print_report(args, res, rate):
    def row(name, value, fmt=""):
        print("{:<40} {:<10{}}".format(name, value, fmt))
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if args.max_concurrency is not None:
        row("Maximum request concurrency:", args.max_concurrency)
    if rate != "trace" and not math.isinf(rate):
        row("Request rate configured (RPS):", rate, ".2f")
    row("Benchmark duration (s):", res["duration"], ".2f")
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", res["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", res["max_concurrent_requests"], ".2f")
    row("Total token throughput (tok/s):", res["total_token_throughput"], ".2f")
    for name in METRICS:
        if name not in args.metrics:
            continue
        short, header = METRICS[name]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", res[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", res[f"median_{name}_ms"], ".2f")
        for p in args.percentiles:
            row(f"P{p_word(p)} {short} (ms):", res[f"p{p_word(p)}_{name}_ms"], ".2f")
    print("=" * 50)
    if "streamed chunks" in res["output_tokens_from"]:
        print("note: the server sent no usage for some requests: their output tokens are "
              "streamed chunks counted")


def result_json(args, model, requests, res):
    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend,
           "backend": args.backend, "label": args.label, "model_id": model,
           "tokenizer_id": args.tokenizer, "num_prompts": args.num_prompts}
    out.update(kv.split("=", 1) for kv in args.metadata or ())
    rate = requests.timed_by
    out.update(request_rate=rate if rate == "trace" or not math.isinf(rate) else "inf",
               burstiness=args.burstiness if math.isfinite(args.burstiness) else "inf",
               max_concurrency=args.max_concurrency, **res,
               dataset_name=args.dataset_name, endpoint=ENDPOINTS[args.api],
               ignore_eos=args.ignore_eos)
    if not args.save_detailed:   # vLLM's way: the long lists only when asked for
        for key in ("input_lens", "output_lens", "ttfts", "itls", "start_times",
                    "generated_texts", "errors"):
            del out[key]
    return out


def result_path(args, model, out):
    if args.json:
        return Path(args.json)
    c = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or (f"{args.label or args.backend}-{out['request_rate']}qps{c}-"
                                    f"{model.split('/')[-1]}-{out['date']}.json")
    return Path(args.result_dir or ".") / name


def main(args):
    from ..core.errors import Error
    from ..models.model import load_tokenizer
    check_args(args)
    if args.kind in ("random", "file", "azure", "mooncake", "burstgpt"):
        args.ignore_eos = True   # a random or trace prompt asks for its length (vLLM: random)
    model = asyncio.run(pick_model(args))
    try:
        if args.tokenizer not in _TOKENIZERS:   # (seconds for a GGUF: a second run reuses it)
            _TOKENIZERS[args.tokenizer] = load_tokenizer(args.tokenizer)
    except (Error, OSError) as e:
        fail(f"--tokenizer {args.tokenizer}: {e}")
    try:
        requests = bench_data.build(args, args.kind, _TOKENIZERS[args.tokenizer])
    except Error as e:
        fail(str(e), 1)
    results, duration = asyncio.run(replay(args, model, requests))
    res = metrics(args, requests, results, duration)
    print_report(args, res, requests.timed_by)
    errors = [e for e in res["errors"] if e]
    if errors:
        print(f"{len(errors)} requests failed; the first: {errors[0]}")
    if args.save_result or args.json:
        out = result_json(args, model, requests, res)
        path = result_path(args, model, out)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=2))
        except OSError as e:
            fail(f"cannot write the result to {path}: {e}", 1)
        print(f"result saved to {path}")
    return 0 if res["failed"] == 0 else 1
