"""How a host's workers are grouped into serving instances, and where a new request goes: the
host asks its pool and never looks at how the workers are shared.

    ShardedPool      every worker keeps only its own part of the model: the layout's instances
                     (TP groups, pipelines); reconfigurations replace them (install, retire)
    ReplicatedPool   every worker keeps the whole model (runtime/replicas.py): DP engines and
                     one TP engine per aligned group, over views of the same KV pool
    MixedPool        both on one host: some workers sharded, an aligned range replicated

Both answer the same questions: every instance that exists (`instances`), those that step now
(`serving`), where a request goes (`place`, which may ask for a reconfiguration to start, e.g. a
group to bind for TP work), what to start before a step (`tick`) and the layout as text."""
from ..core.errors import InvalidArgumentError


class ShardedPool:
    kind = "sharded"

    def __init__(self, instances=()):
        self._instances = list(instances)
        self._sort()

    def _sort(self):
        self._instances.sort(key=lambda inst: min(inst.workers))

    def instances(self):
        return list(self._instances)

    def serving(self):
        return list(self._instances)

    def install(self, instance):
        """Starts serving an instance (kept in order of first worker)."""
        self._instances.append(instance)
        self._sort()

    def remove(self, instance):
        """Takes an instance out of the pool without stopping it (a reconfiguration keeps it
        until its commit, to give it its requests back on a rollback)."""
        if instance in self._instances:
            self._instances.remove(instance)

    def retire(self, instance):
        """Stops an instance; its requests must have moved elsewhere (or its KV been detached)."""
        if instance in self._instances:
            self._instances.remove(instance)
        instance.close()

    def place(self, host, tokens, tp=None, instance=None, priority=0):
        """(the instance a request of `tokens` tokens goes to, reconfigurations to start);
        priority matters where a request may preempt (a replicated pool's binds)."""
        if tp is not None and tp > 1:
            raise InvalidArgumentError("tp= asks a replicated host (weights='replicated') for a "
                                       "TP degree; this host's instances have theirs")
        if instance is not None:
            return instance, ()
        fits = [inst for inst in self._instances if inst.fits(tokens) and (tp != 1 or inst.tp == 1)]
        if not fits:
            raise InvalidArgumentError(
                f"the request needs {tokens} tokens of KV but no instance holds that many "
                f"(layout {host.layout()}); merge instances first")
        return min(fits, key=lambda inst: inst.load()), ()

    def tick(self, host):
        """Reconfigurations to start before a step: none (a sharded host changes when asked)."""
        return ()

    def layout_parts(self):
        """[(first worker, part)] in worker order."""
        return [(min(inst.workers), inst.layout) for inst in self._instances]

    def modes(self):
        """{worker: its mode}."""
        return {w: f"TP{inst.tp}" for inst in self._instances for w in inst.workers}


class MixedPool:
    """A host whose workers are partly sharded, partly replicated (an aligned range): each part
    its own pool, the host asking them all. Requests by degree (tp=k) go to the replicated part;
    others to the least loaded instance either part would place them on."""
    kind = "mixed"

    def __init__(self, sharded, replicated):
        self.sharded, self.replicated = sharded, replicated
        self.parts = (sharded, replicated)

    def instances(self):
        return self.sharded.instances() + self.replicated.instances()

    def serving(self):
        return self.sharded.serving() + self.replicated.serving()

    def install(self, instance):
        self.sharded.install(instance)

    def remove(self, instance):
        self.sharded.remove(instance)

    def retire(self, instance):
        self.sharded.retire(instance)

    def place(self, host, tokens, tp=None, instance=None, priority=0):
        if instance is not None:
            return instance, ()
        if tp is not None and tp > 1:
            return self.replicated.place(host, tokens, tp=tp, priority=priority)
        options, last = [], None
        for pool in self.parts:
            try:
                options.append(pool.place(host, tokens, tp=tp, priority=priority))
            except InvalidArgumentError as e:
                last = e
        if not options:
            raise last
        return min(options, key=lambda o: (len(o[1]), o[0].load()))

    def tick(self, host):
        return list(self.sharded.tick(host)) + list(self.replicated.tick(host))

    def layout_parts(self):
        return sorted(self.sharded.layout_parts() + self.replicated.layout_parts())

    def modes(self):
        return {**self.sharded.modes(), **dict(zip(self.replicated.workers,
                                                   self.replicated.modes()))}
