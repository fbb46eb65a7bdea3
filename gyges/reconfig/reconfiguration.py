"""The one protocol every live change of parallelism follows (Gyges' merges and splits, PipeLive's
re-split, Flying Serving's switches, KunServe's buddy groups, exchanges and restores):

    plan      checks only; what it refuses raises a gyges.Error and changes nothing
    begin     the first changes, each one journaled with what takes it back (undo)
    advance   between two host steps, as often as the change needs (a bounded number of times)
    commit    the switch; past it nothing is taken back, and the journal goes
    rollback  the journal, newest entry first: the host is as it was before begin, the same
              worker objects, the same plan, every KV byte of every running request and the
              same pages in use
    recover   only when the rollback itself fails (a second fault): the group is rebuilt from
              the host copy of the weights and its requests recomputed (gyges.reconfig.recovery)

A Reconfiguration is the handle the host's verbs return (host.transform, host.reconfigure,
host.switch, host.buddy, host.restore). Every handle has the same fields:

    state       "running", "committed", "rolled_back" or "recovered"
    done        it has ended (committed, rolled back or recovered)
    blocked_by  why it waits now (a live NumPy view pins a page, a group is not idle), or None
    error       what failed ("rolled_back" or "recovered"), or None
    stats       a dict: the keys of STATS below for every kind, where they mean the same, and
                keys of its own kind beside them

The Host starts one (Host.start: a conflict check against the live ones, then plan and begin),
advances the live ones at every step (Host.step) and closes them with itself (Host.close).
An executor overrides the underscored hooks; it changes instances and workers only through
their public methods. A kind that runs between two steps (live = False) is planned, begun and
committed inside the call that asks for it; a failure there is rolled back and raised from that
call. A live kind fails at an advance: it is rolled back (or, where its advance changes nothing
when it fails, tried again at the next step, at most `max_retries` times in a row), the handle
says why, and host.step goes on serving.
"""
import logging
import time
import warnings
import weakref

from ..core.errors import Error
from .recovery import rebuild

# Log records hold strings only, never an engine object or an exception: a handler that keeps
# records (pytest's, a memory handler) must not keep a host's pages alive.
log = logging.getLogger(__name__)

STATES = ("running", "committed", "rolled_back", "recovered")

# What every kind reports, with one meaning each (0 where a kind has none of it):
STATS = {
    "bytes_moved": 0,        # KV and weight bytes copied between workers or caches
    "kv_bytes_moved": 0,     # of those, KV
    "weight_bytes_moved": 0,  # of those, weights
    "pages_mapped": 0,       # pages the change mapped
    "pages_freed": 0,        # pages it gave back to the workers' budgets
    "stall_seconds": 0.0,    # serving stopped for it: its start and its switch (commit)
    "advance_seconds": 0.0,  # its advances, each between two steps
    "seconds": 0.0,          # from begin to its end
    "steps": 0,              # host steps it was advanced over
    "retries": 0,            # advances that failed, changed nothing and were tried again
    "requests_moved": 0,     # requests that changed instance
}


class ReconfigurationWarning(UserWarning):
    """A live reconfiguration failed at an advance and was rolled back (or recovered)."""


class Reconfiguration:
    """The protocol's base class: the life cycle, the journal and the common fields."""

    kind = "reconfiguration"
    live = False        # advanced by host.step (False: planned, begun and committed at once)
    max_retries = 0     # advances that may fail and be tried again (each must change nothing)
    max_steps = 1 << 20  # a live one that has not committed after this many advances rolls back
    advance_after_step = False  # also advanced right after each host step (what only waits)
    moves_experts = False       # can change the experts an expert-parallel worker holds whole

    def __init__(self, host, workers):
        self.host = weakref.proxy(host)
        self.workers = tuple(workers)
        self.state = "planned"
        self.error = None
        self.blocked_by = None
        self.stats = dict(STATS)
        self._undo = []         # [(what, fn)]: the journal, oldest first
        self._t0 = None
        self._failures = 0      # failed advances in a row

    # ---- what the host sees ----
    @property
    def done(self):
        return self.state in ("committed", "rolled_back", "recovered")

    @property
    def committed(self):
        return self.state == "committed"

    @property
    def rolled_back(self):
        return self.state == "rolled_back"

    @property
    def recovered(self):
        return self.state == "recovered"

    def claims(self):
        """The workers no other live reconfiguration may touch while this one runs."""
        return set(self.workers)

    def engines(self):
        """Instances this one holds that the host does not list (recovery closes them too)."""
        return ()

    def __repr__(self):
        return f"{type(self).__name__}({self.kind} on workers {list(self.workers)}, {self.state})"

    # ---- the hooks an executor implements ----
    def _plan(self):
        """Checks the host's state; raises (refused) without changing anything."""

    def _begin(self):
        """The first changes; journal each with self.undo."""

    def _advance(self):
        """One step's work between two host steps; returns True when ready to commit. A live
        kind must get there in a bounded number of advances."""
        return True

    def _commit(self):
        """The switch. What it changes before it can fail is journaled too."""

    def _quiesce(self):
        """Stops work it runs beside the steps (a background read) before a rollback touches
        what that work reads; must not raise."""

    def _finish(self):
        """After the commit: what cannot fail and needs no undo (retiring what the change
        replaced, giving back pages no one uses)."""

    def _release(self):
        """Drops the buffers it holds (called once it has ended, whichever way)."""

    def _recovery_layout(self):
        """[(first worker, tp)] the group is rebuilt in when its rollback fails."""
        return None

    # ---- the journal ----
    def undo(self, fn, what=""):
        """Records how to take back the change just made (run newest first by rollback)."""
        self._undo.append((what, fn))

    # ---- the life cycle (Host calls these) ----
    def start(self):
        """plan, then begin (and, for a kind that is not live, advance to its commit). A refusal
        raises with nothing changed; a failure past the first change is rolled back and raised,
        the error carrying this handle as `reconfiguration` (state "rolled_back"), unless the
        rollback failed too and the group was recovered (returned, state "recovered")."""
        self._plan()
        self.state = "running"
        self._t0 = time.perf_counter()
        t = time.perf_counter()
        try:
            self._begin()
            if not self.live:
                while not self._advance():
                    pass
                self._commit_now()
        except BaseException as e:
            self._fail(e)
            if self.state == "rolled_back":
                e.reconfiguration = self
                raise
        finally:
            self.stats["stall_seconds"] += time.perf_counter() - t
        return self

    def advance(self):
        """One advance between two host steps (Host.step). Never raises for the change's own
        failure: that is rolled back (or retried) and reported on the handle."""
        if self.done or self.state != "running":
            return
        self.stats["steps"] += 1
        t = time.perf_counter()
        try:
            ready = self._advance()
            self._failures = 0
            if ready:
                self._commit_now()
            elif self.stats["steps"] >= self.max_steps:
                raise Error(f"{self!r} did not reach its commit in {self.max_steps} steps")
        except Exception as e:
            if self._failures < self.max_retries and not self._commit_failed:
                self._failures += 1
                self.stats["retries"] += 1
                log.warning("%s: an advance failed and changed nothing; it is tried again at the "
                            "next step (%s)", repr(self), str(e))
                return
            self._fail(e)
            warnings.warn(f"{self!r} failed ({self.error})", ReconfigurationWarning, stacklevel=3)
        finally:
            self.stats["advance_seconds"] += time.perf_counter() - t

    _commit_failed = False  # a commit that fails is rolled back, never tried again

    def _commit_now(self):
        t = time.perf_counter()
        try:
            self._commit()
        except BaseException:
            self._commit_failed = True
            raise
        finally:
            if self.live:  # (a kind that is not live counts it in its start)
                self.stats["stall_seconds"] += time.perf_counter() - t
        self._undo.clear()
        self._finish()
        self._end("committed")

    def cancel(self, why="cancelled"):
        """Takes a live one back exactly, as a failure would (Host.cancel calls it under the
        host's lock; a rollback that fails falls back to recovery); False when it had ended."""
        if self.done or self.state != "running":
            return False
        self._fail(None, why)
        return True

    def close(self):
        """The host is closing: a change under way is rolled back (its requests are ending
        anyway; what matters is that nothing it holds stays behind)."""
        if self.done:
            return
        try:
            self._rollback()
        except Exception as e:  # the host's memory goes with it: nothing to keep consistent
            log.warning("%s: rollback at close failed: %s", repr(self), str(e))
        self._undo.clear()
        self._end("rolled_back")

    # ---- failing ----
    def _rollback(self):
        """Runs the journal newest first. Stops at the first entry that fails (raising it): the
        entries before it are kept, so the caller knows the rollback did not finish."""
        self._quiesce()
        while self._undo:
            what, fn = self._undo[-1]
            fn()
            self._undo.pop()

    def _fail(self, cause, why=None):
        """Rolls back after `cause` (an exception; None for a cancel, with `why`), or, when the
        rollback fails too, recovers the group."""
        self.error = why if cause is None else f"{type(cause).__name__}: {cause}"
        try:
            self._rollback()
        except Exception as second:
            log.warning("%s: rollback failed (%s); rebuilding the group", repr(self), str(second))
            self._undo.clear()
            self._recover(cause if cause is not None else second)
            return
        self._end("rolled_back")
        log.info("%s rolled back: %s", repr(self), str(self.error))

    def _recover(self, cause):
        layout = self._recovery_layout()
        self._end("recovered")
        rebuild(self.host, self, layout, cause)

    def _end(self, state):
        log.debug("%s ends %s%s", repr(self), state, f" ({self.error})" if self.error else "")
        self.state = state
        if self._t0 is not None:
            self.stats["seconds"] = time.perf_counter() - self._t0
        self.blocked_by = None
        self._release()
