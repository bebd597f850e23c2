"""MLX loads only where a rank's work is done: the MLX-free modules, every server module among them, imported in a
fresh interpreter, and a bad setting refused before MLX loads. The import statements themselves, and the tree's
other rules: tests/unit/test_layout.py."""

from __future__ import annotations

import subprocess
import sys

from testkit import ROOT
from testkit.layout import SERVER, module_name

# Modules that must import without MLX: what the HTTP layer, the settings and the protocol need.
MLX_FREE = [
    "neuron.rpc",
    "neuron.server.app",  # and through it every family, common/ and the skeleton; test_server_families_load_no_mlx
    "neuron.grammar",
    "neuron.models.folder",
    "neuron.models.shares",
    "neuron.launch.push",
    "neuron.models.gguf",
    "neuron.models.hub",
    "neuron.models.progress",
    "neuron.models.catalog",
    "neuron.config.sources",
    "neuron.config.settings",
    "neuron.cli.reference",
    "neuron.system.cpu",
    "neuron.system.device",
    "neuron.sampling_params",
    "neuron.engine.scheduler",
    "neuron.engine.image_prompts",
    "neuron.images",
    "neuron.engine.sequence",
    "neuron.launch",
    "neuron.system.reexec",
    "neuron.router.run",  # and through it the whole router: it loads no model
    "neuron.cli.router",
]


def test_the_mlx_free_modules_load_no_mlx() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {MLX_FREE!r}: importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm'))\n"
        "print(loaded); sys.exit(1 if loaded else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, f"MLX was imported: {done.stdout} {done.stderr}"


def test_server_families_load_no_mlx() -> None:
    """Every server module, each family's included, imports without MLX."""
    names = [module_name(path) for path in sorted(SERVER.rglob("*.py"))]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm'))\n"
        "print(loaded); sys.exit(1 if loaded else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, f"MLX was imported: {done.stdout} {done.stderr}"


def test_a_bad_setting_is_reported_before_mlx_loads() -> None:
    """``neuron serve --port 99999``: the settings are checked, and refused, with no MLX in the process."""
    code = (
        "import sys\n"
        "from neuron.cli.main import main\n"
        "try:\n"
        "    main(['serve', '--port', '99999'])\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]\n"
        "print('MLX LOADED' if loaded else 'no mlx', file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert "--port must lie in [0, 65535], got 99999" in done.stderr
    assert "no mlx" in done.stderr, done.stderr
