"""Several hosts on this one machine: network namespaces joined by a bridge, each running its own sshd.

The leader runs in the root namespace, on the bridge's address (entry 0 of a
hostfile); host i is namespace ``{prefix}n{i}`` at ``10.{net}.{i + 2}``. All
share this filesystem, so every host runs this venv and sees the same model
folders. Made as root with ``ip netns`` and Debian's ``openssh-server``; torn
down on exit, even when a test failed, killing whatever is left in each
namespace. ``unavailable()`` says why a machine cannot host it, for a skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

SSHD = "/usr/sbin/sshd"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why this machine cannot run the test bed, or None."""
    if os.geteuid() != 0:
        return "the multi-host test bed needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "the multi-host test bed needs iproute2's `ip` (apt-get install iproute2)"
    if shutil.which("nsenter") is None:
        return "the multi-host test bed needs util-linux's `nsenter` (apt-get install util-linux)"
    if not Path(SSHD).is_file() or shutil.which("ssh-keygen") is None:
        return "the multi-host test bed needs an SSH server (apt-get install openssh-server)"
    probe = f"nrnprobe{os.getpid() % 10000}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces are not available here: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


PREFIX = "nrp"  # then the pid of the process that made the bed: another's live bed is left alone


def _owner_gone(name: str) -> bool:
    """Whether ``name`` (a namespace or link of a bed) belongs to a process no longer running."""
    digits = re.match(rf"{PREFIX}(\d+)", name)
    return digits is not None and not Path(f"/proc/{digits.group(1)}").exists()


def clean_leftovers() -> None:
    """Namespaces and links an earlier run left behind (a killed test process cannot clean up); beds of test
    processes still running (another checkout's, at the same time) are theirs."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _owner_gone(name):
            for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                _kill(int(pid))
            _run("ip", "netns", "del", name, check=False)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if _owner_gone(name) and name.endswith("br"):
            _run("ip", "link", "del", name, check=False)


def _free_net() -> int:
    """X of a 10.X.0.0/24 no interface of this machine is in (another bed running at the same time holds one)."""
    taken = set(re.findall(r"inet 10\.(\d+)\.", _run("ip", "-o", "addr", "show", check=False).stdout))
    for offset in range(100):
        net = 100 + (os.getpid() + offset) % 100
        if str(net) not in taken:
            return net
    raise RuntimeError("every 10.X.0.0/24 with X in 100-199 is in use on this machine: no room for a test bed")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Namespaces:
    def __init__(self, hosts: int, root: Path) -> None:
        self.root = root
        self.prefix = f"{PREFIX}{os.getpid()}"  # up to 7 digits: its links' names stay within 15 characters
        self.net = _free_net()
        self.bridge = f"{self.prefix}br"
        self.leader_ip = self.ip(-1)
        self.namespaces = [f"{self.prefix}n{i}" for i in range(hosts)]
        self._sshd: dict[int, subprocess.Popen[bytes]] = {}
        self.key = root / "id"
        self.ssh_config = root / "ssh_config"

    def ip(self, host: int) -> str:
        """Host ``i``'s address; -1 is the leader's, on the bridge."""
        return f"10.{self.net}.0.{host + 2}"

    def veth(self, host: int) -> str:
        return f"{self.prefix}h{host}"  # the bridge's end of host i's link

    def start(self) -> Namespaces:
        clean_leftovers()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.leader_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            inner = f"{self.prefix}n{i}x"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", self.veth(i), "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", self.veth(i), "master", self.bridge)
            _run("ip", "link", "set", self.veth(i), "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", inner)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / "host_key"))
        shutil.copy(f"{self.key}.pub", self.root / "authorized_keys")
        self.ssh_config.write_text(
            f"Host *\n  IdentityFile {self.key}\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        for i in range(len(self.namespaces)):
            self.start_sshd(i)
        return self

    def start_sshd(self, host: int) -> None:
        config = self.root / f"sshd_{host}"
        config.write_text(
            f"ListenAddress {self.ip(host)}\nPort 22\nHostKey {self.root / 'host_key'}\n"
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
            f"StrictModes no\nUsePAM no\nPidFile {self.root / f'sshd_{host}.pid'}\n"
        )
        log = open(self.root / f"sshd_{host}.log", "ab")
        # nsenter enters the namespace's network alone; ``ip netns exec`` would also remount /sys, and hide the
        # host's cgroups from its processes (a memory limit they must see, testkit/cgroups.py).
        self._sshd[host] = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.namespaces[host]}", SSHD, "-D", "-e", "-f", str(config)],
            stdout=log,
            stderr=log,
        )
        deadline = time.monotonic() + 10
        while b"Server listening" not in (self.root / f"sshd_{host}.log").read_bytes():
            assert self._sshd[host].poll() is None, (self.root / f"sshd_{host}.log").read_text()
            assert time.monotonic() < deadline, f"sshd on host {host} did not start"
            time.sleep(0.02)

    def sshd_pid(self, host: int) -> int:
        """Host ``i``'s sshd listener: what it starts (each session, each worker) is its child."""
        return self._sshd[host].pid

    def stop_sshd(self, host: int) -> None:
        process = self._sshd.pop(host, None)
        if process is not None:
            process.terminate()
            process.wait(10)

    def gone_for_good(self, host: int) -> None:
        """Host ``i`` dies as a machine does: its link down first (nothing it says gets out), then every process in
        its namespace killed, its sshd with them. ``back`` undoes it."""
        self.link(host, up=False)
        listener = self._sshd.pop(host, None)
        for pid in _run("ip", "netns", "pids", self.namespaces[host], check=False).stdout.split():
            _kill(int(pid))
        if listener is not None:
            listener.wait(10)

    def back(self, host: int) -> None:
        """Host ``i`` boots again: its link up and its sshd listening."""
        self.link(host, up=True)
        if host not in self._sshd:
            self.start_sshd(host)

    def link(self, host: int, up: bool) -> None:
        _run("ip", "link", "set", self.veth(host), "up" if up else "down")

    @property
    def ssh_command(self) -> str:
        return f"ssh -F {self.ssh_config}"

    def neuron_command(self, env: dict[str, str] | None = None, module: str = "neuron") -> str:
        """How a host starts neuron: this venv's interpreter (and this checkout, when PYTHONPATH names one);
        ``module``: an entry point in front of neuron, found in this repository (``testkit.faults.ENTRY``)."""
        paths = [str(ROOT)] if module != "neuron" else []
        paths += [os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ else []
        env = {**({"PYTHONPATH": os.pathsep.join(paths)} if paths else {}), **(env or {})}
        prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        return " ".join([*prefix, sys.executable, "-m", module])

    def entry(self, host: int, **extra: Any) -> dict[str, Any]:
        """Hostfile entry for host ``i`` (-1: the leader's own)."""
        if host < 0:
            return {"ssh": "localhost", "ips": [self.leader_ip], **extra}
        return {"ssh": f"root@{self.ip(host)}", "ips": [self.ip(host)], "neuron": self.neuron_command(), **extra}

    def hostfile(
        self, entries: list[dict[str, Any]], name: str = "hosts.json", spares: list[dict[str, Any]] | None = None
    ) -> Path:
        """A hostfile of ``entries`` (in the object form, with ``spares``, where given), each rank on a core of this
        machine's own where there are enough to go round (an entry's own ``cpus`` stand).

        Why the cores: the hosts share this machine's cores, and a rank alone on its host takes every core it
        sees, with as many BLAS threads, which spin between a step's products, and ring threads that poll while a
        transfer is pending. Two such ranks on two cores starved one another: a leader's two spinning threads left
        its remote peer a few percent of the CPU, and the suite's multi-host tests ran several times longer. One
        core each, as each would have on a machine of its own. With more ranks than cores they float, as the ranks
        of one host do (``Launcher.cpus``): two ranks sharing a core poll the ring while the other computes.
        """
        cores = sorted(os.sched_getaffinity(0))
        if len(entries) <= len(cores):
            entries = [{"cpus": [core], **entry} for core, entry in zip(cores, entries, strict=False)]
            # A spare takes a remote rank's place, and its core: the last rank's, which it most likely replaces.
            spares = [{"cpus": [cores[len(entries) - 1]], **spare} for spare in spares or []]
        path = self.root / name
        path.write_text(json.dumps({"hosts": entries, "spares": spares} if spares is not None else entries))
        return path

    def pids(self, host: int) -> list[int]:
        """Processes in host ``i``'s namespace, its sshd listener left out."""
        found = _run("ip", "netns", "pids", self.namespaces[host], check=False).stdout.split()
        listener = self._sshd.get(host)
        return [int(p) for p in found if listener is None or int(p) not in _children_of(listener.pid)]

    def workers(self, host: int) -> list[int]:
        """neuron processes in host ``i``'s namespace."""
        out = []
        for pid in self.pids(host):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"neuron" in command and b"--worker" in command:
                out.append(pid)
        return out

    def close(self) -> None:
        for host in list(self._sshd):
            self.stop_sshd(host)
        for ns in self.namespaces:
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                _kill(int(pid))
            _run("ip", "netns", "del", ns, check=False)
        for i in range(len(self.namespaces)):
            _run("ip", "link", "del", self.veth(i), check=False)
        _run("ip", "link", "del", self.bridge, check=False)


@contextlib.contextmanager
def started(hosts: int, root: Path) -> Iterator[Namespaces]:
    """A bed of ``hosts`` hosts under ``root``, torn down on exit whatever happened: a test module's fixture."""
    testbed = Namespaces(hosts, root)
    try:
        yield testbed.start()
    finally:
        testbed.close()


def _children_of(pid: int) -> set[int]:
    """``pid`` and its descendants, from /proc (``nsenter`` execs sshd, which is the listener)."""
    family = {pid}
    changed = True
    while changed:
        changed = False
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in family:
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) in family and "sshd" in (entry / "comm").read_text():
                family.add(int(entry.name))
                changed = True
    return family


def children(pid: int, name: str | None = None) -> list[int]:
    """``pid``'s child processes whose command is ``name`` (a leader's ``ssh`` sessions), or all of them."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if int(stat[1]) == pid and name in (None, comm):
                out.append(int(entry.name))
    return out
