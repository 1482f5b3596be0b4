"""Tensor parallelism: the model's heads split over N processes, the KV cache sharded by heads
under one scheduler (``LLMEngine(tensor_parallel_size=N)``).

**Layout.** Rank 0 is the engine's own process: the scheduler, the block manager, the tokenizer,
sampling, and its shard of the model and of the KV cache. Ranks 1 to N-1 are worker processes
that rank 0 starts; each holds its shard of the model and a ``CacheEngine`` over its KV heads'
slice of every block, with as many blocks as rank 0's. A block id therefore means the same
tokens on every rank, and the one block table rank 0 keeps addresses every rank's cache: the
scheduler decides once (allocate, swap, copy on write, evict) and every rank applies it.

**What is sent per step**, by ``torch.distributed`` (rank 0 broadcasts a pickled message):

- ``("maps", (swap_out, swap_in, copy, partial_gpu, partial_cpu))``, when the step moves blocks
  (or keys per channel keep partial blocks in a residual): every rank moves its slice;
- ``("batch", StepBatch)``, for every model run: the token ids, positions and slots (flat),
  the block tables and lengths; every rank runs the same forward over its heads. Inside it,
  each layer sums the partial outputs of ``o_proj`` and ``down_proj`` over the ranks (one
  all-reduce each), and the last tokens' logits, one slice of the vocabulary per rank, are
  gathered on rank 0, which samples;
- ``None``: stop.

**Sharding** (Megatron-LM's): q/k/v and gate/up are column-parallel (a rank keeps the rows of
its heads and of its intermediate channels), o_proj and down_proj row-parallel (it keeps the
matching columns; the partial sums are all-reduced), lm_head vocabulary-parallel (its rows,
padded to equal slices); the embedding is replicated. Heads and KV heads must divide by N (a
rank keeps whole GQA groups), and so must the intermediate size. With
``kv_quant_group="token"`` a per-token scale covers the rank's KV heads, not all of them.

**Backends**: gloo on a CPU, NCCL on CUDA (rank r on ``cuda:LOCAL_RANK``, else ``cuda:r``); the
messages go through a gloo group in both. Rendezvous is ``env://`` (``MASTER_ADDR``,
``MASTER_PORT``: rank 0 takes a free port on 127.0.0.1 unless they are set). Rank 0 starts
the workers itself, or, when a launcher started every rank (``RANK`` and ``WORLD_SIZE`` set:
``torchrun --nproc-per-node 2 --no-python vkv generate ... --tensor-parallel-size 2``), the
``vkv`` command runs ``run_worker`` on the other ranks; the first message gives each worker
its ``ShardSpec``.

**Failures**: a worker that dies is noticed before the group forms (rank 0 waits for each to be
ready, watching it), before the next message (its process has ended) or inside a collective
(gloo reports the closed connection): rank 0 raises ``WorkerError``, ends the other workers and
leaves no process behind. A worker whose step raises prints the error and exits, which rank 0
then notices; a step that raises on rank 0 cannot be retried alone, as one process retries it
(the workers are inside the same forward): it ends the run with ``WorkerError`` too. A
quantized cache's refusal of a NaN on rank 0 is read after the step, all collectives done, so
rank 0 retries each sequence alone, as one process does. A worker
whose rank 0 dies exits at the closed connection. One engine with tensor parallelism per
process at a time (torch.distributed has one default group).
"""

import contextlib
import math
import multiprocessing
import os
import queue
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from vkv.engine.cache_engine import CacheEngine, CacheShape
from vkv.kernels.backends import attention_kernels
from vkv.models.loader import load_checkpoint
from vkv.models.qwen3 import AllReduce, CausalLM, MergedLinear, ModelConfig
from vkv.net import free_port
from vkv.threads import usable_cpus

WORKER_JOIN_SECONDS = 5.0
GROUP_TIMEOUT = timedelta(days=30)  # an idle worker waits this long for rank 0's next message
POLL_SECONDS = 0.2
RENDEZVOUS_GIVEN = "MASTER_PORT" in os.environ  # set by the user or a launcher: kept
T = TypeVar("T")


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed: the engine cannot go on."""


@dataclass(frozen=True)
class ShardSpec:
    """What a worker needs to build its shard: the checkpoint and how to load it, the
    attention backend, the device type, its cache's shape (this rank's KV heads; its dtype is
    the model's) and pool sizes."""

    model: str | None
    load_format: str
    backend: str
    device_type: str
    shape: CacheShape
    num_gpu_blocks: int
    num_cpu_blocks: int
    residual_slots: int
    decode_graphs: tuple[list[int], int] | None = None  # rank 0's sizes and table width


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """``ValueError`` unless ``size`` ranks can split the model evenly (before any process
    starts)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    for name, count in (
        ("attention heads", config.num_heads),
        ("KV heads", config.num_kv_heads),
        ("intermediate size", config.intermediate_size),
    ):
        if count % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {count} {name}: "
                "every rank needs an equal share"
            )


def shard_model(model: CausalLM, rank: int, size: int, all_reduce: AllReduce) -> None:
    """Keep rank ``rank``'s share of ``model``'s weights, in place (the module docstring's
    sharding); ``all_reduce`` sums a tensor over the ranks, in place."""
    c = model.config
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        _keep_rows(attention.qkv_proj, rank, size)
        _keep_columns(attention.o_proj, rank, size)
        attention.num_heads, attention.num_kv_heads = c.num_heads // size, c.num_kv_heads // size
        attention.all_reduce = all_reduce
        _keep_rows(mlp.gate_up_proj, rank, size)
        _keep_columns(mlp.down_proj, rank, size)
        mlp.all_reduce = all_reduce
    per_rank = math.ceil(c.vocab_size / size)
    rows = model.lm_head.weight.detach()[rank * per_rank : (rank + 1) * per_rank]
    padded = torch.zeros(per_rank, c.hidden_size, dtype=rows.dtype, device=rows.device)
    padded[: len(rows)] = rows
    model.lm_head.weight = torch.nn.Parameter(padded, requires_grad=False)  # untied: a slice


def _keep_rows(linear: MergedLinear, rank: int, size: int) -> None:
    """The rank's share of the rows of each linear that ``linear`` merges (its q heads, its
    k heads, its v heads; its gate channels, its up channels), merged again."""

    def kept(tensor: torch.Tensor) -> torch.nn.Parameter:
        parts = tensor.detach().split(linear.parts)
        shares = [part[rank * len(part) // size : (rank + 1) * len(part) // size] for part in parts]
        return torch.nn.Parameter(torch.cat(shares), requires_grad=False)

    linear.weight = kept(linear.weight)
    if linear.bias is not None:
        linear.bias = kept(linear.bias)
    linear.parts = tuple(part // size for part in linear.parts)
    linear.out_features = sum(linear.parts)


def _keep_columns(linear: torch.nn.Linear, rank: int, size: int) -> None:
    share = linear.in_features // size
    kept = linear.weight.detach()[:, rank * share : (rank + 1) * share].clone()
    linear.weight = torch.nn.Parameter(kept, requires_grad=False)
    linear.in_features = share


class TensorParallel:
    """One rank's side of the process group. On rank 0 (``start``): the workers' processes and
    the messages; on a worker: ``receive``. Both: ``all_reduce`` and ``gather_vocabulary``."""

    def __init__(self, rank: int, size: int, vocab_size: int = 0) -> None:
        self.rank, self.size, self.vocab_size = rank, size, vocab_size
        self.processes: list[multiprocessing.Process] = []
        self.messages: dist.ProcessGroup | None = None
        self.closed = False
        self.threads = torch.get_num_threads()  # rank 0's, given back by close()

    @classmethod
    def start(cls, size: int, spec: ShardSpec, vocab_size: int) -> "TensorParallel":
        """Rank 0: start ranks 1 to ``size - 1`` (unless a launcher such as torchrun started
        every rank), join the group and send them ``spec``."""
        if dist.is_initialized():
            raise ValueError(
                "this process already holds a torch.distributed group (another engine with "
                "tensor parallelism?): close that engine first"
            )
        launch = launched()
        if launch is not None and launch != (0, size):
            rank, world = launch
            raise ValueError(
                f"launched as rank {rank} of {world}: tensor_parallel_size {size} needs "
                f"{size} ranks, and the engine runs on rank 0 (the others run run_worker)"
            )
        if launch is None and not RENDEZVOUS_GIVEN:  # a fresh port for every group formed
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        group = cls(0, size, vocab_size)
        if spec.device_type == "cpu":
            use_cpu_share(size)
        context = multiprocessing.get_context("spawn")
        ready = context.Queue()  # each spawned worker's rank, once it is about to join
        for rank in range(1, size if launch is None else 1):
            process = context.Process(
                target=run_worker,
                args=(rank, size, spec.device_type, dict(os.environ), ready),
                name=f"vkv-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            group.processes.append(process)
        try:
            group.wait_until_ready(ready)
            group.join(spec.device_type)
            group.send(spec)
        except WorkerError:
            raise
        except Exception as error:
            group.close(stop_message=False)
            raise WorkerError(f"the tensor-parallel group did not form: {error}") from error
        return group

    def wait_until_ready(self, ready: "multiprocessing.Queue") -> None:
        """Rank 0: wait until every spawned worker is about to join the group, watching them:
        one that ends first (an import error, a bad environment, a device it cannot use)
        fails the start at once, instead of leaving rank 0 in the rendezvous."""
        waiting = len(self.processes)
        while waiting:
            try:
                ready.get(timeout=POLL_SECONDS)
                waiting -= 1
            except queue.Empty:
                self._check_workers()  # a dead worker: stops the others and raises

    def join(self, device_type: str) -> None:
        """Join the process group (every rank) and make the gloo group for the messages."""
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method="env://", rank=self.rank, world_size=self.size,
            timeout=GROUP_TIMEOUT,
        )  # fmt: skip
        self.messages = dist.group.WORLD
        if backend == "nccl":  # the messages are pickled bytes: a CPU group carries them
            self.messages = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)

    def send(self, message: object) -> None:
        """Rank 0: broadcast ``message`` to the workers."""
        self._check_workers()
        self._collective(lambda: dist.broadcast_object_list([message], 0, group=self.messages))

    def run_step(self, forward: Callable[[], T], batch: tuple) -> T:
        """Rank 0: send ``batch`` and run this rank's ``forward`` of it. The workers are then
        inside the same forward, so a failure here cannot be retried alone (the ranks' next
        collectives would not match): it stops the workers and raises ``WorkerError``."""
        self.send(batch)
        try:
            return forward()
        except WorkerError:
            raise
        except Exception as error:
            self.close(stop_message=False)  # the workers wait inside the step: no message
            raise WorkerError(
                f"a step failed on rank 0 under tensor parallelism: {_first_line(error)}"
            ) from error

    def receive(self) -> object:
        """A worker: the next message of rank 0."""
        box = [None]
        dist.broadcast_object_list(box, 0, group=self.messages)
        return box[0]

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        self._collective(lambda: dist.all_reduce(tensor))

    def gather_vocabulary(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's slice of the vocabulary side by side, the padding cut off; a
        worker sends its slice and gets None."""
        logits = logits.contiguous()
        slices = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        self._collective(lambda: dist.gather(logits, slices, dst=0))
        if slices is None:
            return None
        return torch.cat(slices, dim=-1)[:, : self.vocab_size]

    def _collective(self, call) -> None:
        if self.rank != 0:
            call()  # a worker's failure ends the worker: rank 0 reports it
            return
        try:
            call()
        except RuntimeError as error:
            for process in self.processes:  # a killed worker's sockets close before it is reaped
                process.join(WORKER_JOIN_SECONDS)
            self._check_workers()  # names the worker that died
            self.close(stop_message=False)
            raise WorkerError(f"tensor parallelism failed: {_first_line(error)}") from error

    def _check_workers(self) -> None:
        if self.closed:
            raise WorkerError("the tensor-parallel workers were stopped")
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                self.close(stop_message=False)
                raise WorkerError(
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) died with exit "
                    f"code {process.exitcode}; the engine cannot go on"
                )

    def close(self, stop_message: bool = True) -> None:
        """Rank 0: stop the workers (the stop message, unless a failure left them inside a
        step; then terminate what is left), leave the group and take back its CPU threads.
        Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        formed = self.messages is not None  # else the group (if any) is not this one's
        if stop_message and formed and all(p.exitcode is None for p in self.processes):
            with contextlib.suppress(RuntimeError):  # a worker is gone: terminated below
                dist.broadcast_object_list([None], 0, group=self.messages)
        for process in self.processes:
            process.join(WORKER_JOIN_SECONDS)
            if process.exitcode is None:
                process.terminate()
                process.join(WORKER_JOIN_SECONDS)
            if process.exitcode is None:
                process.kill()
                process.join()
        if formed and dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.threads)


def launched() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` when a launcher (torchrun) started this process as one rank of
    several; None otherwise."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None or int(world) < 2:
        return None
    return int(rank), int(world)


def run_worker(
    rank: int,
    size: int,
    device_type: str | None = None,
    environment: dict | None = None,
    ready: "multiprocessing.Queue | None" = None,
) -> None:
    """Rank ``rank`` of ``size`` (not 0): join the group, take rank 0's ``ShardSpec``, build
    this rank's shard, then run rank 0's messages until None. Started by rank 0, or by a
    launcher on every rank (``device_type`` then: cuda where there is one; on CPUs set
    ``VKV_DEVICE=cpu`` on every rank)."""
    from vkv.engine.model_runner import ModelRunner  # the workers' runner: above this module

    os.environ.update(environment or {})
    device_type = (
        device_type
        or os.environ.get("VKV_DEVICE")
        or ("cuda" if torch.cuda.is_available() else "cpu")
    )
    try:
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device(f"cuda:{local}" if device_type == "cuda" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # Triton launches on the current device
        if device_type == "cpu":
            use_cpu_share(size)
        group = TensorParallel(rank, size)
        if ready is not None:
            ready.put(rank)
        group.join(device_type)
        spec = group.receive()
        if spec.device_type != device_type:
            raise ValueError(
                f"rank 0 runs on {spec.device_type} and rank {rank} on {device_type}: set "
                "VKV_DEVICE the same on every rank"
            )
        model, _, _ = load_checkpoint(spec.model, spec.shape.dtype, device, spec.load_format)
        shard_model(model, rank, size, group.all_reduce)
        cache = CacheEngine(
            spec.shape, spec.num_gpu_blocks, spec.num_cpu_blocks, device, spec.residual_slots
        )
        kernels, _ = attention_kernels(spec.backend, device)
        runner = ModelRunner(model, cache, None, kernels, group)
        if spec.decode_graphs is not None:  # captured where there are graphs: on CUDA
            runner.use_decode_graphs(*spec.decode_graphs, capture=device.type == "cuda")
        with torch.inference_mode():
            while (message := group.receive()) is not None:
                kind, payload = message
                if kind == "maps":
                    cache.apply(*payload)
                else:
                    runner.forward(payload)
                    if device.type == "cuda":  # no tokens to read here: the step's one wait
                        torch.cuda.synchronize(device)
                    cache.raise_if_refused()
    except Exception:
        traceback.print_exc()
        os._exit(1)  # no cleanup that could wait on the group: rank 0 sees the exit
    dist.destroy_process_group()


def use_cpu_share(size: int) -> None:
    """On a CPU, give each of the ``size`` ranks its share of the cores' threads."""
    torch.set_num_threads(max(1, usable_cpus() // size))


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
