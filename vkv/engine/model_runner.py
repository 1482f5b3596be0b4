"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples the next tokens.

For every scheduled sequence the step computes tokens ``[num_computed_tokens, + num_tokens)``:
their ids and positions go into one flat batch, their slots come from the BlockManager's slot
mapping, and each sequence reads ``num_computed_tokens + num_tokens`` cached tokens through its
block table. The CacheEngine first applies the step's swap and copy maps. A pure decode step
uses the decode kernel; any step with a prefill (or a chunk of one) uses the prefill kernel,
for which a decode token is a one-token chunk. The logits of each sequence's last computed token
are sampled (a prefill chunk that stops short gets a token the scheduler then ignores).

A decode step that fits runs on ``decode_graphs`` where the engine set them up
(``decode_graphs.py``: static buffers, padded to a captured batch size, replayed from a CUDA
graph on a GPU); everything else runs eagerly.

On a GPU the host waits for the device once a step, when it reads the sampled tokens: the
inputs go up from pinned memory (``upload``), the kernels' grids come from lengths the host
knows, the forward's time is two CUDA events read afterwards (``ForwardClock``), and a quantized
cache's refusal of a NaN is a flag on the device read afterwards too (``CacheEngine``).

With tensor parallelism (``parallel.py``) this runner is rank 0's: it sends each step's block
maps and batch (``StepBatch``) to the other ranks, which run the same ``forward`` on their
heads, and it samples from the vocabulary the ranks' logits make together.

Before sampling, a request's penalties and logit bias adjust its row of logits
(``adjust_logits``); a request that asks for logprobs gets, for each sampled token, its
log-probability and the most likely alternatives from the log-softmax of the raw row (before
penalties, bias, temperature, top-k and top-p: vLLM's default, ``logprobs_mode="raw_logprobs"``).
"""

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple, Protocol

import numpy as np
import torch

from vkv.engine.block_manager import BlockManager
from vkv.engine.cache_engine import CacheEngine
from vkv.engine.decode_graphs import DecodeGraphs
from vkv.engine.key_residual import partial_blocks
from vkv.engine.scheduler import ScheduledSequence, SchedulerOutput
from vkv.engine.sequence import Sequence
from vkv.engine.staged_tables import StagedTables
from vkv.engine.upload import upload
from vkv.models.qwen3 import AttentionMetadata, CausalLM
from vkv.sampling_params import MAX_SEED, SamplingParams
from vkv.threads import free_cpus

LOGPROB_FLOOR = -9999.0  # a log-probability that underflows to -inf is reported as this (vLLM)
TOP_P_CANDIDATES = 1024  # the likeliest tokens a CPU sorts first for a top-p cut (top_p_cut)


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the ``k`` most likely tokens' (``top``: ``(token
    id, logprob)`` pairs, most likely first; ``k`` is ``SamplingParams.logprobs``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True, frozen=True)
class StepBatch:
    """A step's tokens as plain lists: ids, positions and cache slots (one per token), the
    sequences' cumulative token counts ``cu_seqlens`` (``[0, ...]``), their context lengths
    after the step, and their block tables (the sequences' own lists: read, never kept)."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    cu_seqlens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    is_prefill: bool


class RankZero(Protocol):
    """What the runner needs of tensor parallelism on rank 0 (``parallel.TensorParallel`` is
    one; the runner sits below it: the workers of ``parallel.py`` run runners)."""

    def send(self, message: object) -> None: ...

    def gather_vocabulary(self, logits: torch.Tensor) -> torch.Tensor | None: ...

    def run_step(self, forward: Callable[[], torch.Tensor], batch: tuple) -> torch.Tensor: ...


class ForwardClock:
    """How long a forward took, from its first launch to its last result, read without making
    the host wait for a GPU: there, two CUDA events around the forward, read once the step's
    sampled tokens are on the host (so both events have passed); elsewhere, the host's clock."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
        self.started = self.elapsed = 0.0

    def start(self) -> None:
        if self.events is None:
            self.started = time.perf_counter()
        else:
            self.events[0].record()

    def stop(self) -> None:
        if self.events is None:
            self.elapsed = time.perf_counter() - self.started
        else:
            self.events[1].record()

    def seconds(self) -> float:
        """The last forward's time; on a GPU only once the host has waited for the forward."""
        if self.events is None:
            return self.elapsed
        return self.events[0].elapsed_time(self.events[1]) / 1000


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache_engine: CacheEngine,
        block_manager: BlockManager | None,
        backend: ModuleType,
        parallel: RankZero | None = None,
    ) -> None:
        self.model = model
        self.parallel = parallel  # tensor parallelism: this is rank 0 (see parallel.py)
        self.cache_engine = cache_engine
        self.block_manager = block_manager
        self.backend = backend
        self.device = cache_engine.device
        self.more_tokens: dict[int, list[int]] = {}  # execute's other samples' tokens
        self.logprobs: dict[int, TokenLogprobs] = {}  # execute's tokens' logprobs, if asked
        self.more_logprobs: dict[int, list[TokenLogprobs]] = {}  # the other samples' ones
        self.model_seconds = 0.0
        self.clock = ForwardClock(self.device)
        self.thread_limit = torch.get_num_threads()  # the engine's (see vkv.threads)
        self.decode_graphs: DecodeGraphs | None = None  # see use_decode_graphs
        self.staged_tables = StagedTables()  # the eager path's tables, kept across steps

    def use_decode_graphs(self, sizes: list[int], max_blocks: int, capture: bool) -> DecodeGraphs:
        """Run the decode steps of up to ``max(sizes)`` sequences on static buffers padded to
        ``sizes``, each replayed from a CUDA graph captured now (``capture``) or run eagerly."""
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.cache_engine.layers(),
            self.backend,
            sizes,
            max_blocks,
            self.cache_engine.shape.block_size,
            capture,
        )
        return self.decode_graphs

    def batch_of(self, scheduled: list[ScheduledSequence]) -> StepBatch:
        """The scheduled tokens as one flat batch of plain lists (what a tensor-parallel rank 0
        sends to the other ranks)."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens, context_lens, tables = [0], [], []
        slot_mapping = self.block_manager.get_slot_mapping
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_tokens
            tokens += seq.token_ids[start:end]
            positions += range(start, end)
            slots += slot_mapping(seq, start, end)
            cu_seqlens.append(len(tokens))
            context_lens.append(end)
            tables.append(seq.block_table)
        is_prefill = any(item.is_prefill for item in scheduled)
        return StepBatch(tokens, positions, slots, cu_seqlens, context_lens, tables, is_prefill)

    def tensors(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``batch`` as the model's inputs on this runner's device; plans the key residual."""
        self.cache_engine.plan_step(batch.slots)

        def tensor(values: list[int], dtype: type[np.integer] = np.int32) -> torch.Tensor:
            # through numpy: np.fromiter turns a list of ints into an array 3-4x faster than
            # torch.tensor does (the block tables, a step's costliest input, are staged rows)
            return upload(torch.from_numpy(np.fromiter(values, dtype, len(values))), self.device)

        tables = self.staged_tables.padded(batch.block_tables)
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=tensor(batch.slots, np.int64),
            block_tables=upload(torch.from_numpy(tables), self.device),
            context_lens=tensor(batch.context_lens),
            cu_seqlens_q=tensor(batch.cu_seqlens),
            max_context_len=max(batch.context_lens),
            max_query_len=max(b - a for a, b in itertools.pairwise(batch.cu_seqlens)),
        )
        return tensor(batch.tokens, np.int64), tensor(batch.positions, np.int64), meta

    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """The logits of each sequence's last token in ``batch`` (the whole vocabulary); with
        tensor parallelism, on rank 0 only (the others send their slice of the vocabulary and
        get None). Queued on a GPU, not waited for: ``execute`` reads the sampled tokens, the
        only wait of a step, and then the forward's time (``clock``) and the cache's refusal
        (``CacheEngine.raise_if_refused``)."""
        if self.device.type == "cpu" and self.parallel is None:
            self._fit_threads()
        graphs, num_seqs = self.decode_graphs, len(batch.context_lens)
        if graphs is not None and graphs.serves(num_seqs, batch.is_prefill):
            self.cache_engine.plan_step(batch.slots)
            self.clock.start()
            logits = graphs.run(
                batch.tokens, batch.positions, batch.slots, batch.context_lens, batch.block_tables
            )
        else:
            input_ids, positions, meta = self.tensors(batch)
            self.clock.start()
            logits = self.model(
                input_ids, positions, self.cache_engine.layers(), meta, self.backend
            )
            if len(logits) > num_seqs:  # a row per token: keep each sequence's last
                logits = logits[meta.cu_seqlens_q[1:].long() - 1]
        if self.parallel is not None:
            logits = self.parallel.gather_vocabulary(logits)
        self.clock.stop()
        self.cache_engine.fetch_refusal()
        return logits

    def _fit_threads(self) -> None:
        """As many torch threads as have a CPU to themselves now, up to the engine's limit
        (``vkv.threads.free_cpus``; a single process: tensor-parallel ranks keep their share)."""
        wanted = free_cpus(self.thread_limit)
        if wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)

    def apply_block_maps(
        self, out: SchedulerOutput, running: list[Sequence], swapped: Iterable[Sequence]
    ) -> None:
        """Swap out, swap in and copy the blocks the step moves, before any of it runs (keys
        per channel: the residual follows the ``running`` and ``swapped`` sequences' partial
        blocks); the step's ``model_seconds`` start at 0 here (``execute`` may run more than
        once a step)."""
        partial_gpu, partial_cpu = set(), set()
        if self.cache_engine.residual is not None:
            size = self.cache_engine.shape.block_size
            partial_gpu = partial_blocks(running, size)
            partial_cpu = partial_blocks(swapped, size)
        maps = (out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        keeps_residual = self.cache_engine.residual is not None  # its apply frees slots too
        if self.parallel is not None and (any(maps) or keeps_residual):
            self.parallel.send(("maps", (*maps, partial_gpu, partial_cpu)))
        self.cache_engine.apply(*maps, partial_gpu, partial_cpu)
        self.model_seconds = 0.0

    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[ScheduledSequence],
        more_samples: Mapping[int, list[SamplingParams]] | None = None,
    ) -> list[int]:
        """Run the model over the scheduled tokens; one sampled token per sequence, in order.

        ``more_samples`` maps a sequence id to the params of more samples to draw from the same
        logits (parallel sampling: the other samples' first tokens); they are left in
        ``self.more_tokens`` (sequence id -> tokens, in order). A sequence whose params ask for
        ``logprobs`` has its token's ``TokenLogprobs`` in ``self.logprobs`` (by sequence id;
        its other samples' in ``self.more_logprobs``, in order). Only the slots of
        ``scheduled`` are written, so a subset of a step's batch can run again on its own.
        ``model_seconds`` adds the time the model's forward took (the rest of a step is
        overhead: scheduling, block maps, inputs, sampling).
        """
        self.more_tokens, self.logprobs, self.more_logprobs = {}, {}, {}
        if not scheduled:
            return []
        batch = self.batch_of(scheduled)
        if self.parallel is None:
            logits = self.forward(batch)
        else:
            logits = self.parallel.run_step(lambda: self.forward(batch), ("batch", batch))
        draws = [
            Draw(index, seq.sampling_params, history(seq), seq.num_tokens)
            for index, seq in enumerate(item.seq for item in scheduled)
        ]
        for index, item in enumerate(scheduled if more_samples else ()):  # n > 1: same row
            for params in more_samples.get(item.seq.seq_id, ()):
                draws.append(Draw(index, params, [], item.seq.num_tokens))
        asking = [index for index, draw in enumerate(draws) if draw.params.logprobs is not None]
        drawn = draw_tokens(logits, draws)
        # the tokens are on the host: the step is over on the device too, nothing waits here
        self.model_seconds += self.clock.seconds()
        self.cache_engine.raise_if_refused()
        own = len(scheduled)
        for index in asking:  # in order: a sequence's other samples' entries follow theirs
            draw = draws[index]
            entry = token_logprobs(logits[draw.row], drawn[index], draw.params.logprobs)
            seq_id = scheduled[draw.row].seq.seq_id
            if index < own:  # the sequence's own token
                self.logprobs[seq_id] = entry
            else:
                self.more_logprobs.setdefault(seq_id, []).append(entry)
        for index in range(own, len(draws)):  # the other samples' first tokens, in order
            seq_id = scheduled[draws[index].row].seq.seq_id
            self.more_tokens.setdefault(seq_id, []).append(drawn[index])
        return drawn[:own]


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, output_ids: list[int]
) -> torch.Tensor:
    """One row of logits with the request's logit bias added and its penalties taken off
    (OpenAI's formula): ``logits[t] + bias[t] - frequency_penalty * count[t] -
    presence_penalty * (count[t] > 0)``, where ``count[t]`` is how often ``t`` occurs in
    ``output_ids`` (the tokens generated so far, not the prompt: vLLM's rule). The row itself
    when the params adjust nothing; a new float32 row otherwise."""
    if not params.adjusts_logits:
        return logits
    scores = logits.float().clone()
    device = scores.device
    if params.logit_bias:  # uploaded, as each list here: no wait for a GPU
        ids, biases = zip(*params.logit_bias, strict=True)
        scores[upload(torch.tensor(ids), device)] += upload(torch.tensor(biases), device)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        tokens = upload(torch.tensor(output_ids), device)
        counts = torch.bincount(tokens, minlength=scores.numel()).float()
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return scores


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The sampled ``token``'s log-probability and the ``k`` most likely tokens', from the
    log-softmax of the raw row of ``logits`` (values below ``LOGPROB_FLOOR`` are raised to it:
    JSON has no -inf)."""
    logprobs = logits.float().log_softmax(-1).clamp(min=LOGPROB_FLOOR)
    top = torch.topk(logprobs, min(k, logprobs.numel()))
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprobs(token, float(logprobs[token]), pairs)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's highest-scoring token (the first of equal ones). On the CPU through numpy,
    whose call costs a tenth of torch's: this runs every step, outside the model."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def top_p_cut(
    probs: torch.Tensor,
    top_p: list[float],
    top_k: list[int],
    column: Callable[[list], torch.Tensor],
) -> torch.Tensor:
    """``probs``, each row cut in place to its most likely tokens whose probabilities before
    them sum to at most ``top_p`` (1: no cut), and to every token as likely as the least likely
    of those (ties are kept whole, as ``top_k`` keeps them: the order of equal values decides
    nothing). ``column`` makes a list, one value a row, a ``[rows, 1]`` tensor beside them.

    The cut is a prefix of the row sorted, so only as much of the row is sorted as the prefix
    can reach. Where every row that cuts also kept its ``top_k`` highest only (0: not cut), the
    prefix lies among the largest ``max(top_k)``. Otherwise, on a CPU, where sorting a
    vocabulary of 150,000 tokens takes milliseconds a row, the ``TOP_P_CANDIDATES`` largest are
    sorted first: a row whose candidates sum past its ``top_p`` has its prefix among them (the
    next token's mass before it is over the limit), and only the other rows sort the whole
    vocabulary. A GPU sorts the vocabulary at once (and asking which rows fell short would make
    the host wait for it)."""
    cutting = [p < 1.0 for p in top_p]
    limit = column([p if cuts else float("inf") for p, cuts in zip(top_p, cutting, strict=True)])
    cut_rows = column(cutting)
    vocab = probs.shape[-1]
    if all(k > 0 for k, cuts in zip(top_k, cutting, strict=True) if cuts):
        least = least_kept(probs.topk(min(vocab, max(top_k)), -1).values, limit)
    elif probs.device.type == "cpu" and vocab > TOP_P_CANDIDATES:
        candidates = probs.topk(TOP_P_CANDIDATES, -1).values
        least = least_kept(candidates, limit)
        short = ((candidates.cumsum(-1)[:, -1:] <= limit) & cut_rows).nonzero()[:, 0]
        if len(short):
            least[short] = least_kept(probs[short].topk(vocab, -1).values, limit[short])
    else:
        least = least_kept(probs.topk(vocab, -1).values, limit)
    least = torch.where(cut_rows, least, 0.0)  # a row that does not cut keeps every token
    return probs.masked_fill_(probs < least, 0.0)


def least_kept(ordered: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Each row's probability of its least likely token whose probabilities before it sum to at
    most ``limit`` (``[rows, 1]``), from the row's largest probabilities sorted, most likely
    first."""
    before = ordered.cumsum(-1) - ordered
    return ordered.masked_fill(before > limit, float("inf")).amin(-1, keepdim=True)


class Draw(NamedTuple):  # a tuple: a step makes one a sequence (a frozen dataclass: twice the time)
    """One token a step draws: from row ``row`` of the logits, by ``params``, for a sequence
    whose completion so far is ``history`` (the penalties count it; see ``history``) and
    whose length is ``step`` (a seeded draw depends on it)."""

    row: int
    params: SamplingParams
    history: list[int]
    step: int


def history(seq: Sequence) -> list[int]:
    """What a draw for ``seq`` needs of its completion: a copy of it where its params adjust
    the logits (penalties count its tokens), else nothing (no copy a step and sequence)."""
    return seq.completion_token_ids if seq.sampling_params.adjusts_logits else []


def draw_tokens(logits: torch.Tensor, draws: list[Draw]) -> list[int]:
    """The tokens of ``draws``, drawn together: one read of the device for the whole batch.

    Each draw's row of logits is adjusted (``adjust_logits``), then either greedy (argmax), or
    divided by the temperature, cut to the ``top_k`` highest scores (ties with the k-th kept)
    and to the most likely tokens whose probabilities before them sum to at most ``top_p`` (the
    most likely one always kept, and ties with the least likely kept one: ``top_p_cut``), and
    drawn by inverting the row's cumulative probabilities: a point drawn uniformly in ``[0, 1)``
    falls in token ``t``'s stretch with probability ``probs[t]`` (one search for all rows: no
    ``multinomial`` per row, and one random number a row, where an exponential race would draw
    one a token). With ``params.seed`` the row's point comes from a generator seeded by the
    seed and ``step`` alone, so that the draw does not depend on the rest of the batch.
    """
    if len(draws) == len(logits) and all(
        d.params.greedy and not d.params.adjusts_logits and d.row == index
        for index, d in enumerate(draws)
    ):
        return greedy_tokens(logits)
    device, vocab = logits.device, logits.shape[-1]

    def column(values: list) -> torch.Tensor:  # one value a draw, as a [draws, 1] tensor
        return upload(torch.tensor(values), device)[:, None]

    scores = logits[column([d.row for d in draws])[:, 0]].float()
    for index, draw in enumerate(draws):
        if draw.params.adjusts_logits:
            scores[index] = adjust_logits(scores[index], draw.params, draw.history)
    greedy = column([d.params.greedy for d in draws])
    best = scores.argmax(-1, keepdim=True)  # also the most likely token after every cut
    scores /= column([1.0 if d.params.greedy else d.params.temperature for d in draws])
    top_k = [min(d.params.top_k, vocab) if d.params.top_k > 0 else 0 for d in draws]
    if any(top_k):
        highest = scores.topk(max(top_k), -1).values
        kth = highest.gather(1, column([max(k, 1) - 1 for k in top_k]))
        kth = torch.where(column([k > 0 for k in top_k]), kth, float("-inf"))
        scores.masked_fill_(scores < kth, float("-inf"))
    probs = scores.softmax(-1)
    if any(d.params.top_p < 1.0 for d in draws):
        probs = top_p_cut(probs, [d.params.top_p for d in draws], top_k, column)
    cumulative = probs.cumsum(-1)
    point = torch.rand(len(draws), 1, device=device)
    for index, draw in enumerate(draws):
        if draw.params.seed is not None and not draw.params.greedy:
            seed = (draw.params.seed * 1_000_003 + draw.step) % MAX_SEED
            generator = torch.Generator(device).manual_seed(seed)
            point[index] = torch.rand(1, device=device, generator=generator)
    point *= cumulative[:, -1:]  # the rows' sums, 1 up to rounding
    drawn = torch.searchsorted(cumulative, point, right=True).clamp_(max=vocab - 1)
    # a point rounded onto a row's end lands past it: the most likely token then, never one cut
    drawn = torch.where(probs.gather(1, drawn) > 0, drawn, best)
    return torch.where(greedy, best, drawn)[:, 0].tolist()
