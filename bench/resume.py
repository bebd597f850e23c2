"""Requests that outlive a lost rank: the time from the kill to the next token of each resumed stream.

Run: .venv/bin/python bench/resume.py [--trials 3] [--hosts]   (--hosts: as root, with openssh-server and iproute2)

A TP=2 server of the tiny qwen3 (testkit's, random weights, a real tokenizer) streams testkit/resume.py's four
requests (two greedy, two seeded, 300 tokens each; 60 across hosts, where a step is slower); once every stream
has a few chunks, rank 1's worker is SIGKILLed. Each stream must then end as the same request did on the
undisturbed server (its text equal, no error event), and for each the time from the kill to its first token
after it is taken. One host: the worker is a local process. ``--hosts``: rank 1 runs on a namespace host of
testkit/testbed.py, started over SSH, and the fault is killing its SSH session. The server logs its own part
(``recovered``: loss noticed to the group probed again); the rest is the replay of each stream (its prompt and
output fed again, one blamed stream per step).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit import Server, make_tiny_model
from testkit.resume import disturb, kill, reference, shorter, worker_pid
from testkit.testbed import children


def trials(server: Server, count: int, across: bool, tokens: int) -> tuple[list[float], list[float]]:
    """Seconds from each kill to each stream's next token, and the server's own recovery times."""
    bases = shorter(tokens)
    references = [reference(server.url, base) for base in bases]
    to_next = []
    for _ in range(count):
        victim = children(server.process.pid, "ssh")[0] if across else worker_pid(server)
        streams, at = disturb(server, references, kill(victim, signal.SIGKILL), bases=bases)
        to_next += [t for s in streams if (t := s.first_after(at)) is not None]
    recoveries = [e["ms"] / 1000 for e in server.logs() if e.get("event") == "recovered" and e.get("in_process")]
    return to_next, recoveries


def report(name: str, to_next: list[float], recoveries: list[float]) -> None:
    print(
        f"| {name} | {len(to_next)} | {statistics.median(to_next):.2f} | {max(to_next):.2f} | "
        f"{statistics.median(recoveries):.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--hosts", action="store_true", help="also across namespace hosts (root)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per request on one host")
    parser.add_argument("--hosts-tokens", type=int, default=60, help="tokens per request across hosts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "qwen3", "qwen3")
        print("| ranks | streams resumed | kill → next token, p50 (s) | max (s) | recovery logged, p50 (s) |")
        print("|---|---|---|---|---|")
        server = Server("--model", str(model), "--tp", "2", "--step-timeout", "3", log_path=root / "local.log")
        try:
            report("TP=2, one host (SIGKILL a worker)", *trials(server.start(), args.trials, False, args.tokens))
        finally:
            server.stop()
        if args.hosts:
            from testkit.testbed import Namespaces

            (root / "bed").mkdir()
            bed = Namespaces(1, root / "bed")
            try:
                bed.start()
                hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "bench.json")
                hosts = ("--hosts", str(hostfile), "--ssh-command", bed.ssh_command)
                server = Server("--model", str(model), "--step-timeout", "3", *hosts, log_path=root / "hosts.log")
                try:
                    found = trials(server.start(), args.trials, True, args.hosts_tokens)
                    report("TP=2, two hosts (SIGKILL the SSH session)", *found)
                finally:
                    server.stop()
            finally:
                bed.close()


if __name__ == "__main__":
    main()
