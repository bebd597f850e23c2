"""A tiny ``gpt_oss`` whose greedy decoding writes chosen harmony replies, for the tests of gpt-oss end to end.

Real gpt-oss is too large for the tests, so its weights are written by hand. The residual stream holds three
blocks: the current token (its embedding, one-hot), the previous token (copied in by an attention head whose
query and key are constant and whose rotary phases peak one position back) and whether a trigger token appeared
anywhere in the context (a head that attends to the trigger, or to its sink when there is none). Every other
attention and MLP output is zero. The output head is fitted (a perceptron) to map each script's (previous,
current, trigger) to its next token, so a script may repeat a token wherever the token before it, or the trigger,
tells the places apart. The script's pieces are tokens of their own (added to the tokenizer), so the reply can
spell a word (``assis`` ``tant``) apart from the prompt's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 128, 64, 4, 2
SHARP = 50.0  # logit scale: greedy and sampled decoding agree


@dataclass(frozen=True, slots=True)
class Script:
    """A reply, token by token, from the prompt's last two tokens (``<|start|>``, ``assistant``) on; ``triggered``:
    written when the trigger token is in the context."""

    tokens: tuple[str, ...]
    triggered: bool = False


def make_harmony_model(folder: Path, scripts: list[Script], trigger: str) -> Path:
    """A gpt_oss in ``folder`` that writes ``scripts``; ``trigger`` is a piece of the prompt's text (a token of
    its own) that picks the triggered scripts."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tokenizers import AddedToken, Tokenizer

    from testkit.models import tokenizer_files

    folder.mkdir(parents=True)
    tokenizer_files(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in MARKERS])
    pieces = sorted({t for s in scripts for t in s.tokens if t not in MARKERS} | {"assistant", trigger})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in pieces])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"eos_token": "<|return|>", "additional_special_tokens": MARKERS}
    del config["chat_template"]  # harmony renders gpt-oss's prompts
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ids = {t: tokenizer.token_to_id(t) for t in [*MARKERS, *pieces]}
    vocab = tokenizer.get_vocab_size()
    used = sorted({"assistant", trigger, *MARKERS, *(t for s in scripts for t in s.tokens)})
    slot = {t: i for i, t in enumerate(used)}  # each used token's dimension in the current-token block
    n = len(used)
    assert 2 * n + 1 <= HIDDEN and n <= HEAD_DIM, "the script uses too many tokens for the tiny model"
    prev, seen = n, 2 * n  # where the previous-token block and the trigger's dimension start

    model_config = {
        "model_type": "gpt_oss",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention"],
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": ids["<|return|>"],
    }
    model_class, args_class = _get_classes(model_config)
    model = model_class(args_class.from_dict(model_config))
    weights = {k: np.zeros(v.shape, np.float32) for k, v in tree_flatten(model.parameters())}
    for k in weights:
        if "norm" in k:
            weights[k][:] = 1.0
    for t, i in slot.items():
        weights["model.embed_tokens.weight"][ids[t], i] = 1.0
    root = np.sqrt(HIDDEN)  # what RMSNorm makes of a one-hot vector
    a = "model.layers.0.self_attn."
    half = HEAD_DIM // 2
    # Head 0 (key/value head 0): the previous token. Each rotary pair of the key is turned one position ahead of
    # the query's, so every pair agrees at distance one; nothing else is as close.
    theta = 10000.0 ** (-np.arange(half) / half)
    weights[a + "q_proj.bias"][:half] = 16.0
    weights[a + "k_proj.bias"][:half] = 16.0 * np.cos(theta)
    weights[a + "k_proj.bias"][half:HEAD_DIM] = 16.0 * np.sin(theta)
    for i in slot.values():
        weights[a + "v_proj.weight"][i, i] = 1.0
        weights[a + "o_proj.weight"][prev + i, i] = 1.0 / root
    weights[a + "sinks"][0] = -1e4
    # Head 2 (key/value head 1): the trigger, or the sink (logit 0) where it is absent. Only the slowest rotary
    # pair, which barely turns over the tests' contexts.
    q2, k1, last = 2 * HEAD_DIM, HEAD_DIM, half - 1
    weights[a + "q_proj.bias"][q2 + last] = 240.0
    weights[a + "k_proj.weight"][k1 + last, slot[trigger]] = 2.0 / root
    weights[a + "k_proj.bias"][k1 + last] = -1.0
    weights[a + "v_proj.weight"][k1, slot[trigger]] = 1.0
    weights[a + "o_proj.weight"][seen, q2] = 1.0 / root

    # The output head: each script's (previous, current, trigger) features, as the final norm leaves them.
    examples: dict[tuple[str, str, bool], str] = {}
    for script in scripts:
        tokens = ("<|start|>", "assistant", *script.tokens)
        for before, now, after in zip(tokens, tokens[1:], tokens[2:], strict=False):
            key = (before, now, script.triggered)
            assert examples.setdefault(key, after) == after, f"{key} leads to both {examples[key]!r} and {after!r}"
    features = np.zeros((len(examples), HIDDEN), np.float32)
    labels = np.array([ids[after] for after in examples.values()])
    for row, (before, now, triggered) in enumerate(examples):
        features[row, [slot[now], prev + slot[before]]] = 1.0
        features[row, seen] = float(triggered)
    features /= np.sqrt((features**2).mean(axis=1, keepdims=True))
    head = np.zeros((vocab, HIDDEN), np.float32)
    for _ in range(2000):
        logits = features @ head.T
        target = logits[np.arange(len(labels)), labels].copy()
        logits[np.arange(len(labels)), labels] = -np.inf
        wrong = np.flatnonzero(target - logits.max(axis=1) < 1.0)
        if not len(wrong):
            break
        for row in wrong:
            head[labels[row]] += features[row]
            head[int(np.argmax(logits[row]))] -= features[row]
    else:
        raise AssertionError("no output head writes these scripts: make them differ where they repeat")
    weights["lm_head.weight"] = head * SHARP
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    (folder / "config.json").write_text(json.dumps(model_config))
    return folder
