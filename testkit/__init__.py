"""Helpers shared by the tests and the benchmarks: tiny models, a served ``neuron``, what the OS shows of it.

Not part of the installed package (``pyproject.toml`` packages ``neuron*`` only). The tests import it from the
repository root (pytest's ``pythonpath``); a benchmark puts the root on ``sys.path`` as it does to import ``neuron``.
"""

from testkit.models import (
    CHAT_TEMPLATE,
    GLM4_MOE,
    QWEN3_NEXT,
    SPECIALS,
    TOOLS_TEMPLATE,
    add_prediction_layer,
    cut_layers,
    file_per_layer,
    make_tiny_model,
    quiet_layers,
    tokenizer_files,
    with_template,
)
from testkit.server import (
    ROOT,
    Server,
    greedy_body,
    neuron_command,
    run_neuron,
    run_neuron_side_by_side,
    serving,
    serving_side_by_side,
    sse_events,
    wait_until,
)
from testkit.system import DatagramSink, alive, tcp_sockets

__all__ = [
    "CHAT_TEMPLATE",
    "GLM4_MOE",
    "QWEN3_NEXT",
    "ROOT",
    "SPECIALS",
    "TOOLS_TEMPLATE",
    "DatagramSink",
    "Server",
    "add_prediction_layer",
    "alive",
    "cut_layers",
    "file_per_layer",
    "greedy_body",
    "make_tiny_model",
    "neuron_command",
    "quiet_layers",
    "run_neuron",
    "run_neuron_side_by_side",
    "serving",
    "serving_side_by_side",
    "sse_events",
    "tcp_sockets",
    "tokenizer_files",
    "wait_until",
    "with_template",
]
