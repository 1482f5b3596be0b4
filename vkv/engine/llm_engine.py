"""LLMEngine: requests in, text out, one scheduler step at a time (the names are vLLM's).

``add_request`` tokenizes and queues a prompt, ``step`` runs one scheduler step through the
model and returns what each request gained (new text for streaming, and whether it finished;
a final-only request, ``SamplingParams.output_kind``, returns everything once, when it ends),
``abort`` drops a request, ``stats`` describes the engine after the last step (its queues and
KV usage also after an abort). Bad input (an
empty prompt, one longer than ``max_model_len``, text without a tokenizer) raises at
``add_request`` and leaves the other requests and the block accounting as they were.

A fault while a step runs the model fails the requests it belongs to, never the engine: when
the batch raises, each sequence runs again on its own; one that raises alone finishes with
``finish_reason == "error"`` and the error's one-line description, its blocks freed, and the
others go on. A missing part of the assignment (``NotImplementedError``) is not a request's
fault: it propagates.

The engine runs on what a student has done (``vkv.assignment.progress``): it needs Phases 1–2,
and an option that runs a part still stubbed (a quantized cache: Phase 3; prefix caching:
Phase 4) is refused at construction with that part's one-line ``NotImplementedError``. Without
Phase 5's logger the engine runs without metrics and says so once on stderr.

This module is the loop; its pieces live beside it: ``intake.py`` (what a prompt must be),
``outputs.py`` (what a request gains each step: incremental detokenization, stop strings),
``parallel_sampling.py`` (``n > 1``), ``startup.py`` (device, pool size, metrics, the start-up
line) and ``parallel.py`` (tensor parallelism).
"""

import sys
import time
import weakref
from pathlib import Path

import torch

from vkv.config import WATERMARK, Config
from vkv.engine.block_manager import AllocStatus
from vkv.engine.cache_engine import (
    CacheEngine,
    CacheShape,
    blocks_ever_used,
    size_device_pool,
)
from vkv.engine.decode_graphs import graph_plan
from vkv.engine.intake import check_prompt
from vkv.engine.model_runner import ModelRunner, TokenLogprobs
from vkv.engine.outputs import Detokenizer, OutputProcessor, RequestOutput
from vkv.engine.parallel import (
    ShardSpec,
    TensorParallel,
    WorkerError,
    check_tensor_parallel,
    shard_model,
)
from vkv.engine.parallel_sampling import forks_due
from vkv.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from vkv.engine.sequence import Sequence, SequenceStatus
from vkv.engine.startup import (
    chosen_backend,
    default_device,
    engine_metrics,
    kv_budget,
    metrics_logger,
    model_label,
    pool_note,
    startup_line,
)
from vkv.kernels.backends import attention_kernels
from vkv.models.loader import load_checkpoint, model_dtype, weights_note
from vkv.recording import Recorder, RecordTo, sinks_for
from vkv.sampling_params import SamplingParams
from vkv.threads import usable_cpus

FAILED_TOKEN = -1  # what a failed sequence "sampled": never appended


class LLMEngine:
    """The serving loop over one model (``model=None``: the built-in vkv-tiny).

    The device KV cache holds ``num_gpu_blocks`` blocks if given, else as many as fit in
    ``kv_cache_bytes``, else in ``gpu_memory_fraction`` of the free memory on CUDA (256 MiB on a
    CPU); its size is printed to stderr. ``num_cpu_blocks`` is the swap pool. Attention runs on
    the Triton kernels on CUDA and on the PyTorch reference on a CPU unless ``backend`` says
    otherwise (on a CPU, decode attention reads the paged cache in place: ``cpu_attention``);
    the scheduler's options are ``Config``'s. ``record`` receives a recording of every step's
    KV-cache state (``vkv.recording``): a file's path (``vkv view`` replays it), a
    ``LiveRecording`` (the live page), or a list of both. ``tensor_parallel_size`` N > 1 splits
    the model's heads and the KV cache over N processes (``parallel.py``): the budget and the
    block count are per rank, and ``close()`` (or ``with``) stops the other processes. On CUDA
    with Triton, decode steps replay CUDA graphs captured at start (``decode_graphs.py``) unless
    ``enforce_eager``.

    A pool sized from memory holds no more blocks than the engine can ever use
    (``cache_engine.blocks_ever_used``: ``max_num_seqs`` sequences of ``max_model_len``
    tokens); the start-up line says when that bound, not the memory, set its size. ``dtype``
    is the weights' and the cache's (``auto``: fp16 on CUDA, fp32 on a CPU; or float32,
    float16, bfloat16); ``load_format="dummy"`` gives the model random weights of the shape in
    ``model``'s ``config.json`` (``loader.load_checkpoint``).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        gpu_memory_fraction: float = 0.9,
        num_gpu_blocks: int | None = None,
        num_cpu_blocks: int = 0,
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = False,
        enable_prefix_caching: bool = False,
        preemption_mode: str = "auto",
        kv_cache_dtype: str = "auto",
        key_granularity: str = "per_token",
        kv_quant_group: str = "head",
        backend: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        load_format: str = "auto",
        record: RecordTo | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
    ) -> None:
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}")
        self.device = torch.device(device) if device else default_device()
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device}: torch sees no CUDA GPU on this machine")
        if self.device.type == "cpu":  # no more threads than this process has CPUs
            torch.set_num_threads(min(torch.get_num_threads(), usable_cpus()))
        self.model_dtype = model_dtype(self.device, dtype)
        backend = chosen_backend(backend, self.device, kv_cache_dtype, enable_prefix_caching)
        kernels, attention = attention_kernels(backend, self.device)
        self.model, self.tokenizer, eos = load_checkpoint(
            model, self.model_dtype, self.device, load_format
        )
        c = self.model.config
        check_tensor_parallel(c, tensor_parallel_size)  # before any process starts
        shape = CacheShape(
            c.num_layers,
            block_size,
            c.num_kv_heads // tensor_parallel_size,  # a rank's slice of every block
            c.head_dim,
            self.model_dtype,
            kv_cache_dtype,
            key_granularity,
            kv_quant_group,
        )
        residual_slots = 2 * max_num_seqs  # keys per channel: see key_residual.py
        pool = None
        if num_gpu_blocks is None:
            budget = kv_budget(self.device, kv_cache_bytes, gpu_memory_fraction)
            bound = blocks_ever_used(
                max_num_seqs, max_model_len, block_size, WATERMARK, enable_prefix_caching
            )
            pool = size_device_pool(shape, budget, residual_slots, bound)
            num_gpu_blocks = pool.blocks
        self.config = Config(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode,
            eos_token_id=eos,
            kv_cache_dtype=kv_cache_dtype,
            key_granularity=key_granularity,
            kv_quant_group=kv_quant_group,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.scheduler = Scheduler(self.config)
        self.cache_engine = CacheEngine(
            shape, self.config.num_gpu_blocks, num_cpu_blocks, self.device, residual_slots
        )
        self.parallel: TensorParallel | None = None  # started last (see below)
        if tensor_parallel_size > 1:
            attention += f", tensor parallel over {tensor_parallel_size} processes"
        self.runner = ModelRunner(
            self.model, self.cache_engine, self.scheduler.block_manager, kernels
        )
        notes = pool_note(pool, self.config) + weights_note(model, load_format)
        print(startup_line(self.config, shape, self.device, attention, notes), file=sys.stderr)
        self._requests: dict[int, Sequence] = {}  # sequence id -> sequence, samples included
        self._samples: dict[int, list[Sequence]] = {}  # request id -> its samples, by index
        self.outputs = OutputProcessor(Detokenizer(self.tokenizer))
        self._more_tokens: dict[int, list[int]] = {}  # this step's other samples' first tokens
        self._step_logprobs: dict[int, TokenLogprobs] = {}  # this step's tokens' logprobs
        self._more_logprobs: dict[int, list[TokenLogprobs]] = {}  # and its other samples'
        self._next_id = 0
        self.stats: dict[str, float] = {}
        self.metrics = engine_metrics(model_label(model), self.config, shape)
        self.stat_logger = metrics_logger(self.metrics)
        self.recorder = Recorder(self, *sinks_for(record)) if record else None
        graphs = graph_plan(self.device, backend, shape, enforce_eager, self.config)
        if tensor_parallel_size > 1:  # last: nothing after it can fail and leave workers behind
            spec = ShardSpec(
                None if model is None else str(model), load_format, backend, self.device.type,
                shape, self.config.num_gpu_blocks, num_cpu_blocks, residual_slots, graphs,
            )  # fmt: skip
            self.parallel = TensorParallel.start(tensor_parallel_size, spec, c.vocab_size)
            shard_model(self.model, 0, tensor_parallel_size, self.parallel.all_reduce)
            self.runner.parallel = self.parallel
            weakref.finalize(self, self.parallel.close)  # dropped without close(): stops too
        if graphs is not None:  # every rank captures its own (the all-reduces inside pair up)
            captured = self.runner.use_decode_graphs(*graphs, capture=self.device.type == "cuda")
            print(f"vkv: {captured.describe()}", file=sys.stderr)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt (text, or token ids); return its request id.

        Raises ``ValueError`` and queues nothing for a prompt ``check_request`` refuses.
        """
        token_ids, params = self.check_request(prompt, params)
        request_id = self._next_id
        seq = Sequence(request_id, token_ids, self.config.block_size, params, time.monotonic())
        self.scheduler.add(seq)
        self._track(seq, request_id)
        return request_id

    def _track(self, seq: Sequence, request_id: int) -> None:
        """Record a new sequence as the next sample of its request."""
        samples = self._samples.setdefault(request_id, [])
        self.outputs.track(seq, request_id, len(samples))
        samples.append(seq)
        self._requests[seq.seq_id] = seq
        self._next_id = max(self._next_id, seq.seq_id + 1)

    def _fork_samples(self, parent: Sequence, params: list[SamplingParams], firsts: list[int]):
        """The other samples of a request whose prompt was computed: each starts with its own
        first token and shares the prompt's blocks (``Scheduler.fork``); one that is done with
        that token finishes at once, and if the first sample finished already, the others
        are new requests. Returns the new sequences."""
        children = []
        logprobs = self._more_logprobs.get(parent.seq_id, [])  # each child's first, if asked
        for i, (own, first) in enumerate(zip(params, firsts, strict=True)):
            child = Sequence(
                self._next_id,
                parent.prompt_token_ids,
                self.config.block_size,
                own,
                parent.arrival_time,
            )
            child.append_token(first)
            self.outputs.logprobs[child.seq_id] = logprobs[i : i + 1]
            child.group_id = parent.group_id
            self._track(child, parent.seq_id)
            status = self.scheduler._stop_status(child, first)
            if status is not None:
                child.status = status
            elif parent.is_finished:
                self.scheduler.add(child)
            else:
                self.scheduler.fork(parent, child)
            children.append(child)
        return children

    def check_request(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and its params, as ``add_request`` would queue them.

        Raises ``ValueError`` for params that are not a ``SamplingParams``, text that is not
        valid UTF-8, a prompt that is neither text nor a list of integer token ids (``True``
        and ``65.7`` are not token ids), an empty prompt, one longer than ``max_model_len``, or
        an id outside the vocabulary (in the prompt or in ``params.logit_bias``).
        Queues nothing: ``LLM.generate`` checks a whole batch before adding any of it. Other
        threads run while the text is tokenized (a server tokenizes off the engine's thread).
        """
        c = self.config
        return check_prompt(
            prompt, params, self.tokenizer, self.model.config.vocab_size, c.max_model_len,
            c.max_num_seqs,
        )  # fmt: skip

    def never_fits(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this many tokens could never be admitted (``BlockManager``'s NEVER:
        its blocks leave no watermark free even in an empty GPU pool), or None. A server
        refuses such a request up front, as vLLM does; ``LLM.generate`` lets the scheduler
        finish it as ``ignored``."""
        manager = self.scheduler.block_manager
        need = -(-num_prompt_tokens // self.config.block_size)
        if manager._fit_status(need) is not AllocStatus.NEVER:
            return None
        return (
            f"its {num_prompt_tokens} prompt tokens need {need} blocks; the GPU pool has "
            f"{manager.num_gpu_blocks} with a watermark of {manager.watermark_blocks}"
        )

    def sequence(self, request_id: int) -> Sequence:
        """The request's (first) sequence: tokens, status and block table, as the scheduler
        sees them."""
        return self._requests[request_id]

    def shared_blocks(self) -> int:
        """Block-table entries of the running sequences served by a block another entry holds:
        the blocks sharing saves now (computed on demand: it walks every table)."""
        held = [block_id for seq in self.scheduler.running for block_id in seq.block_table]
        return len(held) - len(set(held))

    def samples(self, request_id: int) -> list[Sequence]:
        """The sequences of a request's samples so far, by index (n > 1: the others are forked
        once the prompt is computed)."""
        return list(self._samples[request_id])

    def forget(self, request_id: int) -> None:
        """Drop what the engine keeps of a finished request: its samples' sequences, text,
        logprobs and errors. Until then ``sequence`` and ``samples`` answer for it, finished or
        not; a long-running caller (``vkv serve``, ``LLM.generate``) forgets each request once
        its outputs are delivered, so that the engine holds only the requests in flight
        (``num_held_requests``). ``ValueError`` for an unknown request or one with an
        unfinished sample (abort it first)."""
        samples = self._samples.get(request_id)
        if samples is None:
            raise ValueError(f"forget: no request has id {request_id}")
        if not all(seq.is_finished for seq in samples):
            raise ValueError(f"forget: request {request_id} has unfinished samples; abort it first")
        del self._samples[request_id]
        for seq in samples:
            del self._requests[seq.seq_id]
            self.outputs.forget(seq.seq_id)

    @property
    def num_held_requests(self) -> int:
        """Requests the engine keeps records of: those in flight, and finished ones until
        ``forget``."""
        return len(self._samples)

    def abort(self, request_id: int) -> None:
        """Abort every unfinished sample of a request (its blocks freed; ``stats`` and the
        gauges refreshed at once); ``ValueError`` if it has none."""
        unfinished = [seq for seq in self._samples.get(request_id, []) if not seq.is_finished]
        if not unfinished:
            raise ValueError(f"abort: no unfinished sequence has id {request_id}")
        now = time.monotonic()
        for seq in unfinished:
            self.scheduler.abort(seq.seq_id)
            if self.stat_logger is not None:
                self.stat_logger.record_finished(seq, "abort", now)
        self._refresh_state(now)

    def _refresh_state(self, now: float) -> None:
        """``stats`` and the metrics' gauges as the engine is now, between steps (an abort
        frees blocks and empties queues when no step may follow). The gauges are set through
        ``StatLogger.record_step`` with an empty ``SchedulerOutput``: no step ran, so its
        event counters add nothing."""
        self.stats.update(self._state())
        if self.stat_logger is not None:
            self.stat_logger.record_step(SchedulerOutput(), self.scheduler, now)

    def _state(self) -> dict[str, float]:
        """The engine's state in ``stats``: its queues, the KV usage of each pool, and the
        preemptions and prefix-cache lookups so far."""
        manager = self.scheduler.block_manager
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped),
            "gpu_kv_usage": manager.gpu_usage,
            "cpu_kv_usage": manager.cpu_usage,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": manager.num_query_tokens,
            "prefix_cache_hits": manager.num_hit_tokens,
        }

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (safe to call twice; nothing to do with
        one process). The engine can run no step after it. An engine dropped without it stops
        its workers when it is collected, or when the interpreter exits."""
        if self.parallel is not None:
            self.parallel.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def step(self) -> list[RequestOutput]:
        """One scheduler step; what each request it touched gained (a final-only request:
        nothing until the step it finishes in, then everything).

        ``stats`` then holds the queues (running, waiting, swapped), the KV usage of each pool,
        the preemptions so far, the blocks this step swapped out and in and copied on write,
        the prompt tokens queried in the prefix cache and hit so far (first admissions only; 0
        without prefix caching), its batched tokens and tokens per second, and its wall time
        with the model's part of it (step_seconds, model_seconds). An ``abort`` refreshes the
        state in ``stats`` (queues, usage, totals) and the metrics' gauges at once, so both
        describe the engine as it is even when no step follows; the step's own figures stay.
        """
        started = time.perf_counter()
        out = self.scheduler.schedule()
        self.runner.apply_block_maps(out, self.scheduler.running, self.scheduler.swapped)
        forks, self._more_tokens = forks_due(out.scheduled, self._samples), {}
        self._step_logprobs, self._more_logprobs = {}, {}
        self.scheduler.postprocess(out.scheduled, self._execute(out.scheduled, forks))
        self._keep_logprobs(out.scheduled)
        touched = [item.seq for item in out.scheduled] + [i.seq for i in out.ignored]
        for seq_id, firsts in self._more_tokens.items():  # n > 1: the other samples begin
            parent = self._requests[seq_id]
            if parent.num_completion_tokens == 1:
                touched += self._fork_samples(parent, forks[seq_id], firsts)
        reported = [(seq, self._output(seq)) for seq in touched]
        outputs = [output for _, output in reported if output is not None]
        self._record(out, reported)
        if self.recorder is not None:
            self.recorder.record(self, out)
        elapsed = time.perf_counter() - started
        self.stats = {
            **self._state(),
            "blocks_swapped_out": len(out.blocks_to_swap_out),
            "blocks_swapped_in": len(out.blocks_to_swap_in),
            "blocks_copied": sum(map(len, out.blocks_to_copy.values())),
            "batched_tokens": out.num_batched_tokens,
            "tokens_per_s": out.num_batched_tokens / elapsed if elapsed else 0.0,
            "step_seconds": elapsed,
            "model_seconds": self.runner.model_seconds,
        }
        return outputs

    def _record(
        self, out: SchedulerOutput, reported: list[tuple[Sequence, RequestOutput | None]]
    ) -> None:
        """The step in the metrics (``StatLogger``): the state and events, the tokens gained by
        the sequences it touched (each with its output, None for a running final-only one), the
        sequences finished; nothing without a logger (Phase 5 not done)."""
        if self.stat_logger is None:
            return
        now = time.monotonic()
        self.stat_logger.record_step(out, self.scheduler, now)
        gained = [seq for seq, _ in reported if self.outputs.took_tokens(seq)]
        self.stat_logger.record_tokens(gained, now)
        for seq, output in reported:
            if output is not None and output.finished:
                self.stat_logger.record_finished(seq, output.finish_reason, now)

    def _execute(
        self,
        scheduled: list[ScheduledSequence],
        forks: dict[int, list[SamplingParams]] | None = None,
    ) -> list[int]:
        """The batch's sampled tokens; when it raises, each sequence runs again on its own.

        A sequence that raises alone fails (``_fail``); its token is a placeholder that
        ``postprocess`` skips, since the sequence is finished by then.
        """
        try:
            tokens = self.runner.execute(scheduled, forks)
            self._more_tokens.update(self.runner.more_tokens)
            self._step_logprobs.update(self.runner.logprobs)
            self._more_logprobs.update(self.runner.more_logprobs)
            return tokens
        except (NotImplementedError, WorkerError):
            raise  # a missing part, or a tensor-parallel worker lost: not a request's fault
        except Exception as error:
            if len(scheduled) > 1:
                return [token for item in scheduled for token in self._execute([item], forks)]
            self._fail(scheduled[0].seq, error)
            return [FAILED_TOKEN]

    def _keep_logprobs(self, scheduled: list[ScheduledSequence]) -> None:
        """Keep the logprobs of each token the step appended (``params.logprobs`` set): one
        entry per completion token (a prefill chunk that stopped short appended none)."""
        for item in scheduled:
            entry = self._step_logprobs.get(item.seq.seq_id)
            if entry is not None:
                self.outputs.keep_logprobs(item.seq, entry)

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        """Finish a request the model could not run: its blocks freed, the error kept."""
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        self.outputs.errors[seq.seq_id] = reason
        self.scheduler.abort(seq.seq_id)
        print(f"vkv: request {seq.seq_id} failed: {reason}", file=sys.stderr)

    def _output(self, seq: Sequence) -> RequestOutput | None:
        """What the sequence gained since its last output (``OutputProcessor``); None while a
        final-only request runs (``SamplingParams.output_kind``). A stop string in its text
        finishes it here, as FINISHED_STOPPED, before another step can run it."""
        params = seq.sampling_params
        final_only = params.output_kind == "final_only"
        if final_only and not params.stop and not seq.is_finished:
            return None  # no text to check: nothing to copy or decode until it ends
        completion = seq.completion_token_ids
        if self.outputs.reaches_stop(seq, completion):
            self._finish_stopped(seq)
        if final_only and not seq.is_finished:
            return None
        return self.outputs.output(seq, completion)

    def _finish_stopped(self, seq: Sequence) -> None:
        """Finish a sequence whose text reached a stop string as FINISHED_STOPPED (vLLM's
        ``finish_reason`` "stop"), its blocks freed; it may have finished in this step
        already (at ``max_tokens``, say): the stop string is the reason then."""
        if not seq.is_finished:
            self.scheduler.abort(seq.seq_id)  # out of its queue, its blocks freed
        seq.status = SequenceStatus.FINISHED_STOPPED

    def decode(self, token_ids: list[int]) -> str:
        return self.outputs.detokenizer.decode(token_ids)
