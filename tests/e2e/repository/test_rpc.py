"""The protocol stands alone: ``neuron.rpc`` imports without MLX, in a fresh interpreter. The codec itself:
tests/unit/rpc/test_rpc.py."""

from __future__ import annotations


def test_protocol_module_does_not_import_mlx() -> None:
    import subprocess
    import sys

    code = "import sys, neuron.rpc; sys.exit(any(m.startswith('mlx') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
