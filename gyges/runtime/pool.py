"""How a host's workers are grouped into serving instances, and where a new request goes: the
host asks its pool and never looks at how the workers are shared.

    ShardedPool      every worker keeps only its own part of the model: the layout's instances
                     (TP groups, pipelines); reconfigurations replace them (install, retire)
    ReplicatedPool   every worker keeps the whole model (runtime/replicas.py): DP engines and
                     one TP engine per aligned group, over views of the same KV pool

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

    def place(self, host, tokens, tp=None, instance=None):
        """(the instance a request of `tokens` tokens goes to, reconfigurations to start)."""
        if tp is not None:
            raise InvalidArgumentError("tp= asks a replicated host (weights='replicated') for a "
                                       "mode; this host's instances have theirs")
        if instance is not None:
            return instance, ()
        fits = [inst for inst in self._instances if inst.fits(tokens)]
        if not fits:
            raise InvalidArgumentError(
                f"the request needs {tokens} tokens of KV but no instance holds that many "
                f"(layout {host.layout()}); merge instances first")
        return min(fits, key=lambda inst: inst.load()), ()

    def tick(self, host):
        """Reconfigurations to start before a step: none (a sharded host changes when asked)."""
        return ()

    def layout_parts(self):
        return [inst.layout for inst in self._instances]

    def modes(self):
        return [f"TP{inst.tp}" for inst in self._instances for _ in inst.workers]
