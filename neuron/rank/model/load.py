"""Loading one rank's share of a model: a slice of every layer (tensor parallel), or a pipeline stage of whole
layers, and the runner that drives it."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx_lm.models.cache import KVCache, make_prompt_cache

from neuron.models import architectures
from neuron.models.folder import KV_GROUP_SIZE, read_config, text_config
from neuron.rank.failures import RankError
from neuron.rank.kv import states
from neuron.rank.kv.quantized import quantize_caches
from neuron.rank.model import kernels, mrope, vision
from neuron.rank.model.share import load_share, load_stage, parameter_count, slice_head
from neuron.rank.runner import Sliced, Stage
from neuron.system import cpu
from neuron.system.native import QUANTIZED_FIX

log = structlog.get_logger("neuron.rank")


@dataclass(slots=True)
class Loaded:
    parameters: int
    seconds: float


@dataclass(slots=True)
class Share:
    """A rank's share of the model, ready to step."""

    model: nn.Module
    runner: Sliced | Stage
    vocab_size: int
    prompts_together: bool  # new prompts fed as one left-padded batch: where every cache can be cut
    parameters: int
    layers: int  # the whole model's, of which a stage holds some
    recording: bool  # its gated delta layers record each position's state (``rank.kv.states``)
    kernel: ModuleType | None  # neuron's CPU kernels, where its products go through them (``rank.model.kernels``)


def load(
    model_path: str,
    layers: list[int],
    rank: int,
    world_size: int,
    group: mx.distributed.Group | None,
    kv_bits: int | None = None,
    cores: list[int] | None = None,
) -> Share:
    """``rank``'s share of the model at ``model_path``: a slice of every layer, or (``layers`` = [first, end))
    a pipeline stage of whole layers; its KV caches quantized to ``kv_bits`` where given; its quantized layers'
    products through neuron's kernel on ``cores`` where it takes them (``rank.model.kernels``)."""
    config = read_config(model_path)  # the leader checked it can be split (rank.model.share.check_splittable)
    vocab_size = text_config(config)["vocab_size"]
    if layers:
        if group is None:
            raise RankError(f"rank {rank}: a pipeline stage needs a group of at least two ranks")
        model = load_stage(model_path, layers[0], layers[1], rank)
    else:
        model = load_share(model_path, group)
    if architectures.supports(config) is None and not all(type(c) is KVCache for c in make_prompt_cache(model)):
        raise RankError(
            f"rank {rank}: {model_path} ({architectures.architecture(config)!r}, outside neuron's table of "
            "architectures) builds caches other than mlx-lm's KVCache (a sliding window or a state); "
            f"serve one of {', '.join(sorted(architectures.TABLE))}"
        )
    kernel = quantized_products(model, rank, cores or [])
    if world_size == 1 and cpu.is_linux_cpu_backend():
        dispatch_layers(model)
    support = architectures.supports(config)
    together = support is None or support.cuttable  # from the whole model: a stage may hold none
    recording = support is not None and support.caches == architectures.STATE
    if recording:
        recording = states.hook(model) > 0  # its gated delta layers keep each position's state where drafts need it
    parameters = parameter_count(model)  # before a stage takes its final norm out of the tree
    runner: Sliced | Stage
    if layers:
        assert group is not None
        runner = Stage(model, rank, world_size, group)
    else:
        runner = Sliced(model, slice_head(model, config.get("model_type", ""), group), rank)
    runner.images = vision.attach(model_path, config, model, rank, group, staged=bool(layers))
    runner.rope = mrope.attach(config, model, rank, layers[0] if layers else 0)
    if kv_bits is not None:
        try:
            architectures.check_kv_bits(config, kv_bits, KV_GROUP_SIZE)  # the leader checked; a worker's own model
        except architectures.Unsupported as e:
            raise RankError(f"rank {rank}: {e}") from None
        quantize_caches(model, KV_GROUP_SIZE, kv_bits)
    layer_count = int(text_config(config)["num_hidden_layers"])
    return Share(model, runner, vocab_size, together, parameters, layer_count, recording, kernel)


def dispatch_layers(model: nn.Module) -> int:
    """A rank alone on the CPU: each decoder layer hands its output to MLX's stream thread as soon as it is built
    (``mx.async_eval``), so that the stream computes the first layers while this thread builds the rest. Built
    whole, a step's graph was built while the stream waited: MLX's ``eval`` holds its caller back once more than
    ten tasks are queued on the CPU (``MAX_ACTIVE_TASKS``, mlx/transforms.cpp), so it was computed after. Across
    ranks nothing is dispatched early, so that no collective is ever in flight outside a step. Returns the layers
    that do."""
    made: dict[type, type] = {}
    layers = list(getattr(model, "layers", []))
    for layer in layers:
        cls = type(layer)
        if not getattr(cls, "dispatches", False):
            if cls not in made:
                made[cls] = _dispatching(cls)
            layer.__class__ = made[cls]
    return len(layers)


def _dispatching(cls: type) -> type:
    """``cls`` (a decoder layer's class) whose call hands its output to MLX's stream thread."""

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = cls.__call__(self, *args, **kwargs)
        if isinstance(out, mx.array):
            mx.async_eval(out)
        return out

    return type(f"Dispatching{cls.__name__}", (cls,), {"__call__": call, "dispatches": True})


def quantized_products(model: nn.Module, rank: int, cores: list[int]) -> ModuleType | None:
    """On a Linux CPU, the quantized layers' products, and the norms and rotations, through neuron's kernel, whose
    module it returns; where it cannot be had, MLX's, and the log says why and how to get it."""
    if not cpu.is_linux_cpu_backend():
        return None
    if not any(type(layer) in kernels.PRODUCT_CLASSES for _, layer in model.named_modules()):
        return None
    kernel, why = kernels.load_kernel(cores)
    if kernel is None:
        log.warning("quantized products by MLX", rank=rank, why=why, fix=QUANTIZED_FIX)
        return None
    taken = kernels.use_kernel(model, kernel)
    log.info("quantized products by neuron's kernel", rank=rank, products=taken.products, packed=taken.packed,
             norms=taken.norms, rotations=taken.rotations, functions=list(taken.functions),
             threads=kernel.threads())  # fmt: skip
    return kernel
