"""KunServe: buddy groups on the CPU host and in the simulator, beside the paper's figures.

1. Drop to KV usable on the CPU host (tiny model, 4 workers of 32 MiB, no requests): the time of
   host.buddy per layer dropped (paper: microseconds per map), the weight bytes released against
   (g - 1) x P (P: one replica's parameters as held, page-exact), and the KV tokens the group
   holds against its members' as replicas.
2. The exchange under load on the CPU host: 2-8 requests of 1,000-2,000 tokens per member, on a
   link of 200 Gbps scaled to the tiny model (a token's KV crosses as fast as qwen2.5-14b's on
   the paper's RDMA): blocking (serving stops for the KV's time on the link) against live (the
   KV takes what the link leaves over, victims attend remotely meanwhile): the stall, the
   steps the live exchange takes, and the mean decode step over that window (paper Fig. 14:
   51.7-79.8% lower during the exchange; blocking stalls up to 8.8 s); then the restore the same
   way (live: the weights and then the KV, patched, stream back over the link while the group
   serves; only the switch stops it).
3. The simulator at paper scale (8 A800-80GB, qwen2.5-14b, 200 Gbps RDMA, pipelines with one
   micro-batch per stage) on two bursts at 100 s (BURSTS: a BurstGPT-like x14 spike of
   1,000-token outputs, compute-bound; a x3 spike for 60 s of 3,000-token outputs, where the
   replicas' KV fills first): P50 / P99 TTFT, the share of requests over a 5 s TTFT SLO and
   P50 TPOT for kunserve, replication (least_load),
   replication that swaps preempted requests' KV to host memory over PCIe (25 GB/s per GPU)
   instead of recomputing it, Llumnix-style live migration between replicas (policy llumnix),
   a static pipeline of groups of 2, kunserve without live restore (its groups, weights back,
   finish their requests as pipelines before they dissolve) and with memory-greedy groups, and
   kunserve and the static pipeline when every step fills and drains the pipeline (flush: the
   GPipe bubble) instead of circulating micro-batches. Paper: Fig. 10 (P99 TTFT 8.4-27.3x lower
   than replication, 2.9-52.2x than a static pipeline, 23.1-47.6x than migration), TBT P50
   +7.9-37.5%, Fig. 15 (37.6x P99 TTFT without live restore), Fig. 16
   (throughput-greedy 1.2x better TTFT than memory-greedy).

With --cuda (a GPU machine; benchmarks/gpu_check.sh runs it): sections 1 and 2 on virtual CUDA
workers sharing one GPU (256 MiB each: a CUDA worker loads the whole model before it drops
layers), the KV exchanged by device copies, written to bench_kunserve_cuda.json.

Run: .venv/bin/python benchmarks/bench_kunserve.py [--cuda]
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from benchmarks.common import host_backend, print_table, step_times, write_json  # noqa: E402
from gyges import costmodel, sim, traces  # noqa: E402

CUDA, HOST_KW = host_backend(sys.argv)
DROP_MEMORY = "256MiB" if CUDA else "32MiB"


def drop_rows():
    rows = []
    model = gyges.Model.tiny()
    L = model.config.num_hidden_layers
    for g in (2, 4):
        times = []
        for _ in range(5):
            host = gyges.Host(model, workers=4, memory_per_worker=DROP_MEMORY, layout="4xTP1",
                              **HOST_KW)
            replica = host.worker(0).arena.stats()["bytes_in_use"]  # one replica, as held
            tokens_before = sum(i.capacity_blocks() for i in host.instances[:g]) * host.block_size
            t = time.perf_counter()
            b = host.buddy(host.instances[:g])
            times.append(time.perf_counter() - t)
            tokens_after = b.instance.capacity_blocks() * host.block_size
            released = b.stats["weight_bytes_released"]
            host.close()
        dropped_layers = L * (g - 1)
        rows.append({"g": g, "ms": 1e3 * statistics.median(times),
                     "us_per_layer": 1e6 * statistics.median(times) / dropped_layers,
                     "released_mb": released / 2**20, "expected_mb": (g - 1) * replica / 2**20,
                     "exact": released == (g - 1) * replica,
                     "kv_tokens_before": tokens_before, "kv_tokens_after": tokens_after,
                     "paper": "us per map"})
    return rows


def scaled_link(model):
    """The paper's 200 Gbps RDMA scaled to the model: a token's KV takes as long to cross as a
    qwen2.5-14b token's 192 KB on 200 Gbps (25 GB/s); 5 us a message."""
    c = model.config
    kv_token = 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4 * \
        c.num_hidden_layers
    return gyges.reconfig.Link(bandwidth=25e9 * kv_token / (192 * 1024), latency=5e-6)


def exchange_rows():
    """The same load, live and blocking, on the scaled link: the stall, and the mean decode step
    over the steps the live exchange takes (the blocking one's window of as many steps starts
    with its stall)."""
    rows = []
    model = gyges.Model.tiny()
    link = scaled_link(model)
    for per_member in (2, 4, 8):
        window = None
        for live in (True, False) if not CUDA else (False,):   # live first: it sets the window
            rng = np.random.default_rng(1)
            host = gyges.Host(model, workers=2, memory_per_worker="256MiB", layout="2xTP1",
                              max_batch_tokens=16384, **HOST_KW)
            p = gyges.SamplingParams(max_tokens=64, ignore_eos=True)
            for i in range(2 * per_member):
                host.submit(rng.integers(3, 4000, size=int(rng.integers(1000, 2000))).tolist(), p,
                            instance=i % 2)
            host.step()
            steps = step_times(host, 3)
            t = time.perf_counter()
            b = host.buddy(host.instances, live=live, link=None if CUDA else link)
            n = 0
            while (b.exchange is not None and not b.exchange.done) or (window and n < window):
                host.step()
                n += 1
            window = window or n
            during = (time.perf_counter() - t) / max(n, 1)
            # the restore, the same way: live streams the weights while serving
            host.restore(b, live=live, link=None if CUDA else link)
            restore_steps = 0
            while b.restoring is not None and not b.restoring.done:
                host.step()
                restore_steps += 1
            restore_stall = b.stats.get("restore_stall_seconds", b.stats["restore_seconds"])
            rows.append({"requests": 2 * per_member, "mode": "live" if live else "blocking",
                         "kv_mb": b.stats["kv_bytes_exchanged"] / 2**20,
                         "stall_ms": 1e3 * b.stats["stall_seconds"], "steps": n,
                         "remote_calls": b.stats["remote_attention_calls"],
                         "activation_ms": 1e3 * b.stats["activation_seconds"],
                         "step_ms": 1e3 * statistics.median(steps), "during_ms": 1e3 * during,
                         "restore_stall_ms": 1e3 * restore_stall, "restore_steps": restore_steps,
                         "paper": "blocking stalls up to 8.8 s" if not live else
                                  "decode 51.7-79.8% lower than blocking"})
            host.run()
            host.close()
        if not CUDA:
            rows[-2]["lower_than_blocking"] = 1 - rows[-2]["during_ms"] / rows[-1]["during_ms"]
    return rows


# Two bursts: the BurstGPT-like x14 spike of 1,000-token outputs, where compute runs out before
# memory, and a longer x3 spike of 3,000-token outputs on 1,000-token prompts, where the KV of the
# replicas fills first (KunServe's case: memory, not compute, is short).
BURSTS = {
    "x14 10 s, out 1000": dict(rate=8, factor=14, length=10, input_mean=603, output_mean=1000),
    "x3 60 s, out 3000": dict(rate=4, factor=3, length=60, input_mean=1000, output_mean=3000),
}


def sim_rows():
    # a buddy group's pipeline keeps one micro-batch per stage in flight (vLLM's virtual
    # engines), as the static pipeline baseline does
    cost = costmodel.PipelineCost.create("qwen2.5-14b", ["a800-80gb"] * 8,
                                         link_bw=costmodel.RDMA_200G, micro_batches=None)
    runs = [("kunserve", dict(policy="kunserve")),
            ("replication", dict(policy="least_load")),
            ("replication + KV swap (PCIe 25 GB/s)", dict(policy="least_load", swap_bw=25e9)),
            ("migration (Llumnix)", dict(policy="llumnix")),
            ("static pipeline (g=2)", dict(policy="least_load", buddy_group=2)),
            ("kunserve, no live restore", dict(policy="kunserve", live_restore=False)),
            ("kunserve, memory-greedy", dict(policy="kunserve", buddy_strategy="memory")),
            # every step fills and drains the pipelines (GPipe's bubble) instead
            ("kunserve, flushed pipelines", dict(policy="kunserve",
                                                 cost=cost.replace(flush=True))),
            ("static pipeline (g=2), flushed", dict(policy="least_load", buddy_group=2,
                                                    cost=cost.replace(flush=True)))]
    rows = []
    for burst, b in BURSTS.items():
        trace = traces.burst(b["rate"], 300, at=100, factor=b["factor"], length=b["length"],
                             seed=1, input_tokens=traces.lognormal_lengths(b["input_mean"]),
                             output_tokens=traces.lognormal_lengths(b["output_mean"], cap=8192))
        group = []
        for name, kw in runs:
            res = sim.run(trace, weights="buddy", sample_interval=0.5, **{"cost": cost, **kw})
            s = res.summary()
            req = res.requests
            ttft = (req["first_token"] - req["arrival"])[req["status"] == 3]  # finished
            group.append({"burst": burst, "system": name, "p50_ttft": s["ttft_median"],
                          "p99_ttft": s["ttft_p99"],
                          "slo_miss": float(np.mean(ttft > 5.0)) if len(ttft) else None,
                          "p50_tpot_ms": 1e3 * s["tpot_median"], "rejected": s["rejected"],
                          "drops": res.stats.get("drops", 0),
                          "restores": res.stats.get("restores", 0),
                          "victims": res.stats.get("victims", 0)})
        for r in group:
            r["p99_vs_kunserve"] = r["p99_ttft"] / group[0]["p99_ttft"]
        rows += group
    return rows


def main():
    out = {"drop": drop_rows()}
    print_table(f"1. Drop to KV usable (tiny model, {DROP_MEMORY} {'CUDA' if CUDA else 'CPU'} "
                f"workers, idle; paper: microseconds per map)", out["drop"],
                [("g", "g", "{}"), ("ms", "buddy ms", "{:.2f}"), ("us_per_layer", "us/layer", "{:.0f}"),
                 ("released_mb", "released MiB", "{:.2f}"), ("expected_mb", "(g-1) P MiB", "{:.2f}"),
                 ("exact", "page-exact", "{}"), ("kv_tokens_before", "KV tokens before", "{}"),
                 ("kv_tokens_after", "KV tokens after", "{}"), ("paper", "paper", "{}")])
    out["exchange"] = exchange_rows()
    print_table(f"2. The exchange on the {'CUDA' if CUDA else 'CPU'} host (2 members, requests of "
                f"1-2K tokens; " + ("blocking, no link)" if CUDA else
                                    f"blocking vs live on {scaled_link(gyges.Model.tiny())}, "
                                    f"200 Gbps scaled to the tiny model's KV)"), out["exchange"],
                [("requests", "requests", "{}"), ("mode", "mode", "{}"),
                 ("kv_mb", "KV MiB moved", "{:.1f}"), ("stall_ms", "stall ms", "{:.1f}"),
                 ("steps", "steps", "{}"), ("remote_calls", "remote attn", "{}"),
                 ("activation_ms", "act. link ms", "{:.1f}"),
                 ("step_ms", "step before ms", "{:.1f}"), ("during_ms", "step during ms", "{:.1f}"),
                 ("lower_than_blocking", "lower", "{:.1%}"),
                 ("restore_stall_ms", "restore stall ms", "{:.1f}"),
                 ("restore_steps", "restore steps", "{}"), ("paper", "paper", "{}")])
    if CUDA:  # the simulator's section is the same on any machine
        write_json("bench_kunserve_cuda", out)
        return
    out["sim"] = sim_rows()
    print_table("3. Simulator: 8x A800, qwen2.5-14b, 200 Gbps, two bursts at 100 s (paper Fig. 10: "
                "P99 TTFT 8.4-27.3x below replication, 2.9-52.2x below a static pipeline, 23.1-47.6x below "
                "migration; "
                "Fig. 15: 37.6x without live restore; Fig. 16: memory-greedy 1.2x worse)",
                out["sim"],
                [("burst", "burst", "{}"), ("system", "system", "{}"),
                 ("p50_ttft", "P50 TTFT s", "{:.2f}"),
                 ("p99_ttft", "P99 TTFT s", "{:.2f}"), ("p99_vs_kunserve", "P99 / kunserve", "{:.2f}"),
                 ("slo_miss", "TTFT > 5 s", "{:.1%}"), ("p50_tpot_ms", "P50 TPOT ms", "{:.1f}"),
                 ("rejected", "rejected", "{}"), ("drops", "drops", "{}"),
                 ("restores", "restores", "{}"), ("victims", "victims", "{}")])
    write_json("bench_kunserve", out)


if __name__ == "__main__":
    main()
