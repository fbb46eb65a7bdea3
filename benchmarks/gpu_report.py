"""The tables of a closing note from one run of benchmarks/gpu_check.sh: what each step did, the
tests' outcome, and every GPU figure beside its anchor (a paper's or a datasheet's figure, or the
baseline measured in the same run). Reads OUTDIR/steps.tsv, test.log, memcheck.log and
gpu_check.json (what a device call brings back); a part that did not run says so.

Run: python benchmarks/gpu_report.py OUTDIR   (markdown on stdout)
"""
import json
import re
import sys
from pathlib import Path

def microseconds(*ops):
    """Columns of microseconds, one per operation."""
    return [(op, op.replace("_", "-"), "{:.2f}") for op in ops]


# name in gpu_check.json -> [(title, key of the rows, anchor, columns: (key, header, format),
# which rows: None for all)]
TABLES = {
    "bench_cuda_kernels": [
        ("VMM, microseconds per 2 MiB page (map includes set-access)", "arena_us_per_page",
         "kvcached on A100: create 193, map + set-access 37.45, unmap 25.6 (its row)",
         [("pool", "pool", "{}")] + microseconds("create", "map", "remap", "unmap", "release"),
         None),
        ("VMM, microseconds per driver call, each timed alone", "driver_us_per_call",
         "kvcached on A100 (its row): cuMemCreate 193, cuMemMap 1.45, cuMemSetAccess 36, "
         "cuMemUnmap 25.6",
         [("calls", "", "{}")] + microseconds("create", "map", "set_access", "unmap", "release"),
         None),
        ("Paged-attention decode, KV bytes read per second (batch 1 and 64, 4K context)",
         "decode_attention", "the device-to-device copy of the same run; goal 70% of it",
         [("layout", "layout", "{}"), ("kv_dtype", "KV", "{}"), ("batch", "batch", "{}"),
          ("context", "context", "{}"), ("us", "us", "{:.1f}"), ("gbps", "GB/s", "{:.0f}"),
          ("of_copy", "of copy", "{:.0%}")],
         lambda r: r["batch"] in (1, 64) and r["context"] == 4096),
    ],
    "bench_cuda_engine_llama3-8b": [
        ("Decode step of the CUDA engine, random weights in bf16", "rows",
         "HBM: the copy bandwidth of the same run (roofline) and the datasheet's 4.8 TB/s (H200); "
         "PyTorch eager on the same GPU",
         [("batch", "batch", "{}"), ("context", "context", "{}"), ("gyges_ms", "ms", "{:.2f}"),
          ("tokens_per_s", "tok/s", "{:.0f}"), ("of_roofline", "of copy roofline", "{:.0%}"),
          ("of_datasheet", "of datasheet", "{:.0%}"), ("torch_ms", "torch ms", "{:.2f}"),
          ("vs_torch", "vs torch", "{:.2f}x")], None),
    ],
    "bench_transform_cuda": [
        ("Gyges Figure 9: KV transformation 4xTP1 -> TP4 at ~90% KV", "kv",
         "basic, the paper's baseline (Gyges: 91.6% less peak extra memory than basic)",
         [("layout", "layout", "{}"), ("method", "method", "{}"), ("chunks", "rounds", "{}"),
          ("kv_ms", "KV ms", "{:.2f}"), ("peak_extra", "peak extra B", "{:,}"),
          ("peak_vs_basic", "vs basic", "{:.3f}")], None),
        ("Gyges Figure 10: weights at scale-up", "weights",
         "partial_swap (unpadded FFN), the paper's baseline",
         [("method", "method", "{}"), ("ms_per_layer", "ms per layer", "{:.3f}"),
          ("copied", "bytes copied", "{:,}"), ("released", "bytes released", "{:,}"),
          ("padding_overhead", "padding", "{:.2%}")], None),
        ("Gyges Figure 11: step time while transforming", "stagger",
         "the steps of an untouched host in the same run (plain); stop_world",
         [("model", "model", "{}"), ("layers_per_step", "layers/step", "{}"),
          ("overlap", "overlap", "{}"), ("plain_step_ms", "plain ms", "{:.2f}"),
          ("mean_step_ms", "mean ms", "{:.2f}"), ("worst_step_ms", "worst ms", "{:.2f}"),
          ("overhead", "overhead", "{:+.1%}")], None),
    ],
    "bench_pipeline_cuda": [
        ("PipeLive: stop and migration time against layers moved", "migration",
         "PipeLive Fig. 13: a live stop of about 10 ms whatever the layers moved",
         [("layers", "layers", "{}"), ("mode", "mode", "{}"), ("stop_ms", "stop ms", "{:.2f}"),
          ("step_ms", "decode step ms", "{:.2f}"), ("total_ms", "total ms", "{:.1f}"),
          ("rounds", "patch rounds", "{}"), ("fallback", "fallback", "{}")], None),
    ],
    "bench_flying_cuda": [
        ("Flying Serving: bind of four workers into TP4 and release", "switch",
         "Flying Serving Table 2: 15 ms live against 146-292 s for a cold restart",
         [("kv_used", "KV in use", "{}"), ("bind_ms", "bind ms", "{:.3f}"),
          ("release_ms", "release ms", "{:.3f}"),
          ("gyges_transform_ms", "Gyges 4xTP1->TP4 ms", "{:.2f}")], None),
    ],
    "bench_kunserve_cuda": [
        ("KunServe: drop to KV usable", "drop",
         "(g-1) replicas' bytes released exactly; paper: microseconds per map",
         [("g", "group", "{}"), ("ms", "ms", "{:.2f}"), ("us_per_layer", "us/layer", "{:.1f}"),
          ("released_mb", "MiB released", "{:.1f}"), ("exact", "exact", "{}")], None),
        ("KunServe: KV exchange (blocking)", "exchange",
         "the decode step of the same run",
         [("requests", "requests", "{}"), ("kv_mb", "KV MiB", "{:.1f}"),
          ("stall_ms", "stall ms", "{:.2f}"), ("step_ms", "step ms", "{:.2f}")], None),
    ],
}


ENGINE = "bench_cuda_engine"  # its file is named after the model (bench_cuda_engine_MODEL)


def markdown(rows, columns):
    cells = [[fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in columns]
             for r in rows]
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


def steps_part(out):
    path = out / "steps.tsv"
    if not path.exists():
        return "No steps.tsv: gpu_check.sh did not run there."
    rows = [dict(zip(("step", "rc", "seconds", "limit"), line.split("\t")))
            for line in path.read_text().splitlines() if line]
    return markdown(rows, [("step", "step", "{}"), ("rc", "exit", "{}"),
                           ("seconds", "seconds", "{}"), ("limit", "limit s", "{}")])


def pytest_part(log, name):
    """The summary line and the failures of one pytest log."""
    if not log.exists():
        return f"{name}: not run"
    text = log.read_text(errors="replace")
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?) in ([\d.]+)s", text, re.M)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    out = [f"{name}: " + (f"{summary[-1][0]} in {summary[-1][1]} s" if summary else
                          "no pytest summary (cut by its time limit?)")]
    sanitizer = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    if sanitizer:
        out.append(f"compute-sanitizer: {sanitizer[-1]} errors")
    out += [f"- {f}" for f in failed]
    return "\n".join(out)


def main(argv):
    if len(argv) != 1:
        sys.exit("usage: gpu_report.py OUTDIR")
    out = Path(argv[0])
    results_path = out / "gpu_check.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    parts = ["## Steps", steps_part(out), "## Tests", pytest_part(out / "test.log", "CUDA tests"),
             pytest_part(out / "memcheck.log", "kernel tests under memcheck")]
    for name, tables in TABLES.items():
        data = results.get(name)
        if data is None and name.startswith(ENGINE):  # another model's engine run stands in
            data = next((results[k] for k in sorted(results) if k.startswith(ENGINE)), None)
        for title, key, anchor, columns, keep in tables:
            parts.append(f"## {title}")
            if data is None or key not in data:
                parts.append(f"not run ({name}.json did not come back)")
                continue
            device = data.get("device", {}).get("name") if isinstance(data.get("device"), dict) \
                else None
            bandwidth = data.get("copy_traffic_gbps") or (
                data.get("copy_bandwidth_bytes_per_s", 0) / 1e9)
            parts.append(f"Anchor: {anchor}." + (f" Device: {device}." if device else "") +
                         (f" Model: {data['model']}." if "model" in data else "") +
                         (f" Copy bandwidth {bandwidth:.0f} GB/s." if bandwidth else "") +
                         (f" Cold start of a TP4 host: {data['cold_start_ms']:.1f} ms."
                          if "cold_start_ms" in data else ""))
            parts.append(markdown([r for r in data[key] if keep is None or keep(r)], columns))
    print("\n\n".join(parts))


if __name__ == "__main__":
    main(sys.argv[1:])
