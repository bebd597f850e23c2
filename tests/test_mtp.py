"""Speculative decoding with the model's own multi-token-prediction layer (``--speculate mtp``, ``rank.head.mtp``).

The models are built: a tiny GLM-4.5 (glm4_moe) with a random prediction layer of its own, whose greedy output
must equal decoding without drafts at TP=1 and TP=2, alone and batched; and one whose layer agrees with the model
exactly (every layer's output projections zeroed, so the model's next token is a function of the current one's
embedding, which the prediction layer computes through an identity ``eh_proj`` and a layer that adds nothing), so
that its drafts are kept. A model without such a layer, or served in stages, is refused with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import Server, serving
from drafting import complete, drafts_change_nothing, spoken
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache
from tiny_archs import make_arch_model

from neuron.models import architectures
from neuron.rank.head.mtp import MtpDrafter, MtpLayer, _pairs
from neuron.rank.kv.sequence import Seen, SeqState
from neuron.sampling_params import SamplingParams
from neuron.step import DraftRow
from testkit import add_prediction_layer, make_tiny_model, quiet_layers, run_neuron_side_by_side

PROMPTS = ["hello", "one two three four one two", "The quick brown fox jumps", "def add(a, b):\n"]
MAX_TOKENS = [20, 27, 16, 24]
DAMPING = 0.01


def _complete(server: Server, prompt: str, max_tokens: int, **extra: object) -> dict:
    return complete(server, "m", prompt, max_tokens, **extra)


@pytest.mark.unit
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
    from tiny_archs import config

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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.fixture(scope="module")
def damped(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each architecture's model, made on first use: its layers damped, so that its prediction layer, exact for the
    undamped model, agrees with it often, not always."""
    made: dict[str, Path] = {}

    def model(arch: str) -> Path:
        if arch not in made:
            folder = make_arch_model(tmp_path_factory.mktemp(arch) / "m", arch)
            made[arch] = add_prediction_layer(quiet_layers(folder, 0, DAMPING), exact=True)
        return made[arch]

    return model


# Qwen3-Next's linear-attention states take back a rejected draft (rank.states), rows of a batch keeping different
# counts; its TP split is neuron's own plan.
@pytest.fixture(
    scope="module",
    params=[
        ("glm4_moe", "--tp", "1"),
        ("glm4_moe", "--tp", "2"),
        ("qwen3_next", "--tp", "1"),
        ("qwen3_next", "--tp", "2"),
        ("deepseek_v3", "--pp", "2"),  # rank 0 drafts from the hidden states the last stage sends it
    ],
    ids=["glm-tp1", "glm-tp2", "next-tp1", "next-tp2", "deepseek-pp2"],
)
def mtp_server(
    request: pytest.FixtureRequest, damped: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    arch, *split = request.param
    model = damped(arch)
    with serving(tmp_path_factory, "--model", str(model), "--speculate", "mtp", "--prefill-chunk", "16", *split) as s:
        yield s


@pytest.mark.anyio
async def test_greedy_with_the_models_own_prediction_layer_is_decoding_without_it(mtp_server: Server) -> None:
    await drafts_change_nothing(mtp_server, "m", PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3", "qwen3_next"])
def test_a_prediction_layer_the_model_agrees_with_is_kept(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_arch_model(tmp_path_factory.mktemp("exact") / "m", arch)
    model = add_prediction_layer(quiet_layers(model, 0, 0.0), exact=True)
    with serving(tmp_path_factory, "--model", str(model), "--speculate", "mtp", "--tp", "2") as server:
        plain = _complete(server, PROMPTS[2], 30, num_draft_tokens=0)
        with_draft = _complete(server, PROMPTS[2], 30)
    assert with_draft["choices"][0]["text"] == plain["choices"][0]["text"]
    kept, thrown = spoken([with_draft])
    assert kept >= 20 and thrown <= 2, (kept, thrown)


def test_a_model_without_prediction_layers_is_refused(tmp_path: Path) -> None:
    plain = make_tiny_model(tmp_path / "plain", "qwen3")
    # Declared, but dropped from the weights (as mlx-lm's conversions drop it): refused once the model loads.
    converted = make_arch_model(tmp_path / "converted", "glm4_moe")
    config = json.loads((converted / "config.json").read_text())
    (converted / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    serve = ("serve", "--speculate", "mtp", "--port", "0", "--model")
    done, dropped = run_neuron_side_by_side((*serve, str(plain)), (*serve, str(converted)), timeout=120)
    assert done.returncode != 0
    assert "--speculate mtp" in done.stderr and "ships no multi-token-prediction layers" in done.stderr, done.stderr
    assert dropped.returncode != 0 and "a conversion dropped them" in dropped.stderr, dropped.stderr[-2000:]


def test_the_layer_is_given_the_whole_prompts_hidden_states() -> None:
    """Rank 0 keeps the final hidden state of every prompt position it feeds (as vLLM fills its MTP layer's cache
    over the whole prompt), not only the last one's: new prompts fed together, left-padded, and a prompt fed in
    chunks, each joined up to its last position, equal to the model's own over the whole prompt."""
    from mlx_lm.utils import _get_classes
    from tiny_archs import config

    from neuron.rank.model.parts import backbone
    from neuron.rank.prefill import feed_prompts
    from neuron.rank.runner import Sliced
    from neuron.rpc import Prefill

    cfg = config("glm4_moe", 64)
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(6)
    model = model_class(args_class.from_dict(cfg))
    runner = Sliced(model, None, 0)
    runner.keep_states = True
    prompts = {1: [3, 14, 15, 9, 26, 5, 35], 2: [8, 9, 7], 3: [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]}
    seqs: dict[int, SeqState] = {}
    feed_prompts(runner, model, seqs, [Prefill(s, 0, prompts[s], True) for s in (1, 2)])
    chunks = [Prefill(3, 0, prompts[3][:4], False), Prefill(3, 4, prompts[3][4:], True)]
    for chunk in chunks:
        feed_prompts(runner, model, seqs, [chunk], together=False)
    for seq, prompt in prompts.items():
        pairs = _pairs(seqs[seq].seen, [*prompt, 0])
        assert pairs is not None
        at, hidden, following = pairs
        assert at == 0 and following == [*prompt[1:], 0], seq
        expected = backbone(model)(mx.array(prompt)[None])[0]
        assert mx.allclose(hidden, expected, atol=1e-4).item(), (seq, mx.abs(hidden - expected).max())
