"""More than one process, more than one machine: gyges.Cluster, hosts as Ray actors
(cluster.py), each a Host stepping on its own (host_actor.py)."""
from .cluster import Cluster, ClusterRequest, HostProxy, RemoteReconfiguration

__all__ = ["Cluster", "ClusterRequest", "HostProxy", "RemoteReconfiguration"]
