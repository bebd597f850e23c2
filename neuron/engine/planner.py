"""Building one step's plan from the scheduler's batch: who leaves, which prompt chunks are fed (or restored from
the prefix cache, and saved to it), every running sequence's next input and draft, and whether the ranks may run
the next step ahead. Decisions only, as the scheduler's (``Scheduler.schedule`` calls it)."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Rows

from neuron.engine import image_prompts
from neuron.engine.drafts import StepCost, width
from neuron.engine.prefix import PrefixIndex, Stored, disk_key
from neuron.engine.sequence import Sequence
from neuron.images import Inputs
from neuron.rpc import Decode, Evict, Prefill, Restore, Save, StepPlan
from neuron.sampling_params import PENALTY_WINDOW
from neuron.step import Start, Step


def plan_step(
    filling: list[Sequence],
    running: list[Sequence],
    waiting: Rows[Sequence],
    leaving: list[int],
    *,
    budget: int,
    max_batch: int,
    micro_batches: int,
    run_ahead: bool,
    prefix: PrefixIndex | None,
    cost: StepCost,
    keeping: Rows[Sequence] = (),
    spill: bool = False,
    parking: Rows[tuple[int, list[int]]] = (),
    scored_chunk: int | None = None,
    proposed: Mapping[int, list[int]] | None = None,
) -> Step | None:
    """The next step: who leaves (``keeping``: those of them saved to the prefix cache as they go; ``parking``:
    preempted ones whose caches go to disk, by number with their tokens), which prompt chunks are fed, every
    running sequence's next input, and how each sequence it starts is sampled. ``budget``: the prompt tokens this
    step may feed (the scheduler's ``prefill_budget``), ``scored_chunk`` the most of them a prompt scored
    (``prompt_logprobs``) is fed; ``proposed``: the draft model's tokens for the rows that draft with it, by
    sequence (``Scheduler.to_draft``), made before the plan is; ``spill``: entries evicted to make room are written
    to disk. None when nothing is admitted and nothing is saved."""
    spilled: dict[str, list[int]] = {}
    allowed = budget
    if not filling and not running:
        saves, evicts = _keep(keeping, parking, prefix, spill, spilled)
        plan = StepPlan(leave=list(leaving), save=saves, evict=evicts)
        return Step(plan, {}, spilled) if saves or evicts else None
    prefill: list[Prefill] = []
    restore: list[Restore] = []
    starts: dict[int, Start] = {}
    pixels: dict[str, Inputs] = {}  # the images the chunks put in, for rank 0's encoder
    suspect = False  # whether the step feeds a sequence blamed for a lost group
    for seq in sorted(filling, key=_feeding_order):
        if budget <= 0:
            break
        if seq.copy_of is not None and not seq.alone:
            continue  # fed when its original's prompt ends
        if prefill and (seq.losses or suspect):
            break  # a sequence blamed for a lost group is fed alone, so that a second loss blames it alone
        suspect = bool(seq.losses)
        tokens = seq.tokens
        start = seq.fed
        if seq.pooling is not None:  # an embedding input: no prefix cache (hidden states are not kept), no sampler
            end = min(len(seq.prompt), start + budget)
            prefill.append(Prefill(seq.no, start, seq.prompt[start:end], end == len(seq.prompt), pool=seq.pooling))
            budget -= end - start
            continue
        # A restored prefix would leave its tokens unscored; a resumed sequence's prompt was scored already.
        scores = seq.params.prompt_logprobs is not None and seq.replay is None
        cached = prefix if seq.params.prompt_logprobs is None else None
        if start == 0:
            produced = None if seq.paused is None else tuple(seq.output)
            recent: tuple[int, ...] = ()
            if (
                cached is not None
                and (hit := cached.lookup(image_prompts.keyed(tokens, seq.images), seq.adapter)) is not None
            ):
                restore.append(Restore(seq.no, hit.entry, hit.tokens))
                start = hit.tokens  # restored, not computed: outside the budget
                recent = tuple(tokens[max(0, start - PENALTY_WINDOW) : start])
            starts[seq.no] = Start(seq.params, recent, produced)
        take = min(budget, len(tokens) - start)
        if scores and scored_chunk is not None:  # every position's logits: a chunk the step's memory holds
            take = min(take, scored_chunk)
        end = start + take
        last = end == len(tokens)
        copies = [c for c in seq.fed_with if c in filling] if last else []
        for copy in copies:
            starts[copy.no] = Start(copy.params, tuple(copy.prompt[-PENALTY_WINDOW:]))
        runs = image_prompts.runs(seq.images, start, end) if seq.images else []
        pixels |= image_prompts.pixels(seq.images, runs)
        positions = seq.rope.chunk(start, end) if seq.rope else []
        fed = tokens[start:end]
        copied = [c.no for c in copies]
        prefill.append(
            Prefill(seq.no, start, fed, last, copied, scores, images=runs, positions=positions, adapter=seq.adapter)
        )
        budget -= take
    # Planned in admission order all the same: prompts that end in this step join the batch in that order.
    admitted = {seq.no: i for i, seq in enumerate(filling)}
    prefill.sort(key=lambda chunk: admitted[chunk.seq])
    restore.sort(key=lambda entry: admitted[entry.seq])
    decode = _decode(running, micro_batches, cost, proposed or {})
    ahead = run_ahead and _steady(prefill, decode, filling, running, waiting, max_batch, micro_batches)
    # Saved only after every lookup: a rank restores before it saves, so no plan may restore what it saves.
    saves, evicts = _keep(keeping, parking, prefix, spill, spilled)
    plan = StepPlan(list(leaving), prefill, decode, restore, saves, evicts, ahead)
    by_no = {seq.no: seq for seq in filling}
    for chunk in prefill:
        if chunk.pool or not chunk.last or prefix is None:
            continue
        seq = by_no[chunk.seq]
        if stored := prefix.store(image_prompts.keyed(seq.tokens, seq.images), seq.adapter):
            plan.save.append(Save(chunk.seq, stored.entry))
            seq.cache_saved = min(len(seq.tokens), len(seq.prompt))
            plan.evict.extend(_evicts(stored, spill, spilled))
    return Step(plan, starts, spilled, allowed, pixels)


def _feeding_order(seq: Sequence) -> tuple[int, int]:
    """Which prompt a step's budget feeds first (the plan lists the chunks in admission order). Sequences paused
    and resuming (a lost group, a preemption) first, as admitted: they were running, and one blamed for a loss is
    fed alone. Then the prompts with the fewest tokens left: a short one admitted while a long one is fed is fed
    whole in the next step, not after every chunk of the long one (head-of-line blocking), and the long one takes
    what is left."""
    if seq.paused is not None or seq.losses:
        return 0, 0
    return 1, len(seq.tokens) - seq.fed


def _keep(
    keeping: Rows[Sequence],
    parking: Rows[tuple[int, list[int]]],
    prefix: PrefixIndex | None,
    spill: bool,
    spilled: dict[str, list[int]],
) -> tuple[list[Save], list[Evict]]:
    """Each leaving sequence's prompt and the output it was fed, as entries: a chat's next turn resends them, and
    restores them where the template writes the reply back as it was generated. First, the evictions that entries
    read back from disk, or the batch's growth, deferred (``PrefixIndex.reload``, ``PrefixIndex.shrink``); and
    each preempted sequence's caches saved and written to disk at once (the disk tier reads them back when it
    resumes)."""
    saves: list[Save] = []
    evicts: list[Evict] = []
    if prefix is None:
        return saves, evicts
    for deferred in prefix.deferred:
        evicts.extend(_evicts(deferred, spill, spilled))
    prefix.deferred.clear()
    for no, held in parking:
        entry, key = prefix.fresh(), disk_key(held)
        saves.append(Save(no, entry, len(held)))
        evicts.append(Evict(entry, key))
        spilled[key] = held
    for seq in keeping:
        if seq.pooling is not None or seq.held <= len(seq.prompt):
            continue  # nothing past its prompt, which was saved when it was fed
        tokens = min(seq.held, len(seq.prompt) + len(seq.output))
        if stored := prefix.store([*image_prompts.keyed(seq.prompt, seq.images), *seq.output][:tokens]):
            saves.append(Save(seq.no, stored.entry, tokens))
            evicts.extend(_evicts(stored, spill, spilled))
    return saves, evicts


def _evicts(stored: Stored, spill: bool, spilled: dict[str, list[int]]) -> list[Evict]:
    """The plan's evictions for ``stored``: with ``spill``, each entry made room for goes to disk (its tokens to
    ``spilled``); an entry a longer one covers just goes."""
    out = []
    for entry in stored.evicted:
        tokens = stored.spilled.get(entry) if spill else None
        if tokens is None:
            out.append(Evict(entry))
            continue
        key = disk_key(tokens)
        spilled[key] = tokens
        out.append(Evict(entry, key))
    return out


def _steady(
    prefill: list[Prefill],
    decode: list[Decode],
    filling: list[Sequence],
    running: list[Sequence],
    waiting: Rows[Sequence],
    max_batch: int,
    micro_batches: int,
) -> bool:
    """Whether the next step will most likely decode the same rows, one token each (the ranks may run it
    ahead): no prompt fed now or soon, no draft now (a row that drafts now drafts next too, most likely), one
    micro-batch. A sequence that ends meanwhile just leaves."""
    if prefill or filling or not decode or micro_batches != 1:
        return False
    if waiting and len(running) + waiting[0].n <= max_batch:
        return False
    if all(seq.completion_tokens + 1 >= seq.max_tokens for seq in running):
        return False  # every row ends with this step's token: a step ahead would be thrown away
    return not any(row.draft for row in decode)


def _decode(
    running: list[Sequence], micro_batches: int, cost: StepCost, proposed: Mapping[int, list[int]]
) -> list[Decode]:
    """Every running sequence's row: its token, and its draft cut to the width its micro-batch pays for."""
    drafts = {seq.no: _draft(seq, proposed.get(seq.no, [])) for seq in running}
    share = 1 / micro_batches  # each micro-batch's part of the step's fixed time
    for micro_batch in range(micro_batches):
        rows = [seq for seq in running if seq.micro_batch == micro_batch]
        estimates = [(len(drafts[seq.no]), seq.proposer.acceptance if seq.proposer else 0.0) for seq in rows]
        modelled = max((len(drafts[seq.no]) for seq in rows if seq.proposer and seq.proposer.model), default=0)
        cut = width(estimates, cost, share, modelled) - 1
        for seq in rows:
            drafts[seq.no] = drafts[seq.no][:cut]
    return [
        Decode(
            seq.no,
            seq.next_token,  # type: ignore[arg-type]
            seq.micro_batch,
            drafts[seq.no],
            seq.drop,
            adapter=seq.adapter,
            rope_delta=seq.rope.delta if seq.rope else 0,
        )
        for seq in running
    ]


def _draft(seq: Sequence, proposed: list[int]) -> list[int]:
    """The tokens ``seq`` proposes after its next one (``proposed``: what the draft model proposed for it, where
    one drafts): never more than ``max_tokens`` leaves room for."""
    if seq.proposer is None or seq.next_token is None:
        return []
    room = seq.max_tokens - seq.completion_tokens - 1
    return seq.proposer.propose(seq.prompt, seq.output, room, proposed)
