"""The files a rank joins its group with (the ring's hostfile) live only while MLX reads them, and on Linux never
on disk: a worker killed while it waits for its peers to join used to leave a folder in /tmp behind."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from neuron.rank.dist.group import _written


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux's")
def test_the_joining_files_are_in_memory_readable_at_their_path_and_gone_after(tmp_path: Path) -> None:
    def folders() -> set[Path]:  # none is made on Linux, by this rank or any other
        return set(Path(tempfile.gettempdir()).glob("neuron-rank*"))

    before = folders()
    with _written({"MLX_HOSTFILE": '[["127.0.0.1:5000"]]'}, "neuron-rank1-") as paths:
        path = paths["MLX_HOSTFILE"]
        assert path.startswith("/proc/self/fd/")
        assert Path(path).read_text() == '[["127.0.0.1:5000"]]'
        fd = int(path.rsplit("/", 1)[1])
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:neuron-rank1-mlx_hostfile")
    assert folders() == before
    with pytest.raises(OSError):
        os.fstat(fd)
