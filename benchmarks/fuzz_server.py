"""A server that always answers, the long run (issue: the probe's findings): 10,000 random HTTP
requests against a live server on 127.0.0.1 (tests/test_server_fuzz.py's generator and server:
bodies of every shape, headers, content types, keys, methods and paths, some dropped before the
answer). Every answer must be 2xx or 4xx within ANSWER_SECONDS, never 5xx; afterwards nothing
runs, every KV block is back, and a normal request gets the text it got before the fuzz.

    .venv/bin/python benchmarks/fuzz_server.py [--requests 10000] [--seed 0]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.common import print_table, write_json  # noqa: E402
from test_server_fuzz import ANSWER_SECONDS, fuzz, fuzz_server  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    host, server = fuzz_server()
    try:
        result = fuzz(host, server, args.requests, args.seed)
    finally:
        server.stop()
        host.close()
    bad = result.pop("bad")
    row = {**result, "statuses": " ".join(f"{k}:{v}" for k, v in result["statuses"].items()),
           "rate": result["requests"] / result["seconds"]}
    print_table(f"fuzz_server: {args.requests} random requests, seed {args.seed} (every failure "
                f"column must be 0 / False, the text the same)", [row], [
        ("requests", "requests", "{}"), ("dropped", "dropped", "{}"),
        ("server_errors", "5xx or none", "{}"), ("slowest_seconds", "slowest s", "{:.3f}"),
        ("slowest_request", "slowest request", "{}"), ("rate", "req/s", "{:.0f}"),
        ("left_running", "left running", "{}"), ("kv_blocks_used", "KV blocks left", "{}"),
        ("same_text", "same text", "{}")])
    print(f"\nstatuses: {row['statuses']}")
    for b in bad[:10]:
        print("BAD", b)
    write_json("fuzz_server", {"seed": args.seed, "answer_seconds": ANSWER_SECONDS,
                               **result, "bad": [repr(b) for b in bad[:50]]})
    ok = not bad and result["same_text"] and not result["left_running"] and \
        result["kv_blocks_used"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
