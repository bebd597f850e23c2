"""Which of neuron's modules one steady decode step enters: an entry point in front of ``neuron``, for
``bench/step_trace.py``, never in production code.

``python -m testkit.trace serve ...`` (or ``--worker ...``) runs neuron with a profile function on every thread
(``sys.setprofile``, and ``threading.setprofile`` for the threads started later: rank 0's among them) that, while a
trace is on, notes the module of every function called. The leader's trace is on for one whole turn of the engine's
loop, the ``NEURON_TRACE_TURN``-th (from one ``Scheduler.schedule`` to the next: the step's plan, the fan-out, rank
0's forward and sampling on its thread, the drain, the deliveries, and the HTTP stream that the event loop writes
meanwhile); a worker's for its handling of the ``NEURON_TRACE_TURN``-th step it is sent (from the request read to
the next one: the run-ahead settled after the reply included). Each process writes the modules it entered, in the
order first entered with the times each was entered from another module, one a line, to
``NEURON_TRACE_OUT.<pid>``; the leader's event loop's other tasks (the HTTP streams it writes meanwhile) to
``NEURON_TRACE_OUT.<pid>.streams``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from types import FrameType
from typing import Any

from testkit.faults import start_here, when_imported

TURN_ENV = "NEURON_TRACE_TURN"
OUT_ENV = "NEURON_TRACE_OUT"

# Each module, in the order first entered: how many times it was entered. The step's (the engine's loop, rank 0's
# thread, a worker's main thread), and the other tasks' of the leader's event loop: the HTTP streams written meanwhile.
_entered: dict[str, int] = {}
_streams: dict[str, int] = {}
_on = False


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if _on and event == "call":
        module = frame.f_globals.get("__name__", "")
        if module.startswith("neuron"):
            # Entered from another module (or from outside neuron: a thread's start, the event loop's callback),
            # not a call inside it; a comprehension's frame is its function's.
            caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
            into = _streams if _in_a_stream(frame) else _entered
            into[module] = into.get(module, 0) + (caller != module)


def _in_a_stream(frame: FrameType | None) -> bool:
    """On the event loop, but not under the engine's loop (``Loop.run``; ``Engine._loop`` before the house)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no event loop on this thread: rank 0's, or a worker's
        return False
    while frame is not None:
        if frame.f_code.co_qualname in ("Loop.run", "Engine._loop"):
            return False
        frame = frame.f_back
    return True


def _write() -> None:
    with open(f"{os.environ[OUT_ENV]}.{os.getpid()}", "w") as out:
        out.write("".join(f"{module} {times}\n" for module, times in _entered.items()))
    if _streams:
        with open(f"{os.environ[OUT_ENV]}.{os.getpid()}.streams", "w") as out:
            out.write("".join(f"{module} {times}\n" for module, times in _streams.items()))


def _trace_turn(scheduler: Any) -> None:
    """The leader: trace from the N-th ``schedule`` to the next."""
    schedule = scheduler.Scheduler.schedule
    calls = [0]
    turn = int(os.environ[TURN_ENV])

    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _on
        calls[0] += 1
        if calls[0] == turn + 1 and _on:
            _on = False
            _write()
        if calls[0] == turn:
            _on = True
        return schedule(self, *args, **kwargs)

    scheduler.Scheduler.schedule = traced


def _trace_worker_step(worker: Any) -> None:
    """A worker: trace its handling of the N-th step, to the next request."""
    handle = worker.Worker.handle
    steps = [0]
    turn = int(os.environ[TURN_ENV])

    def traced(self: Any, request: Any) -> Any:
        global _on
        if _on:
            _on = False
            _write()
        if getattr(request, "op", "") == "generate_step":
            steps[0] += 1
            if steps[0] == turn:
                _on = True
        return handle(self, request)

    worker.Worker.handle = traced


def main() -> int:
    start_here()
    try:
        from neuron.system import reexec
    except ImportError:  # the tree before the house moved it
        from neuron import reexec  # type: ignore[no-redef]

    reexec.MODULE = "testkit.trace"
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    when_imported("neuron.engine.scheduler", _trace_turn)
    for name in ("neuron.worker", "neuron.cli.worker"):  # before and after the house moved it
        when_imported(name, _trace_worker_step)
    try:
        from neuron.cli.main import main as neuron_main
    except ImportError:
        from neuron.cli import main as neuron_main  # type: ignore[no-redef]

    return neuron_main()


if __name__ == "__main__":
    sys.exit(main())
