"""gyges.Cluster on Ray: what driving a host from another process costs, and how fast a lost
host's requests run again elsewhere.

1. Control overhead per decode step (issue 32's target: under 5% of a decode step of
   SmolLM2-135M). The same batch of requests decoded three ways, side by side in one run:
   an in-process Host stepped by a loop (the reference), the HostActor class in this process
   (its stepping thread and the token hand-over, no Ray), and a 1-host Cluster (a Ray actor in
   another process, its tokens streamed to the driver). Per step: wall time of the whole
   generation over its decode steps, best of `--repeat`.
2. Recovery: a 2-host cluster serving long requests has host 1 killed; the time until the driver
   notices (host 1 leaves cluster.live_hosts) and until the first token of one of its requests,
   recomputed on host 0, reaches the driver past what it had streamed.
3. KV bytes/s between hosts: requests with long prompts migrate from host 0 to host 1 of a
   2-host cluster (Cluster.migrate: export between two steps, the packet through Ray's object
   store from one actor's process to the other's, import), one at a time; bytes of KV over the
   wall time of each migrate call, which includes the source's wait for its step in flight (a
   decode step: the migrations start once every prefill is done).
4. Live vs stop-and-copy migration (Llumnix's multi-round copy, Cluster.migrate(live=True)):
   pairs of decoding requests move from host 0 to host 1, one of each pair live and the other
   stopped and copied, in one run: KV bytes per round, bytes moved while the request was
   stopped, and its downtime (the driver's time from asking the source to stop it to its
   admission at the destination, the source's step in flight and the Ray calls included).
5. The one controller over two hosts (issue 32's part 2): a spaced trace replayed by
   gyges.experiment.run(cluster=...) on 2 hosts of the tiny model and simulated by
   gyges.sim.run(hosts=2) with the same policy: whether they place every request on the same
   GPU and reconfigure the same groups in order, and what a decision costs over Ray (the
   hosts' loads read through their actors, the controller's own time).

6. A KunServe buddy group whose members sit on different hosts (Cluster.buddy: a pipeline
   split between two processes, engine/peer.h): the same batch decoded, side by side in one
   run, by one TP1 instance, by the group split over Ray (each step's rows to the follower's
   process and its logits back), and by the same split in one process (the outlet a direct
   call: the engine's own cost of the split, without Ray); per decode step, the bytes that
   cross per step, and the seconds a formation and a restore take with the batch in flight.

    python benchmarks/bench_cluster.py [--model smollm2-135m-instruct|tiny] [--batch 8]
                                       [--tokens 64] [--repeat 3] [--prompt 1024]
Writes benchmarks/results/bench_cluster.json."""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import gyges  # noqa: E402
from gyges.distributed.host_actor import HostActor  # noqa: E402
from common import print_table, write_json  # noqa: E402

TARGET_OVERHEAD = 0.05


def prompts(n, seed=0, vocab=4000):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, vocab, 32)] for _ in range(n)]


def in_process(model, host_args, ps, params):
    host = gyges.Host(model, **host_args)
    start = time.perf_counter()
    host.generate(ps, params)
    seconds = time.perf_counter() - start
    steps = host.steps
    host.close()
    return seconds, steps


def actor_in_process(model, host_args, ps, params):
    """HostActor driven here: its own stepping thread, tokens handed over through updates()."""
    actor = HostActor(model.source, host_args)
    start = time.perf_counter()
    for i, p in enumerate(ps):
        actor.submit(i, p, params)
    left = set(range(len(ps)))
    while left:
        for rid, _, _, finished, *_ in actor.updates(0.05):
            if finished:
                left.discard(rid)
    seconds = time.perf_counter() - start
    steps = actor.host.steps
    actor.close()
    return seconds, steps


def on_ray(cluster, ps, params):
    start = time.perf_counter()
    cluster.generate(ps, params)
    return time.perf_counter() - start


def recovery(model, host_args, params):
    with gyges.Cluster(model, hosts=2, **{k: v for k, v in host_args.items() if k != "workers"},
                       workers_per_host=host_args["workers"]) as cluster:
        handles = [cluster.submit(p, params) for p in prompts(4, seed=1)]
        victims = [h for h in handles if h.host == 1]
        while not all(len(h.output_tokens) > 2 for h in victims):
            time.sleep(0.001)
        had = {h.id: len(h.output_tokens) for h in victims}
        killed = time.perf_counter()
        cluster._ray.kill(cluster.host(1).actor, no_restart=True)
        noticed = None
        while True:
            if noticed is None and 1 not in cluster.live_hosts:
                noticed = time.perf_counter() - killed
            if any(len(h.output_tokens) > had[h.id] and h.host == 0 for h in victims):
                break
            time.sleep(0.0005)
        running = time.perf_counter() - killed
        cluster.wait(handles)
        mismatches = sum(h.recompute_mismatches for h in handles)
    return noticed, running, mismatches


def _decoding(cluster, model, prompt_tokens, n, seed=2):
    """n requests of `prompt_tokens`-token prompts on host 0, returned once each decodes."""
    params = gyges.SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(seed)
    vocab = min(model.config.vocab_size, 4000)
    handles = [cluster.submit([int(t) for t in rng.integers(1, vocab, prompt_tokens)],
                              params, host=0) for _ in range(n)]
    while not all(len(h.output_tokens) >= 2 for h in handles):   # every prefill done:
        time.sleep(0.001)                                          # decode steps only
    return handles


def _two_hosts(model, host_args):
    return gyges.Cluster(model, hosts=2, workers_per_host=host_args["workers"],
                         layout=host_args["layout"],
                         memory_per_worker=host_args["memory_per_worker"])


def migration(model, host_args, prompt_tokens, n):
    rows = []
    with _two_hosts(model, host_args) as cluster:
        for h in _decoding(cluster, model, prompt_tokens, n):
            start = time.perf_counter()
            moved = cluster.migrate(h, 1)
            seconds = time.perf_counter() - start
            rows.append(dict(bytes=moved, seconds=seconds, rate=moved / seconds))
            cluster.abort(h)
    return rows


def live_vs_stop(model, host_args, prompt_tokens, n):
    """Pairs of decoding requests of one prompt length: one of each pair moves live (Llumnix's
    rounds), the other stopped and copied, alternately first, in one run. Per migration: its
    KV bytes per live round, the bytes moved while the request was stopped, and its downtime
    (Migration.downtime: the driver's seconds from asking the source to stop it to its
    admission at the destination)."""
    rows = []
    with _two_hosts(model, host_args) as cluster:
        handles = _decoding(cluster, model, prompt_tokens, 2 * n, seed=3)
        for i in range(n):
            pair = handles[2 * i:2 * i + 2]
            for h, live in zip(pair, (i % 2 == 0, i % 2 == 1)):
                start = time.perf_counter()
                cluster.migrate(h, 1, live=live)
                m = h.last_migration
                rows.append(dict(mode=m.mode, rounds=len(m.rounds),
                                 round_bytes=" ".join(f"{b:,}" for b in m.rounds) or "-",
                                 stopped_bytes=m.final_bytes, downtime_ms=1e3 * m.downtime,
                                 migrate_s=time.perf_counter() - start))
            for h in pair:
                cluster.abort(h)
    return rows


def _split_in_process(model, host_args, ps, params):
    """The batch decoded by a group split between two Hosts of this process (Lead and Follow
    joined by a direct call): seconds, leader steps."""
    from gyges.reconfig.split_buddy import Follow, Lead
    a, b = gyges.Host(model, **host_args), gyges.Host(model, **host_args)
    lead, follow = Lead(a, 0, model.config.num_hidden_layers // 2), \
        Follow(b, 0, model.config.num_hidden_layers // 2)
    moved, _ = lead.form(follow.form(lead.upper_kv()), follow.follow, follow.capacity_blocks)
    follow.adopt(moved)
    start = time.perf_counter()
    a.generate(ps, params)
    seconds, steps = time.perf_counter() - start, a.steps
    a.close()
    b.close()
    return seconds, steps


def split_group(model, host_args, ps, params, repeat):
    """Per decode step: one TP1 instance (host 0 of a 2-host cluster, alone), the group split
    between the two hosts over Ray, and the same split in one process; and the formation's and
    the restore's seconds with a batch in flight."""
    cfg = model.config
    rows, form_s, restore_s, exchanged = {"tp1": [], "ray": [], "local": []}, [], [], []
    with _two_hosts(model, host_args) as cluster:
        for _ in range(repeat):
            before = cluster.host(0).steps()
            start = time.perf_counter()
            cluster.wait([cluster.submit(p, params, host=0) for p in ps])
            rows["tp1"].append((time.perf_counter() - start) / (cluster.host(0).steps() - before))
            flight = [cluster.submit(p, params, host=i % 2) for i, p in enumerate(ps)]
            while not all(len(h.output_tokens) >= 2 for h in flight):
                time.sleep(0.001)
            start = time.perf_counter()
            group = cluster.buddy([(0, 0), (1, 0)])
            form_s.append(time.perf_counter() - start)
            st = group.stats["leader"]   # its requests' KV out, the follower's in
            exchanged.append(st["kv_bytes_sent"] + st["kv_bytes_received"])
            cluster.wait(flight)
            before = cluster.host(0).steps()
            start = time.perf_counter()
            cluster.wait([cluster.submit(p, params, host=0) for p in ps])
            rows["ray"].append((time.perf_counter() - start) / (cluster.host(0).steps() - before))
            flight = [cluster.submit(p, params, host=0) for p in ps]
            while not all(len(h.output_tokens) >= 2 for h in flight):
                time.sleep(0.001)
            start = time.perf_counter()
            cluster.restore(group)
            restore_s.append(time.perf_counter() - start)
            cluster.wait(flight)
            seconds, steps = _split_in_process(model, host_args, ps, params)
            rows["local"].append(seconds / steps)
    tp1 = min(rows["tp1"])
    n = len(ps)
    cross = n * cfg.hidden_size * 4 + n * cfg.vocab_size * 4   # a decode step: rows out, logits back
    out = [dict(way=what, per_step_ms=1e3 * min(rows[key]), vs_tp1=min(rows[key]) / tp1 - 1,
                crossing=0 if key == "tp1" else cross)
           for key, what in (("tp1", "one TP1 instance (Ray actor)"),
                             ("ray", "split between 2 hosts over Ray"),
                             ("local", "split between 2 hosts of one process"))]
    best = int(np.argmin(form_s))
    return out, form_s[best], min(restore_s), exchanged[best]


def replay_vs_sim(policy="round_robin"):
    """Decisions of a 2-host replay and of the simulator on one spaced trace (arrivals 1.5 s
    apart: every request done before the next, so timing cannot change a decision)."""
    from gyges import experiment, sim, traces
    from gyges.cluster.costmodel import ConstantCost
    tiny = gyges.Model.tiny()
    shape = dict(workers=2, memory_per_worker="24MiB", layout="2xTP1")
    host = gyges.Host(tiny, **shape)
    caps = experiment.capacities(host)
    host.close()
    cost = ConstantCost(step=0.001, phase=0.0, capacity=tuple(caps))
    long2 = (caps[0] + 8) * 16
    trace = traces.from_arrays(np.arange(8) * 1.5, np.array([40, 60, long2, 30, 50, long2 + 100,
                                                             20, 70]),
                               np.array([5, 6, 4, 7, 5, 3, 6, 4]))

    def decisions(res):
        r, x = res.requests, res.transformations
        return (list(zip(r["gpu"].tolist(), r["tp"].tolist())),
                list(zip(x["kind"].tolist(), x["gpu"].tolist())))

    simulated = sim.run(trace, policy=policy, hosts=2, gpus_per_host=2, cost=cost,
                        watermark=0.0)
    with gyges.Cluster(tiny, hosts=2, workers_per_host=2, layout="2xTP1",
                       memory_per_worker="24MiB") as cluster:
        real = experiment.run(trace, policy=policy, cluster=cluster, cost=cost)
    st = real.stats
    return [dict(what="placements equal (request: GPU, TP)",
                 value=decisions(real)[0] == decisions(simulated)[0]),
            dict(what="reconfigurations equal, in order", value=decisions(real)[1] ==
                 decisions(simulated)[1]),
            dict(what="reconfigurations (merges + splits)", value=st["n_merges"] + st["n_splits"]),
            dict(what="every host's load read over Ray, ms each",
                 value=round(1e3 * st["load_read_seconds"] / max(st["n_load_reads"], 1), 2)),
            dict(what="a controller call, ms (its ops' Ray calls included)",
                 value=round(1e3 * st["controller_seconds"] / max(st["n_decisions"], 1), 2))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens of a migrated request")
    ap.add_argument("--memory", default="1GiB", help="memory per worker")
    a = ap.parse_args()
    model = gyges.Model.tiny() if a.model == "tiny" else gyges.Model.load(a.model)
    vocab = model.config.vocab_size
    host_args = dict(workers=1, layout="1xTP1", memory_per_worker=a.memory)
    params = gyges.SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    ps = prompts(a.batch, vocab=min(vocab, 4000))
    # every way once to warm up, then the best of `repeat` runs of each, interleaved
    best = {"host": [], "actor": [], "ray": []}
    with gyges.Cluster(model, hosts=1, workers_per_host=1, layout="1xTP1",
                       memory_per_worker=a.memory) as cluster:
        for i in range(a.repeat + 1):
            t_host, steps = in_process(model, host_args, ps, params)
            t_actor, _ = actor_in_process(model, host_args, ps, params)
            t_ray = on_ray(cluster, ps, params)
            if i:
                best["host"].append(t_host)
                best["actor"].append(t_actor)
                best["ray"].append(t_ray)
    step = min(best["host"]) / steps
    rows = []
    for key, what in (("host", "in-process Host, stepped by a loop"),
                      ("actor", "HostActor in this process (stepping thread)"),
                      ("ray", "1-host Cluster (Ray actor, tokens streamed)")):
        per = min(best[key]) / steps
        rows.append(dict(way=what, seconds=min(best[key]), per_step_ms=per * 1e3,
                         overhead=per / step - 1, target=TARGET_OVERHEAD if key == "ray" else None))
    print_table(f"{a.model}: {a.batch} requests x {a.tokens} tokens, {steps} steps "
                f"(best of {a.repeat})", rows,
                [("way", "driven by", "{}"), ("seconds", "total s", "{:.3f}"),
                 ("per_step_ms", "per step ms", "{:.3f}"), ("overhead", "overhead", "{:+.1%}"),
                 ("target", "target", "<{:.0%}")])
    noticed, running, mismatches = recovery(model, host_args, params)
    rec = [dict(what="host 1 killed -> driver notices", seconds=noticed),
           dict(what="host 1 killed -> an orphan's next token at the driver", seconds=running),
           dict(what="tokens a recomputation gave differently", seconds=mismatches)]
    print_table("recovery of a killed host (2 hosts)", rec,
                [("what", "", "{}"), ("seconds", "s (or count)", "{:.3f}")])
    moves = migration(model, host_args, a.prompt, 4)
    print_table(f"KV migration between two hosts ({a.prompt}-token prompts; Ray object store)",
                moves, [("bytes", "KV bytes", "{:,}"), ("seconds", "migrate s", "{:.4f}"),
                        ("rate", "bytes/s", "{:,.0f}")])
    both = live_vs_stop(model, host_args, a.prompt, 3)
    print_table(f"live (Llumnix's rounds) vs stop-and-copy migration ({a.prompt}-token prompts, "
                f"decoding; side by side)", both,
                [("mode", "mode", "{}"), ("rounds", "rounds", "{}"),
                 ("round_bytes", "KV bytes per round", "{}"),
                 ("stopped_bytes", "KV bytes while stopped", "{:,}"),
                 ("downtime_ms", "downtime ms", "{:.2f}"), ("migrate_s", "migrate s", "{:.4f}")])
    for mode in ("live", "stop"):
        d = [r["downtime_ms"] for r in both if r["mode"] == mode]
        print(f"  {mode}: downtime median {np.median(d):.2f} ms over {len(d)} migrations")
    split, formed, restored, kv = split_group(model, host_args, ps, params, max(1, a.repeat - 1))
    print_table(f"a buddy group split between two hosts ({a.batch} requests x {a.tokens} tokens; "
                f"best of {max(1, a.repeat - 1)})", split,
                [("way", "decoded by", "{}"), ("per_step_ms", "per step ms", "{:.3f}"),
                 ("vs_tp1", "vs TP1", "{:+.1%}"), ("crossing", "bytes across per step", "{:,}")])
    print(f"  formation with {a.batch} requests in flight: {formed:.3f} s, {kv:,} bytes of KV "
          f"exchanged ({kv / formed:,.0f} bytes/s over the whole formation); restore: "
          f"{restored:.3f} s")
    replay = replay_vs_sim()
    print_table("one controller over 2 hosts (tiny model, round_robin, 8 spaced requests) vs "
                "gyges.sim.run(hosts=2)", replay, [("what", "", "{}"), ("value", "", "{}")])
    write_json("bench_cluster", {"model": a.model, "batch": a.batch, "tokens": a.tokens,
                                 "steps": steps, "overhead": rows, "recovery": rec,
                                 "migration": moves, "live_vs_stop": both,
                                 "split_group": split, "split_form_s": formed,
                                 "split_restore_s": restored, "split_kv_bytes": kv,
                                 "replay_vs_sim": replay})


if __name__ == "__main__":
    main()
