"""A worker-to-worker link for the CPU host (KunServe's RDMA between buddies), and the pacing
that live transfers share: how much one advance may move.

    link = Link(bandwidth=50e6, latency=20e-6)   # bytes/s, seconds per message
    host.buddy((0, 1), live=True, link=link)
"""
import time

from ..core.checks import number

__all__ = ["Link", "Paced"]


class Link:
    """A worker-to-worker link for the CPU host (KunServe's RDMA between buddies): a transfer of
    n bytes in m messages takes m * latency + n / bandwidth seconds of wall time, spent asleep.
    Workers of one process copy in microseconds; a link makes a blocking exchange stall as long
    as it would on the network, and charges remote attention its round trips, so that live and
    blocking can be told apart. Off (None) unless given to host.buddy. Scale it to the model:
    a tiny model's KV is a few MiB, so 200 Gbps would hide everything."""

    def __init__(self, bandwidth, latency=0.0):
        self.bandwidth = number("bandwidth", bandwidth, lo=0, lo_open=True)   # bytes / s
        self.latency = number("latency", latency, lo=0)                       # s per message

    def seconds(self, nbytes, messages=1):
        return messages * self.latency + nbytes / self.bandwidth

    def send(self, nbytes, messages=1):
        """Sleeps as long as the transfer takes; returns the seconds."""
        t = self.seconds(nbytes, messages)
        if t > 0:
            time.sleep(t)
        return t

    def __repr__(self):
        return f"Link({self.bandwidth * 8 / 1e9:g} Gbps, {self.latency * 1e6:g} us)"


class Paced:
    """What a live exchange and a live restore share: what one advance may move. Without a link,
    `layers_per_step` layers per key (a victim and buddy, a member, a pair of stages); with one,
    as many bytes as the link carried since the last advance, less what it spent on other
    traffic (`busy` seconds: remote attention's activations, which go first)."""

    def __init__(self, link, layers_per_step):
        self.link, self.layers_per_step = link, layers_per_step
        self._credit, self._last = 0.0, time.perf_counter()

    def _refill(self, busy=0.0):
        now = time.perf_counter()
        if self.link is not None:
            self._credit += max(now - self._last - busy, 0.0) * self.link.bandwidth
        self._last = now

    def _may(self, moved, key, nbytes):
        if self.link is None:
            return moved.get(key, 0) < self.layers_per_step
        return self._credit >= nbytes

    def _moved(self, moved, key, nbytes):
        self._credit -= nbytes
        moved[key] = moved.get(key, 0) + 1
