"""The prefix index and the plans it leads to, checked directly: no process, no model; milliseconds each.

tests/e2e/caching/test_prefix_cache.py shows the plans run on real ranks and change no output.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from neuron.engine.prefix import Hit, PrefixIndex
from neuron.engine.scheduler import Scheduler, Scheduling
from neuron.engine.sequence import Sequence, StopText
from neuron.rank.kv.batch import Batch, MicroBatch
from neuron.rank.kv.entries import Entries
from neuron.rank.kv.sequence import SeqState
from neuron.rpc import Evict, Prefill, Restore, Save, StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import NOT_ASKED, Sampled

_numbers = itertools.count(1)


def request(prompt: list[int], **params: object) -> Sequence:
    no = next(_numbers)
    return Sequence(f"r{no}", no, prompt, 50, SamplingParams(**params), StopText(()))  # type: ignore[arg-type]


def test_the_longest_exact_prefix_is_found_and_the_last_token_is_always_fed() -> None:
    index = PrefixIndex(budget=10_000, bytes_per_token=10)
    first = index.store([1, 2, 3, 4, 5])
    assert first is not None and first.evicted == []
    assert index.lookup([1, 2, 3, 9]) == Hit(first.entry, 3)
    assert index.lookup([1, 2, 3, 4, 5, 6]) == Hit(first.entry, 5)
    assert index.lookup([1, 2, 3, 4, 5]) == Hit(first.entry, 4)  # never the whole prompt: its logits are needed
    assert index.lookup([2, 1]) is None
    assert index.lookup([1]) is None
    assert index.bytes == 50 and index.entries == {first.entry: 5}


def test_a_prompt_already_covered_is_not_stored_again_and_a_longer_one_replaces_the_shorter() -> None:
    index = PrefixIndex(budget=10_000, bytes_per_token=1)
    turn1 = index.store([1, 2, 3])
    assert turn1 is not None
    assert index.store([1, 2, 3]) is None and index.store([1, 2]) is None
    turn2 = index.store([1, 2, 3, 4, 5])  # the next turn of the same chat
    assert turn2 is not None and turn2.evicted == [turn1.entry]
    assert index.entries == {turn2.entry: 5} and index.evictions == 1
    other = index.store([1, 2, 7])  # branches off: both stay
    assert other is not None and other.evicted == []
    assert index.lookup([1, 2, 7, 8]) == Hit(other.entry, 3)
    assert index.lookup([1, 2, 3, 4, 9]) == Hit(turn2.entry, 4)


def test_where_caches_cannot_be_cut_only_a_whole_saved_prompt_is_restored() -> None:
    """A sliding window's or a linear-attention state's entry is a snapshot at its prompt's end (``exact``)."""
    index = PrefixIndex(budget=10_000, bytes_per_token=1, bytes_per_entry=100, exact=True)
    turn1 = index.store([1, 2, 3])
    assert turn1 is not None and index.bytes == 103
    assert index.lookup([1, 2, 3, 4, 5]) == Hit(turn1.entry, 3)  # the next turn: the whole previous prompt
    assert index.lookup([1, 2, 9]) is None  # shares a beginning, but not the whole entry
    assert index.lookup([1, 2, 3]) is None  # its last token is fed: the snapshot is past it
    turn2 = index.store([1, 2, 3, 4, 5])
    assert turn2 is not None and turn2.evicted == [turn1.entry] and index.bytes == 105
    # A prompt on a longer entry's path is an entry of its own here: the longer one cannot be cut back to it.
    short = index.store([1, 2, 3, 4])
    assert short is not None and short.evicted == []
    assert index.lookup([1, 2, 3, 4, 7]) == Hit(short.entry, 4)
    assert index.lookup([1, 2, 3, 4, 5, 6]) == Hit(turn2.entry, 5)  # the longest whole one
    assert index.store([1, 2, 3, 4]) is None


def test_the_least_recently_used_goes_first_and_an_entry_over_budget_flushes_nothing() -> None:
    index = PrefixIndex(budget=10, bytes_per_token=1)
    a, b = index.store([1] * 4), index.store([2] * 4)
    assert a is not None and b is not None
    assert index.lookup([1, 1, 1, 1, 9]) == Hit(a.entry, 4)  # a is now the most recently used
    index.unpin()
    c = index.store([3] * 4)
    assert c is not None and c.evicted == [b.entry]
    assert set(index.entries) == {a.entry, c.entry} and index.bytes == 8
    assert index.store([4] * 11) is None  # larger than the whole budget
    assert set(index.entries) == {a.entry, c.entry} and index.evictions == 1


def test_an_entry_being_restored_is_never_evicted() -> None:
    index = PrefixIndex(budget=8, bytes_per_token=1)
    a = index.store([1] * 4)
    assert a is not None and index.lookup([1, 1, 1, 1, 5]) == Hit(a.entry, 4)
    b = index.store([2] * 4)
    assert b is not None and b.evicted == []
    assert index.store([3] * 5) is None  # only the pinned a could make room: nothing is evicted
    assert set(index.entries) == {a.entry, b.entry}
    index.unpin()
    c = index.store([3] * 5)
    assert c is not None and c.evicted == [a.entry, b.entry]


def test_plans_restore_the_cached_beginning_and_save_each_prompt_at_its_end() -> None:
    s = Scheduler(Scheduling(prefill_chunk=4), {2}, PrefixIndex(budget=1 << 20, bytes_per_token=1))
    first = request([10, 11, 12, 13, 14, 15])
    s.queues.add(first)
    step = s.schedule().step
    assert step is not None and step.plan.restore == [] and step.plan.save == []  # the prompt does not end yet
    s.update(step, {}, 1.0)
    step = s.schedule().step
    assert step is not None and step.plan.save == [Save(first.no, 1)] and step.plan.prefill[0].last
    s.update(step, {first.no: Sampled(7, NOT_ASKED)}, 1.0)

    # The next turn: the whole first prompt is restored, and only what follows it counts against the chunk budget.
    second = request([10, 11, 12, 13, 14, 15, 7, 16, 17], repetition_penalty=1.2)
    s.queues.add(second)
    step = s.schedule().step
    assert step is not None
    plan = step.plan
    assert plan.restore == [Restore(second.no, 1, 6)]
    assert plan.prefill[0] == Prefill(second.no, 6, [7, 16, 17], True)
    assert plan.save == [Save(second.no, 2)] and plan.evict == [Evict(1)]  # the longer prompt covers the first
    assert step.starts[second.no].params.repetition_penalty == 1.2
    assert step.starts[second.no].recent == (10, 11, 12, 13, 14, 15)  # the penalties still see them
    s.update(step, {first.no: Sampled(8, NOT_ASKED), second.no: Sampled(9, NOT_ASKED)}, 1.0)
    assert second.cached == 6 and second.fed == 9


def test_no_plan_restores_an_entry_it_saves() -> None:
    """Two prompts that start alike, admitted together: the second cannot use the first's entry in the same step
    (every rank restores before it saves), only in a later one."""
    s = Scheduler(Scheduling(), {2}, PrefixIndex(budget=1 << 20, bytes_per_token=1))
    a, b = request([5, 6, 7]), request([5, 6, 7, 8])
    for seq in (a, b):
        s.queues.add(seq)
    step = s.schedule().step
    assert step is not None and step.plan.restore == []
    plan = step.plan
    assert [save.seq for save in plan.save] == [a.no, b.no] and plan.evict == [Evict(1)]


def test_a_ranks_entries_state_tells_apart_holdings_of_the_same_count() -> None:
    """The fingerprint's part for the prefix cache: the same number of entries, but another id or another length,
    is another state; the same entries saved in another order are the same; evicting all is the empty state."""

    def seq(tokens: int) -> SeqState:
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((1, 1, tokens, 2)), mx.zeros((1, 1, tokens, 2)))
        return SeqState(tokens, 0, [cache], True)

    def held(*saves: tuple[int, int]) -> Entries:
        entries = Entries()
        for entry, tokens in saves:
            entries.evict_and_save(StepPlan(save=[Save(entry, entry)]), {entry: seq(tokens)})
        return entries

    assert held((1, 3), (2, 4)).state == held((2, 4), (1, 3)).state
    assert held((1, 3), (2, 4)).state != held((1, 3), (5, 4)).state
    assert held((1, 3), (2, 4)).state != held((1, 3), (2, 5)).state
    emptied = held((1, 3), (2, 4))
    emptied.evict_and_save(StepPlan(evict=[Evict(1), Evict(2)]), {})
    assert emptied.state == Entries().state


def test_a_finished_reply_is_saved_with_its_prompt_as_it_leaves_and_the_next_turn_restores_through_it() -> None:
    """A chat's next turn resends the reply: the plan in which a sequence leaves saves its prompt and the output it
    was fed (the last token sampled is never fed), even with nothing else to run; the next turn restores it all."""
    s = Scheduler(Scheduling(), {2}, PrefixIndex(budget=1 << 20, bytes_per_token=1))
    first = request([10, 11, 12])
    first.max_tokens = 3
    s.queues.add(first)
    for token in (20, 21, 22):  # the prompt's step samples 20; two decode steps feed 20 and 21 and sample 21, 22
        step = s.schedule().step
        assert step is not None
        s.update(step, {first.no: Sampled(token, NOT_ASKED)}, 1.0)
    assert first.output == [20, 21, 22] and first.held == 5
    step = s.schedule().step
    assert step is not None, "the leaving sequence's save is a plan of its own"
    plan = step.plan
    assert plan.leave == [first.no] and not plan.prefill and not plan.decode
    assert plan.save == [Save(first.no, 2, 5)] and plan.evict == [Evict(1)]  # it covers the prompt's entry
    s.update(step, {}, 1.0)
    assert s.schedule().step is None

    second = request([10, 11, 12, 20, 21, 22, 2, 30])  # the reply as the template writes it back, then a new turn
    s.queues.add(second)
    step = s.schedule().step
    assert step is not None and step.plan.restore == [Restore(second.no, 2, 5)]


def test_a_reply_ended_by_its_end_of_sequence_token_keeps_every_output_token() -> None:
    s = Scheduler(Scheduling(), {2}, PrefixIndex(budget=1 << 20, bytes_per_token=1))
    seq = request([10, 11, 12])
    s.queues.add(seq)
    for token in (20, 2):  # the end-of-sequence token is sampled after 20 is fed
        step = s.schedule().step
        assert step is not None
        s.update(step, {seq.no: Sampled(token, NOT_ASKED)}, 1.0)
    step = s.schedule().step
    assert step is not None and step.plan.save == [Save(seq.no, 2, 4)]


def test_a_leaving_rows_first_tokens_are_kept_past_its_padding_and_before_a_rejected_tail() -> None:
    """On a rank: the row's tokens sit after its left padding in the batched cache, and a rejected draft's tail
    (dropped only by the next decode, which a leaving row has none of) lies after them."""
    layer = BatchKVCache([2, 0])
    values = mx.arange(2 * 1 * 6 * 1, dtype=mx.float32).reshape(2, 1, 6, 1)
    layer.update_and_fetch(values, values)
    batch = Batch()
    batch.micro_batches[0] = MicroBatch([7, 8], [layer])
    entries = Entries()
    plan = StepPlan(leave=[7], save=[Save(7, 1, 3)])
    seqs = {7: SeqState(4, 0, None, True), 8: SeqState(6, 0, None, True)}
    assert entries.disagreement(plan) is None and entries.disagreement_leaving(plan, seqs, batch) is None
    entries.save_leaving(plan, batch)
    (restored,) = entries.restore(1, 3)
    assert restored.keys[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0]  # row 0, after its 2 padding positions
    too_long = StepPlan(leave=[7], save=[Save(7, 2, 5)])
    assert "does not hold them" in (entries.disagreement_leaving(too_long, seqs, batch) or "")


def test_with_a_disk_tier_an_entry_made_room_for_is_spilled_and_a_covered_one_just_goes() -> None:
    from neuron.engine.prefix import disk_key

    s = Scheduler(Scheduling(), {2}, PrefixIndex(budget=8, bytes_per_token=1))
    s.queues.spill = True
    first = request([10, 11, 12, 13])
    first.max_tokens = 1
    s.queues.add(first)
    step = s.schedule().step
    assert step is not None and step.plan.save == [Save(first.no, 1)]
    s.update(step, {first.no: Sampled(7, NOT_ASKED)}, 1.0)  # its one token: it ends, nothing past its prompt fed
    s.schedule()
    second = request([20, 21, 22, 23, 24, 25])  # needs the room the first holds
    second.max_tokens = 1
    s.queues.add(second)
    step = s.schedule().step
    assert step is not None
    assert step.plan.evict == [Evict(1, disk_key([10, 11, 12, 13]))]
    assert step.spilled == {disk_key([10, 11, 12, 13]): [10, 11, 12, 13]}


def test_an_entry_read_back_while_serving_makes_room_that_the_next_plan_evicts_to_disk() -> None:
    from neuron.engine.prefix import disk_key

    index = PrefixIndex(budget=8, bytes_per_token=1)
    held = index.store([10, 11, 12, 13, 14])
    assert held is not None
    assert index.reach([10, 11, 12, 99]) == 3 and index.reach([20, 21]) == 0
    back = index.reload([20, 21, 22, 23, 24])  # needs the room the first holds
    assert back is not None and back.evicted == [held.entry] and index.deferred == [back]
    assert index.reach([20, 21, 22, 23, 24, 25]) == 5
    s = Scheduler(Scheduling(), {2}, index)
    s.queues.spill = True
    step = s.schedule().step  # nothing runs: the plan only evicts, to disk
    assert step is not None and step.plan.evict == [Evict(held.entry, disk_key([10, 11, 12, 13, 14]))]
    assert step.spilled == {disk_key([10, 11, 12, 13, 14]): [10, 11, 12, 13, 14]} and index.deferred == []
    index.forget(back.entry)  # its file failed on some rank: no rank holds it
    assert index.reach([20, 21, 22, 23, 24, 25]) == 0 and index.bytes == 0
