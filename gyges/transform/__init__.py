"""Live tensor-parallel transformation of a group of workers (Gyges section 4, AMOEBAs
section 3): merge m instances of TPt into one TPk, or split one TPk into m instances of TPt,
with requests in flight, moving no request's progress and recomputing nothing.

    plans.py           the pure plans: rank maps, the balance of requests, the phased all-to-all
    requests.py        the requests that move, and their hand-over in C (gy_engine_take)
    kv_move.py         where the KV bytes move: host memory or device copies, one interface
    at_once.py         every layer at once, between two steps (scale_up, scale_down)
    staggered.py       a few layers per step, serving in between (Gyges 4.3)
    baselines.py       the methods: gyges, stop_world, basic, partial_swap (Gyges 6.2)
    transformation.py  the handle (done, stats), TransformError, and what they all share

Host.transform picks the executor; a failure past the first change rebuilds the group
(gyges.recovery). Nothing here reaches into a host's instances or workers but through their
methods (Host.install/retire/begin_change, Instance.take/detach_kv/begin_transition...,
Worker.install)."""
from .at_once import scale_down, scale_up
from .baselines import METHODS
from .staggered import StaggeredScaleDown, StaggeredScaleUp
from .transformation import Transformation, TransformError, views_in

__all__ = ["METHODS", "StaggeredScaleDown", "StaggeredScaleUp", "Transformation", "TransformError",
           "scale_down", "scale_up", "views_in"]
