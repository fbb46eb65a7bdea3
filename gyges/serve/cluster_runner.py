"""The server in front of a gyges.Cluster: the same app and streams as over one Host
(runner.py), the tokens coming from the hosts' processes instead of a stepping thread here.

ClusterRunner has HostRunner's interface (submit, abort, steps, started, start, close, host);
its `host` is a ClusterFront, what the app asks of a host: the model (config, tokenizer: the
driver's copy), stats() over every host (each instance and worker labelled with its host),
n_workers (per host), and the admin verbs on one host (`host` in the body, default 0). The
streams are updated by the cluster's pollers (Cluster.add_listener) as tokens arrive.
"""
import threading
import time

from ..core.errors import InvalidArgumentError
from .runner import Stream, TokenCounts


class ClusterFront:
    def __init__(self, cluster):
        if cluster.model is None or cluster.model.tokenizer is None:
            raise InvalidArgumentError("a server in front of a cluster needs the cluster made "
                                       "from a loaded Model with a tokenizer (Model.load)")
        self.cluster = cluster
        self.model = cluster.model
        self.n_workers = cluster.workers_per_host
        self.n_hosts = cluster.n_hosts

    def stats(self):
        """Host.stats of every live host, its instances and workers labelled with the host, the
        counters summed; `hosts`: each live host's own."""
        out = {"instances": [], "workers": [], "reconfigurations": 0,
               "reconfigurations_started": 0, "hosts": {}}
        for i in list(self.cluster.live_hosts):
            s = self.cluster.host(i).stats()
            out["instances"] += [dict(inst, host=i) for inst in s["instances"]]
            out["workers"] += [dict(w, host=i) for w in s["workers"]]
            out["reconfigurations"] += s["reconfigurations"]
            out["reconfigurations_started"] += s["reconfigurations_started"]
            out["hosts"][i] = s
        return out

    def transform(self, host=0, **args):
        return self.cluster.host(host).transform(**args)

    def layout(self):
        return " | ".join(f"host {i}: {self.cluster.host(i).layout()}"
                          for i in self.cluster.live_hosts)


class ClusterRunner:

    def __init__(self, cluster):
        self.cluster = cluster
        self.host = ClusterFront(cluster)
        self.started = time.time()
        self._streams = {}   # request id -> Stream
        self.counts = TokenCounts()
        self._lock = threading.Lock()
        cluster.add_listener(self._updated)

    @property
    def steps(self):
        return sum(self.cluster.host(i).steps() for i in list(self.cluster.live_hosts))

    def start(self):
        return self

    def close(self):
        with self._lock:
            self._streams.clear()

    def submit(self, prompt, params, loop):
        """Places a request on the least loaded host and returns its Stream."""
        h = self.cluster.submit(prompt, params)
        stream = Stream(h, loop, self.counts)
        with self._lock:
            self._streams[h.id] = stream
        self._updated([h])   # (tokens that came before the stream was known)
        return stream

    def abort(self, stream):
        with self._lock:
            self._streams.pop(stream.request.id, None)
        stream.closed = True
        if not stream.request.finished:
            self.cluster.abort(stream.request)

    def _updated(self, handles):
        with self._lock:   # (a stream is updated by one thread at a time: pollers, submit)
            for h in handles:
                stream = self._streams.get(h.id)
                if stream is not None and stream.update():
                    del self._streams[h.id]
