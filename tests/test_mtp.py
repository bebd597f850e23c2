"""Speculative decoding with the model's own multi-token-prediction layer (``--speculate mtp``, ``rank.mtp``).

The models are built: a tiny GLM-4.5 (glm4_moe) with a random prediction layer of its own, whose greedy output
must equal decoding without drafts at TP=1 and TP=2, alone and batched; and one whose layer agrees with the model
exactly (every layer's output projections zeroed, so the model's next token is a function of the current one's
embedding, which the prediction layer computes through an identity ``eh_proj`` and a layer that adds nothing), so
that its drafts are kept. A model without such a layer, or served in stages, is refused with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import Server, run_neuron, serving
from drafting import complete, drafts_change_nothing, spoken
from tiny_archs import make_arch_model

from neuron import architectures
from neuron.rank.mtp import _pairs
from neuron.rank.prefill import Seen
from testkit import make_tiny_model, quiet_layers

PROMPTS = ["hello", "one two three four one two", "The quick brown fox jumps", "def add(a, b):\n"]
MAX_TOKENS = [20, 27, 16, 24]
DAMPING = 0.01


def _with_mtp(model: Path, seed: int = 1, exact: bool = False) -> Path:
    """Give ``model`` (a tiny glm4_moe or deepseek_v3) a prediction layer as their checkpoints hold it: layer
    ``num_hidden_layers``, random; with ``exact``, one that computes what the model computes once every layer's
    output projections are zeroed (``quiet_layers(model, 0, 0.0)``)."""
    import importlib

    from mlx.utils import tree_flatten, tree_map

    from neuron.rank.mtp import BLOCKS, MtpLayer

    config = json.loads((model / "config.json").read_text())
    layers, dims = config["num_hidden_layers"], config["hidden_size"]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    layer = MtpLayer(dims, config["rms_norm_eps"], getattr(module, BLOCKS[config["model_type"]])(args, layers))
    layer.update(tree_map(lambda p: p * 4.0 if p.ndim >= 2 else p, layer.parameters()))
    weights = dict(mx.load(str(model / "model.safetensors")).items())  # type: ignore[union-attr]
    mine = dict(tree_flatten(layer.parameters()))
    if exact:
        mine["eh_proj.weight"] = mx.concatenate([mx.eye(dims), mx.zeros((dims, dims))], axis=1)
        mine = {
            k: mx.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in mine.items()
        }
        mine["shared_head.norm.weight"] = weights["model.norm.weight"]
    for name, value in mine.items():
        weights[f"model.layers.{layers}.{name.removeprefix('block.')}"] = value
    mx.save_safetensors(str(model / "model.safetensors"), weights)
    (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return model


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


@pytest.mark.unit
def test_mtp_is_refused_with_the_reason_where_it_cannot_draft() -> None:
    glm = {"model_type": "glm4_moe", "num_nextn_predict_layers": 1}
    assert architectures.mtp_refusal(glm, "glm", 1) is None
    assert "ships no multi-token-prediction" in (architectures.mtp_refusal({"model_type": "qwen3"}, "q", 1) or "")
    next_ = {"model_type": "qwen3_next", "mtp_num_hidden_layers": 1}
    assert "cannot be cut back" in (architectures.mtp_refusal(next_, "n", 1) or "")
    assert "--tp" in (architectures.mtp_refusal(glm, "glm", 2) or "")
    other = {"model_type": "llama", "num_nextn_predict_layers": 1}
    assert "runs those of deepseek_v3, glm4_moe only" in (architectures.mtp_refusal(other, "l", 1) or "")


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The model's layers damped: its prediction layer, exact for the undamped model, agrees with it often, not always.
    model = make_arch_model(tmp_path_factory.mktemp("glm") / "m", "glm4_moe")
    return _with_mtp(quiet_layers(model, 0, DAMPING), exact=True)


@pytest.fixture(scope="module", params=[("--tp", "1"), ("--tp", "2")], ids=["tp1", "tp2"])
def mtp_server(request: pytest.FixtureRequest, glm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(
        tmp_path_factory, "--model", str(glm), "--speculate", "mtp", "--prefill-chunk", "16", *request.param
    ) as s:
        yield s


@pytest.mark.anyio
async def test_greedy_with_the_models_own_prediction_layer_is_decoding_without_it(mtp_server: Server) -> None:
    await drafts_change_nothing(mtp_server, "m", PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_a_prediction_layer_the_model_agrees_with_is_kept(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_arch_model(tmp_path_factory.mktemp("exact") / "m", arch)
    model = _with_mtp(quiet_layers(model, 0, 0.0), exact=True)
    with serving(tmp_path_factory, "--model", str(model), "--speculate", "mtp", "--tp", "2") as server:
        plain = _complete(server, PROMPTS[2], 30, num_draft_tokens=0)
        with_draft = _complete(server, PROMPTS[2], 30)
    assert with_draft["choices"][0]["text"] == plain["choices"][0]["text"]
    kept, thrown = spoken([with_draft])
    assert kept >= 20 and thrown <= 2, (kept, thrown)


def test_a_model_without_prediction_layers_is_refused(tmp_path: Path, glm: Path) -> None:
    plain = make_tiny_model(tmp_path / "plain", "qwen3")
    done = run_neuron("serve", "--model", str(plain), "--speculate", "mtp", "--port", "0", timeout=120)
    assert done.returncode != 0
    assert "--speculate mtp" in done.stderr and "ships no multi-token-prediction layers" in done.stderr, done.stderr
    staged = run_neuron("serve", "--model", str(glm), "--speculate", "mtp", "--pp", "2", "--port", "0", timeout=120)
    assert staged.returncode != 0 and "serve it with --tp" in staged.stderr, staged.stderr[-2000:]
