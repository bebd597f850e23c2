"""Whether a rank's state can follow a step's plan (``Holdings.disagreement``): each way a plan and a rank can disagree,
named; a plan that fits passes. A rank's bookkeeping with a few tiny caches, no model; tests/e2e/parallel/test_pool.py
shows a rank that disagrees fail its step on every rank without a hang.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from neuron.rank.holdings import Holdings
from neuron.rank.kv.sequence import SeqState
from neuron.rpc import Decode, Evict, Prefill, Restore, Save, StepPlan

LAYERS = 2


def cache(tokens: int) -> list[KVCache]:
    """One layer's worth of keys and values per layer, ``tokens`` long: what a fed prompt leaves."""
    out = []
    for _ in range(LAYERS):
        layer = KVCache()
        layer.update_and_fetch(mx.zeros((1, 1, tokens, 4)), mx.zeros((1, 1, tokens, 4)))
        out.append(layer)
    return out


def holdings() -> Holdings:
    """Sequences 1 and 2 decode in micro-batch 0, 3 in micro-batch 1; 4's prompt is done, waiting to join; 5 is
    halfway through its prompt (8 of it fed); prefix entry 10 holds 6 tokens."""
    held = Holdings()
    seqs = held.seqs
    seqs.update({s: SeqState(position=12, last=7, prompt_done=True) for s in (1, 2, 3)})
    seqs[4] = SeqState(position=9, last=7, cache=cache(9), prompt_done=True)
    seqs[5] = SeqState(position=8, last=7, cache=cache(8))
    held.batch.join(0, [1, 2], [cache(12), cache(12)])
    held.batch.join(1, [3], [cache(12)])
    held.entries.evict_and_save(
        StepPlan(prefill=[Prefill(6, 0, [1] * 6, True)], save=[Save(6, 10)]), {6: SeqState(6, 1, cache(6), True)}
    )
    return held


DECODING = [Decode(1, 5, 0), Decode(2, 5, 0), Decode(3, 5, 1)]

FITS = [
    ("a decode step", StepPlan(decode=DECODING)),  # every row of the batch decodes every step
    ("a row joins after the others", StepPlan(decode=[*DECODING, Decode(4, 5, 1)])),
    ("a row leaves", StepPlan(leave=[1], decode=DECODING[1:])),
    ("a prompt goes on", StepPlan(prefill=[Prefill(5, 8, [1, 2], False)], decode=DECODING)),
    ("a new prompt, with copies", StepPlan(prefill=[Prefill(20, 0, [1, 2], True, copies=[21])], decode=DECODING)),
    ("a restored prompt", StepPlan(restore=[Restore(20, 10, 4)], prefill=[Prefill(20, 4, [1], True)], decode=DECODING)),
    (
        "evict one, save another",
        StepPlan(prefill=[Prefill(20, 0, [1], True)], evict=[Evict(10)], save=[Save(20, 11)], decode=DECODING),
    ),
]

DISAGREE = [
    ("leaving unknown", StepPlan(leave=[9]), "sequence 9 cannot leave: this rank does not hold it"),
    ("restore missing", StepPlan(restore=[Restore(20, 11, 4)]), "prefix entry 11 cannot give 4 tokens"),
    ("restore too long", StepPlan(restore=[Restore(20, 10, 7)]), "prefix entry 10 cannot give 7 tokens"),
    ("evict missing", StepPlan(evict=[Evict(11)]), "prefix entry 11 cannot be evicted"),
    ("save held entry", StepPlan(prefill=[Prefill(20, 0, [1], True)], save=[Save(20, 10)]), "entry 10 cannot be"),
    ("save unfinished", StepPlan(prefill=[Prefill(20, 0, [1], False)], save=[Save(20, 11)]), "entry 11 cannot be"),
    ("started again", StepPlan(prefill=[Prefill(5, 0, [1], False)]), "sequence 5 is started again"),
    ("fed elsewhere", StepPlan(prefill=[Prefill(5, 7, [1], False)]), "fed a prompt chunk at 7 but this rank holds 8"),
    ("fed when done", StepPlan(prefill=[Prefill(4, 9, [1], False)]), "prompt done: True"),
    ("fed unknown", StepPlan(prefill=[Prefill(9, 3, [1], False)]), "at 3 but this rank holds nothing"),
    (
        "restored fed elsewhere",
        StepPlan(restore=[Restore(20, 10, 4)], prefill=[Prefill(20, 5, [1], True)]),
        "sequence 20 is restored to 4 tokens but fed at 5",
    ),
    ("copies early", StepPlan(prefill=[Prefill(20, 0, [1], False, copies=[21])]), "cannot be copied to [21]"),
    ("copy exists", StepPlan(prefill=[Prefill(20, 0, [1], True, copies=[3])]), "cannot be copied to [3]"),
    ("rows reordered", StepPlan(decode=[DECODING[1], DECODING[0], DECODING[2]]), "micro-batch 0 here is [1, 2]"),
    ("a row missing", StepPlan(decode=DECODING[1:]), "micro-batch 0 here is [1, 2], the plan decodes [2]"),
    ("joins unfinished", StepPlan(decode=[*DECODING, Decode(5, 5, 0)]), "sequence 5 cannot join micro-batch 0"),
    ("joins twice", StepPlan(decode=[*DECODING, Decode(3, 5, 0)]), "sequence 3 cannot join micro-batch 0"),
    ("joins leaving", StepPlan(leave=[4], decode=[*DECODING, Decode(4, 5, 1)]), "sequence 4 cannot join"),
]


@pytest.mark.parametrize("plan", [p for _, p in FITS], ids=[what for what, _ in FITS])
def test_a_plan_the_rank_can_follow_passes(plan: StepPlan) -> None:
    assert holdings().disagreement(plan) is None


@pytest.mark.parametrize(("plan", "says"), [(p, s) for _, p, s in DISAGREE], ids=[what for what, *_ in DISAGREE])
def test_each_disagreement_is_named(plan: StepPlan, says: str) -> None:
    problem = holdings().disagreement(plan)
    assert problem is not None and says in problem, problem
