"""Each setting is declared once (neuron/config/settings.py): a default edited in a copy of the package changes
the flag's help, what serve resolves, the docs' row and the engine's limits, in a fresh interpreter. The
declarations read directly: tests/unit/config/test_settings.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from testkit import ROOT

PROBE = """
import contextlib, io, json, os, sys
from pathlib import Path
from neuron.config import sources
from neuron.cli import reference
from neuron.cli.main import _parser
from neuron.engine.scheduler import Scheduling

def serve(*argv):
    args = _parser().parse_args(["serve", "--config", sys.argv[1], *argv])
    return sources.resolve(args, "serve"), args.max_batch

shown = io.StringIO()
with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
    _parser().parse_args(["serve", "--help"])
Path(sys.argv[1]).write_text("max_waiting = 3\\n")
unset = serve()
os.environ["NEURON_MAX_BATCH"] = "5"
from_env = serve()
del os.environ["NEURON_MAX_BATCH"]
Path(sys.argv[1]).write_text("max_batch = 6\\n")
from_file = serve()
row = next(line for line in reference.settings_page().splitlines() if line.startswith("| `--max-batch`"))
print(json.dumps({"help": shown.getvalue(), "unset": unset, "env": from_env, "file": from_file, "row": row,
                  "engine": Scheduling().max_batch}))
"""


def test_a_default_changed_in_its_declaration_changes_everything_that_shows_it(tmp_path: Path) -> None:
    """Edit ``max_batch``'s default in a copy of the package: the flag's help, what serve resolves with neither the
    environment nor the file setting it (and with either), the docs' row and the engine's ``Scheduling`` follow."""
    copy = tmp_path / "neuron"
    shutil.copytree(ROOT / "neuron", copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    declaration = copy / "config" / "settings.py"
    source, count = re.subn(r"max_batch: int = setting\(\s*8,", "max_batch: int = setting(13,", declaration.read_text())
    assert count == 1, "max_batch's declaration is not where this test looks"
    declaration.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "COLUMNS": "1000"}
    env = {k: v for k, v in env.items() if not (k.startswith("NEURON_") and k != "NEURON_BLAS")}
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "neuron.toml")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert re.search(r"--max-batch MAX_BATCH\s+sequences decoding together; .* \(default 13\)", seen["help"])
    assert seen["unset"] == [[], 13] and seen["env"] == [[], 5] and seen["file"] == [[], 6]
    assert "| 13 |" in seen["row"] and "| 8 |" not in seen["row"]
    assert seen["engine"] == 13
