"""Native helpers compiled on the machine that runs them (why each: its own header comment):

- ``gemv.c``, one-row fp32 products through ``cblas_sgemv``, built with whatever C compiler is there (``$CC``,
  ``cc`` or ``gcc``);
- ``quantized.cpp``, products against MLX's quantized weights, with ``layers.cpp``, a layer's RMS norm and rotary
  embedding as one node each: one MLX extension for a quantized model's step on the CPU, built with the system's
  CMake (``CMakeLists.txt``; nanobind comes with the ``cpu`` extra) and whatever C++ compiler is there (``$CXX``,
  ``c++`` or ``g++``).

Each is built once per machine into neuron's cache directory, keyed by a digest of what went into it (the sources,
the compiler, the versions), so a new version or another compiler builds afresh and concurrent builds never see a
half-written file. No compiler means no helper, never an error: the caller runs without it and says how to get it.
No MLX here: the builds find its files without importing it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from neuron.system.paths import cache_dir

GEMV_SOURCE = Path(__file__).with_name("gemv.c")
COMPILER_HINT = "install a C compiler (Debian/Ubuntu: apt-get install gcc; Fedora: dnf install gcc)"
QUANTIZED_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "quantized.cpp",
        "quantized.h",
        "layers.cpp",
        "attention.cpp",
        "mlx_math.h",
        "strided.h",
        "cpu_eval.h",
        "team.h",
    )
]
QUANTIZED_CMAKE = Path(__file__).with_name("CMakeLists.txt")
MLX_CMAKE = Path("share", "cmake", "MLX")  # in the MLX wheel's folder
CXX_HINT = "install a C++ compiler (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++)"
EXTRA_HINT = "install CMake (Debian/Ubuntu: apt-get install cmake) and neuron's cpu extra, which brings nanobind"
BUILD_TIMEOUT_S = 600
QUANTIZED_FIX = "install a C++ compiler, CMake and neuron[cpu] (scripts/fast-blas installs them)"
QUANTIZED_ENV = "NEURON_QUANTIZED_KERNEL"  # "off": quantized products stay MLX's, and a GGUF file is dequantized


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


@dataclass(frozen=True, slots=True)
class Toolchain:
    compiler: str
    cmake: str
    nanobind_cmake: Path
    mlx_dir: Path


def quantized_toolchain() -> Toolchain | str:
    """What building the quantized kernel takes, found without building anything; else why it cannot be built."""
    if os.environ.get(QUANTIZED_ENV) == "off":
        return f"{QUANTIZED_ENV}=off"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return f"no C++ compiler found: {CXX_HINT}"
    cmake = shutil.which("cmake", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    nanobind, mlx = importlib.util.find_spec("nanobind"), importlib.util.find_spec("mlx")
    if cmake is None or nanobind is None or nanobind.origin is None:
        return f"no {'CMake' if cmake is None else 'nanobind'} found: {EXTRA_HINT}"
    # ``mlx`` is a namespace package: a folder named mlx in the working directory joins it, ahead of the wheel's.
    wheels = [Path(p) for p in (mlx.submodule_search_locations or []) if (Path(p) / MLX_CMAKE).is_dir()] if mlx else []
    if not wheels:
        return "MLX is not installed (no MLX with its CMake files found)"
    return Toolchain(compiler, cmake, Path(nanobind.origin).parent / "cmake", wheels[0])


def build_quantized(arch: str | None = None) -> Built:
    """The quantized-weights kernel as an importable extension module for this machine and this MLX, built now
    unless already cached; its path is the module's file. ``arch``: the compiler's flag for the instruction set,
    this machine's own unless given (a test builds each SIMD path this machine can run)."""
    tools = quantized_toolchain()
    if isinstance(tools, str):
        return Built(None, tools)
    compiler, cmake, mlx_dir = tools.compiler, tools.cmake, tools.mlx_dir
    if arch is None:
        arch = "-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native"
    versions = [importlib.metadata.version(name) for name in ("mlx", "nanobind")]
    digest = hashlib.blake2b(
        b"".join(source.read_bytes() for source in [*QUANTIZED_SOURCES, QUANTIZED_CMAKE])
        + "|".join([compiler, arch, *versions]).encode(),
        digest_size=8,
    ).hexdigest()
    target = cache_dir() / "native" / f"quantized-{platform.machine()}-{digest}" / "_quantized.so"
    if target.is_file():
        return Built(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            build = Path(scratch)
            configure = [
                cmake,
                *("-S", str(QUANTIZED_CMAKE.parent), "-B", str(build)),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DCMAKE_CXX_COMPILER={compiler}",
                f"-DPython_EXECUTABLE={sys.executable}",
                f"-Dnanobind_DIR={tools.nanobind_cmake}",
                f"-DMLX_DIR={mlx_dir / MLX_CMAKE}",
                f"-DNEURON_ARCH_FLAGS={arch}",
                f"-DNEURON_MLX_LIB={mlx_dir / 'lib'}",
            ]
            for command in (configure, [cmake, "--build", str(build), "-j", str(os.cpu_count() or 1)]):
                done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
                if done.returncode != 0:
                    said = (done.stderr.strip() or done.stdout.strip())[-400:]
                    return Built(None, f"building the quantized kernel failed ({' '.join(command[:2])}): {said}")
            built = next(build.glob("_quantized*.so"), None)
            if built is None:
                return Built(None, f"building the quantized kernel left no module in {build}")
            os.replace(built, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Built(None, f"could not build the quantized kernel in {target.parent}: {e}")
    return Built(target)
