"""The `gyges` command (also `python -m gyges`):

    gyges serve --model smollm2-135m-instruct --workers 3 --layout 3xTP1 --port 8000
    gyges serve --hosts 2 --workers-per-host 2 [--ray-address auto]   # a cluster on Ray
    gyges bench serve --base-url http://127.0.0.1:8000/v1 --trace azure --requests 100

Every command logs in vLLM's format on stderr at --log-level (default GYGES_LOGGING_LEVEL, else
info); the server adds a line per request and a throughput line every --log-stats-interval s.
"""
import argparse
import logging
import sys

from ..core import logs

log = logging.getLogger("gyges.serve.cli")


def _fail(command, message):
    """A mistake on the command line: one line, exit status 2 (argparse's), nothing loaded."""
    sys.stderr.write(f"gyges {command}: error: {message}\n")
    sys.exit(2)   # (argparse's status for a usage error, as parser.exit gives it)


def check_log_level(command, args):
    """--log-level, or GYGES_LOGGING_LEVEL in its place, names a level; then gyges logs at it."""
    if args.log_level is None:
        args.log_level = logs.env_level()
        if args.log_level not in logs.LEVELS:
            _fail(command, f"{logs.LEVEL_ENV}={args.log_level!r}: expected one of "
                           f"{', '.join(logs.LEVELS)}")
    elif args.log_level.lower() not in logs.LEVELS:
        _fail(command, f"--log-level {args.log_level!r}: expected one of {', '.join(logs.LEVELS)}")
    args.log_level = args.log_level.lower()


def check_serve_args(args):
    """Every flag of `gyges serve` checked before the model loads."""
    check_log_level("serve", args)
    from ..core.errors import Error
    from ..core.units import parse_size
    from ..runtime.layout import parse
    if args.enable_admin and not args.api_key:
        _fail("serve", "--enable-admin needs --api-key (the admin endpoints change the layout)")
    for flag, value, low in (("--workers", args.workers, 1), ("--hosts", args.hosts, 0),
                             ("--workers-per-host", args.workers_per_host, 1),
                             ("--threads-per-worker", args.threads_per_worker, 1),
                             ("--max-batch-tokens", args.max_batch_tokens, 1),
                             ("--max-body-bytes", args.max_body_bytes, 1),
                             ("--max-tokens-limit", args.max_tokens_limit, 1),
                             ("--port", args.port, 0)):
        if value < low:
            _fail("serve", f"{flag} must be at least {low}, got {value}")
    if args.port > 65535:
        _fail("serve", f"--port must be at most 65535, got {args.port}")
    if not args.body_timeout > 0:
        _fail("serve", f"--body-timeout must be > 0 seconds, got {args.body_timeout}")
    if not args.log_stats_interval > 0:
        _fail("serve", f"--log-stats-interval must be > 0 seconds, got {args.log_stats_interval}")
    try:
        if args.memory_per_worker is not None:
            parse_size(args.memory_per_worker, "--memory-per-worker")
        if not 0 <= args.seed < 2**64:
            _fail("serve", f"--seed must be in [0, 2**64), got {args.seed}")
        parse_size(args.page_size, "--page-size")
        # a TP layout is checked here; a pipeline's needs the model's layers (the host checks it)
        if args.layout is not None and "pp" not in args.layout.lower():
            parse(args.layout, args.workers_per_host if args.hosts else args.workers)
    except Error as e:
        _fail("serve", f"--layout: {e}" if "layout" in str(e) else str(e))


def _serve(args):
    check_serve_args(args)
    from ..models.model import Model
    from ..runtime.host import Host
    from . import Server
    logs.configure(args.log_level)
    defaults = vars(parser().parse_args(["serve"]))
    log.info("gyges serve, non-default args: %s",
             {k: "<hidden>" if k == "api_key" else v for k, v in vars(args).items()
              if k not in ("run", "log_level") and v != defaults.get(k)})
    # the load's bar, as vLLM's, at info and below
    model = Model.load(args.model, dtype=args.dtype,
                       progress=args.log_level in ("debug", "info"))
    options = dict(memory_per_worker=args.memory_per_worker, page_size=args.page_size,
                   max_batch_tokens=args.max_batch_tokens,
                   threads_per_worker=args.threads_per_worker, seed=args.seed)
    if args.hosts:   # hosts as Ray actors, each with --workers-per-host workers
        from ..distributed.cluster import Cluster
        w = args.workers_per_host
        host = Cluster(model, hosts=args.hosts, workers_per_host=w,
                       layout=args.layout or f"{w}xTP1", ray_address=args.ray_address,
                       **options)
    else:
        host = Host(model, workers=args.workers, layout=args.layout or f"{args.workers}xTP1",
                    **options)
    server = Server(host, model_name=args.served_model_name or args.model, port=args.port,
                    bind=args.host, api_key=args.api_key, enable_admin=args.enable_admin,
                    max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                    protect_metrics=args.protect_metrics, body_timeout_s=args.body_timeout,
                    log_level=args.log_level,
                    access_log=not (args.disable_uvicorn_access_log or args.disable_log_requests),
                    log_stats_interval=None if args.disable_log_stats else args.log_stats_interval)
    log.info("serving %s on http://%s:%d/v1 (layout %s)", args.model, args.host, server.port,
             server.runner.host.layout())
    try:
        server.run()
    finally:
        host.close()
    return 0


def _bench_serve(args):
    check_log_level("bench serve", args)
    logs.configure(args.log_level)
    from .bench import main as bench_main
    return bench_main(args)


def add_log_level(p):
    # checked by check_log_level, not by argparse's choices: a bad value is one line, not two
    p.add_argument("--log-level", default=None, metavar="{debug,info,warning,error}",
                   help=f"default: {logs.LEVEL_ENV}, else info")


def parser():
    p = argparse.ArgumentParser(prog="gyges", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="an OpenAI-compatible server over a host of workers")
    s.add_argument("--model", default="smollm2-135m-instruct",
                   help="a packaged model name, a .gguf file or an HF checkpoint directory")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    s.add_argument("--workers", type=int, default=1)
    s.add_argument("--hosts", type=int, default=0,
                   help="serve on a gyges.Cluster of this many hosts (Ray actors) instead of "
                        "one host in this process")
    s.add_argument("--workers-per-host", type=int, default=1)
    s.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto); default: start a local one")
    s.add_argument("--layout", default=None, help="e.g. 3xTP1, TP3 (default: every worker TP1)")
    s.add_argument("--memory-per-worker", default=None,
                   help="e.g. 2GiB (default: the whole model and the KV of 8192 tokens)")
    s.add_argument("--seed", type=int, default=0,
                   help="requests without a seed draw their own stream from this one")
    s.add_argument("--page-size", default="256KiB",
                   help="arena pages; large ones keep a real model's mappings few")
    s.add_argument("--threads-per-worker", type=int, default=1)
    s.add_argument("--max-batch-tokens", type=int, default=512)
    s.add_argument("--host", default="127.0.0.1", help="the address to bind (default: loopback)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="every /v1 request must send it as a Bearer token")
    s.add_argument("--enable-admin", action="store_true",
                   help="POST /admin/transform (needs --api-key)")
    s.add_argument("--protect-metrics", action="store_true",
                   help="/metrics asks for --api-key too (by default it is open, as vLLM's)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--max-tokens-limit", type=int, default=4096)
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive (408 after)")
    add_log_level(s)
    s.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no line per HTTP request (method, path, status, duration)")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="the same (vLLM's older name)")
    s.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between throughput lines (tokens/s, requests, KV cache usage)")
    s.add_argument("--disable-log-stats", action="store_true", help="no throughput lines")
    s.set_defaults(run=_serve)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    from .bench import add_arguments
    bs = bsub.add_parser("serve", help="replay a trace against an OpenAI-compatible endpoint")
    add_arguments(bs)
    add_log_level(bs)
    bs.set_defaults(run=_bench_serve)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    from ..core.errors import Error
    try:
        return args.run(args)
    except Error as e:   # a gyges.Error is the user's to read, not a traceback
        sys.stderr.write(f"gyges: error: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
