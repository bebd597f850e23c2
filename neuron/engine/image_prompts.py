"""A chat's images on the leader: mlx-vlm's processor turns the rendered chat and its pictures into the prompt's
tokens (each image expanded into its placeholder tokens) and each image's pixel inputs.

Each image's pixel inputs go with its prompt (``PromptImage.inputs``) and, in the step that feeds it, to rank 0's
encoder (``Step.images``: rank 0 runs in the leader, so they never cross a pipe); the step's plan carries only
where each image's features go (``rpc.ImageRun``). An image's tokens are prompt tokens like any other: they count
toward the context, admission and memory.

mlx-vlm is imported only when a model has a ``vision_config``: a text-only install never needs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron import images
from neuron.engine.refusals import RequestError
from neuron.models.folder import ModelError
from neuron.rpc import ImageRun


@dataclass(frozen=True, slots=True)
class PromptImage:
    """One image of a prompt: its digest, the prompt positions its features fill, in feature order, and its inputs
    to rank 0's encoder."""

    digest: str
    positions: tuple[int, ...]
    inputs: images.Inputs | None = None


@dataclass(frozen=True, slots=True)
class Rope:
    """A prompt's multimodal rotary positions (M-RoPE, Qwen3-VL's): each token's time, row and column, as
    mlx-vlm's ``get_rope_index`` gives them, and ``delta``, how far the positions after the prompt lag its length
    (each image of h x w tokens advances them by max(h, w))."""

    rows: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    delta: int

    def chunk(self, start: int, end: int) -> list[list[int]]:
        """The positions of the tokens ``[start, end)`` (past the prompt: its output, lagging by ``delta``), or
        none where they are the plain ``start .. end - 1`` (text before the first image)."""
        length = len(self.rows[0])
        rows = [list(row[start:end]) + [i + self.delta for i in range(max(start, length), end)] for row in self.rows]
        return [] if all(row == list(range(start, end)) for row in rows) else rows


def rope_index(ids: list[int], images: list[tuple[int, tuple[int, int, int]]]) -> Rope:
    """M-RoPE positions of a prompt whose images each start at a position with a grid of (time, rows, columns)
    tokens (after the spatial merge): text tokens count on from the previous token's largest position; an image's
    tokens take its grid's coordinates, offset by the position it starts at. As mlx-vlm's ``get_rope_index``."""
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    position, next_ = 0, 0  # the next token's index, and the position it takes
    for start, (t, h, w) in sorted(images):
        for _ in range(start - position):
            for row in rows:
                row.append(next_)
            next_ += 1
        for k in range(t * h * w):
            rows[0].append(next_ + k // (h * w))
            rows[1].append(next_ + (k // w) % h)
            rows[2].append(next_ + k % w)
        next_ += max(t, h, w)
        position = start + t * h * w
    for _ in range(len(ids) - position):
        for row in rows:
            row.append(next_)
        next_ += 1
    return Rope((tuple(rows[0]), tuple(rows[1]), tuple(rows[2])), next_ - len(ids))


class Prompt(list[int]):
    """A prompt's tokens, with the images whose features replace the embeddings at some of its positions."""

    images: tuple[PromptImage, ...] = ()
    rope: Rope | None = None  # a model with M-RoPE: the positions where an image makes them other than plain


def pixels(prompt_images: tuple[PromptImage, ...], runs: list[ImageRun]) -> dict[str, images.Inputs]:
    """The inputs of the images whose features ``runs`` put in a chunk, by digest: what rank 0's encoder needs of
    the step that feeds it."""
    named = {run.digest for run in runs}
    return {image.digest: image.inputs for image in prompt_images if image.digest in named and image.inputs}


def runs(prompt_images: tuple[PromptImage, ...], start: int, end: int) -> list[ImageRun]:
    """Where the images' features go in the chunk of the prompt ``[start, end)``: runs of consecutive positions,
    each relative to the chunk, with the row of its image's features the run starts at."""
    out: list[ImageRun] = []
    for image in prompt_images:
        for row, position in enumerate(image.positions):
            if not start <= position < end:
                continue
            last = out[-1] if out else None
            if (
                last is not None
                and last.digest == image.digest
                and last.at + last.count == position - start
                and last.first + last.count == row
            ):
                out[-1] = ImageRun(last.at, last.count + 1, last.digest, last.first)
            else:
                out.append(ImageRun(position - start, 1, image.digest, row))
    return out


def keyed(tokens: list[int], prompt_images: tuple[PromptImage, ...]) -> list[int]:
    """The prompt as the prefix cache keys it: each image position holds a key of its image's digest and its row
    there (negative: never a token id), so only the same picture, at the same place, matches."""
    if not prompt_images:
        return tokens
    out = list(tokens)
    for image in prompt_images:
        salt = int(image.digest[:32], 16) << 24
        for row, position in enumerate(image.positions):
            if position < len(out):
                out[position] = -1 - (salt + row)
    return out


class Vision:
    """A vision-language model's processor (mlx-vlm's), and the id of the token an image's features replace."""

    def __init__(self, processor: Any, config: dict[str, Any]) -> None:
        self.processor = processor
        token = config.get("image_token_index", config.get("image_token_id"))
        if not isinstance(token, int):
            raise ModelError("the model's config.json names no image_token_index or image_token_id")
        self.image_token = token
        # What a chat template writes for an image, which the processor expands: Gemma 3's begin-of-image marker,
        # else the image token itself (Mistral 3's [IMG], Gemma 4's image token).
        marker = "boi_token" if config.get("model_type") == "gemma3" else "image_token"
        self.placeholder: str = getattr(processor, marker, None) or "<image>"
        # Qwen3-VL's multimodal rotary positions: an image's tokens take their grid's coordinates.
        text = config.get("text_config", config)
        scaling = text.get("rope_scaling") or text.get("rope_parameters") or {}
        self.merge = int(config["vision_config"].get("spatial_merge_size", 2)) if "mrope_section" in scaling else 0

    @classmethod
    def load(cls, model_path: Path) -> Vision | None:
        """The model's processor where its config has a ``vision_config``; None for a text-only model."""
        config_file = model_path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if "vision_config" not in config:
            return None
        try:
            from mlx_vlm.utils import get_model_and_args, load_processor
        except ImportError as e:
            raise ModelError(
                f"{model_path.name} is a vision-language model and mlx-vlm is not installed: "
                "pip install 'neuron[vision]' (or serve it for text with its images refused: remove vision_config)"
            ) from e
        get_model_and_args(config)  # importing the model's module registers its processor with transformers
        return cls(load_processor(model_path, add_detokenizer=False, trust_remote_code=False), config)

    def encode(self, text: str, pictures: list[images.Picture]) -> Prompt:
        """The prompt of a chat rendered to ``text``, with its ``pictures`` in order and their pixel inputs for rank
        0. Raises ``RequestError`` where the template rendered another number of images than were sent."""
        ids = self._prepare(text, pictures)["input_ids"]
        positions = [i for i, t in enumerate(ids) if t == self.image_token]
        prompt_images, taken, grids = [], 0, []
        for picture in pictures:
            alone = self._prepare(self.placeholder, [picture])
            count = sum(1 for t in alone["input_ids"] if t == self.image_token)
            inputs = images.Inputs(alone["input_ids"], alone["arrays"], self.image_token)
            prompt_images.append(PromptImage(picture.digest, tuple(positions[taken : taken + count]), inputs))
            if self.merge and taken < len(positions):
                t, h, w = (int(n) for n in alone["arrays"]["image_grid_thw"][0])
                grids.append((positions[taken], (t, h // self.merge, w // self.merge)))
            taken += count
        if taken != len(positions) or any(len(p.positions) == 0 for p in prompt_images):
            raise RequestError(
                f"the model's chat template placed {len(positions)} image tokens for {len(pictures)} images; "
                "put each image in a user message's content",
                "messages",
            )
        if ids and ids[-1] == self.image_token:
            raise RequestError("the prompt ends inside an image; add text after the last image", "messages")
        prompt = Prompt(ids)
        prompt.images = tuple(prompt_images)
        if grids:
            prompt.rope = rope_index(ids, grids)
        return prompt

    def _prepare(self, text: str, pictures: list[images.Picture]) -> dict[str, Any]:
        """mlx-vlm's own preparation (what its ``generate`` feeds the model), as plain lists and numpy arrays."""
        import numpy as np
        from mlx_vlm.utils import prepare_inputs

        try:
            out = prepare_inputs(
                self.processor, images=[p.image for p in pictures], prompts=text, image_token_index=self.image_token
            )
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise RequestError(f"the model's processor refused the images: {e}", "messages") from e
        ids = [int(t) for t in np.array(out["input_ids"])[0]]
        if len(pictures) != 1:  # only the ids: pictures of several sizes come as a list of arrays of several shapes
            return {"input_ids": ids, "arrays": {}}
        arrays = {k: np.array(v) for k, v in out.items() if k not in ("input_ids", "attention_mask") and v is not None}
        return {"input_ids": ids, "arrays": arrays}
