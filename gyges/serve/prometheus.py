"""/metrics in the Prometheus text format, with vLLM's metric names under a `gyges:` prefix, so
that dashboards and scrapers made for vLLM read a gyges server.

  gyges:num_requests_running, gyges:num_requests_waiting     gauges, per instance layout
  gyges:kv_cache_usage_perc{worker}                           KV blocks in use / capacity
  gyges:time_to_first_token_seconds                           histogram
  gyges:inter_token_latency_seconds                           histogram (vLLM's, formerly
                                                              time_per_output_token)
  gyges:e2e_request_latency_seconds                           histogram
  gyges:prompt_tokens_total, gyges:generation_tokens_total    counters
  gyges:request_success_total{finished_reason}                counter
  gyges:reconfigurations_total, gyges:host_steps_total       counters
In front of a cluster, instance and worker series carry a `host` label, and
gyges:cluster_num_requests_running / _waiting and gyges:cluster_hosts give the sums.
"""
import bisect
import threading

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _host(row):
    """The host label of a cluster's row (none for one host's)."""
    return f'host="{row["host"]}",' if "host" in row else ""


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

    def lines(self, name, labels):
        out, running = [], 0
        for bound, n in zip((*self.buckets, "+Inf"), self.counts):
            running += n
            out.append(f'{name}_bucket{{{labels}le="{bound}"}} {running}')
        out.append(f"{name}_sum{{{labels[:-1]}}} {self.sum}" if labels else f"{name}_sum {self.sum}")
        out.append(f"{name}_count{{{labels[:-1]}}} {self.count}" if labels else
                   f"{name}_count {self.count}")
        return out


class ServerMetrics:
    """What the server observed of its requests; render() adds the host's state at that moment."""

    def __init__(self, model_name):
        self.model = model_name
        self.lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = {}

    def observe(self, request):
        """A finished request's latencies and counts."""
        m = request.metrics
        with self.lock:
            self.prompt_tokens += len(request.prompt)
            self.generation_tokens += len(request.output_tokens)
            reason = request.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if m.token_times:
                self.ttft.observe(max(m.ttft, 0.0))
                for gap in m.itl:
                    self.itl.observe(float(gap))
            if m.finish == m.finish:  # not NaN
                self.e2e.observe(max(m.e2e, 0.0))

    def render(self, host_stats, steps):
        label = f'model_name="{self.model}",'
        lines = []

        def family(name, kind, doc):
            lines.append(f"# HELP {name} {doc}")
            lines.append(f"# TYPE {name} {kind}")

        family("gyges:num_requests_running", "gauge", "Requests in the running batch.")
        family("gyges:num_requests_waiting", "gauge", "Requests waiting to be scheduled.")
        for i, inst in enumerate(host_stats["instances"]):
            where = f'{label}{_host(inst)}instance="{i}",layout="{inst["layout"]}"'
            lines.append(f"gyges:num_requests_running{{{where}}} {inst['running']}")
            lines.append(f"gyges:num_requests_waiting{{{where}}} {inst['waiting']}")
        if "hosts" in host_stats:   # in front of a cluster: the sums over its hosts too
            family("gyges:cluster_num_requests_running", "gauge", "Running, every host.")
            family("gyges:cluster_num_requests_waiting", "gauge", "Waiting, every host.")
            family("gyges:cluster_hosts", "gauge", "Hosts alive.")
            for key in ("running", "waiting"):
                total = sum(inst[key] for inst in host_stats["instances"])
                lines.append(f"gyges:cluster_num_requests_{key}{{{label[:-1]}}} {total}")
            lines.append(f"gyges:cluster_hosts{{{label[:-1]}}} {len(host_stats['hosts'])}")
        family("gyges:kv_cache_usage_perc", "gauge", "KV-cache usage per worker (1 is full).")
        for w in host_stats["workers"]:
            used = w["kv_blocks_used"] / max(w["kv_blocks_capacity"], 1)
            lines.append(f'gyges:kv_cache_usage_perc{{{label}{_host(w)}worker="{w["worker"]}"}} '
                         f'{used}')
        with self.lock:
            for name, hist, doc in (
                    ("gyges:time_to_first_token_seconds", self.ttft, "Time to first token."),
                    ("gyges:inter_token_latency_seconds", self.itl, "Time between tokens."),
                    ("gyges:e2e_request_latency_seconds", self.e2e, "End-to-end latency.")):
                family(name, "histogram", doc)
                lines += hist.lines(name, label)
            family("gyges:prompt_tokens_total", "counter", "Prompt tokens processed.")
            lines.append(f"gyges:prompt_tokens_total{{{label[:-1]}}} {self.prompt_tokens}")
            family("gyges:generation_tokens_total", "counter", "Tokens generated.")
            lines.append(f"gyges:generation_tokens_total{{{label[:-1]}}} {self.generation_tokens}")
            family("gyges:request_success_total", "counter", "Finished requests by reason.")
            for reason, n in sorted(self.finished.items()):
                lines.append(f'gyges:request_success_total{{{label}finished_reason="{reason}"}} {n}')
        family("gyges:reconfigurations_total", "counter",
               "Live reconfigurations started (transformations, re-splits, switches, buddy "
               "groups, restores).")
        lines.append(f"gyges:reconfigurations_total{{{label[:-1]}}} "
                     f"{host_stats['reconfigurations_started']}")
        family("gyges:host_steps_total", "counter", "Host steps taken.")
        lines.append(f"gyges:host_steps_total{{{label[:-1]}}} {steps}")
        return "\n".join(lines) + "\n"
