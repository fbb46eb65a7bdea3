"""gyges' logging and progress bars: one line format, vLLM's, for gyges' records and uvicorn's,

    INFO 11-29 16:20:01 [app.py:123] message

and one rule for when a progress bar shows.

The library (`import gyges`) gives the "gyges" logger a handler on stderr at INFO (or at
GYGES_LOGGING_LEVEL: debug, info, warning, error, as vLLM's VLLM_LOGGING_LEVEL), as vLLM does,
so a notebook sees what loads and serves; that handler prints only while the application has no
logging of its own (the root logger has no handler). Once it has (logging.basicConfig, pytest's
capture), gyges' records go to the application's handlers and this one steps aside, so nothing
prints twice. GYGES_CONFIGURE_LOGGING=0 leaves the logger alone altogether.

The `gyges` command calls configure(level) (its --log-level) and hands uvicorn_config(level) to
uvicorn, whose lines then read like gyges' own.

Progress bars (tqdm, on stderr): progress(iterable, enabled) shows one when enabled is True,
never when False, and when None (the library's default where vLLM shows one, a model's load) only
on a terminal, after a second: quick work and captured output (tests, logs) stay clean.
GYGES_PROGRESS=1 or 0 decides for every None.
"""
import logging
import os
import re
import sys

LEVELS = ("debug", "info", "warning", "error")
LEVEL_ENV = "GYGES_LOGGING_LEVEL"
FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
# a line in FORMAT (tests match every line of a server's output against it)
LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[\S+:\d+\] ")


def env_level():
    """GYGES_LOGGING_LEVEL in lower case ("info" when unset or empty); the caller checks it is
    one of LEVELS."""
    return (os.environ.get(LEVEL_ENV) or "info").strip().lower()


def formatter():
    return logging.Formatter(FORMAT, DATE_FORMAT)


class DefaultHandler(logging.StreamHandler):
    """The handler `import gyges` gives the "gyges" logger: it writes only while the root logger
    has no handler, i.e. while the application has not configured logging."""

    def __init__(self):
        super().__init__()   # (the stream is looked up at each record: pytest swaps sys.stderr)
        self.setFormatter(formatter())

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass

    def emit(self, record):
        if not logging.getLogger().handlers:
            super().emit(record)


def install_default():
    """On `import gyges`: the default handler, unless GYGES_CONFIGURE_LOGGING=0 or the logger
    already has a handler (the application gave it one)."""
    logger = logging.getLogger("gyges")
    if os.environ.get("GYGES_CONFIGURE_LOGGING", "1") == "0" or logger.handlers:
        return
    logger.addHandler(DefaultHandler())
    if logger.level == logging.NOTSET:   # (a bad GYGES_LOGGING_LEVEL: INFO; the CLI refuses it)
        level = env_level()
        logger.setLevel(level.upper() if level in LEVELS else logging.INFO)


def configure(level):
    """A command's logging: gyges' records at `level` (one of LEVELS) on stderr in FORMAT, in
    place of the default handler, and not handed on to the root logger (no line twice)."""
    logger = logging.getLogger("gyges")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter())
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def uvicorn_config(level="info"):
    """uvicorn's log_config: its loggers (server, errors, access) in FORMAT on stderr. Loggers
    already made (gyges') stay enabled: dictConfig would disable them by default."""
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"gyges": {"format": FORMAT, "datefmt": DATE_FORMAT}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "gyges",
                                "stream": "ext://sys.stderr"}},
        "loggers": {"uvicorn": {"handlers": ["stderr"], "level": level, "propagate": False},
                    "uvicorn.error": {"level": level},
                    "uvicorn.access": {"handlers": ["stderr"], "level": level,
                                       "propagate": False}},
    }


def progress(iterable=None, enabled=None, **tqdm_args):
    """`iterable` wrapped in a tqdm bar on stderr (tqdm_args: desc, total, unit, ...), or a bar
    to update by hand when iterable is None; a do-nothing stand-in when no bar shows (see the
    module's docstring), or when tqdm is not installed and the bar was not asked for."""
    if enabled is None:
        env = os.environ.get("GYGES_PROGRESS", "")
        enabled = {"1": True, "0": False}.get(env)
    try:   # (not tqdm.auto: its notebook bars need ipywidgets)
        from tqdm import tqdm
    except ImportError:
        if enabled:
            from .errors import require
            require("tqdm", "progress bars")
        return _NoBar(iterable)
    if enabled is None:   # a terminal only (tqdm's disable=None), and work over a second long
        return tqdm(iterable, disable=None, delay=1.0, file=sys.stderr, **tqdm_args)
    if not enabled:
        return _NoBar(iterable)
    return tqdm(iterable, file=sys.stderr, **tqdm_args)


class _NoBar:
    """tqdm's interface, doing nothing."""

    n = 0

    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n=1):
        pass

    def set_postfix_str(self, s="", refresh=True):
        pass

    def close(self):
        pass
