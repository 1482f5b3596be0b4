"""Simulator: run the Scheduler without a model, with a cost model for the time of each step.

The stand-in model returns the same token for every sequence (never EOS), so each request runs
until its ``max_tokens``; a request's output length is therefore set by its SamplingParams. The
clock advances by ``CostModel.step_time`` of each step, and requests join the scheduler when
the clock passes their arrival time. What comes back is a per-step record of the batch and the
KV cache, enough to compare schedules and memory schemes without running a network.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vkv.config import Config
from vkv.engine.scheduler import Scheduler, SchedulerOutput
from vkv.engine.sequence import Sequence
from vkv.sampling_params import SamplingParams

STAND_IN_TOKEN = 7


@dataclass(slots=True, frozen=True)
class Request:
    """A request of a workload: when it arrives and how long its prompt and output are."""

    arrival_time: float
    prompt_len: int
    output_len: int


@dataclass(slots=True, frozen=True)
class CostModel:
    """Step time = a fixed cost + a cost per computed token + a cost per cached token read.

    The defaults are of the order of a 13B model on one A100 (about 20 ms a decode step, a
    prefill throughput of about 10k tokens/s); only ratios between schedules matter.
    """

    step_s: float = 0.015
    per_token_s: float = 1.0e-4
    per_context_token_s: float = 2.0e-7

    def time(self, num_batched_tokens: int, num_context_tokens: int) -> float:
        """Seconds for a step computing that many tokens over that many cached ones."""
        return (
            self.step_s
            + self.per_token_s * num_batched_tokens
            + self.per_context_token_s * num_context_tokens
        )

    def step_time(self, out: SchedulerOutput) -> float:
        context = sum(item.seq.num_computed_tokens for item in out.scheduled)
        return self.time(out.num_batched_tokens, context)


@dataclass(slots=True, frozen=True)
class StepRecord:
    """One step: its kind, the batch, and the KV cache after scheduling."""

    time: float
    kind: str
    num_scheduled: int
    num_batched_tokens: int
    num_running: int
    kv_reserved_slots: int
    kv_live_tokens: int
    num_preempted: int


@dataclass(slots=True)
class SimulationResult:
    steps: list[StepRecord] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    ignored: list[Sequence] = field(default_factory=list)
    num_preemptions: int = 0
    elapsed: float = 0.0
    first_token_time: dict[int, float] = field(default_factory=dict)  # seq id -> clock

    @property
    def num_computed_tokens(self) -> int:
        """Tokens the steps computed: prompts (less prefix-cache hits), recomputations, decodes."""
        return sum(step.num_batched_tokens for step in self.steps)

    @property
    def num_generated_tokens(self) -> int:
        return sum(seq.num_completion_tokens for seq in self.finished)

    @property
    def throughput(self) -> float:
        """Generated tokens per simulated second."""
        return self.num_generated_tokens / self.elapsed if self.elapsed else 0.0

    @property
    def mean_running(self) -> float:
        """Requests holding KV blocks, averaged over busy steps (the batch the cache allows)."""
        busy = [step.num_running for step in self.steps if step.num_scheduled]
        return sum(busy) / len(busy) if busy else 0.0

    @property
    def kv_utilization(self) -> float:
        """Share of reserved KV slots that hold a live token, over all steps."""
        reserved = sum(step.kv_reserved_slots for step in self.steps)
        live = sum(step.kv_live_tokens for step in self.steps)
        return live / reserved if reserved else 0.0


def make_sequences(
    requests: Iterable[Request], block_size: int, prompts: list[list[int]] | None = None
) -> list[Sequence]:
    """One sequence per request, ``max_tokens`` = its output length: the prompt ``prompts[i]``
    if given, else distinct token ids (no two prompts share a prefix)."""
    return [
        Sequence(
            seq_id,
            (
                prompts[seq_id]
                if prompts is not None
                else [(seq_id + i) % 50_000 + 8 for i in range(request.prompt_len)]
            ),
            block_size,
            SamplingParams(max_tokens=request.output_len, ignore_eos=True),
            arrival_time=request.arrival_time,
        )
        for seq_id, request in enumerate(requests)
    ]


def simulate(
    config: Config,
    requests: list[Request],
    cost_model: CostModel | None = None,
    on_step: Callable[[Scheduler, SchedulerOutput], None] | None = None,
    max_steps: int | None = None,
    prompts: list[list[int]] | None = None,
) -> SimulationResult:
    """Serve ``requests`` (sorted by arrival) to the end; return what every step did.

    ``prompts`` gives each request's token ids (``make_sequences``), so that prompts can share
    prefixes (with ``config.enable_prefix_caching``).

    ``on_step`` is called after each step's postprocess (tests check invariants there).
    A step that runs nothing but changes the queues (only preempts, swaps in or ignores) is
    progress and counts as a step. Raises ``RuntimeError`` if a step does nothing at all with
    work left and no arrival to wait for, or if the run takes more than ``max_steps`` steps
    (default: 4 steps per token the requests hold, plus 1,000).
    """
    if max_steps is None:
        max_steps = 4 * sum(r.prompt_len + r.output_len for r in requests) + 1000
    cost_model = cost_model or CostModel()
    scheduler = Scheduler(config)
    pending = make_sequences(requests, config.block_size, prompts)
    result = SimulationResult()
    clock, next_arrival = 0.0, 0
    while next_arrival < len(pending) or not scheduler.is_finished():
        while next_arrival < len(pending) and pending[next_arrival].arrival_time <= clock:
            scheduler.add(pending[next_arrival])
            next_arrival += 1
        out = scheduler.schedule()
        result.ignored += [item.seq for item in out.ignored]
        moved = out.preempted or out.blocks_to_swap_in or out.ignored  # queues changed
        if not out.scheduled and not moved:
            if next_arrival == len(pending):
                if scheduler.is_finished():
                    break
                raise RuntimeError(
                    f"the scheduler made no progress with {scheduler.num_unfinished} "
                    "unfinished sequences and no arrivals left"
                )
            clock = max(clock, pending[next_arrival].arrival_time)
            continue
        if len(result.steps) == max_steps:
            raise RuntimeError(f"the simulation ran past {max_steps} steps without finishing")
        clock += cost_model.step_time(out)
        result.steps.append(_record(clock, scheduler, out))
        result.finished += scheduler.postprocess(
            out.scheduled, [STAND_IN_TOKEN] * len(out.scheduled)
        )
        for seq in out.seqs:
            if seq.num_completion_tokens == 1:
                result.first_token_time.setdefault(seq.seq_id, clock)
        if on_step is not None:
            on_step(scheduler, out)
    result.num_preemptions = scheduler.num_preemptions
    result.elapsed = clock
    return result


def _record(clock: float, scheduler: Scheduler, out: SchedulerOutput) -> StepRecord:
    manager = scheduler.block_manager
    used_blocks = manager.num_gpu_blocks - manager.num_free_gpu_blocks
    return StepRecord(
        time=clock,
        kind=out.kind,
        num_scheduled=len(out.scheduled),
        num_batched_tokens=out.num_batched_tokens,
        num_running=len(scheduler.running),
        kv_reserved_slots=used_blocks * manager.block_size,
        kv_live_tokens=sum(seq.num_tokens for seq in scheduler.running),
        num_preempted=len(out.preempted),
    )
