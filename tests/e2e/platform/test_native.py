"""The one-row interposer (neuron/system/native/gemv.c): built here, preloaded as neuron preloads it, every product
right.

Each check runs MLX in a child process with ``cpu.preload_for``'s libraries
preloaded (a preload only takes at process start), and compares its products
with numpy's in float64: every transposition of a one-row product (the path the
interposer takes), an ``addmm`` (beta = 1, the bias already in the output), and
a product of more rows (handed on, unchanged, to the library's own sgemm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from neuron.system import cpu
from neuron.system.native import build_gemv

pytestmark = pytest.mark.skipif(not cpu.is_linux_cpu_backend(), reason="the interposer is for Linux CPU BLAS")

CHECK = """
import json, mlx.core as mx, numpy as np
mx.random.seed(0)
out = {}
for name, a_shape, b_shape, ta, tb in [
    ("row . matrix", (1, 576), (576, 1536), False, False),
    ("row . matrix^T", (1, 576), (1536, 576), False, True),
    ("column^T . matrix", (576, 1), (576, 1536), True, False),
    ("column^T . matrix^T", (576, 1), (1536, 576), True, True),
    ("batched rows", (3, 1, 64), (3, 64, 96), False, False),
    ("eight rows", (8, 576), (576, 1536), False, False),
]:
    a, b = mx.random.normal(a_shape), mx.random.normal(b_shape)
    a = a.swapaxes(-1, -2) if ta else a
    b = b.swapaxes(-1, -2) if tb else b
    want = np.array(a).astype(np.float64) @ np.array(b).astype(np.float64)
    out[name] = float(np.abs(np.array(a @ b) - want).max() / np.abs(want).max())
# MLX copies what it cannot pass as is; called directly, the one row is a column of a 576 x 4 matrix (lda 4).
import ctypes
sgemm = ctypes.CDLL(None).cblas_sgemm  # the first definition in the process: the interposer's
f, i = ctypes.c_float, ctypes.c_int
sgemm.argtypes = [i, i, i, i, i, i, f, ctypes.c_void_p, i, ctypes.c_void_p, i, f, ctypes.c_void_p, i]
column, b = np.random.rand(576, 4).astype(np.float32), np.random.rand(576, 96).astype(np.float32)
c = np.zeros((1, 96), np.float32)
ptr = lambda array: array.ctypes.data
sgemm(101, 112, 111, 1, 96, 576, 1.0, ptr(column[:, 1:]), 4, ptr(b), 96, 0.0, ptr(c), 96)
want = column[:, 1].astype(np.float64) @ b.astype(np.float64)
out["strided row, direct"] = float(np.abs(c[0] - want).max() / np.abs(want).max())
x, w, bias = mx.random.normal((1, 576)), mx.random.normal((1536, 576)), mx.random.normal((1536,))
want = np.array(bias).astype(np.float64) + np.array(x).astype(np.float64) @ np.array(w).astype(np.float64).T
out["addmm"] = float(np.abs(np.array(mx.addmm(bias, x, w.T)) - want).max() / np.abs(want).max())
print(json.dumps(out))
"""


def test_one_row_products_through_the_interposer_equal_numpys() -> None:
    library = cpu.find_blas()
    if library is None:
        pytest.skip("no fast BLAS installed: run scripts/fast-blas")
    built = build_gemv()
    if built.path is None:
        pytest.skip(built.problem)
    preload, problem = cpu.preload_for(library)
    assert problem is None and preload == [str(built.path), library]
    env = {**os.environ, cpu.PRELOAD_ENV: ":".join(preload)}
    maps = subprocess.run(
        [sys.executable, "-c", "import mlx.core; print(open('/proc/self/maps').read())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(built.path) in maps and "/native/gemv-" in maps
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    errors = json.loads(done.stdout)
    assert errors and all(error < 1e-5 for error in errors.values()), errors


def test_off_and_a_library_without_sgemv_keep_sgemm(monkeypatch: pytest.MonkeyPatch) -> None:
    library = cpu.find_blas()
    if library is None:
        pytest.skip("no fast BLAS installed: run scripts/fast-blas")
    monkeypatch.setenv(cpu.GEMV_ENV, "off")
    assert cpu.preload_for(library) == ([library], f"{cpu.GEMV_ENV}=off")
    monkeypatch.delenv(cpu.GEMV_ENV)
    libm = "/lib/x86_64-linux-gnu/libm.so.6"
    if os.path.exists(libm):
        assert cpu.preload_for(libm) == ([libm], f"{libm} exports no cblas_sgemv")


def test_without_a_compiler_it_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    built = build_gemv()
    assert built.path is None and "apt-get install gcc" in built.problem
