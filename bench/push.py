"""--push-model across a namespace link: a TP=2 share sent to a host with an empty cache, then a start that finds it.

Run (as root, with openssh-server and iproute2): .venv/bin/python bench/push.py [--hidden 1024 --layers 8 ...]

The host is testkit/testbed.py's: a namespace on a bridge with its own sshd and
its own neuron cache, holding no model. Three ``neuron generate --max-tokens 1``
starts, each a fresh leader: the first pushes rank 1's share (the log's ``push
started`` and ``push done``: bytes and seconds, the leader's slicing and
hashing, SSH and the host's writing and checking included); the second finds
the share whole (the host checks every tensor's digest again) and sends
nothing; the third, for comparison, gives the host the model folder itself
(the shared filesystem), checked by the sampled digest. For each start: the
time from the group's forming to the model loaded on every rank (the model's
check, any push, the load).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from generated import ROOT, add_shape_flags, generated_model


def start(hostfile: Path, model: Path, ssh_command: str, *extra: str) -> list[dict]:
    hosts = ("--hosts", str(hostfile), "--ssh-command", ssh_command)
    done = subprocess.run(
        [sys.executable, "-m", "neuron", "generate", "--max-tokens", "1", "--model", str(model), *hosts, *extra, "hi"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]


def seconds_between(logs: list[dict], first: str, last: str) -> float:
    when = {e["event"]: datetime.fromisoformat(e["timestamp"]) for e in logs if e.get("event") in (first, last)}
    return (when[last] - when[first]).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_flags(parser)
    args = parser.parse_args()
    from testkit.testbed import Namespaces

    with tempfile.TemporaryDirectory(prefix="neuron-bench-push-") as tmp:
        root = Path(tmp)
        model = generated_model(args, root / "model")
        size = (model / "model.safetensors").stat().st_size
        (root / "bed").mkdir()
        bed = Namespaces(1, root / "bed")
        try:
            bed.start()
            command = bed.neuron_command({"NEURON_CACHE_DIR": str(root / "cache")})
            empty = bed.hostfile([bed.entry(-1), {**bed.entry(0), "model": "/nowhere", "neuron": command}], "e.json")
            own = bed.hostfile([bed.entry(-1), bed.entry(0)], "own.json")
            pushed = start(empty, model, bed.ssh_command, "--push-model")
            again = start(empty, model, bed.ssh_command, "--push-model")
            copy = start(own, model, bed.ssh_command)
        finally:
            bed.close()
    (done,) = [e for e in pushed if e["event"] == "push done"]
    assert not [e for e in again if e["event"] == "push started"], "the second start sent something"
    print(f"model: {size / 1e6:.0f} MB fp32 ({args.hidden} hidden, {args.layers} layers); TP=2, rank 1 on the host\n")
    print("| start | sent (MB) | push (s) | push (MB/s) | group ready to model loaded (s) |")
    print("|---|---|---|---|---|")
    rate = done["bytes"] / 1e6 / done["seconds"]
    span = seconds_between(pushed, "group ready", "model loaded")
    sent = done["bytes"] / 1e6
    print(f"| empty cache, --push-model | {sent:.0f} | {done['seconds']:.1f} | {rate:.0f} | {span:.1f} |")
    print(f"| share held | 0 | - | - | {seconds_between(again, 'group ready', 'model loaded'):.1f} |")
    print(f"| own model folder | 0 | - | - | {seconds_between(copy, 'group ready', 'model loaded'):.1f} |")


if __name__ == "__main__":
    main()
