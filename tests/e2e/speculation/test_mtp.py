"""Speculative decoding with the model's own multi-token-prediction layer (``--speculate mtp``, ``rank.head.mtp``).

The models are built: a tiny GLM-4.5 (glm4_moe) with a random prediction layer of its own, whose greedy output
must equal decoding without drafts at TP=1 and TP=2, alone and batched; and one whose layer agrees with the model
exactly (every layer's output projections zeroed, so the model's next token is a function of the current one's
embedding, which the prediction layer computes through an identity ``eh_proj`` and a layer that adds nothing), so
that its drafts are kept. A model without such a layer, or served in stages, is refused with the reason. The
layer's own decisions: tests/unit/rank/head/test_mtp.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from neuron.rank.head.mtp import _pairs
from neuron.rank.kv.sequence import SeqState
from testkit import Server, add_prediction_layer, make_tiny_model, quiet_layers, run_neuron_side_by_side, serving
from testkit.drafting import complete, drafts_change_nothing, spoken
from testkit.tiny_archs import make_arch_model

PROMPTS = ["hello", "one two three four one two", "The quick brown fox jumps", "def add(a, b):\n"]
MAX_TOKENS = [20, 27, 16, 24]
DAMPING = 0.01


def _complete(server: Server, prompt: str, max_tokens: int, **extra: object) -> dict:
    return complete(server, "m", prompt, max_tokens, **extra)


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

    from neuron.rank.model.parts import backbone
    from neuron.rank.prefill import feed_prompts
    from neuron.rank.runner import Sliced
    from neuron.rpc import Prefill
    from testkit.tiny_archs import config

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
