"""Hidden tests for Phase 2: instructor-only (left out of the student edition).

They check the rules of ``assignment/phase2.md`` as ``tests/test_phase2.py`` does, on workloads
drawn from the grade's seed: block sizes, pool sizes, budgets, prompt lengths, arrival times,
sampled tokens and the orders of aborts change from one grade to the next, so a table of the
visible tests' answers cannot pass them. Every test gets its ``rng`` from ``@seeded``
(``test_seed.py``: the seed is ``VKV_GRADE_SEED``, or a fresh one when it is unset, and every
failure names it). Expected plans come from small models of the handout's rules written here
(admission in order, decode and preemption of the newest, swap-in in arrival order), never from
the code under test. Like the visible tests, a part's tests stand in for the later parts it must
not depend on (``_preempt``, ``_preempt_by_swap``, ``_schedule_prefill_chunks``).
"""

import bisect
from collections import deque
from dataclasses import dataclass, field

import pytest
from scheduler_stand_ins import ids, small_scheduler, stand_in_preempt
from test_seed import seeded

from vkv.config import Config
from vkv.engine.block import Device
from vkv.engine.block_manager import BlockManager
from vkv.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput, SchedulingBudget
from vkv.engine.sequence import Sequence, SequenceStatus
from vkv.sampling_params import SamplingParams

VOCAB = 151_936
LENGTH = SequenceStatus.FINISHED_LENGTH_CAPPED
STOPPED = SequenceStatus.FINISHED_STOPPED
FINISHED = [q for q in SequenceStatus if q.name.startswith("FINISHED_")]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def planned(out: SchedulerOutput) -> list[tuple[int, int, bool]]:
    return [(item.seq.seq_id, item.num_tokens, item.is_prefill) for item in out.scheduled]


def new_seq(rng, s: Scheduler, seq_id: int, prompt_len: int, arrival: float, **params):
    """A sequence of random prompt tokens (not yet added)."""
    prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
    return Sequence(
        seq_id, prompt, s.config.block_size, SamplingParams(**params), arrival_time=arrival
    )


def by_arrival(seqs):
    return sorted(seqs, key=lambda seq: (seq.arrival_time, seq.group_id, seq.seq_id))


def a_token(rng, eos: int | None = None) -> int:
    token = rng.randrange(VOCAB)
    return token + 1 if token == eos else token


# --------------------------------------------------------------------------------------------
# Part 2.1: admission, budgets, abort
# --------------------------------------------------------------------------------------------


class CachedPrefixManager(BlockManager):
    """A BlockManager whose prefix cache holds a given number of each prompt's leading tokens
    (``cached``), counted computed when it allocates: what Phase 4 does, for part 2.1 alone."""

    cached: dict[int, int]

    def num_cached_tokens(self, seq: Sequence) -> int:
        return self.cached.get(seq.seq_id, 0)

    def allocate(self, seq: Sequence) -> None:
        super().allocate(seq)
        seq.num_computed_tokens = self.cached.get(seq.seq_id, 0)


@dataclass
class Admission:
    """A drawn admission pass: a fresh scheduler, its waiting prompts, and the expected result."""

    s: Scheduler
    seqs: list[Sequence]
    lengths: dict[int, int]
    free_before: int
    cached: dict[int, int]
    admitted: list[tuple[int, int, bool]] = field(default_factory=list)
    ignored: list[tuple[int, str | None]] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    free: int = 0

    def describe(self) -> str:
        c = self.s.config
        return (
            f"block_size {c.block_size}, a GPU pool of {c.num_gpu_blocks} with "
            f"{self.free_before} free, watermark {self.s.block_manager.watermark_blocks} blocks, "
            f"max_model_len {c.max_model_len}, max_num_seqs {c.max_num_seqs}, token budget "
            f"{c.token_budget}, chunked prefill {c.enable_chunked_prefill}; waiting (id, tokens"
            f", n): {[(q.seq_id, self.lengths[q.seq_id], q.sampling_params.n) for q in self.seqs]}"
            + (f", cached tokens {self.cached}" if self.cached else "")
        )


def draw_admission(
    rng, cached: bool = False, never: bool = False, chunked: bool | None = None
) -> Admission:
    """A random fresh scheduler, prompts added to it, and the handout's admission rule applied
    to them by hand. ``never``: one prompt (often the first) could never fit the pool."""
    bs = rng.randint(1, 8)
    gpu = rng.randint(3, 40)
    watermark = rng.choice([0.0, 0.0, 0.05, 0.1, 0.2])
    mml = rng.randint(bs, 10 * bs)
    roomy = gpu - int(watermark * gpu)  # the most blocks a prompt may have
    if never:
        mml = max(mml, bs * (roomy + 1))
    places = rng.randint(1, 8)
    chunked = rng.random() < 0.5 if chunked is None else chunked
    if chunked:
        budget = rng.randint(places, max(places, 2 * mml))
    else:
        budget = rng.randint(max(mml, places), 3 * mml + places)
    options = {
        "block_size": bs,
        "num_gpu_blocks": gpu,
        "watermark": watermark,
        "max_model_len": mml,
        "max_num_seqs": places,
        "enable_chunked_prefill": chunked,
        "max_num_batched_tokens": budget,
    }
    s = small_scheduler(**options)
    if cached:
        s.block_manager = CachedPrefixManager(bs, gpu, 0, watermark)
        s.block_manager.cached = {}
    filler = rng.randint(0, gpu // 2)
    if filler:  # blocks held outside the scheduler's queues
        s.block_manager.allocate(Sequence(10**6, [1] * (filler * bs), bs))
    count = rng.randint(1, 8)
    arrivals = rng.sample(range(1, 1000), count)
    lengths, seqs, hits = {}, [], {}
    hopeless = rng.choice([0, rng.randrange(count)]) if never else -1
    for k in range(count):
        seq_id = rng.randrange(10**5)
        while seq_id in lengths:
            seq_id += 1
        kind = rng.random()
        if kind < 0.12:
            n = mml + rng.randint(1, 5)
        elif kind < 0.2:
            n = mml
        else:
            n = rng.randint(1, mml)
        if k == hopeless:
            n = bs * roomy + rng.randint(1, bs)  # one block more than the pool can give
        lengths[seq_id] = n
        samples = 1 if rng.random() < 0.8 else rng.randint(2, 3)
        seq = new_seq(rng, s, seq_id, n, float(arrivals[k]), n=samples)
        if cached and n > bs:
            hits[seq_id] = bs * rng.randint(0, (n - 1) // bs)
        s.add(seq)
        seqs.append(seq)
    if cached:
        s.block_manager.cached = hits
    case = Admission(s, seqs, lengths, gpu - filler, hits)
    free, mark = gpu - filler, int(watermark * gpu)
    used, seats = 0, 0
    for index, seq in enumerate(seqs):
        n = lengths[seq.seq_id]
        if n > mml:
            case.ignored.append((seq.seq_id, None))
            continue
        need = ceil_div(n, bs)
        if gpu - need < mark:
            reason = f"needs {need} blocks; the GPU pool has {gpu} with a watermark of {mark}"
            case.ignored.append((seq.seq_id, reason))
            continue
        if free - need < mark:
            case.waiting = ids(seqs[index:])
            break
        tokens = n - hits.get(seq.seq_id, 0)
        if chunked:
            tokens = min(tokens, budget - used)
        samples = seq.sampling_params.n
        if tokens == 0 or used + tokens > budget or seats + samples > places:
            case.waiting = ids(seqs[index:])
            break
        case.admitted.append((seq.seq_id, tokens, True))
        free, used, seats = free - need, used + tokens, seats + samples
    case.free = free
    return case


@seeded
def test_part1_admission_takes_prompts_in_order_until_one_must_wait(rng):
    for _ in range(25):
        case = draw_admission(rng)
        out = case.s.schedule()
        assert planned(out) == case.admitted, (
            "admission takes the front of waiting while its blocks fit above the watermark "
            "(LATER stops it: no overtaking) and its tokens and places fit the budgets "
            f"(chunked: the last one cut to the tokens left). {case.describe()}: expected "
            f"(id, tokens, prefill) {case.admitted}, got {planned(out)}"
        )
        assert ids(case.s.waiting) == case.waiting, (
            f"the prompts from the first that must wait stay in waiting, in order: expected "
            f"{case.waiting}, got {ids(case.s.waiting)}. {case.describe()}"
        )
        assert case.s.block_manager.num_free_gpu_blocks == case.free, (
            f"each admitted prompt takes its blocks: {case.free} free expected, got "
            f"{case.s.block_manager.num_free_gpu_blocks}. {case.describe()}"
        )


@seeded
def test_part1_prompts_that_can_never_run_are_ignored_with_a_reason(rng):
    for k in range(25):
        case = draw_admission(rng, never=k % 2 == 0)
        out = case.s.schedule()
        got = [item.seq.seq_id for item in out.ignored]
        assert got == [seq_id for seq_id, _ in case.ignored], (
            "a prompt over max_model_len, or whose blocks could never fit the pool with the "
            f"watermark kept (NEVER), is ignored: expected {[i for i, _ in case.ignored]}, got "
            f"{got}. {case.describe()}"
        )
        for item, (seq_id, reason) in zip(out.ignored, case.ignored, strict=True):
            want = "max_model_len" if reason is None else reason
            assert want in item.reason, (
                f"sequence {seq_id}: the reason must contain {want!r}, got {item.reason!r}"
            )
            assert item.seq.status is SequenceStatus.FINISHED_IGNORED and not item.seq.block_table
        assert case.s.num_unfinished == len(case.seqs) - len(case.ignored), (
            "an ignored sequence is finished and in no queue"
        )


@seeded
def test_part1_admitted_prompts_run_in_arrival_order_with_their_blocks(rng):
    for _ in range(25):
        case = draw_admission(rng)
        case.s.schedule()
        admitted = [q for q in case.seqs if q.seq_id in {a for a, _, _ in case.admitted}]
        want = ids(by_arrival(admitted))
        assert ids(case.s.running) == want, (
            f"admitted sequences join running in arrival order (not the order of waiting): "
            f"arrivals {[(q.seq_id, q.arrival_time) for q in admitted]}, expected {want}, got "
            f"{ids(case.s.running)}"
        )
        bs = case.s.config.block_size
        for seq in admitted:
            blocks = ceil_div(case.lengths[seq.seq_id], bs)
            assert seq.status is SequenceStatus.RUNNING and len(seq.block_table) == blocks, (
                f"sequence {seq.seq_id} was admitted: RUNNING with {blocks} blocks, got "
                f"{seq.status.name} with {len(seq.block_table)}"
            )
        for seq in case.seqs:
            if seq.seq_id in case.waiting:
                assert seq.status is SequenceStatus.WAITING and seq.block_table == []


@seeded
def test_part1_admission_keeps_the_watermark_free(rng):
    for _ in range(10):
        bs, gpu = rng.randint(1, 8), rng.randint(20, 60)
        watermark = rng.choice([0.05, 0.1, 0.2, 0.3])
        mark = int(watermark * gpu)  # at least 1
        s = small_scheduler(
            block_size=bs, num_gpu_blocks=gpu, watermark=watermark, max_model_len=bs * gpu
        )
        need = rng.randint(1, gpu - mark)  # fits an empty pool with the watermark: not NEVER
        short = rng.choice([0, 1])
        free = need + mark - short  # exactly the watermark left after it, or one block less
        if gpu > free:  # blocks held outside the scheduler's queues
            s.block_manager.allocate(Sequence(10**6, [1] * ((gpu - free) * bs), bs))
        seq = new_seq(rng, s, 1, need * bs - rng.randrange(bs), 1.0)
        s.add(seq)
        out = s.schedule()
        want = [] if short else [(1, seq.num_prompt_tokens, True)]
        assert planned(out) == want and not out.ignored, (
            f"a prompt of {need} blocks, {free} free of {gpu}, a watermark of {mark}: "
            f"{free} - {need} {'<' if short else '>='} {mark}, so it is "
            f"{'LATER (it waits)' if short else 'OK (admitted)'}; got {planned(out)}"
        )


@seeded
def test_part1_a_cached_prefix_is_neither_computed_nor_charged(rng):
    for k in range(25):  # with chunked prefill the chunk is cut from the uncached tokens
        case = draw_admission(rng, cached=True, chunked=k % 3 > 0)
        out = case.s.schedule()
        assert planned(out) == case.admitted, (
            "a prompt whose first tokens a prefix cache holds (block_manager.num_cached_tokens) "
            "is a prefill of the others, and the budget is charged only those: "
            f"{case.describe()}: expected {case.admitted}, got {planned(out)}"
        )


@seeded
def test_part1_abort_finishes_a_sequence_in_any_queue_and_frees_its_blocks(rng):
    bs = rng.randint(1, 6)
    s = small_scheduler(block_size=bs, num_gpu_blocks=400, max_num_seqs=rng.randint(2, 5))
    seqs = [new_seq(rng, s, 3 * i + 1, rng.randint(1, 5 * bs), float(i)) for i in range(8)]
    for seq in seqs:
        s.add(seq)
    s.schedule()  # the first max_num_seqs run; the rest wait
    for seq in rng.sample(list(s.running), rng.randint(1, len(s.running))):
        s.running.remove(seq)  # put in swapped by hand (a real swap-out is part 2.4's)
        seq.status = SequenceStatus.SWAPPED
        s.swapped.append(seq)
    for seq in rng.sample(seqs, len(seqs)):
        queues = {"waiting": s.waiting, "running": s.running, "swapped": s.swapped}
        name = next(q for q, queue in queues.items() if seq in queue)
        others = {q: [x for x in queue if x is not seq] for q, queue in queues.items()}
        held = len(seq.block_table)
        free = s.block_manager.num_free_gpu_blocks
        assert s.abort(seq.seq_id) is seq, "abort(seq_id) returns the sequence it finished"
        assert seq.status is SequenceStatus.FINISHED_ABORTED and seq.block_table == [], (
            f"sequence {seq.seq_id}, in {name}: FINISHED_ABORTED with its blocks freed at once, "
            f"got {seq.status.name} with {seq.block_table}"
        )
        assert s.block_manager.num_free_gpu_blocks == free + held, (
            f"aborting sequence {seq.seq_id} ({name}) frees its {held} blocks"
        )
        now = {"waiting": list(s.waiting), "running": s.running, "swapped": s.swapped}
        assert now == others, (
            f"abort({seq.seq_id}) takes it out of {name} and leaves the other sequences where "
            f"they were, in order: expected {dict((q, ids(v)) for q, v in others.items())}, got "
            f"{dict((q, ids(v)) for q, v in now.items())}"
        )
    assert s.is_finished() and s.block_manager.num_free_gpu_blocks == 400


@seeded
def test_part1_a_refused_add_or_abort_says_why_and_changes_nothing(rng):
    bs = rng.randint(1, 8)
    s = small_scheduler(block_size=bs, max_num_seqs=2)
    first, second, third = (
        new_seq(rng, s, rng.randrange(10**4) * 3 + i, rng.randint(1, 3 * bs), float(i))
        for i in range(3)
    )
    for seq in (first, second, third):
        s.add(seq)
    s.schedule()  # first and second run, third waits

    def state():
        return ids(s.waiting), ids(s.running), s.block_manager.num_free_gpu_blocks

    before = state()
    for taken in (first, third):  # running, waiting
        with pytest.raises(ValueError, match=rf"^a sequence with id {taken.seq_id} is already "):
            s.add(Sequence(taken.seq_id, [1, 2], bs))
    used = Sequence(rng.randrange(10**5, 10**6), [5] * bs, bs)
    if rng.random() < 0.5:
        used.status = rng.choice([SequenceStatus.RUNNING, SequenceStatus.SWAPPED, *FINISHED])
    else:
        used.block_table = rng.sample(range(64), rng.randint(1, 3))
    with pytest.raises(
        ValueError,
        match=rf"^sequence {used.seq_id} is {used.status.name} with blocks .*: only a new "
        "WAITING sequence that holds no blocks can be added$",
    ):
        s.add(used)
    other = bs + rng.randint(1, 8)
    stranger = Sequence(rng.randrange(10**6, 10**7), [4, 5], other)
    with pytest.raises(
        ValueError,
        match=rf"^sequence {stranger.seq_id} has block size {other}, the scheduler {bs}$",
    ):
        s.add(stranger)
    unknown = rng.randrange(10**7, 10**8)
    with pytest.raises(ValueError, match=rf"^abort: no unfinished sequence has id {unknown}$"):
        s.abort(unknown)
    assert state() == before, (
        f"a refused add or abort changes nothing: (waiting, running, free blocks) expected "
        f"{before}, got {state()}"
    )
    s.abort(second.seq_id)
    before = state()
    with pytest.raises(
        ValueError, match=rf"^abort: no unfinished sequence has id {second.seq_id}$"
    ):
        s.abort(second.seq_id)  # finished already
    assert state() == before, "aborting a finished sequence again changes nothing"


# --------------------------------------------------------------------------------------------
# Part 2.2: decode, postprocess, continuous batching
# --------------------------------------------------------------------------------------------


@dataclass
class Req:
    """The model's record of one request."""

    seq_id: int
    arrival: float
    tokens: int  # how many the sequence has
    max_tokens: int
    ignore_eos: bool
    computed: int = 0
    generated: int = 0
    status: SequenceStatus = SequenceStatus.WAITING


class PlainModel:
    """The handout's step without chunked prefill, for a pool that never runs out: admit the
    front of waiting while the budgets allow (a prefill step), else decode every running
    sequence; postprocess appends, then stops at EOS, at max_tokens, or past max_model_len."""

    def __init__(self, config: Config, reqs: list[Req]) -> None:
        self.c = config
        self.by_id = {r.seq_id: r for r in reqs}
        self.waiting = deque(reqs)
        self.running: list[Req] = []
        self.plan: list[tuple[int, int, bool]] = []

    def schedule(self) -> list[tuple[int, int, bool]]:
        plan, used = [], 0
        while self.waiting:
            r = self.waiting[0]
            if r.tokens > self.c.max_model_len:
                self.waiting.popleft()
                r.status = SequenceStatus.FINISHED_IGNORED
                continue
            if used + r.tokens > self.c.token_budget or len(self.running) >= self.c.max_num_seqs:
                break
            self.waiting.popleft()
            bisect.insort(self.running, r, key=lambda q: (q.arrival, q.seq_id))
            r.status = SequenceStatus.RUNNING
            plan.append((r.seq_id, r.tokens, True))
            used += r.tokens
        if not plan:
            plan = [(r.seq_id, 1, False) for r in self.running]
        self.plan = plan
        return plan

    def postprocess(self, tokens: list[int]) -> list[int]:
        by_id = {r.seq_id: r for r in self.running}
        finished = []
        for (seq_id, n, _), token in zip(self.plan, tokens, strict=True):
            r = by_id[seq_id]
            r.computed += n
            if r.computed < r.tokens:
                continue
            r.tokens += 1
            r.generated += 1
            if token == self.c.eos_token_id and not r.ignore_eos:
                r.status = STOPPED
            elif r.generated >= r.max_tokens or r.tokens > self.c.max_model_len:
                r.status = LENGTH
            else:
                continue
            finished.append(seq_id)
        self.running = [r for r in self.running if r.status is SequenceStatus.RUNNING]
        return finished

    def used_blocks(self) -> int:
        return sum(ceil_div(r.computed, self.c.block_size) for r in self.running)


@dataclass
class Trace:
    steps: list[dict] = field(default_factory=list)
    problem: str | None = None


def plain_workload(rng, tight: bool, short: bool = False):
    """A scheduler with a pool that never runs out, its requests added, and the model.
    ``short``: prompts near max_model_len and outputs of 1 to 3 tokens (the stops coincide)."""
    bs = rng.randint(1, 8)
    mml = rng.randint(4, 40)
    places = rng.randint(1, 3) if tight else rng.randint(2, 8)
    budget = rng.randint(max(mml, places), 2 * mml + places)
    count = rng.randint(2, 9)
    eos = rng.randrange(VOCAB)
    reqs, seqs = [], []
    arrivals = rng.sample(range(1, 10_000), count)
    for k in range(count):
        prompt = rng.randint(1, mml) if rng.random() < 0.9 else mml + rng.randint(1, 4)
        max_tokens = rng.randint(1, 2 * mml)
        if short:
            prompt, max_tokens = rng.randint(max(1, mml - 3), mml), rng.randint(1, 3)
        reqs.append(Req(k * 7 + 2, float(arrivals[k]), prompt, max_tokens, rng.random() < 0.3))
    need = sum(ceil_div(r.tokens + r.max_tokens, bs) for r in reqs) + 1
    config = {
        "block_size": bs,
        "num_gpu_blocks": need,
        "max_model_len": mml,
        "max_num_seqs": places,
        "max_num_batched_tokens": budget,
        "eos_token_id": eos,
    }
    s = small_scheduler(**config)
    for r in reqs:
        seq = new_seq(
            rng, s, r.seq_id, r.tokens, r.arrival, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos
        )
        s.add(seq)
        seqs.append(seq)
    return s, seqs, PlainModel(s.config, reqs)


def drive_plain(rng, s: Scheduler, model: PlainModel, eos_rate: float) -> Trace:
    trace = Trace()
    for k in range(2000):
        if not model.waiting and not model.running:
            break
        want = model.schedule()
        out = s.schedule()
        if planned(out) != want:
            trace.problem = (
                f"step {k}: a step admits the front of waiting under the budgets (a prefill "
                f"step), or else decodes every running sequence, oldest first: expected (id, "
                f"tokens, prefill) {want}, got {planned(out)}"
            )
            return trace
        eos = s.config.eos_token_id
        tokens = [eos if rng.random() < eos_rate else a_token(rng, eos) for _ in want]
        done = s.postprocess(out.scheduled, tokens)
        want_done = model.postprocess(tokens)
        trace.steps.append(
            {
                "step": k,
                "finished": [(q.seq_id, q.status.name) for q in done],
                "want_finished": [(i, model.by_id[i].status.name) for i in want_done],
                "free": s.block_manager.num_free_gpu_blocks,
                "want_free": s.config.num_gpu_blocks - model.used_blocks(),
                "running": ids(s.running),
                "want_running": [r.seq_id for r in model.running],
            }
        )
    else:
        trace.problem = "the workload did not finish in 2000 steps"
    return trace


@seeded
def test_part2_each_step_prefills_the_admitted_or_decodes_every_running_sequence(rng):
    for _ in range(6):
        s, _seqs, model = plain_workload(rng, tight=rng.random() < 0.5)
        trace = drive_plain(rng, s, model, eos_rate=rng.choice([0.0, 0.05, 0.2]))
        assert trace.problem is None, trace.problem


@seeded
def test_part2_a_sequence_stops_at_eos_at_max_tokens_or_past_max_model_len(rng):
    for k in range(8):
        s, seqs, model = plain_workload(rng, tight=False, short=k % 2 == 0)
        trace = drive_plain(rng, s, model, eos_rate=rng.choice([0.05, 0.2, 0.5]))
        for record in trace.steps:
            assert record["finished"] == record["want_finished"], (
                f"step {record['step']}: postprocess appends the token, then finishes a "
                "sequence: FINISHED_STOPPED on EOS (unless ignore_eos; EOS wins), else "
                "FINISHED_LENGTH_CAPPED at max_tokens completion tokens or past max_model_len "
                f"({s.config.max_model_len}); expected (id, status) "
                f"{record['want_finished']}, got {record['finished']}"
            )
        assert trace.problem is None, trace.problem
        for seq in seqs:
            if seq.status is SequenceStatus.FINISHED_IGNORED:
                continue
            assert seq.status in (STOPPED, LENGTH) and seq.block_table == []


@seeded
def test_part2_a_finished_sequence_frees_its_blocks_and_its_place_at_once(rng):
    for _ in range(6):
        s, _seqs, model = plain_workload(rng, tight=True)
        trace = drive_plain(rng, s, model, eos_rate=rng.choice([0.0, 0.1]))
        for record in trace.steps:
            assert record["running"] == record["want_running"], (
                f"after step {record['step']}: running holds the unfinished sequences in "
                f"arrival order (the finished leave it in postprocess): expected "
                f"{record['want_running']}, got {record['running']}"
            )
            assert record["free"] == record["want_free"], (
                f"after step {record['step']}: the running sequences hold a block per "
                f"{s.config.block_size} computed tokens and the finished none: "
                f"{record['want_free']} free expected, got {record['free']}"
            )
        assert trace.problem is None, trace.problem


@seeded
def test_part2_copies_on_write_of_a_step_go_into_blocks_to_copy(rng):
    for k in range(3):
        check_copies(rng, forced=k == 0)


def check_copies(rng, forced: bool) -> None:
    """Forked samples write their first tokens; ``forced``: 3 or more share a partly full block."""
    bs = rng.randint(2, 8)
    s = small_scheduler(block_size=bs, num_gpu_blocks=200, max_num_seqs=12)
    prompt = rng.randint(1, 5 * bs)
    if forced and prompt % bs == 0:
        prompt += 1
    parent = new_seq(rng, s, 10, prompt, 5.0, max_tokens=50)
    others = [
        new_seq(rng, s, 20 + i, rng.randint(1, 3 * bs), 1.0 + i * 3, max_tokens=50)
        for i in range(2)
    ]
    for seq in (parent, *others):
        s.add(seq)
    out = s.schedule()
    s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
    children = []
    for i in range(rng.randint(2 if forced else 1, 4)):
        child = Sequence(11 + i, [*parent.token_ids[:prompt], a_token(rng)], bs)
        s.fork(parent, child)  # given: shares the parent's blocks, joins its group, runs
        children.append(child)
    family = [parent, *children]
    shared = parent.block_table[-1]
    out = s.schedule()
    assert planned(out) == [(q.seq_id, 1, False) for q in by_arrival([*family, *others])]
    if prompt % bs:
        want = {shared: [q.block_table[-1] for q in family[:-1]]}
        rule = (
            f"the {len(family)} samples write position {prompt} into their shared, partly full "
            f"block {shared}: in running order each but the last gets a copy, "
            "{src: [dst, ...]}"
        )
    else:
        want = {}
        rule = f"position {prompt} opens a new block for each sample: nothing is copied"
    assert out.blocks_to_copy == want, f"{rule}; expected {want}, got {out.blocks_to_copy}"


@seeded
def test_part2_a_decode_takes_a_token_of_the_budget_and_no_place(rng):
    for _ in range(6):
        budget = rng.randint(4, 40)
        places = rng.randint(2, min(8, budget))
        decoders = rng.randint(1, places - 1)
        s = small_scheduler(
            block_size=rng.randint(1, 8),
            num_gpu_blocks=2000,
            max_model_len=200,
            max_num_seqs=places,
            enable_chunked_prefill=True,
            max_num_batched_tokens=budget,
        )
        for k in range(decoders):
            s.add(new_seq(rng, s, k, 1, float(k), max_tokens=50))
        out = s.schedule()
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])  # all decoding now
        lengths = [rng.randint(1, 2 * budget) for _ in range(rng.randint(1, 6))]
        for k, n in enumerate(lengths):
            s.add(new_seq(rng, s, 100 + k, n, 100.0 + k))
        want = [(k, 1, False) for k in range(decoders)]
        left, seats = budget - decoders, places - decoders
        for k, n in enumerate(lengths):
            if left == 0 or seats == 0:
                break
            want.append((100 + k, min(n, left), True))
            left, seats = left - min(n, left), seats - 1
        out = s.schedule()
        assert planned(out) == want, (
            f"{decoders} running sequences decode, one token each of the budget of {budget} and "
            f"no new place (the {places} places count the running once): prompts of {lengths} "
            f"are then admitted with what is left; expected {want}, got {planned(out)}"
        )


@seeded
def test_part2_a_chunk_short_of_the_end_yields_no_token_and_the_batch_goes_on(rng):
    s = small_scheduler(
        block_size=rng.randint(1, 8),
        num_gpu_blocks=500,
        max_model_len=100,
        enable_chunked_prefill=True,
        max_num_batched_tokens=400,
        max_num_seqs=10,
    )
    seqs = [new_seq(rng, s, k, rng.randint(2, 40), float(k)) for k in range(rng.randint(2, 8))]
    for seq in seqs:
        s.add(seq)
    s.schedule()  # all admitted (the plan is made by hand below)
    items, full = [], {}
    for k, seq in enumerate(seqs):  # a short chunk first, a full one after it
        short = k == 0 or (k > 1 and rng.random() < 0.5)
        n = rng.randint(1, seq.num_tokens - 1) if short else seq.num_tokens
        items.append(ScheduledSequence(seq, n, True))
        full[seq.seq_id] = not short
    tokens = [a_token(rng) for _ in items]
    s.postprocess(items, tokens)
    for item, token in zip(items, tokens, strict=True):
        seq = item.seq
        if full[seq.seq_id]:
            got = (seq.num_computed_tokens, seq.completion_token_ids, seq.is_prefill)
            want = (len(seq.prompt_token_ids), [token], False)
            assert got == want, (
                f"sequence {seq.seq_id}: its chunk reaches the end: computed, completion and "
                f"is_prefill expected {want}, got {got} (a short chunk before it in the batch "
                "must not stop postprocess)"
            )
        else:
            got = (seq.num_computed_tokens, seq.num_completion_tokens, seq.is_prefill)
            assert got == (item.num_tokens, 0, True), (
                f"sequence {seq.seq_id}: a chunk of {item.num_tokens} of {seq.num_tokens} tokens "
                f"stops short: it computes them, yields no token and stays in its prefill; got "
                f"(computed, completion tokens, is_prefill) {got}"
            )


def full_pool(rng, mode: str = "recompute", cpu: int = 0, count: int | None = None):
    """Sequences admitted in one prefill step whose blocks fill the pool exactly; the oldest
    needs a block at its next decode. Returns the scheduler and the sequences by arrival."""
    bs = rng.randint(1, 6)
    count = count or rng.randint(1, 7)
    arrivals = sorted(rng.sample(range(1, 1000), count))
    lengths = [bs * rng.randint(1, 4)] + [rng.randint(1, 5 * bs) for _ in range(count - 1)]
    blocks = sum(ceil_div(n, bs) for n in lengths)
    s = small_scheduler(
        block_size=bs,
        num_gpu_blocks=blocks,
        num_cpu_blocks=cpu,
        max_model_len=200,
        max_num_seqs=8,
        max_num_batched_tokens=400,
        preemption_mode=mode,
    )
    order = list(range(count))
    rng.shuffle(order)  # add in another order than arrival: running is kept by arrival
    seqs = [None] * count
    for k in order:
        seqs[k] = new_seq(
            rng, s, rng.randrange(100) * 10 + k, lengths[k], float(arrivals[k]), max_tokens=100
        )
        s.add(seqs[k])
    out = s.schedule()
    s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
    return s, seqs


def decode_oracle(seqs: list[Sequence], bs: int, free: int = 0):
    """The handout's decode loop over sequences (in arrival order) just out of their prefill:
    each holds ceil(prompt / bs) blocks and one token past them, at position prompt. A sequence
    whose position needs a block and finds none preempts the newest not yet handled, or itself
    when none is left. Returns (victims in order, the decoded)."""
    queue = deque(seqs)
    victims, decoded = [], []
    while queue:
        seq = queue.popleft()
        need = 1 if seq.num_prompt_tokens % bs == 0 else 0
        while need > free:
            victim = queue.pop() if queue else seq
            victims.append(victim)
            free += ceil_div(victim.num_prompt_tokens, bs)
            if victim is seq:
                break
        else:
            free -= need
            decoded.append(seq)
    return victims, decoded


@seeded
def test_part2_when_blocks_run_out_the_newest_unhandled_sequence_is_preempted(rng, monkeypatch):
    for k in range(8):
        s, seqs = full_pool(rng, count=1 if k == 0 else None)  # alone, it preempts itself
        victims, decoded = decode_oracle(seqs, s.config.block_size)
        calls, preempt = stand_in_preempt(s)
        monkeypatch.setattr(s, "_preempt", preempt)
        out = s.schedule()
        want = [[v.seq_id] for v in victims]
        lengths = [(q.seq_id, q.num_tokens, len(q.block_table)) for q in seqs]
        assert calls == want, (
            "oldest first, a sequence whose newest token needs a block and finds none preempts "
            "the newest running sequence not yet handled (or itself, if none is left), and "
            f"retries: running (id, tokens, blocks) {lengths}, block size "
            f"{s.config.block_size}, no block free: _preempt calls expected {want}, got {calls}"
        )
        assert planned(out) == [(q.seq_id, 1, False) for q in decoded], (
            f"the others decode, oldest first: expected {ids(decoded)}, got {planned(out)}"
        )
        assert ids(s.running) == ids(decoded), "the preempted leave running"
        monkeypatch.undo()


@seeded
def test_part2_the_newest_group_of_samples_is_preempted_together(rng, monkeypatch):
    for _ in range(4):
        bs = rng.randint(2, 6)
        singles = rng.randint(1, 4)
        lengths = [bs * rng.randint(1, 3)] + [rng.randint(1, 4 * bs) for _ in range(singles - 1)]
        group_len, n = rng.randint(1, 4 * bs), rng.randint(2, 4)
        s = small_scheduler(
            block_size=bs,
            num_gpu_blocks=sum(ceil_div(q, bs) for q in lengths) + ceil_div(group_len, bs),
            max_num_seqs=12,
            max_num_batched_tokens=400,
        )
        olds = [new_seq(rng, s, 1 + k, q, float(k), max_tokens=30) for k, q in enumerate(lengths)]
        parent = new_seq(rng, s, 20, group_len, 50.0, max_tokens=30, n=n)
        for seq in (*olds, parent):
            s.add(seq)
        out = s.schedule()
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
        group = [parent]
        for i in range(n - 1):
            child = Sequence(21 + i, [*parent.token_ids[:group_len], a_token(rng)], bs)
            s.fork(parent, child)  # given
            group.append(child)
        calls, preempt = stand_in_preempt(s)
        monkeypatch.setattr(s, "_preempt", preempt)
        s.schedule()
        assert calls[:1] == [ids(group)], (
            f"sequence {olds[0].seq_id} needs a block and none is free: the newest group, the "
            f"{n} parallel samples {ids(group)} (same group_id), is handed to _preempt in one "
            f"call, in arrival order; _preempt got {calls}"
        )
        monkeypatch.undo()


@seeded
def test_part2_running_prefills_go_to_the_chunk_pass_after_the_decodes(rng, monkeypatch):
    bs = rng.randint(1, 6)
    s = small_scheduler(
        block_size=bs,
        num_gpu_blocks=300,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        max_num_seqs=12,
    )
    count = rng.randint(3, 8)
    arrivals = rng.sample(range(1, 1000), count)
    seqs = []
    for k in range(count):
        seq = new_seq(rng, s, 5 * k + 3, rng.randint(2, 6 * bs), float(arrivals[k]), max_tokens=9)
        s.add(seq)
        s.waiting.remove(seq)  # made running by hand
        s.block_manager.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        if k == 0:
            seq.num_computed_tokens = seq.num_tokens - 1  # in its prefill, one token left
        elif rng.random() < 0.5:
            seq.num_computed_tokens = rng.randint(0, seq.num_tokens - 1)  # in its prefill
        else:
            seq.num_computed_tokens, seq.is_prefill = seq.num_tokens - 1, False
        seqs.append(seq)
    s.running = by_arrival(seqs)
    order = list(s.running)
    passed = []
    monkeypatch.setattr(
        s, "_schedule_prefill_chunks", lambda q, out, budget: passed.append((ids(q), planned(out)))
    )
    out = s.schedule()
    decodes = [(q.seq_id, 1, False) for q in order if not q.is_prefill]
    prefills = [q.seq_id for q in order if q.is_prefill]
    assert planned(out) == decodes, (
        f"running (id, prefill) {[(q.seq_id, q.is_prefill) for q in order]}: the sequences out "
        f"of their prefill decode, oldest first, and those in it are not decoded: expected "
        f"{decodes}, got {planned(out)}"
    )
    want = [(prefills, decodes)] if prefills else []
    passed = [call for call in passed if call[0]]  # a call with no sequence is harmless
    assert passed == want, (
        "the sequences in their prefill go, in order, to _schedule_prefill_chunks after every "
        f"decode: expected calls (prefills, plan so far) {want}, got {passed}"
    )
    assert s.running == order, "running keeps every sequence, in arrival order"


@seeded
def test_part2_postprocess_refuses_a_token_count_mismatch_and_skips_the_aborted(rng):
    s = small_scheduler(block_size=rng.randint(1, 8), num_gpu_blocks=200)
    seqs = [new_seq(rng, s, 4 * k + 1, rng.randint(1, 20), float(k)) for k in range(5)]
    for seq in seqs:
        s.add(seq)
    out = s.schedule()
    count = len(out.scheduled)
    wrong = rng.choice([c for c in range(count + 3) if c != count])
    message = f"postprocess got {wrong} tokens for {count} sequences"
    with pytest.raises(ValueError, match=rf"^{message}$"):
        s.postprocess(out.scheduled, [a_token(rng) for _ in range(wrong)])
    assert [q.num_tokens for q in seqs] == [len(q.prompt_token_ids) for q in seqs], (
        "a refused postprocess changes nothing"
    )
    assert all(q.num_computed_tokens == 0 for q in seqs), "a refused postprocess changes nothing"
    aborted = rng.sample(seqs, rng.randint(1, 4))
    for seq in aborted:
        s.abort(seq.seq_id)
    tokens = [a_token(rng) for _ in range(count)]
    s.postprocess(out.scheduled, tokens)
    for seq, token in zip(seqs, tokens, strict=True):
        if seq in aborted:
            assert seq.status is SequenceStatus.FINISHED_ABORTED, "an aborted sequence stays so"
            assert seq.completion_token_ids == [], (
                f"sequence {seq.seq_id} was aborted after schedule: postprocess skips it"
            )
        else:
            assert seq.completion_token_ids == [token], (
                f"sequence {seq.seq_id} gets its sampled token {token}, got "
                f"{seq.completion_token_ids}"
            )
    assert ids(s.running) == [q.seq_id for q in seqs if q not in aborted]


@seeded
def test_part2_append_slot_says_false_only_for_a_missing_block(rng):
    bs = rng.randint(1, 6)
    lengths = [bs * rng.randint(1, 3), rng.randint(1, 3 * bs)]
    s = small_scheduler(block_size=bs, num_gpu_blocks=sum(ceil_div(q, bs) for q in lengths))
    full, other = (new_seq(rng, s, k + 1, q, float(k)) for k, q in enumerate(lengths))
    for seq in (full, other):
        s.add(seq)
    s.schedule()  # both admitted: the pool is full; full's next token opens a block
    full.append_token(a_token(rng))
    out = SchedulerOutput()
    table = list(full.block_table)
    assert s._append_slot(full, out) is False and full.block_table == table, (
        "its newest token needs a block and none is free: _append_slot returns False and "
        "changes nothing"
    )
    waiting = new_seq(rng, s, 9, 3, 9.0)
    s.add(waiting)
    with pytest.raises(ValueError):
        s._append_slot(waiting, out)  # holds no blocks: append_slot's ValueError goes through
    for _ in range(bs + 1):
        other.append_token(a_token(rng))  # more than one token past its blocks
    with pytest.raises(ValueError):
        s._append_slot(other, out)  # append_slot's ValueError goes through too
    assert out.blocks_to_copy == {} and out.scheduled == []


# --------------------------------------------------------------------------------------------
# Part 2.3: preemption by recompute
# --------------------------------------------------------------------------------------------


@seeded
def test_part3_the_newest_are_recomputed_and_wait_at_the_front(rng):
    for _ in range(8):
        mode = rng.choice(["recompute", "auto"])
        s, seqs = full_pool(rng, mode=mode, cpu=rng.choice([0, 50]))
        bs = s.config.block_size
        victims, decoded = decode_oracle(seqs, bs)
        tokens = {q.seq_id: q.num_tokens for q in seqs}
        s.add(new_seq(rng, s, 999, 1, 5000.0))  # waits: the pool is full (LATER)
        out = s.schedule()
        assert out.preempted == victims, (
            f"mode {mode}: the newest running sequences are preempted one by one as blocks run "
            f"out: expected preempted {ids(victims)}, got {ids(out.preempted)}"
        )
        want_waiting = [*ids(reversed(victims)), 999]
        assert ids(s.waiting) == want_waiting, (
            "each recomputed sequence goes to the front of waiting (so the last preempted is "
            f"first), before the newcomer: expected {want_waiting}, got {ids(s.waiting)}"
        )
        for seq in victims:
            got = (seq.status, seq.block_table, seq.num_computed_tokens, seq.is_prefill)
            assert got == (SequenceStatus.WAITING, [], 0, True), (
                f"sequence {seq.seq_id} preempted by recompute: WAITING, no blocks, nothing "
                f"computed, in its prefill again; got {got}"
            )
            assert seq.num_tokens == tokens[seq.seq_id], "its tokens, generated ones too, stay"
        assert not out.blocks_to_swap_out, f"mode {mode}: a lone sequence is recomputed"
        assert s.num_preemptions == len(victims), "each preempted sequence counts once"
        assert planned(out) == [(q.seq_id, 1, False) for q in decoded]


def run_to_the_end(rng, s: Scheduler, max_steps: int) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if s.is_finished():
            return outs
        out = s.schedule()
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
        outs.append(out)
    raise AssertionError(
        f"after {max_steps} steps {s.num_unfinished} sequences are unfinished (waiting "
        f"{ids(s.waiting)}, running {ids(s.running)}, swapped {ids(s.swapped)}): every request "
        "that fits the pool alone must finish (starvation or livelock)"
    )


def pressure_workload(rng, mode: str, certain: bool = False):
    """Requests that each fit the pool alone but not all at once. ``certain``: the first two
    fill the pool with whole blocks, so that the first decode step must preempt."""
    bs = rng.randint(1, 4)
    count = rng.randint(3, 10)
    prompts = [rng.randint(1, 6 * bs) for _ in range(count)]
    outputs = [rng.randint(1, 6 * bs) for _ in range(count)]
    biggest = max(ceil_div(p + m, bs) for p, m in zip(prompts, outputs, strict=True))
    gpu = biggest + rng.randint(0, biggest)
    if certain:
        half = rng.randint(2 if bs == 1 else 1, 4)
        gpu = 2 * half
        prompts[:2] = [half * bs] * 2  # both admitted at once, both need a block next
        outputs[:2] = [rng.randint(2, half * bs) for _ in range(2)]  # neither ends at once
        for k in range(2, count):
            prompts[k] = rng.randint(1, gpu * bs - 1)
            outputs[k] = rng.randint(1, gpu * bs - prompts[k])
    mml = max(p + m for p, m in zip(prompts, outputs, strict=True))
    options = {
        "block_size": bs,
        "num_gpu_blocks": gpu,
        "num_cpu_blocks": 4
        * sum(ceil_div(p + m, bs) for p, m in zip(prompts, outputs, strict=True)),
        "max_model_len": mml,
        "max_num_seqs": rng.randint(2, 6),
        "preemption_mode": mode,
    }
    s = small_scheduler(**options)
    seqs = []
    for k in range(count):
        seq = new_seq(rng, s, k, prompts[k], float(k), max_tokens=outputs[k], ignore_eos=True)
        s.add(seq)
        seqs.append(seq)
    return s, seqs


@seeded
def test_part3_every_request_finishes_its_whole_output_under_memory_pressure(rng):
    for k in range(5):
        s, seqs = pressure_workload(rng, "recompute", certain=k == 0)
        outs = run_to_the_end(rng, s, max_steps=3000)
        for seq in seqs:
            assert (
                seq.status is LENGTH and seq.num_completion_tokens == seq.sampling_params.max_tokens
            ), (
                f"sequence {seq.seq_id} fits the pool alone: preempted or not, it must finish with "
                f"its {seq.sampling_params.max_tokens} tokens (recompute keeps the generated "
                f"ones); got {seq.status.name} with {seq.num_completion_tokens}"
            )
        assert s.num_preemptions == sum(len(out.preempted) for out in outs)
        assert s.block_manager.num_free_gpu_blocks == s.config.num_gpu_blocks
        assert not any(out.blocks_to_swap_out for out in outs), "recompute mode never swaps"


def group_case(rng, mode: str, cpu: int = 0, roomy: bool = False):
    """An old sequence whose next decode needs a block, and a request of n samples (forked after
    its prefill) that fills the rest of the pool: the group is the newest, preempted whole.
    ``roomy``: the old sequence holds at least n blocks, so that once it is gone the group fits
    back with a block for each sample's next token (can_swap_in's lookahead)."""
    bs = rng.randint(2, 6)
    n = rng.randint(2, 4)
    old_len = bs * (rng.randint(n, n + 2) if roomy else rng.randint(1, 3))
    group_len = rng.randint(1, 4 * bs)
    s = small_scheduler(
        block_size=bs,
        num_gpu_blocks=old_len // bs + ceil_div(group_len, bs),
        num_cpu_blocks=cpu,
        max_num_seqs=8,
        preemption_mode=mode,
    )
    old = new_seq(rng, s, 1, old_len, 1.0, max_tokens=20)
    parent = new_seq(rng, s, 5, group_len, 2.0, max_tokens=20, n=n)
    s.add(old)
    s.add(parent)
    out = s.schedule()
    s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
    group = [parent]
    for i in range(n - 1):
        child = Sequence(6 + i, [*parent.token_ids[:group_len], a_token(rng)], bs)
        s.fork(parent, child)
        group.append(child)
    return s, old, group


@seeded
def test_part3_a_group_is_recomputed_together_and_leaves_its_group(rng, monkeypatch):
    for _ in range(4):
        mode = rng.choice(["recompute", "auto"])
        s, old, group = group_case(rng, mode)
        asked = []

        def refuse(seqs, out, asked=asked):
            asked.append(ids(seqs))
            return False

        monkeypatch.setattr(s, "_preempt_by_swap", refuse)  # stands in for part 2.4
        out = s.schedule()
        assert out.preempted == group, (
            f"sequence {old.seq_id} needs a block and none is free: the newest group, the "
            f"{len(group)} samples {ids(group)}, is preempted together, in order; got "
            f"{ids(out.preempted)}"
        )
        assert asked == ([ids(group)] if mode == "auto" else []), (
            f"mode {mode}: auto tries a swap of a group of more than one (in one call), "
            f"recompute never; _preempt_by_swap got {asked}"
        )
        assert ids(s.waiting)[: len(group)] == ids(group), (
            "recomputed last member first, the group starts waiting in arrival order: expected "
            f"{ids(group)} first, got {ids(s.waiting)}"
        )
        assert [q.group_id for q in group] == ids(group), (
            "a recomputed sequence shares no block any more: group_id = seq_id"
        )
        assert s.num_preemptions == len(group) and planned(out) == [(old.seq_id, 1, False)]
        monkeypatch.undo()


@seeded
def test_part3_a_sequence_that_outgrew_the_pool_is_ignored_and_the_next_runs(rng):
    bs = rng.randint(1, 6)
    gpu = rng.randint(2, 8)
    s = small_scheduler(
        block_size=bs, num_gpu_blocks=gpu, max_model_len=500, preemption_mode="recompute"
    )
    big = new_seq(rng, s, 3, gpu * bs, 1.0, max_tokens=100, ignore_eos=True)
    small_len = rng.randint(1, bs * (gpu - 1))
    small_out = rng.randint(1, gpu * bs - small_len)
    small = new_seq(rng, s, 4, small_len, 2.0, max_tokens=small_out, ignore_eos=True)
    s.add(big)
    s.add(small)
    outs = run_to_the_end(rng, s, max_steps=500)
    reasons = [i.reason for out in outs for i in out.ignored if i.seq is big]
    assert big.status is SequenceStatus.FINISHED_IGNORED and len(reasons) == 1, (
        f"a prompt of {gpu * bs} tokens fills the pool of {gpu} blocks of {bs}: its next token "
        f"needs block {gpu + 1}, it preempts itself and can never be admitted again: ignored "
        f"once; got {big.status.name}, reasons {reasons}"
    )
    assert f"needs {gpu + 1} blocks" in reasons[0] and f"pool has {gpu}" in reasons[0], reasons
    assert small.status is LENGTH and small.num_completion_tokens == small_out, (
        f"the request behind it runs to its end, got {small.status.name}"
    )


# --------------------------------------------------------------------------------------------
# Part 2.4: preemption by swap, swap-in order
# --------------------------------------------------------------------------------------------


@seeded
def test_part4_victims_move_to_the_cpu_and_join_swapped_in_arrival_order(rng):
    for _ in range(8):
        s, seqs = full_pool(rng, mode="swap", cpu=400)
        victims, decoded = decode_oracle(seqs, s.config.block_size)
        tables = {q.seq_id: list(q.block_table) for q in seqs}
        computed = {q.seq_id: q.num_prompt_tokens for q in seqs}
        out = s.schedule()
        assert out.preempted == victims, (
            f"the newest running sequences are preempted as blocks run out: expected "
            f"{ids(victims)}, got {ids(out.preempted)}"
        )
        moved = sorted(b for v in victims for b in tables[v.seq_id])
        assert sorted(out.blocks_to_swap_out) == moved, (
            f"blocks_to_swap_out maps every GPU block of the victims {moved} to a CPU block, "
            f"got {out.blocks_to_swap_out}"
        )
        want = ids(by_arrival(victims))
        assert ids(s.swapped) == want, (
            "victims come newest first, and swapped stays in arrival order: expected "
            f"{want} (arrivals {[(v.seq_id, v.arrival_time) for v in victims]}), got "
            f"{ids(s.swapped)}"
        )
        for v in victims:
            assert v.status is SequenceStatus.SWAPPED, f"{v.seq_id}: SWAPPED, got {v.status}"
            assert s.block_manager.device_of(v) is Device.CPU
            assert v.num_computed_tokens == computed[v.seq_id], "its computed K/V survive"
        assert not out.blocks_to_swap_in, "a step never swaps in and out at once"
        assert planned(out) == [(q.seq_id, 1, False) for q in decoded]


@seeded
def test_part4_swapped_sequences_come_back_oldest_first_before_any_new_prompt(rng):
    for _ in range(8):
        s, _seqs = full_pool(rng, mode="swap", cpu=400)
        out = s.schedule()
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
        for seq in list(s.running):
            s.abort(seq.seq_id)  # the pool is free again
        s.add(new_seq(rng, s, 10**6, 1, 10**5))
        bs, gpu = s.config.block_size, s.config.num_gpu_blocks
        free, back, ignored, left = gpu, [], [], []
        for seq in list(s.swapped):
            need = len(seq.block_table) + (seq.num_tokens > len(seq.block_table) * bs)
            if left:
                left.append(seq)
            elif gpu - need < 0:
                ignored.append(seq)
            elif free - need < 0:
                left.append(seq)
            else:
                free -= need
                back.append(seq)
        cpu_tables = sorted(b for q in back for b in q.block_table)
        out = s.schedule()
        assert planned(out) == [(q.seq_id, 1, False) for q in back], (
            "swapped sequences come back in arrival order while their blocks and a block for "
            "the newest token fit (LATER stops it; NEVER is ignored), and each decodes in that "
            f"very step; swapped (id, blocks, tokens) "
            f"{[(q.seq_id, len(q.block_table), q.num_tokens) for q in back + ignored + left]}"
            f", {gpu} free blocks of {bs}: expected {ids(back)}, got {planned(out)}"
        )
        assert sorted(out.blocks_to_swap_in) == cpu_tables, "the map lists their CPU blocks"
        assert ids(s.swapped) == ids(left) and ids(s.running) == ids(back), (
            f"swapped keeps {ids(left)} and running gets {ids(back)}: got swapped "
            f"{ids(s.swapped)}, running {ids(s.running)}"
        )
        assert [i.seq for i in out.ignored] == ignored, "NEVER: taken out and ignored"
        assert ids(s.waiting) == [10**6] and s.waiting[0].status is SequenceStatus.WAITING, (
            "no new prompt is admitted while a sequence is swapped out: the newcomer waits"
        )
        assert not out.blocks_to_swap_out, "a step never swaps in and out at once"


@seeded
def test_part4_every_request_finishes_its_whole_output_with_swapping(rng):
    for k in range(5):
        s, seqs = pressure_workload(rng, "swap", certain=k == 0)
        outs = run_to_the_end(rng, s, max_steps=3000)
        for seq in seqs:
            assert (
                seq.status is LENGTH and seq.num_completion_tokens == seq.sampling_params.max_tokens
            ), (
                f"sequence {seq.seq_id} fits the pool alone: swapped or not, it finishes with "
                f"its {seq.sampling_params.max_tokens} tokens; got {seq.status.name} with "
                f"{seq.num_completion_tokens}"
            )
        assert not any(out.blocks_to_swap_in and out.blocks_to_swap_out for out in outs), (
            "a step never swaps in and out at once"
        )
        assert s.block_manager.num_free_cpu_blocks == s.config.num_cpu_blocks
        assert s.block_manager.num_free_gpu_blocks == s.config.num_gpu_blocks


@seeded
def test_part4_no_cpu_room_falls_back_to_recompute(rng):
    for _ in range(6):
        s, seqs = full_pool(rng, mode="swap", cpu=0)
        victims, _ = decode_oracle(seqs, s.config.block_size)
        out = s.schedule()
        assert out.preempted == victims and not out.blocks_to_swap_out, (
            "the CPU pool has no block: can_swap_out says no, so each victim is recomputed and "
            f"nothing swapped; expected preempted {ids(victims)}, got {ids(out.preempted)} and "
            f"swap map {out.blocks_to_swap_out}"
        )
        assert all(v.status is SequenceStatus.WAITING and not v.block_table for v in victims)


@seeded
def test_part4_a_swapped_sequence_that_can_never_come_back_is_ignored(rng):
    bs = rng.randint(1, 6)
    gpu = rng.randint(2, 8)
    s = small_scheduler(
        block_size=bs,
        num_gpu_blocks=gpu,
        num_cpu_blocks=gpu + 4,
        max_model_len=500,
        preemption_mode="swap",
    )
    big = new_seq(rng, s, 3, gpu * bs, 1.0, max_tokens=100, ignore_eos=True)
    small_len = rng.randint(1, bs * (gpu - 1))
    small_out = rng.randint(1, gpu * bs - small_len)
    small = new_seq(rng, s, 4, small_len, 2.0, max_tokens=small_out, ignore_eos=True)
    s.add(big)
    s.add(small)
    outs = run_to_the_end(rng, s, max_steps=500)
    assert any(out.blocks_to_swap_out for out in outs), "the big sequence swaps itself out"
    reasons = [i.reason for out in outs for i in out.ignored if i.seq is big]
    assert big.status is SequenceStatus.FINISHED_IGNORED and len(reasons) == 1, (
        f"the {gpu * bs}-token prompt fills the pool of {gpu}; swapped out, it needs {gpu} blocks "
        f"+ 1 for its newest token to come back: NEVER, ignored once; got {big.status.name}, "
        f"reasons {reasons}"
    )
    assert small.status is LENGTH and small.num_completion_tokens == small_out
    assert s.block_manager.num_free_cpu_blocks == gpu + 4, "its CPU blocks are freed"


@seeded
def test_part4_swapped_sequences_come_back_within_the_sequence_places(rng):
    for _ in range(6):
        bs = rng.randint(1, 6)
        s = small_scheduler(
            block_size=bs, num_gpu_blocks=400, num_cpu_blocks=400, preemption_mode="swap"
        )
        seqs = [
            new_seq(rng, s, k, rng.randint(1, 5 * bs), float(k)) for k in range(rng.randint(2, 7))
        ]
        for seq in seqs:
            s.add(seq)
        out = s.schedule()
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
        for seq in seqs:  # swapped out by hand, oldest first
            s.running.remove(seq)
            s.block_manager.swap_out([seq])
            seq.status = SequenceStatus.SWAPPED
            s.swapped.append(seq)
        places = rng.choice([len(seqs), rng.randint(1, len(seqs))])
        s.config.max_num_seqs = places  # set by hand, as the visible tests do
        out = s.schedule()
        want = seqs[:places]
        assert ids(out.seqs) == ids(want) and ids(s.swapped) == ids(seqs[places:]), (
            f"nothing runs and {len(seqs)} are swapped out: each swapped-in sequence takes one "
            f"of the {places} places, oldest first: expected {ids(want)} back, got "
            f"{ids(out.seqs)} (swapped {ids(s.swapped)})"
        )


@seeded
def test_part4_a_prefill_swapped_out_midway_comes_back_as_its_next_chunk(rng):
    for _ in range(4):
        bs = rng.randint(1, 6)
        first = bs * rng.randint(2 if bs == 1 else 1, 4) - 1  # its second decode opens a block
        budget = rng.randint(max(2, first), first + 20)
        long = rng.randint(budget, 4 * budget)  # admitted with a cut chunk of budget - 1
        s = small_scheduler(
            block_size=bs,
            num_gpu_blocks=ceil_div(first + 1, bs) + ceil_div(long, bs),
            num_cpu_blocks=ceil_div(long, bs) + 2,
            max_model_len=long + 10,
            max_num_seqs=2,
            enable_chunked_prefill=True,
            max_num_batched_tokens=budget,
            preemption_mode="swap",
        )
        old = new_seq(rng, s, 1, first, 1.0, max_tokens=3)
        s.add(old)
        s.postprocess((out := s.schedule()).scheduled, [a_token(rng) for _ in out.scheduled])
        late = new_seq(rng, s, 2, long, 2.0, max_tokens=5)
        s.add(late)
        out = s.schedule()
        assert planned(out) == [(1, 1, False), (2, budget - 1, True)], planned(out)
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
        out = s.schedule()  # old needs a block: late, in its prefill, is swapped out
        assert out.preempted == [late] and late.status is SequenceStatus.SWAPPED, (
            f"the newest running sequence is swapped out, even mid-prefill; got preempted "
            f"{ids(out.preempted)}, {late.status.name}"
        )
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])  # old finishes
        out = s.schedule()
        chunk = min(long - (budget - 1), budget)
        assert planned(out) == [(2, chunk, True)], (
            f"a sequence swapped out in its prefill ({budget - 1} of {long} tokens computed) "
            f"comes back as a prefill of its next chunk ({chunk}, what the budget of {budget} "
            f"allows), in the same step; got {planned(out)}"
        )


@seeded
def test_part4_a_group_of_samples_is_swapped_out_and_back_together(rng):
    for _ in range(4):
        s, old, group = group_case(rng, "swap", cpu=64, roomy=True)
        out = s.schedule()
        assert [q.status for q in group] == [SequenceStatus.SWAPPED] * len(group), (
            f"the newest group {ids(group)} is swapped out together: got "
            f"{[q.status.name for q in group]}"
        )
        blocks = ceil_div(group[0].num_prompt_tokens, s.config.block_size)
        assert len(out.blocks_to_swap_out) == blocks and ids(s.swapped) == ids(group), (
            f"one swap of the group moves its {blocks} shared blocks once, and every member "
            f"joins swapped in order: got the map {out.blocks_to_swap_out}, swapped "
            f"{ids(s.swapped)}"
        )
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
        s.abort(old.seq_id)
        s.config.max_num_seqs = len(group) - 1  # set by hand: one place too few
        out = s.schedule()
        assert ids(s.swapped) == ids(group) and not out.blocks_to_swap_in, (
            f"the group of {len(group)} takes a place per sequence: with {len(group) - 1} it "
            f"stays swapped, whole; got swapped {ids(s.swapped)}"
        )
        s.config.max_num_seqs = len(group)
        out = s.schedule()
        assert ids(s.running) == ids(group) and len(out.blocks_to_swap_in) == blocks, (
            f"with {len(group)} places the group comes back together, in one swap of its "
            f"{blocks} blocks: running {ids(s.running)}, map {out.blocks_to_swap_in}"
        )


@seeded
def test_part4_a_swap_in_charges_a_token_per_decode_and_stops_at_the_budget(rng, monkeypatch):
    for _ in range(4):
        bs, budget = rng.randint(1, 6), rng.randint(4, 30)
        s = small_scheduler(
            block_size=bs,
            num_gpu_blocks=600,
            num_cpu_blocks=600,
            max_model_len=300,
            max_num_seqs=budget,
            enable_chunked_prefill=True,
            max_num_batched_tokens=budget,
            preemption_mode="swap",
        )
        prefill = new_seq(rng, s, 0, rng.randint(2, 60), 0.0)
        s.add(prefill)  # made running by hand, in its prefill
        s.waiting.remove(prefill)
        s.block_manager.allocate(prefill)
        prefill.status = SequenceStatus.RUNNING
        s.running.append(prefill)
        swapped = []
        count = rng.randint(2, 8)
        for k in range(count):  # decoding sequences swapped out by hand
            seq = new_seq(rng, s, 1 + k, rng.randint(1, 20), 1.0 + k)
            s.add(seq)
            s.waiting.remove(seq)
            s.block_manager.allocate(seq)
            seq.num_computed_tokens, seq.is_prefill = seq.num_tokens - 1, False
            s.block_manager.swap_out([seq])
            seq.status = SequenceStatus.SWAPPED
            s.swapped.append(seq)
            swapped.append(seq)
        # the tokens left bind before the places do (budget - 1 left) in most draws
        spend = (
            budget - rng.randint(0, min(count, budget - 1) - 1)
            if rng.random() < 0.7
            else (rng.randint(0, budget))
        )

        def chunks(seqs, out, left, spend=spend):  # a stand-in for part 2.5
            if spend:
                out.scheduled.append(ScheduledSequence(seqs[0], spend, True))
            left.add(spend, 0)

        monkeypatch.setattr(s, "_schedule_prefill_chunks", chunks)
        out = s.schedule()
        back = swapped[: min(len(swapped), budget - spend, budget - 1)]
        want = ([(0, spend, True)] if spend else []) + [(q.seq_id, 1, False) for q in back]
        assert planned(out) == want, (
            f"the chunk pass spent {spend} of the {budget}-token budget: each swapped-in decode "
            f"takes a token (and a place), so at most {budget - spend} of the "
            f"{len(swapped)} come back; expected {want}, got {planned(out)}"
        )
        assert out.num_batched_tokens <= budget
        monkeypatch.undo()


@seeded
def test_part4_a_swapped_group_comes_back_whole_or_is_ignored_whole(rng):
    for _ in range(4):
        s, old, group = group_case(rng, "swap", cpu=64)
        out = s.schedule()  # the group is swapped out
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
        s.abort(old.seq_id)  # the GPU pool is free
        bs, gpu = s.config.block_size, s.config.num_gpu_blocks
        shared = ceil_div(group[0].num_prompt_tokens, bs)
        need = shared + len(group)  # every sample's next token writes the shared last block
        out = s.schedule()
        if need > gpu:
            assert [i.seq for i in out.ignored] == group and not s.swapped, (
                f"the group needs {shared} blocks + 1 per sample = {need} > the pool of {gpu}: "
                f"NEVER, the whole group is taken out and each ignored, in order; got ignored "
                f"{[i.seq.seq_id for i in out.ignored]}, swapped {ids(s.swapped)}"
            )
            assert s.block_manager.num_free_cpu_blocks == 64, "its CPU blocks are freed"
        else:
            assert ids(s.running) == ids(group) and not out.ignored, (
                f"the group needs {need} blocks of the {gpu} free: it comes back whole, got "
                f"running {ids(s.running)}"
            )


# --------------------------------------------------------------------------------------------
# Part 2.5: chunked prefill
# --------------------------------------------------------------------------------------------


@seeded
def test_part5_a_long_prompt_is_prefilled_in_chunks_of_the_budget(rng):
    budget = rng.randint(2, 40)
    length = rng.choice([rng.randint(budget + 1, 6 * budget), budget * rng.randint(1, 5) + 1])
    s = small_scheduler(
        block_size=rng.randint(1, 8),
        num_gpu_blocks=400,
        max_model_len=length + 10,
        max_num_seqs=min(budget, 4),
        enable_chunked_prefill=True,
        max_num_batched_tokens=budget,
    )
    seq = new_seq(rng, s, 7, length, 1.0, max_tokens=3)
    s.add(seq)
    want = [budget] * (length // budget) + ([length % budget] if length % budget else [])
    got = []
    for _ in want:
        out = s.schedule()
        got += [n for i, n, prefill in planned(out) if i == 7 and prefill]
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
        if len(got) < len(want):
            assert seq.num_completion_tokens == 0, "a chunk that stops short yields no token"
    assert got == want, (
        f"a {length}-token prompt under a budget of {budget} is prefilled in chunks {want}, got "
        f"{got}"
    )
    assert seq.num_completion_tokens == 1 and seq.num_computed_tokens == length
    assert not seq.is_prefill and planned(s.schedule()) == [(7, 1, False)]


@seeded
def test_part5_decodes_go_first_and_the_prompt_takes_what_is_left(rng):
    budget = rng.randint(6, 40)
    decoders = rng.randint(1, min(5, budget - 2))
    length = rng.randint(budget, 5 * budget)
    s = small_scheduler(
        block_size=rng.randint(1, 8),
        num_gpu_blocks=3000,
        max_model_len=length + 500,
        max_num_seqs=decoders + 1,
        enable_chunked_prefill=True,
        max_num_batched_tokens=budget,
    )
    short = []
    for k in range(decoders):
        seq = new_seq(rng, s, k, 1, float(k), max_tokens=400)
        s.add(seq)
        short.append(seq)
    out = s.schedule()
    s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
    long = new_seq(rng, s, 50, length, 100.0, max_tokens=3)
    s.add(long)
    left, chunk = length, budget - decoders
    while left:
        out = s.schedule()
        want = [(q.seq_id, 1, False) for q in short] + [(50, min(chunk, left), True)]
        assert planned(out) == want, (
            f"{decoders} decoding sequences and a {length}-token prompt ({left} left) under a "
            f"budget of {budget}: the decodes first, then a chunk of what is left of the budget "
            f"({chunk}); expected {want}, got {planned(out)}"
        )
        s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
        left -= min(chunk, left)


@seeded
def test_part5_prefill_chunks_go_oldest_first_and_stop_when_the_budget_is_spent(rng):
    for k in range(3):
        check_prefill_chunks(rng, runs_out=k > 0)


def check_prefill_chunks(rng, runs_out: bool) -> None:
    """Running prefills made by hand; ``runs_out``: the budget ends before the last one."""
    bs = rng.randint(1, 6)
    s = small_scheduler(
        block_size=bs, num_gpu_blocks=400, enable_chunked_prefill=True, max_num_batched_tokens=64
    )
    seqs = []
    for k in range(rng.randint(2, 7)):
        seq = new_seq(rng, s, k * 11, rng.randint(2, 40), float(k))
        s.add(seq)
        s.waiting.remove(seq)  # made running by hand, part-way through its prefill
        s.block_manager.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = rng.randint(0, seq.num_tokens - 1)
        if k == 0:
            seq.num_computed_tokens = seq.num_tokens - 1  # a last chunk of one token
        s.running.append(seq)
        seqs.append(seq)
    total, seats = rng.randint(1, 80), rng.randint(0, 8)
    used = rng.randint(0, total - 1)
    if runs_out:
        lefts = [q.num_tokens - q.num_computed_tokens for q in seqs]
        cut = rng.randint(1, len(seqs) - 1)  # sequences from `cut` on find the budget (nearly)
        used = rng.randint(0, 10)
        total = used + sum(lefts[:cut]) + rng.randint(0, lefts[cut] - 1)
        total = max(total, used + 1)
    budget = SchedulingBudget(total, 16, num_batched_tokens=used, num_seqs=seats)
    out = SchedulerOutput()
    s._schedule_prefill_chunks(seqs, out, budget)
    want, spent = [], used
    for seq in seqs:
        n = min(seq.num_tokens - seq.num_computed_tokens, total - spent)
        if n == 0:
            break
        want.append((seq.seq_id, n, True))
        spent += n
    left = [(q.seq_id, q.num_tokens - q.num_computed_tokens) for q in seqs]
    assert planned(out) == want, (
        f"prefills (id, tokens left) {left}, a budget of {total} with {used} spent: oldest "
        "first, each the chunk that fits "
        f"what is left, no chunk of 0; expected {want}, got {planned(out)}"
    )
    assert (budget.num_batched_tokens, budget.num_seqs) == (spent, seats), (
        "chunks charge their tokens, not sequence places: (tokens, places) expected "
        f"{(spent, seats)}, got {(budget.num_batched_tokens, budget.num_seqs)}"
    )


@seeded
def test_part5_every_step_fills_the_token_budget_while_there_is_work(rng):
    for _ in range(4):
        budget = rng.randint(4, 48)
        count = rng.randint(2, min(10, budget))
        mml = rng.randint(budget + 1, budget + 80)
        s = small_scheduler(
            block_size=rng.randint(1, 8),
            num_gpu_blocks=3000,
            max_model_len=mml,
            max_num_seqs=count,
            enable_chunked_prefill=True,
            max_num_batched_tokens=budget,
        )
        seqs = []
        for k in range(count):  # the first is longer than the budget: it is cut into chunks
            prompt = rng.randint(budget + 1, mml) if k == 0 else rng.randint(1, mml)
            seq = new_seq(rng, s, k, prompt, float(k), max_tokens=rng.randint(1, 30))
            s.add(seq)
            seqs.append(seq)
        work = {q.seq_id: [q.num_tokens, 0] for q in seqs}  # the test's own (tokens, computed)
        for k in range(5000):
            if not work:
                break
            want = min(budget, sum(n - c for n, c in work.values()))
            out = s.schedule()
            assert out.num_batched_tokens == want, (
                f"step {k}: decodes, then prefill chunks, then new prompts cut to fit, fill the "
                f"budget of {budget} while there is work: {want} tokens expected (the work left "
                f"is {sum(n - c for n, c in work.values())}), got {out.num_batched_tokens}"
            )
            finished = s.postprocess(out.scheduled, [a_token(rng) for _ in out.scheduled])
            for seq_id, n, _ in planned(out):
                work[seq_id][1] += n
                if work[seq_id][1] == work[seq_id][0]:
                    work[seq_id][0] += 1
            for seq in finished:
                del work[seq.seq_id]


@seeded
def test_part5_chunked_and_unchunked_runs_generate_the_same_tokens(rng):
    salt = rng.getrandbits(32)
    eos = rng.randrange(VOCAB)

    def token(seq: Sequence) -> int:
        draw = rng_token(salt, seq.seq_id, seq.num_completion_tokens)
        return eos if draw % 23 == 0 else draw

    mml = rng.randint(8, 60)
    bs = rng.randint(1, 8)
    requests = [(rng.randint(1, mml), rng.randint(1, 20)) for _ in range(rng.randint(2, 8))]
    requests[0] = (mml, requests[0][1])  # longer than the chunked budget: cut into chunks
    runs = []
    for chunk in (None, rng.randint(2, mml - 1)):
        options = {
            "block_size": bs,
            "num_gpu_blocks": 2000,
            "max_model_len": mml,
            "max_num_seqs": 2,
            "eos_token_id": eos,
        }
        if chunk:
            options |= {"enable_chunked_prefill": True, "max_num_batched_tokens": chunk}
        s = small_scheduler(**options)
        seqs = []
        for k, (prompt, out_len) in enumerate(requests):
            seq = Sequence(
                k,
                [rng_token(salt, -1, k * 1000 + i) for i in range(prompt)],
                bs,
                SamplingParams(max_tokens=out_len),
                float(k),
            )
            s.add(seq)
            seqs.append(seq)
        for _ in range(5000):
            if s.is_finished():
                break
            out = s.schedule()
            s.postprocess(out.scheduled, [token(item.seq) for item in out.scheduled])
        runs.append({q.seq_id: (q.status, q.token_ids) for q in seqs})
    assert runs[1] == runs[0], (
        "chunking changes when tokens are computed, not what is generated: with the same "
        "sampled tokens, every request's (status, tokens) with chunked prefill must equal "
        "those without"
    )


def rng_token(salt: int, seq_id: int, index: int) -> int:
    """A token that depends only on (salt, sequence, position)."""
    return hash((salt, seq_id, index)) % VOCAB
