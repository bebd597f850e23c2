"""Loading the model onto every rank: each host checked to hold the same model (or sent the share its rank
loads, with ``--push-model``), then every rank's share loaded at once.

``Loader`` also remembers what the ranks hold beside the model (its LoRA
adapters, the draft model, the prediction layers, the KV cache's bits), so
that a recovery's load (``replacement.py``) loads it all again.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import structlog

from neuron import rpc
from neuron.launch import cgroup
from neuron.launch.checks import Refused, Unreachable, check_memory, check_models, model_differences
from neuron.launch.push import PushCut, Pushed, push
from neuron.launch.stages import SplitError, by_memory, check_split, plan_stages, ranges, weights_per_rank
from neuron.log import ms_since
from neuron.models import architectures, hub
from neuron.models.folder import (
    DECIDING_FILES,
    ModelError,
    cache_bytes,
    cache_shares,
    digest_files,
    model_digest,
    read_config,
    text_config,
)
from neuron.models.shares import Contents, files_read, sha256_of, share_key
from neuron.pool.fanout import PoolError
from neuron.pool.ranks import Layout, Ranks
from neuron.rank.head.drafter import Drafter
from neuron.rank.head.mtp import MtpDrafter
from neuron.rank.model.share import ShareSource, check_splittable
from neuron.rank.rank import Loaded, Rank

log = structlog.get_logger("neuron.pool")


class Loader:
    """Loads ``model_path`` onto ``ranks``, and keeps what each rank holds of it.

    Why it keeps what was asked beside the model (adapters, draft model, MTP,
    KV bits): a fresh group knows none of it, and every load, a recovery's
    too, must leave the ranks as they were.
    """

    def __init__(self, ranks: Ranks, model_path: str, model: str | None) -> None:
        self._ranks = ranks
        self.model_path = model_path
        self.model = model  # what --model said: a host of its own resolves it there
        self.layers: list[tuple[int, int]] = []  # each rank's [first, end) once loaded in stages
        self.loaded = False
        # The LoRA adapters every rank holds, by number: (name, folder); a load (a recovery's too) loads them again.
        self.adapters: dict[int, tuple[str, str]] = {}
        self.draft_path: Path | None = None  # the draft model (--draft-model), loaded whole on rank 0 with the model
        self.mtp = False  # the model's own prediction layers draft (--speculate mtp), loaded on rank 0 with the model
        self.kv_bits: int | None = None  # every rank's KV cache quantized to these bits (--kv-bits); None: not
        self.weights: list[int] = []  # bytes of the model each rank holds, once checked before loading

    def forget(self) -> None:
        """The group that held the model is gone: no step may run until ``load`` has loaded it again."""
        self.loaded = False

    def check_split(self) -> None:
        """Refuse a model the layout cannot split, before any worker exists to be told so."""
        layout = self._ranks.layout
        config = read_config(self.model_path)
        check_splittable(config, self._ranks.world_size, layout.stages)
        if layout.stages > 1:
            layers = int(text_config(config)["num_hidden_layers"])
            check_split(list(layout.split), layers, layout.stages, architectures.kept_together(config))

    def shrunk(self, lost: list[int]) -> Layout:
        """The layout of the group without ``lost`` ranks: a pipeline's stages planned again over the ranks left, by
        their memory, or a tensor-parallel split over fewer ranks. ``Refused``, saying what is missing, where the
        model cannot be split so or a rank left lacks the memory for its larger share of the weights."""
        ranks = self._ranks
        layout = ranks.layout
        world = ranks.world_size - len(lost)
        stages = world if layout.stages > 1 else 1
        config = read_config(self.model_path)
        hosts = ", ".join(ranks.hosts[rank] for rank in lost)
        try:
            check_splittable(config, world, stages)
            if stages > 1:
                layers = int(text_config(config)["num_hidden_layers"])
                check_split([], layers, stages, architectures.kept_together(config))
        except (ModelError, SplitError) as e:
            split = f"{stages} pipeline stages" if stages > 1 else f"tensor parallel over {world} rank(s)"
            raise Refused(
                f"the group cannot go on without {hosts}: the model cannot be split as {split} ({e}); bring the "
                "host back, or add a spare with `neuron hosts add`",
                tuple(lost),
            ) from None
        kept = [rank for rank in range(ranks.world_size) if rank not in lost]
        # Each rank left gives its present share back as it loads the larger one: rank 0 holds its own now.
        infos = [
            dataclasses.replace(ranks.said[rank], free_memory=ranks.said[rank].free_memory + (self.weights or [0])[0])
            if rank == 0
            else ranks.said[rank]
            for rank in kept
        ]
        stage_ranges = ranges(by_memory(self.model_path, [info.free_memory for info in infos])) if stages > 1 else []
        needs = weights_per_rank(self.model_path, world, stage_ranges)
        try:
            check_memory(needs, infos, [ranks.hosts[rank] for rank in kept])
        except Refused as e:
            raise Refused(f"the group cannot go on without {hosts}: {e}", tuple(lost)) from None
        return dataclasses.replace(layout, stages=stages, split=())

    async def load(self) -> dict[int, Loaded]:
        """Check every host holds the same model (or send one that does not the share its rank loads, with
        ``push``), then load each rank's share of it, all ranks at once."""
        ranks = self._ranks
        self.loaded = False
        started = time.perf_counter()
        layers = self._stage_layers()
        mine = digest_files(self.model_path)
        shares = self._share_keys(model_digest(mine), layers)
        # What each rank loads from: a host fetching the model from the Hub fetches only that.
        reads = [files_read(self.model_path, stage, rank) if stage else [] for rank, stage in enumerate(layers)]
        checked = await ranks.fan_out(
            "check_model",
            lambda rank, id: self._check(rank, id, shares[rank], reads[rank]),
            lambda _: rpc.ModelChecked(id=0, path=self.model_path, files=mine),
            ranks.deadlines.load,
        )
        paths = {rank: reply.path for rank, reply in checked.items()}
        check_models({r: c for r, c in checked.items() if r == 0 or not shares[r]}, ranks.hosts, reads)
        self.weights = weights_per_rank(self.model_path, ranks.world_size, self.layers)
        check_memory(self.weights, list(ranks.said), ranks.hosts)
        for rank in sorted(model_differences(checked, ranks.hosts, reads)):  # each may take its share from the leader
            paths[rank] = checked[rank].share or await self._push(rank, shares[rank], layers[rank])
            log.info("loading a pushed share", rank=rank, host=ranks.hosts[rank], path=paths[rank])
        replies = await ranks.fan_out(
            "load_share",
            lambda rank, id: rpc.LoadShare(id=id, model_path=paths[rank], layers=layers[rank], kv_bits=self.kv_bits),
            lambda rank: rank.load(self.model_path, layers[0], self.kv_bits),
            ranks.deadlines.load,
        )
        cgroup.forget_file_pages(self.model_path, ranks.gauge.group)
        if self.draft_path is not None:
            await self._load_draft(self.draft_path)
        if self.mtp:
            await self._load_mtp()
        self.loaded = True
        for number, (name, path) in sorted(self.adapters.items()):
            await self._load_adapter(number, name, path)
        loaded = {
            0: replies[0],
            **{w.rank: Loaded(replies[w.rank].parameters, replies[w.rank].seconds) for w in ranks.workers},
        }
        log.info(
            "model loaded",
            model=self.model_path,
            world_size=ranks.world_size,
            parameters_per_rank=[loaded[r].parameters for r in sorted(loaded)],
            ms=ms_since(started),
        )
        return loaded

    async def load_adapter(self, number: int, name: str, path: str) -> list[int]:
        """Load the LoRA adapter in ``path`` as ``number`` on every rank, each its slice (``rank.model.lora``); returns
        how many projections it adapts on each rank. Refused (``PoolError``, the group still in step) with each
        failing rank's reason, and then dropped wherever it loaded."""
        try:
            projections = await self._load_adapter(number, name, path)
        except PoolError as e:
            if not e.broken:
                await self.unload_adapter(number)
            raise
        self.adapters[number] = (name, path)
        return projections

    async def _load_adapter(self, number: int, name: str, path: str) -> list[int]:
        ranks = self._ranks
        replies = await ranks.fan_out(
            "load_adapter",
            lambda _, id: rpc.LoadAdapter(id=id, adapter=number, name=name, path=path),
            lambda rank: rank.load_adapter(number, name, path),
            ranks.deadlines.load,
        )
        projections = [replies[0], *(replies[w.rank].projections for w in ranks.workers)]
        log.info("adapter loaded", adapter=name, number=number, path=path, projections_per_rank=projections)
        return projections

    async def unload_adapter(self, number: int) -> None:
        """Drop adapter ``number`` on every rank."""
        ranks = self._ranks
        self.adapters.pop(number, None)
        await ranks.fan_out(
            "unload_adapter",
            lambda _, id: rpc.UnloadAdapter(id=id, adapter=number),
            lambda rank: rank.unload_adapter(number),
            ranks.deadlines.control,
        )

    async def _load_draft(self, path: Path) -> None:
        """The draft model, whole on rank 0 (``rank.head.drafter``), checked to cut back as speculation needs."""
        ranks = self._ranks
        started = time.perf_counter()
        head = ranks.rank0.head

        def load_draft(rank: Rank) -> None:
            head.drafter = Drafter.load(str(path), rank.vocab_size)

        try:
            await ranks.rank0.call(load_draft, ranks.deadlines.load)
        except Exception as e:  # any reason is the operator's to read, as a failed step's
            raise PoolError("load_draft", {0: f"{path}: {e}"}, broken=False, hosts=ranks.hosts) from e
        log.info("draft model loaded", model=str(path), ms=ms_since(started))

    async def _load_mtp(self) -> None:
        """The model's own prediction layer, whole on rank 0 (``rank.head.mtp``), which drafts from now on."""
        ranks = self._ranks
        head = ranks.rank0.head

        def load_mtp(rank: Rank) -> None:
            head.drafter = MtpDrafter.load(self.model_path, rank.model, rank.runner, rank.held.seqs, rank.vocab_size)

        try:
            await ranks.rank0.call(load_mtp, ranks.deadlines.load)
        except Exception as e:  # any reason is the operator's to read, as a failed step's
            raise PoolError("load_mtp", {0: str(e)}, broken=False, hosts=ranks.hosts) from e
        log.info("the model's multi-token-prediction layer drafts", model=self.model_path)

    def _check(self, rank: int, id: int, share: str, weights: list[str]) -> rpc.CheckModel:
        """What ``rank`` is asked to find: the model, with the leader's Hugging Face token where its host fetches
        it from the Hub itself (``hub.token``)."""
        ranks = self._ranks
        model = ranks.launcher.model(rank, self.model, self.model_path)
        token = "" if ranks.launcher.hosts[rank].local else hub.token(model, ranks.layout.push)
        return rpc.CheckModel(id=id, model=model, share=share, weights=weights, token=token)

    def _share_keys(self, digest: str, layers: list[list[int]]) -> list[str]:
        """Each rank's share of the model (``neuron.models.shares``) where the leader may push it: on another host, with
        ``push``; empty elsewhere."""
        ranks = self._ranks
        return [
            share_key(digest, rank, ranks.world_size, layers[rank])
            if hub.leader_may_push(self.model, ranks.layout.push) and not ranks.launcher.hosts[rank].local
            else ""
            for rank in range(ranks.world_size)
        ]

    async def _push(self, rank: int, key: str, layers: list[int]) -> str:
        """Send ``rank``'s host the share it lacks; the share's folder there. The tensors are cut on rank 0's
        thread (MLX's), as that rank cuts them when it loads; a cut session is a host out of reach, and the
        next try resumes where it stopped."""
        ranks = self._ranks
        host = ranks.hosts[rank]
        argv = ranks.launcher.receiver(rank, key)
        files = {
            name: Path(self.model_path) / name for name in DECIDING_FILES if (Path(self.model_path) / name).is_file()
        }

        def send(_: Rank) -> Pushed:
            source = ShareSource(self.model_path, rank, ranks.world_size, layers)
            contents = Contents(key, source.entries(), {name: sha256_of(path) for name, path in files.items()})
            return push(argv, contents, source, files, host, rank)

        try:
            pushed = await ranks.rank0.call(send, math.inf)  # ssh's keep-alive ends a dead session
        except PushCut as e:
            raise Unreachable(f"rank {rank} on {host}: {e}", [host]) from e
        return pushed.path

    @property
    def cache_shares(self) -> list[tuple[int, int]]:
        """What a prompt's caches hold on each rank (``models.cache_shares``), rank 0's with its draft model's (whole
        there, a cache per sequence beside the model's)."""
        ranks = self._ranks
        shares = cache_shares(self.model_path, self.layers, ranks.world_size, self.kv_bits)
        if self.draft_path is not None:
            per_token, per_sequence = cache_bytes(self.draft_path, [], 1)
            shares[0] = (shares[0][0] + per_token, shares[0][1] + per_sequence)
        return shares

    @property
    def cache_bytes(self) -> tuple[int, int]:
        """What a prompt's caches cost the rank holding the largest share, per token and whatever the length,
        computed here so that no rank measures anything (the prefix cache's budget must hold on all of them
        alike)."""
        ranks = self._ranks
        return cache_bytes(self.model_path, self.layers, ranks.world_size, self.kv_bits)

    def _stage_layers(self) -> list[list[int]]:
        """Each rank's ``[first, end)`` of layers in a pipeline; empty lists (every layer, sliced) otherwise."""
        ranks = self._ranks
        if ranks.layout.stages == 1:
            self.layers = []  # a pipeline shrunk to one rank holds every layer, as tensor parallelism does
            return [[] for _ in range(ranks.world_size)]
        free = [info.free_memory for info in ranks.said]
        self.layers = plan_stages(self.model_path, list(ranks.layout.split), free, ranks.hosts)
        return [list(r) for r in self.layers]
