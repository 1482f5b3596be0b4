"""The decode step replayed from CUDA graphs, as nano-vLLM and vLLM do.

A decode step launches a few hundred small kernels (about ten a layer); run eagerly, the CPU
takes longer to launch them than the GPU to run them, and the GPU waits. A CUDA graph records
the launches of one forward once and replays them all with one call. A graph replays exactly
what it recorded: the same kernels, the same grid, the same memory. So the step's inputs live
in static buffers that every replay reads (``input_ids``, ``positions``, ``slot_mapping``,
``block_tables``, ``context_lens``), a graph is captured at start for each of a few batch sizes
(``graph_batch_sizes``: 1, 2, 4, 8, 16, 32, 48, ... up to ``max_num_seqs``), and a batch of n
sequences is copied into the buffers and padded to the smallest captured size that holds it.

A padded row is harmless by construction: token 0 at position 0, slot -1 (the store writes
nothing for it) and a context of 0 with a table of -1 (attention reads nothing and gives 0);
its logits are computed and dropped. The decode kernel's split of the context is fixed at
capture: it is derived from the table's width (``max_model_len``), never from the step's
contexts, which a graph could not read without stopping to wait for the GPU.

Prefill steps, and decode batches larger than the largest size, run eagerly. So does
everything on a CPU, where nothing is captured: ``DecodeGraphs(capture=False)`` runs the same
padded buffers through the model's forward, so that the padding is tested on every machine
(the same tokens with and without it). Graphs need the Triton backend (the torch reference
reads the slots back to skip padding, a device sync that capture refuses) and a cache that is
16-bit or quantized per token; keys per channel plan their writes on the host each step and
decode eagerly.

A quantized store refuses a step with a NaN or an infinity in its keys or values without
waiting for the GPU (which capture refuses): the engine's caches quantized per token carry a
step flag (``QuantizedCache.refused``) that a store sets and every store reads, writing nothing
while it is set; the ``CacheEngine`` clears it before each step and the runner raises after the
step, eager or replayed alike.
"""

import time
from collections.abc import Sequence
from types import ModuleType

import torch

from vkv.config import Config
from vkv.engine.cache_engine import CacheShape
from vkv.engine.staged_tables import StagedTables
from vkv.models.qwen3 import AttentionMetadata, CausalLM

PADDING_SLOT = -1


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and it, if it is not one):
    a batch pads to the next size, so at most 15 rows of padding past 16."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return [*sizes, max_num_seqs]


def graph_plan(
    device: torch.device, backend: str, shape: CacheShape, enforce_eager: bool, config: Config
) -> tuple[list[int], int] | None:
    """The batch sizes and table width of an engine's decode graphs; None where it runs
    eagerly (not CUDA, not Triton, keys quantized per channel, or ``enforce_eager``)."""
    per_channel = shape.quantized and shape.key_granularity == "per_channel"
    if device.type != "cuda" or backend != "triton" or per_channel or enforce_eager:
        return None
    max_blocks = -(-config.max_model_len // config.block_size)
    return graph_batch_sizes(config.max_num_seqs), max_blocks


class DecodeGraphs:
    """Static decode buffers for up to ``max(sizes)`` sequences of ``max_blocks`` blocks each,
    and, with ``capture``, a CUDA graph of the model's forward over them for each size."""

    def __init__(
        self,
        model: CausalLM,
        caches: Sequence[tuple],
        backend: ModuleType,
        sizes: list[int],
        max_blocks: int,
        block_size: int,
        capture: bool,
    ) -> None:
        self.model, self.backend = model, backend
        self.sizes, self.capture = sorted(sizes), capture
        device = model.lm_head.weight.device
        largest = self.sizes[-1]
        self.caches = caches

        def buffer(*shape: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = buffer(largest, dtype=torch.int64, fill=0)
        self.positions = buffer(largest, dtype=torch.int64, fill=0)
        self.slot_mapping = buffer(largest, dtype=torch.int64, fill=PADDING_SLOT)
        self.context_lens = buffer(largest, dtype=torch.int32, fill=0)
        self.block_tables = buffer(largest, max_blocks, dtype=torch.int32, fill=-1)
        self.max_context_len = max_blocks * block_size
        # the step's rows on the host, copied with one transfer per buffer (pinned: no sync)
        pinned = device.type == "cuda"
        self.staged = {
            name: torch.empty_like(tensor, device="cpu", pin_memory=pinned)
            for name, tensor in self._buffers().items()
        }
        self.staged["block_tables"].fill_(-1)
        self.tables = StagedTables(self.staged["block_tables"].numpy())
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.steps = 0  # decode steps run here
        if capture:
            self._capture_all()

    def serves(self, num_seqs: int, is_prefill: bool) -> bool:
        """Whether a step of ``num_seqs`` sequences runs here (a decode that fits)."""
        return not is_prefill and num_seqs <= self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        """The smallest size that holds ``num_seqs`` rows."""
        return next(size for size in self.sizes if size >= num_seqs)

    def run(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """The logits ``[n, vocab]`` of a decode step of n sequences (one token each, one block
        table each), computed on the padded buffers."""
        num_seqs = len(tokens)
        size = self.padded_size(num_seqs)
        self._stage(size, tokens, positions, slots, context_lens, block_tables)
        self.steps += 1
        if size in self.graphs:
            self.graphs[size].replay()
            logits = self.logits[size]
        else:
            logits = self._forward(size)
        return logits[:num_seqs]

    def _stage(self, size, tokens, positions, slots, context_lens, block_tables) -> None:
        """Write the step's rows and ``size - n`` rows of padding into the static buffers (the
        tables' rows only where a table changed: ``StagedTables``)."""
        n = len(tokens)
        staged = self.staged
        for name, values, fill in (
            ("input_ids", tokens, 0),
            ("positions", positions, 0),
            ("slot_mapping", slots, PADDING_SLOT),
            ("context_lens", context_lens, 0),
        ):
            row = staged[name][:size].numpy()
            row[:n] = values
            row[n:] = fill
        self.tables.stage(block_tables)
        for name, tensor in self._buffers().items():
            tensor[:size].copy_(staged[name][:size], non_blocking=True)

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "slot_mapping": self.slot_mapping,
            "context_lens": self.context_lens,
            "block_tables": self.block_tables,
        }

    def _forward(self, size: int) -> torch.Tensor:
        """The model's forward over the first ``size`` rows of the buffers."""
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            max_context_len=self.max_context_len,
        )
        inputs = (self.input_ids[:size], self.positions[:size])
        return self.model(*inputs, self.caches, meta, self.backend)

    def _capture_all(self) -> None:
        """A graph per size, largest first, all in one memory pool (a smaller graph reuses the
        larger one's memory: they never run at once). The buffers hold padding only, so the
        warm-up run (Triton compiles its kernels there, which capture could not) and the
        capture write nothing to the cache."""
        started = time.perf_counter()
        device = self.input_ids.device
        # capture empties the allocator's cache: empty it first, or the memory it gives back
        # would be counted against the graphs (the difference below could be negative)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up, outside the graph
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size] = self._forward(size)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - started
        self.capture_bytes = torch.cuda.memory_reserved(device) - before

    def describe(self) -> str:
        """What the engine prints after capture: sizes, time and memory."""
        sizes = f"{len(self.sizes)} batch sizes {self.sizes[0]}-{self.sizes[-1]}"
        if not self.capture:
            return f"decode padded to {sizes} (static buffers, run eagerly)"
        return (
            f"decode replayed from CUDA graphs: {sizes} captured in "
            f"{self.capture_seconds:.1f} s, {self.capture_bytes / 2**20:.0f} MiB"
        )
