"""How the leader starts each worker rank's process, where, and how it checks them; beside the pool, not in it.

``launcher.py`` is the one interface the pool calls (a process per rank, its
host's name, its cores and model path); ``local.py`` starts a worker as a
subprocess, ``ssh.py`` on another host over SSH; ``hosts.py`` reads the
hostfile and describes a host (``cgroup.py``: the room its memory cgroup leaves,
and the OOM kills counted there); ``dataplane.py`` picks and probes the addresses
the collectives use, and ``tunnels.py`` carries them through SSH (``--data-plane
ssh``); ``checks.py`` compares what the ranks report; ``push.py`` sends a host
that lacks the model the share its rank loads (``--push-model``), and is that
host's receiving end. The modules are imported by path: a worker uses ``hosts``
and ``dataplane`` alone.
"""
