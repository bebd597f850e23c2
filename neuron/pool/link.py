"""The leader's end of one worker: its process, and the NDJSON requests and replies on its pipes.

A reply must carry the id of the request it answers and be the one reply type
that request expects (or ``Error``); anything else is a protocol violation,
never a reply to be guessed at.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from neuron import rpc
from neuron.launch import cgroup
from neuron.launch.checks import size
from neuron.rpc import ErrorKind

log = structlog.get_logger("neuron.pool")


@dataclass(slots=True)
class Link:
    rank: int
    host: str  # where the worker runs, as the operator named it: errors and logs say so
    process: anyio.abc.Process
    reader: BufferedByteReceiveStream
    last_words: Callable[[], str] = lambda: ""  # what the process (or ssh) said last on stderr, where it is kept
    next_id: int = 1
    said: rpc.HostInfo | None = None  # its handshake, once answered: where its host counts its OOM kills
    read_file: Callable[[str], Awaitable[str | None]] | None = None  # a file on its host, read here or over SSH
    over_ssh: bool = False  # the process is ssh carrying the worker: its exit is the session's

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def name(self) -> str:
        return f"rank {self.rank} on {self.host}"

    def take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    async def send(self, request: rpc.Request, deadline: float) -> rpc.Request:
        assert self.process.stdin is not None
        # A worker that stops reading fills the pipe, and the write would block forever.
        with anyio.fail_after(deadline):
            await self.process.stdin.send(rpc.encode(request))
        return request

    async def receive(self, request: rpc.Request, deadline: float) -> rpc.Reply:
        """The reply to ``request``; anything else is a protocol violation."""
        with anyio.fail_after(deadline):
            line = await self.reader.receive_until(b"\n", rpc.MAX_LINE_BYTES)
        reply = rpc.decode_reply(line)
        if reply.id != request.id:
            raise rpc.ProtocolError(
                ErrorKind.INVALID_FIELD,
                f"reply id {reply.id} ({reply.op}) does not answer request id {request.id} ({request.op})",
            )
        if not isinstance(reply, (rpc.EXPECTED_REPLY[type(request)], rpc.Error)):
            raise rpc.ProtocolError(ErrorKind.UNKNOWN_OP, f"{reply.op} does not answer {request.op}")
        return reply

    async def stop(self, deadline: float, broken: bool) -> None:
        """Ask the worker to leave and reap it; kill it if it has not left by ``deadline``, or at once if the
        group is ``broken`` (its worker may sit in a collective for a lost peer: asking it only waits)."""
        try:
            if broken:
                if self.process.returncode is None:
                    self.process.kill()
                await self.process.wait()
                return
            try:
                request = await self.send(rpc.Shutdown(id=self.take_id()), deadline)
                await self.receive(request, deadline)
                with anyio.fail_after(deadline):
                    await self.process.wait()
            except Exception as e:  # noqa: BLE001 - any failure here ends in a kill
                if self.process.returncode is None:
                    log.warning("worker did not leave cleanly; killing it", rank=self.rank, error=str(e))
                    self.process.kill()
                    await self.process.wait()
        finally:
            await self.process.aclose()

    async def exit_status(self) -> str:
        """How the process ended, for an error message, as observed; waits briefly for the kernel to report it. A
        worker killed outright (SIGKILL here; over SSH, ssh's code 255) is named an OOM kill only where its host's
        OOM count says so; an ssh process that ended on this host is named as a lost SSH session."""
        with anyio.move_on_after(2.0):
            await self.process.wait()
        code = self.process.returncode
        if code != (SSH_FAILED if self.over_ssh else -signal.SIGKILL):
            return self.describe(self.status())
        return self.describe(await self._killed(code))

    def status(self) -> str:
        """How the process ended, from its exit status alone."""
        code = self.process.returncode
        if not self.over_ssh or code is None:
            return describe_exit(code)
        if code < 0:
            return (
                f"lost its SSH session: ssh, on the leader's host, {describe_exit(code)}; the worker there ends with it"
            )
        if code == SSH_FAILED:
            return (
                f"lost its SSH session (ssh exited with {SSH_FAILED}: the connection to {self.host} dropped, or the "
                "worker there was killed by a signal)"
            )
        return f"{describe_exit(code)} (on {self.host}, through its SSH session)"

    async def _killed(self, code: int) -> str:
        """``code``'s status, saying whether the kernel's OOM killer ended the worker: its memory cgroup counted
        more OOM kills than at its handshake (the OOM killer ends the largest process, the worker). Where the
        count cannot be read, the status says so, and blames no one."""
        status = self.status()
        said, now = self.said, None
        if said is not None and said.oom_counter and said.oom_kills >= 0 and self.read_file is not None:
            with anyio.move_on_after(OOM_READ_S):
                text = await self.read_file(said.oom_counter)
                now = cgroup.oom_kills(text) if text is not None else None
        if said is not None and now is not None and now > said.oom_kills:
            limit = f" of {size(said.memory_limit)}" if said.memory_limit else ""
            return (
                f"was killed by the kernel's OOM killer: its memory cgroup reached its limit{limit} "
                f"({now - said.oom_kills} OOM kill(s) there since it started, {said.oom_counter}); give that host "
                "more memory or a higher limit, or split the model over more ranks (--tp or --pp)"
            )
        if now is None and code == -signal.SIGKILL:
            return (
                f"{status} (its host's OOM count could not be read: whether the kernel's OOM killer sent it is unknown)"
            )
        return status

    def describe(self, status: str) -> str:
        """``status`` of this worker's process, with its last words (ssh's own, when ssh could not connect)."""
        words = self.last_words()
        who = f"worker on {self.host} (ssh pid {self.pid})" if self.over_ssh else f"worker pid {self.pid}"
        return f"{who} {status}" + (f" ({words})" if words else "")


# ssh's own exit code when the session ends without the remote command's status: a worker killed by a signal,
# or a connection that failed.
SSH_FAILED = 255
# Seconds to read a dead worker's OOM count (over SSH for another host) before reporting without it.
OOM_READ_S = 5.0


def describe_exit(code: int | None) -> str:
    if code is None:
        return "closed its stdout but is still running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
