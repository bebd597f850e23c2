"""Speculative decoding with the model's own multi-token-prediction layer (``--speculate mtp``, ``rank.head.mtp``),
in-process: the pairs fed are the positions the target kept, the layer drafts what it computes afresh over them,
and where it cannot draft it is refused with the reason. Served: tests/e2e/speculation/test_mtp.py."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache

from neuron.models import architectures
from neuron.rank.head.mtp import MtpDrafter, MtpLayer, _pairs
from neuron.rank.kv.sequence import Seen, SeqState
from neuron.sampling_params import SamplingParams
from neuron.step import DraftRow


def test_the_pairs_fed_are_the_positions_the_target_kept_joined_up_to_the_last() -> None:
    context = [5, 6, 7, 8, 9, 10]  # 10 was just drawn: the last pair is position 4 (token 9)
    hidden = mx.arange(8, dtype=mx.float32).reshape(4, 2)
    # A step fed 7, 8, 99 from position 2: 7 and 8 kept, 99 rejected (9 drawn in its place); then one fed 9.
    seen = [Seen(2, [7, 8, 99], hidden[:3]), Seen(4, [9], hidden[3:])]
    pairs = _pairs(seen, context)
    assert pairs is not None
    at, states, following = pairs
    assert at == 2 and following == [8, 9, 10]
    assert states.tolist() == [[0, 1], [2, 3], [6, 7]]
    assert _pairs(seen[:1], context) is None  # the last position's hidden state is missing: no draft
    # A gap (a step that kept none) starts afresh after it.
    gapped = _pairs([Seen(0, [5], hidden[:1]), Seen(4, [9], hidden[3:])], context)
    assert gapped is not None and gapped[0] == 4 and gapped[2] == [10]


def _tiny_drafter(seqs: dict[int, SeqState]) -> MtpDrafter:
    from mlx_lm.models import glm4_moe

    from testkit.tiny_archs import config

    args = glm4_moe.ModelArgs.from_dict({**config("glm4_moe", 64), "hidden_size": 32, "head_dim": 8})
    mx.random.seed(3)
    layer = MtpLayer(32, 1e-5, glm4_moe.DecoderLayer(args, 4))
    layer.update(tree_map(lambda p: p * 4.0 if p.ndim >= 2 else p, layer.parameters()))
    embed, head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
    return MtpDrafter(layer, embed, head, seqs, 64)


def _from_scratch(drafter: MtpDrafter, context: list[int], hidden: mx.array, start: int, k: int) -> list[int]:
    """What the layer drafts after ``context`` computed afresh over positions ``start``.. in one pass, each with
    the target's hidden state (``hidden``, by position), then k - 1 times on its own output."""
    cache = KVCache()
    embedded = drafter.embed(mx.array(context[start + 1 :]))[None]
    if start == 0:
        embedded = mx.concatenate([mx.zeros_like(embedded[:, :1]), embedded[:, 1:]], axis=1)
    g = drafter.layer(embedded, hidden[None, start : len(context) - 1], cache)[:, -1:]
    out = []
    for _ in range(k):
        token = mx.argmax(drafter.head(drafter.layer.shared_head.norm(g))[0, -1])
        out.append(int(token.item()))
        g = drafter.layer(drafter.embed(token.reshape(1, 1)), g, cache)
    return out


def test_the_layer_drafts_what_it_computes_afresh_over_the_positions_the_target_kept() -> None:
    """Its cache, fed step by step, cut back after each draft and after a rejected one, and started afresh after
    a gap, drafts what one pass over the kept positions drafts."""
    state = SeqState()
    drafter = _tiny_drafter({0: state})
    mx.random.seed(4)
    hidden = mx.random.normal((32, 32))  # the target's final hidden state at each position
    greedy = SamplingParams(temperature=0.0)
    context = [3, 14, 15, 9, 26, 5]
    state.saw(hidden[5:6], [5], 5)  # the prompt's last position
    context.append(35)  # drawn from it
    first = drafter.propose([DraftRow(0, context, 3, greedy)])[0].tokens
    assert first == _from_scratch(drafter, context, hidden, 5, 3)
    # The step fed 35 and the draft at 6..9; the first draft token kept, another drawn in place of the second.
    state.saw(hidden[6:10], [35, *first], 6)
    context += [first[0], (first[1] + 1) % 64]
    assert drafter.propose([DraftRow(0, context, 2, greedy)])[0].tokens == _from_scratch(drafter, context, hidden, 5, 2)
    state.saw(hidden[8:9], [context[-1]], 8)  # a step without a draft; then one with
    context.append(7)
    state.saw(hidden[9:11], [7, 8], 9)
    context += [8, 40]
    assert drafter.propose([DraftRow(0, context, 4, greedy)])[0].tokens == _from_scratch(drafter, context, hidden, 5, 4)
    state.saw(None, [], 12)  # a step run ahead kept none: afresh from the next
    context.append(41)
    state.saw(hidden[12:13], [41], 12)
    context.append(42)
    assert drafter.propose([DraftRow(0, context, 3, greedy)])[0].tokens == _from_scratch(
        drafter, context, hidden, 12, 3
    )
    sampled = drafter.propose([DraftRow(0, [*context, 1], 3, SamplingParams(temperature=1.0, seed=1))])
    assert sampled == {}  # no hidden state for the context's last position: no draft
    state.saw(hidden[13:14], [42], 13)
    proposal = drafter.propose([DraftRow(0, [*context, 1], 3, SamplingParams(temperature=1.0, seed=1))])[0]
    assert proposal.q is not None and proposal.q.shape == (3, 64) and len(proposal.tokens) == 3


def test_mtp_is_refused_with_the_reason_where_it_cannot_draft() -> None:
    glm = {"model_type": "glm4_moe", "num_nextn_predict_layers": 1}
    assert architectures.mtp_refusal(glm, "glm") is None
    assert "ships no multi-token-prediction" in (architectures.mtp_refusal({"model_type": "qwen3"}, "q") or "")
    next_ = {"model_type": "qwen3_next", "mtp_num_hidden_layers": 1}
    assert architectures.mtp_refusal(next_, "n") is None  # its linear-attention states drop a rejected draft
    windowed = {"model_type": "gpt_oss", "num_nextn_predict_layers": 1}
    assert "cannot drop a rejected draft" in (architectures.mtp_refusal(windowed, "g") or "")
    other = {"model_type": "llama", "num_nextn_predict_layers": 1}
    assert "runs those of deepseek_v3, glm4_moe, qwen3_next only" in (architectures.mtp_refusal(other, "l") or "")
