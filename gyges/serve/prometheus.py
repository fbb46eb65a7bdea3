"""/metrics in the Prometheus text exposition format (version 0.0.4): vLLM's metrics under vLLM's
own names and types, so that dashboards and alerts made for a vLLM server read a gyges one, and
gyges' own under `gyges:`.

vLLM's (labels model_name and engine="0", as vLLM's V1 engine writes them):
  vllm:num_requests_running, vllm:num_requests_waiting         gauges, every instance summed
  vllm:kv_cache_usage_perc (and its older name gpu_cache_usage_perc)
                                                              gauge: KV blocks in use / capacity
  vllm:num_preemptions_total, vllm:prompt_tokens_total,
  vllm:generation_tokens_total, vllm:request_success_total{finished_reason}    counters
  vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds,
  vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds,
  vllm:request_queue_time_seconds, vllm:request_prompt_tokens,
  vllm:request_generation_tokens                              histograms (vLLM's buckets)
gyges' own:
  gyges:num_requests_running / _waiting{instance, layout}     gauges per instance
  gyges:kv_cache_usage_perc{worker}                           gauge per worker
  gyges:memory_bytes{worker, tag}                             arena bytes: weights, kv, in_use
  gyges:reconfigurations_total, gyges:host_steps_total        counters
In front of a cluster, instance and worker series carry a `host` label, and gyges:cluster_hosts
counts the hosts alive.

Every family is written whole, its samples right after its # HELP and # TYPE lines: the format's
rule, which prometheus_client's parser (tests/test_server.py) holds it to.
"""
import bisect
import threading

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def _labels(labels):
    """{name: value} as the format writes it: `{a="x",b="y"}` (values escaped), or ''."""
    if not labels:
        return ""
    esc = (str(v).replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
           for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value):
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class Exposition:
    """Metric families in the order first named, each written whole."""

    def __init__(self):
        self._families = {}   # name -> (type, help, [sample lines])

    def family(self, name, kind, doc):
        return self._families.setdefault(name, (kind, doc, []))[2]

    def sample(self, name, kind, doc, labels, value, suffix=""):
        self.family(name, kind, doc).append(f"{name}{suffix}{_labels(labels)} {value}")

    def histogram(self, name, doc, labels, hist):
        out = self.family(name, "histogram", doc)
        running = 0
        for bound, n in zip((*hist.buckets, "+Inf"), hist.counts):
            running += n
            out.append(f"{name}_bucket{_labels({**labels, 'le': bound})} {running}")
        out.append(f"{name}_sum{_labels(labels)} {hist.sum}")
        out.append(f"{name}_count{_labels(labels)} {hist.count}")

    def text(self):
        lines = []
        for name, (kind, doc, samples) in self._families.items():
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples]
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """What the server observed of its requests; render() adds the host's state at that moment."""

    HISTOGRAMS = (  # (name, buckets, help)
        ("vllm:time_to_first_token_seconds", TTFT_BUCKETS, "Histogram of time to first token in "
                                                           "seconds."),
        ("vllm:time_per_output_token_seconds", TPOT_BUCKETS, "Histogram of time per output token "
                                                             "in seconds."),
        ("vllm:inter_token_latency_seconds", TPOT_BUCKETS, "Histogram of inter-token latency in "
                                                           "seconds."),
        ("vllm:e2e_request_latency_seconds", LATENCY_BUCKETS, "Histogram of end to end request "
                                                              "latency in seconds."),
        ("vllm:request_queue_time_seconds", LATENCY_BUCKETS, "Histogram of time spent waiting "
                                                             "before first scheduled, seconds."),
        ("vllm:request_prompt_tokens", TOKEN_BUCKETS, "Number of prefill tokens processed."),
        ("vllm:request_generation_tokens", TOKEN_BUCKETS, "Number of generation tokens "
                                                          "processed."))

    def __init__(self, model_name):
        self.model = model_name
        self.lock = threading.Lock()
        self.hist = {name: Histogram(buckets) for name, buckets, _ in self.HISTOGRAMS}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = {}

    def observe(self, request):
        """A finished request's latencies and counts."""
        m = request.metrics
        n_out = len(request.output_tokens)
        with self.lock:
            self.prompt_tokens += len(request.prompt)
            self.generation_tokens += n_out
            reason = request.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            h = self.hist
            h["vllm:request_prompt_tokens"].observe(len(request.prompt))
            h["vllm:request_generation_tokens"].observe(n_out)
            if m.token_times:
                h["vllm:time_to_first_token_seconds"].observe(max(m.ttft, 0.0))
                for gap in m.itl:
                    h["vllm:inter_token_latency_seconds"].observe(float(gap))
                if n_out > 1 and m.finish == m.finish:
                    h["vllm:time_per_output_token_seconds"].observe(max(m.tpot, 0.0))
            if m.scheduled == m.scheduled and m.scheduled is not None and m.scheduled >= 0:
                h["vllm:request_queue_time_seconds"].observe(max(m.scheduled - m.arrival, 0.0))
            if m.finish == m.finish:  # not NaN
                h["vllm:e2e_request_latency_seconds"].observe(max(m.e2e, 0.0))

    def render(self, host_stats, steps, memory=None):
        """The exposition of the host's (or cluster's) `host_stats` (Host.stats), its steps and
        per-worker `memory` (Host.memory, when it has one)."""
        ex = Exposition()
        base = {"model_name": self.model, "engine": "0"}
        model = {"model_name": self.model}
        insts, workers = host_stats["instances"], host_stats["workers"]
        for key, doc in (("running", "Number of requests in model execution batches."),
                         ("waiting", "Number of requests waiting to be processed.")):
            ex.sample(f"vllm:num_requests_{key}", "gauge", doc, base,
                      sum(inst[key] for inst in insts))
        used = sum(w["kv_blocks_used"] for w in workers)
        capacity = sum(w["kv_blocks_capacity"] for w in workers)
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            ex.sample(name, "gauge", "KV-cache usage. 1 means 100 percent usage.", base,
                      used / max(capacity, 1))
        ex.sample("vllm:num_preemptions_total", "counter", "Cumulative number of preemption "
                  "from the engine.", base, sum(inst.get("preemptions", 0) for inst in insts))
        with self.lock:
            ex.sample("vllm:prompt_tokens_total", "counter", "Number of prefill tokens "
                      "processed.", base, self.prompt_tokens)
            ex.sample("vllm:generation_tokens_total", "counter", "Number of generation tokens "
                      "processed.", base, self.generation_tokens)
            ex.family("vllm:request_success_total", "counter", "Count of successfully processed "
                      "requests.")
            for reason, n in sorted(self.finished.items()):
                ex.sample("vllm:request_success_total", "counter", "",
                          {**base, "finished_reason": reason}, n)
            for name, _, doc in self.HISTOGRAMS:
                ex.histogram(name, doc, base, self.hist[name])
        for i, inst in enumerate(insts):
            where = {**model, **({"host": inst["host"]} if "host" in inst else {}),
                     "instance": i, "layout": inst["layout"]}
            for key in ("running", "waiting"):
                ex.sample(f"gyges:num_requests_{key}", "gauge", f"Requests {key}, per instance.",
                          where, inst[key])
        for w in workers:
            where = {**model, **({"host": w["host"]} if "host" in w else {}),
                     "worker": w["worker"]}
            ex.sample("gyges:kv_cache_usage_perc", "gauge", "KV-cache usage per worker (1 is "
                      "full).", where, w["kv_blocks_used"] / max(w["kv_blocks_capacity"], 1))
        for row in memory or ():
            for tag in ("weights", "kv", "in_use", "peak"):
                ex.sample("gyges:memory_bytes", "gauge", "A worker's arena bytes: weights, KV, "
                          "all in use, the peak.", {**model, "worker": row["worker"], "tag": tag},
                          row[tag])
        if "hosts" in host_stats:
            ex.sample("gyges:cluster_hosts", "gauge", "Hosts alive.", model,
                      len(host_stats["hosts"]))
        ex.sample("gyges:reconfigurations_total", "counter", "Live reconfigurations started "
                  "(transformations, re-splits, switches, buddy groups, restores).", model,
                  host_stats["reconfigurations_started"])
        ex.sample("gyges:host_steps_total", "counter", "Host steps taken.", model, steps)
        return ex.text()
