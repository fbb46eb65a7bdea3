"""The serving runtime: a worker's memory (arena), its KV cache (kv_cache) and weights placed
in it (weights), the worker itself (worker), communicators (comm), the serving loop of one
instance (engine), layouts (layout) and the Host that serves with a group of workers (host).
Reconfigurations (gyges.reconfig) sit above this layer and change it only through its public
methods."""
