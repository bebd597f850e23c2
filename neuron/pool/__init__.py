"""The leader's pool of ranks: rank 0 in this process, a worker process per other rank.

``pool.py`` is the pool (the group, every operation as a fan-out and a drain,
the watch on worker processes); ``rank0.py`` the thread rank 0's MLX work runs
on; ``link.py`` the leader's end of one worker's pipes. How a worker's process
is started lives beside the pool, in ``neuron.launch``.
"""

from neuron.pool.pool import Deadlines, Layout, Pool, PoolError, Unrecoverable

__all__ = ["Deadlines", "Layout", "Pool", "PoolError", "Unrecoverable"]
