"""`gyges bench serve` as vLLM's `vllm bench serve`: vLLM's flags (and gyges' older names) against
a real server over the packaged SmolLM2, on both endpoints, streaming; vLLM's printed table and
result JSON, whose totals add up (completed == num_prompts, total output tokens == the sum of
the server's per-request usage, throughputs == totals / duration) and whose per-request start
times and latencies show that --max-concurrency was never exceeded; and every mistake (a bad
flag value, a wrong or missing key, a model the server lacks, a server that is down) is one line
on stderr with exit status 2 or 1."""
import json
import math

import pytest

import gyges
from gyges.serve import bench_data
from packaged import NAME, needs_packaged_model

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from gyges.serve import Server  # noqa: E402
from gyges.serve.cli import main  # noqa: E402

pytestmark = needs_packaged_model
KEY = "bench-key"
ERROR = "gyges bench serve: error: "

# vLLM's result keys, in its order (vllm/benchmarks/serve.py), with --save-detailed's lists
VLLM_KEYS = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
             "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
             "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies",
             "start_times", "queue_times", "generated_texts", "errors", "max_output_tokens_per_s",
             "max_concurrent_requests"]
ROWS = ["Successful requests:", "Failed requests:", "Maximum request concurrency:",
        "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
        "Request throughput (req/s):", "Output token throughput (tok/s):",
        "Peak output token throughput (tok/s):", "Peak concurrent requests:",
        "Total token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):",
        "P50 TTFT (ms):", "P90 TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "Mean ITL (ms):",
        "Mean E2EL (ms):", "P99 E2EL (ms):"]


@pytest.fixture(scope="module")
def server():
    h = gyges.Host(gyges.Model.load(NAME), workers=1, memory_per_worker="768MiB",
                   max_batch_tokens=256)
    s = Server(h, NAME, port=0, api_key=KEY).start()
    yield s
    s.stop()
    h.close()


def bench(capsys, *args):
    """(exit status, stdout, stderr) of `gyges bench serve ARGS`, run in this process."""
    try:
        code = main(["bench", "serve", *args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def most_in_flight(starts, latencies):
    """The most requests in flight at once, from the JSON's own per-request intervals."""
    events = sorted([(s, 1) for s in starts] + [(s + d, -1) for s, d in zip(starts, latencies)])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("backend, tqdm", [("openai", True), ("openai-chat", False)])
def test_vllm_flags_report_and_result_on_both_endpoints(server, capsys, tmp_path, backend, tqdm):
    n, out_len = 4, 4
    code, out, err = bench(
        capsys, "--base-url", f"http://127.0.0.1:{server.port}", "--backend", backend,
        "--api-key", KEY, "--dataset-name", "random", "--random-input-len", "8",
        "--random-output-len", str(out_len), "--num-prompts", str(n), "--request-rate", "inf",
        "--max-concurrency", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--seed", "1", "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path), *([] if tqdm else ["--disable-tqdm"]))
    assert code == 0, out + err
    assert ("requests: 100%" in err) == tqdm and "Traceback" not in err
    table = out[out.index("============ Serving Benchmark Result ============"):]
    at = [table.index(row) for row in ROWS]
    assert at == sorted(at), out   # vLLM's rows in vLLM's order

    [path] = tmp_path.iterdir()
    assert path.name.startswith(f"{backend}-infqps-concurrency2-{NAME}-")
    d = json.loads(path.read_text())
    assert [k for k in d if k in VLLM_KEYS] == VLLM_KEYS
    assert d["backend"] == backend and d["max_concurrency"] == 2 and d["request_rate"] == "inf"
    assert d["completed"] == d["num_prompts"] == n and d["failed"] == 0
    assert d["output_tokens_from"] == d["input_tokens_from"] == "usage"
    # the server's usage: ignore_eos makes every output the length asked for
    assert d["output_lens"] == [out_len] * n
    assert d["total_output_tokens"] == sum(d["output_lens"])
    assert d["total_input_tokens"] == sum(d["input_lens"])
    if backend == "openai":   # the prompt as built (+ BOS); chat adds its template's tokens
        assert all(k in (8, 9) for k in d["input_lens"]), d["input_lens"]
    else:
        assert all(k > 9 for k in d["input_lens"]), d["input_lens"]
    dur = d["duration"]
    assert d["request_throughput"] == pytest.approx(n / dur)
    assert d["output_throughput"] == pytest.approx(d["total_output_tokens"] / dur)
    assert d["total_token_throughput"] == pytest.approx(
        (d["total_input_tokens"] + d["total_output_tokens"]) / dur)
    # at most 2 in flight, by the JSON's own start times and latencies (all sent at once: 2)
    assert most_in_flight(d["start_times"], d["latencies"]) == d["max_concurrent_requests"] == 2
    assert max(d["queue_times"]) > 0   # the other two waited for a slot
    assert all(0 <= s and s + lat <= dur for s, lat in zip(d["start_times"], d["latencies"]))
    assert all(0 < t < lat for t, lat in zip(d["ttfts"], d["latencies"]))
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert d[f"p50_{m}_ms"] == pytest.approx(d[f"median_{m}_ms"])
        assert 0 < d[f"mean_{m}_ms"] and d[f"p90_{m}_ms"] <= d[f"p99_{m}_ms"]
    assert d["mean_e2el_ms"] == pytest.approx(1000 * sum(d["latencies"]) / n)
    assert all(d["generated_texts"]) and not any(d["errors"])


def test_gygeses_older_flags_and_a_real_trace(server, capsys, tmp_path):
    """--trace, --requests, --max-input/--max-output, --json and a /v1 base URL still work; the
    Azure trace gives the lengths (capped) and, scaled, the arrival times."""
    if not (bench_data.TRACES / "azure_llm_2023_conv.csv").is_file():
        pytest.skip(f"no Azure trace under {bench_data.TRACES}")
    path = tmp_path / "r.json"
    code, out, err = bench(capsys, "--base-url", server.url, "--api-key", KEY, "--trace", "azure",
                           "--requests", "3", "--max-input", "8", "--max-output", "3",
                           "--time-scale", "0.001", "--json", str(path), "--disable-tqdm")
    assert code == 0 and err == "", out + err
    d = json.loads(path.read_text())
    assert d["completed"] == 3 and d["request_rate"] == "trace" and d["dataset_name"] == "azure"
    assert "output_lens" not in d   # (vLLM's: the lists only with --save-detailed)
    assert 3 <= d["total_output_tokens"] <= 9 and d["max_concurrent_requests"] >= 1
    assert d["p99_ttft_ms"] > 0 and "Request rate configured" not in out


def test_sharegpt_prompts_through_chat(server, capsys, tmp_path):
    conv = [{"conversations": [{"from": "human", "value": f"Name a color, {i}."},
                               {"from": "gpt", "value": "Blue is a color."}]} for i in range(3)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(conv + [{"conversations": []}]))
    code, out, err = bench(capsys, "--base-url", server.url, "--api-key", KEY,
                           "--endpoint-type", "chat", "--dataset-name", "sharegpt",
                           "--dataset-path", str(data), "--num-prompts", "2", "--max-output", "3",
                           "--request-rate", "20", "--burstiness", "0.5", "--disable-tqdm",
                           "--save-result", "--result-dir", str(tmp_path / "out"),
                           "--result-filename", "s.json")
    assert code == 0, out + err
    d = json.loads((tmp_path / "out" / "s.json").read_text())
    assert d["completed"] == 2 and d["endpoint"] == "/v1/chat/completions"
    assert d["request_rate"] == 20 and d["burstiness"] == 0.5 and d["ignore_eos"] is False
    assert "Request rate configured (RPS):           20.00" in out


@pytest.mark.parametrize("args, says", [
    (["--max-concurrency", "0"], "--max-concurrency must be at least 1, got 0"),
    (["--num-prompts", "0"], "--num-prompts/--requests must be at least 1, got 0"),
    (["--request-rate", "-1"], "--request-rate/--rate must be > 0, got -1.0"),
    (["--request-rate", "nan"], "--request-rate/--rate must be > 0, got nan"),
    (["--num-prompts", "many"], "argument --num-prompts/--requests: invalid int value: 'many'"),
    (["--metric-percentiles", "50,101"], "--metric-percentiles takes numbers in (0, 100]"),
    (["--percentile-metrics", "ttft,goodput"], "--percentile-metrics takes ttft,tpot,itl,e2el"),
    (["--backend", "tgi"], "--backend/--endpoint-type must be one of"),
    (["--endpoint", "/v1/embeddings"], "--endpoint must be /v1/completions or"),
    (["--dataset-name", "nope"], "--dataset-name must be one of random"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--burstiness", "0"], "--burstiness must be > 0"),
    (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1)"),
    (["--time-scale", "inf"], "--time-scale must be > 0 and finite"),
    (["--metadata", "novalue"], "--metadata takes KEY=VALUE"),
    (["--dataset-name", "burstgpt", "--dataset-path", "/no/such.csv"],
     "no burstgpt file at /no/such.csv"),
    (["--base-url", "127.0.0.1:8000"], "--base-url must be an http:// or https:// URL"),
    (["--tokenizer", "nope"], "--tokenizer nope: nope: no such GGUF file"),
])
def test_every_bad_flag_value_is_one_line(server, capsys, args, says):
    code, out, err = bench(capsys, "--base-url", server.url, "--api-key", KEY, *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(ERROR) and says in err, err


@pytest.mark.parametrize("args, says", [
    (["--model", "nope"], "does not serve the model 'nope' (it serves 'smollm2-135m-instruct')"),
    (["--api-key", "wrong"], "refused the API key: give the server's key with --api-key"),
    ([], "refused the API key"),   # no key at all
], ids=["model", "wrong-key", "no-key"])
def test_a_server_that_refuses_is_one_line(server, capsys, monkeypatch, args, says):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    key = [] if "--api-key" in args or not args else ["--api-key", KEY]
    code, out, err = bench(capsys, "--base-url", server.url, *key, "--num-prompts", "1", *args)
    assert code == 1
    assert err.count("\n") == 1 and err.startswith(ERROR) and says in err, err


def test_a_server_that_is_down_is_one_line(capsys):
    code, out, err = bench(capsys, "--port", "9", "--num-prompts", "1")
    assert code == 1 and err.count("\n") == 1 and "cannot reach http://127.0.0.1:9/v1" in err, err


def test_without_usage_the_streamed_chunks_are_counted_and_said_so():
    """A server that sends no usage: output tokens are its text chunks, and the JSON says so."""
    import argparse
    args = argparse.Namespace(metrics=["ttft", "tpot"], percentiles=[99.0])
    reqs = bench_data.Requests(["a", "b"], [5, 6], [3, 3], [0.0, 0.0], "inf")
    rs = [{"start": 0.0, "times": [0.1, 0.2, 0.3], "end": 0.4, "usage": None, "error": None,
           "text": ["x"] * 3, "queue": 0.0},
          {"start": 0.1, "times": [0.3, 0.5], "end": 0.6, "usage": None, "error": None,
           "text": ["y"] * 2, "queue": 0.1}]
    from gyges.serve.bench import metrics
    d = metrics(args, reqs, rs, 1.0)
    assert d["output_tokens_from"] == "streamed chunks" and d["input_tokens_from"] == "tokenizer"
    assert d["total_output_tokens"] == 5 and d["total_input_tokens"] == 11
    assert d["max_concurrent_requests"] == 2 and d["mean_tpot_ms"] == pytest.approx(150.0)
    assert math.isclose(d["mean_ttft_ms"], 150.0)
