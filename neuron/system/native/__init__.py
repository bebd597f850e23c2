"""Native helpers compiled on the machine that runs them: today one, ``gemv.c`` (why: its own header comment).

Built once per machine with whatever C compiler is there (``$CC``, ``cc`` or
``gcc``), into neuron's cache directory, keyed by a digest of the source and the
compiler, so a new version or another compiler builds afresh and concurrent
builds never see a half-written file. No compiler means no helper, never an
error: the caller runs without it and says how to get it. No MLX here.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from neuron.system.paths import cache_dir

GEMV_SOURCE = Path(__file__).with_name("gemv.c")
COMPILER_HINT = "install a C compiler (Debian/Ubuntu: apt-get install gcc; Fedora: dnf install gcc)"


@dataclass(frozen=True, slots=True)
class Built:
    path: Path | None
    problem: str = ""  # why there is none


def build_gemv() -> Built:
    """The one-row interposer as a shared library for this machine, built now unless already cached."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return Built(None, f"no C compiler found: {COMPILER_HINT}")
    source = GEMV_SOURCE.read_bytes()
    digest = hashlib.blake2b(source + compiler.encode(), digest_size=8).hexdigest()
    target = cache_dir() / "native" / f"gemv-{platform.machine()}-{digest}.so"
    if target.is_file():
        return Built(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, "-shared", "-fPIC", "-O2", "-nostdlib", "-o", str(built), str(GEMV_SOURCE)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                return Built(None, f"{' '.join(command)} failed: {done.stderr.strip()[-300:]}")
            os.replace(built, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Built(None, f"could not build it in {target.parent}: {e}")
    return Built(target)
