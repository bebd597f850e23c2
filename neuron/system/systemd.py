"""The two halves of systemd's service protocol we speak: readiness notifications and socket activation.

Both are a few lines over the standard library, so no binding is needed:
``sd_notify`` is one datagram of ``KEY=value`` lines to ``$NOTIFY_SOCKET``,
and an activated socket is file descriptor 3 when ``$LISTEN_PID`` is ours.
Outside systemd the variables are unset and all of this does nothing.
"""

from __future__ import annotations

import os
import socket

LISTEN_FDS_START = 3
ACTIVATION_ENV = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class Notifier:
    """Sends state changes to systemd (``Type=notify``); ``watchdog_s`` is ``WatchdogSec=``, or None when off."""

    def __init__(self, environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
        address = environ.get("NOTIFY_SOCKET", "")
        # An abstract socket's name starts with a NUL byte, which systemd writes as "@".
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self._address else None
        self.watchdog_s: float | None = None
        pid = environ.get("WATCHDOG_PID")
        if (usec := environ.get("WATCHDOG_USEC", "")).isdigit() and (pid is None or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def send(self, *assignments: str) -> None:
        """``send("READY=1", "STATUS=serving")``; a lost datagram is not worth failing the server for."""
        if self._socket is None:
            return
        try:
            self._socket.sendto("\n".join(assignments).encode(), self._address)
        except OSError:
            pass

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()


def activated_socket() -> socket.socket | None:
    """The listening socket systemd passed us (``neuron.socket``), or None when started without one.

    The variables are removed once read, so that no child (a worker) mistakes
    them for its own.
    """
    pid, count = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS", "0")
    for name in ACTIVATION_ENV:
        os.environ.pop(name, None)
    if pid != str(os.getpid()) or not count.isdigit() or int(count) < 1:
        return None
    sock = socket.socket(fileno=LISTEN_FDS_START)
    sock.set_inheritable(False)
    return sock
