"""How the leader starts each worker rank's process, and where it runs; beside the pool, not inside it.

The pool asks a launcher for a process per rank above 0 and then speaks the
protocol over its stdin and stdout, whatever started it. ``local`` runs
``neuron --worker`` as a subprocess on this host.
"""

from neuron.launch.local import Launcher, LocalLauncher

__all__ = ["Launcher", "LocalLauncher"]
