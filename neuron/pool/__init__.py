"""The leader's pool of ranks: rank 0 in this process, a worker process per other rank.

``pool.py`` is the pool (every step as a fan-out and a drain, and the face the
engine sees), which holds one object per job: ``ranks.py`` (spawning the
workers, forming the group, shutting them down), ``loading.py`` (loading the
model onto every rank), ``replacement.py`` (replacing a lost group in this
process), ``spares.py`` (when a rank moves to a spare host), ``roster.py`` (the hosts as they change: moves,
spares added or removed, a group that shrinks) and ``watch.py``
(the watch on the worker processes);
``rank0.py`` the thread rank 0's MLX work runs on; ``link.py`` the leader's
end of one worker's pipes. How a worker's process is started lives beside the
pool, in ``neuron.launch``.
"""

from neuron.pool.fanout import Deadlines, PoolError
from neuron.pool.pool import Pool
from neuron.pool.ranks import Layout
from neuron.pool.replacement import Unrecoverable
from neuron.pool.roster import NotShrunk
from neuron.pool.spares import ranks_named

__all__ = ["Deadlines", "Layout", "NotShrunk", "Pool", "PoolError", "Unrecoverable", "ranks_named"]
