"""FairLock: the lock of an Engine or a Host. Reentrant, and granted in the order it was asked
for: a thread that steps without pause (a serving loop) would otherwise take it again before a
thread waiting to submit or abort wakes up, and starve it for hundreds of steps.

A waiter interrupted by an exception (Ctrl-C in a notebook raises KeyboardInterrupt in the main
thread while it waits) gives its turn back: its ticket is skipped when its turn comes, or passed
on at once if the turn was already its own. Otherwise every later caller would wait forever for a
ticket nobody holds."""
import threading

from .errors import StateError


class FairLock:
    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._owner = None
        self._depth = 0
        self._next_ticket = 0  # handed to the next thread that has to wait its turn
        self._serving = 0      # the ticket whose turn it is
        self._abandoned = set()  # tickets whose waiters left before their turn came

    def acquire(self):
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            ticket = self._next_ticket
            self._next_ticket = ticket + 1
            try:
                while self._owner is not None or self._serving != ticket:
                    self._cond.wait()
                self._owner, self._depth = me, 1
            except BaseException:
                if self._owner == me:        # interrupted just after taking it: let it go
                    self._owner, self._depth = None, 0
                if self._serving == ticket:  # its turn: pass it on
                    self._next_turn()
                else:                        # not yet: skip it when it comes
                    self._abandoned.add(ticket)
                raise
            return True

    def release(self):
        with self._cond:
            if self._owner != threading.get_ident():
                raise StateError("release of a FairLock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._next_turn()

    def _next_turn(self):
        """The turn goes to the next ticket whose waiter is still there (the lock is held)."""
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False
