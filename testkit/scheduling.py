"""A scheduler with no engine behind it, and the requests it plans for: the scheduler's decisions checked directly,
each step applied as though every rank ran it (tests/unit/engine/ and the unit tests that plan embeddings and
images)."""

from __future__ import annotations

import itertools

from neuron.engine.scheduler import Delivery, Scheduler, Scheduling
from neuron.engine.sequence import Sequence, StopText
from neuron.rpc import StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import NOT_ASKED, Sampled, Step

EOS = 2
sequence_numbers = itertools.count(1)  # each request its own, as the engine numbers them


def request(prompt_tokens: int, max_tokens: int = 100, **params: object) -> Sequence:
    no = next(sequence_numbers)
    prompt = [10 + i for i in range(prompt_tokens)]
    return Sequence(f"r{no}", no, prompt, max_tokens, SamplingParams(**params), StopText(()))  # type: ignore[arg-type]


def scheduler(**limits: object) -> Scheduler:
    return Scheduler(Scheduling(**limits), {EOS})  # type: ignore[arg-type]


def admitted(s: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        s.queues.add(seq)
    assert s.schedule().admitted == list(seqs)


def next_step(s: Scheduler) -> Step:
    step = s.schedule().step
    assert step is not None
    return step


def next_plan(s: Scheduler) -> StepPlan:
    return next_step(s).plan


def apply(s: Scheduler, step: Step, sampled: dict[int, Sampled]) -> list[Delivery]:
    return s.update(step, sampled, 1.0)


def run(s: Scheduler, tokens: dict[int, int] | None = None, default: int = 7) -> StepPlan:
    """Plan a step and apply it as though every rank ran it: each sequence with logits samples ``default``
    (or its entry in ``tokens``)."""
    return run_delivering(s, tokens, default)[0]


def run_delivering(
    s: Scheduler, tokens: dict[int, int] | None = None, default: int = 7
) -> tuple[StepPlan, list[Delivery]]:
    step = next_step(s)
    plan = step.plan
    having = [c.seq for c in plan.prefill if c.last] + [r.seq for r in plan.decode]
    return plan, apply(s, step, {seq: Sampled((tokens or {}).get(seq, default), NOT_ASKED) for seq in having})
