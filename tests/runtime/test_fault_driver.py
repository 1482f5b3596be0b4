"""A randomized fault driver for ``LLMEngine``: the block accounting and the outputs under abuse.

Each run draws an engine (block size 1, 4 or 16; a GPU pool of 8 to 48 tokens and a CPU pool
of 0, 1 or 2 times it; swap or recompute preemption; chunked prefill on or off) over a tiny
random Qwen3, then for ``steps`` steps adds requests (some longer than ``max_model_len``:
refused; some longer than the pool: ignored; some poisoned: the model raises on them; one in
five asks for 2 or 3 parallel samples, which fork, share blocks and are preempted as a group),
aborts requests (running, waiting, swapped, already finished, unknown: the last two refused),
and steps. After every step it checks the engine's invariants. Then, with no more arrivals,
everything must finish within a bound (no livelock). At the end every poisoned request has
failed alone (``finish_reason == "error"``, nothing generated) unless it was ignored or aborted
first, and every other completion (each sample's), whatever ended it, is a prefix of the greedy
completion of the same prompt served alone (so the engines run in float32: ``devices.py``).

The short version runs in every test run; ``uv run pytest -m slow
tests/runtime/test_fault_driver.py`` runs the long one (20 seeds of 1,000 steps).
"""

import random

import pytest
from devices import EXACT_DTYPE
from prefix_checks import check_prefix_cache
from tiny_checkpoints import tiny_hf_model

from vkv import SamplingParams
from vkv.engine.block import Device
from vkv.engine.key_residual import partial_blocks
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.radix_cache import block_hash
from vkv.engine.sequence import SequenceStatus

MAX_MODEL_LEN = 64
GREEDY = dict(temperature=0.0, ignore_eos=True)
POISON = 95  # the last id of the tiny vocabulary; a prompt that starts with it is poisoned


class PoisonedModel:
    """The engine's model, except that a batch with a poisoned prompt's first token raises."""

    def __init__(self, model):
        self.model = model
        self.config = model.config

    def __call__(self, input_ids, positions, *rest):
        if bool(((input_ids == POISON) & (positions == 0)).any()):
            raise RuntimeError("the model met a poisoned prompt")
        return self.model(input_ids, positions, *rest)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_hf_model().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def alone(folder):
    """Greedy completions of prompts served one at a time, in a pool that holds everything."""
    engine = LLMEngine(
        folder, block_size=16, num_gpu_blocks=64, max_model_len=MAX_MODEL_LEN, dtype=EXACT_DTYPE
    )
    done: dict[tuple[int, ...], list[int]] = {}

    def completion(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in done:
            budget = MAX_MODEL_LEN + 1 - len(prompt)
            request = engine.add_request(prompt, SamplingParams(max_tokens=budget, **GREEDY))
            while engine.has_unfinished_requests():
                engine.step()
            done[key] = engine.sequence(request).completion_token_ids
        return done[key]

    return completion


def make_engine(folder, rng: random.Random, kv: dict[str, str | bool]) -> LLMEngine:
    """A pool of 8 to 48 tokens (smaller than many requests; 24 to 96 with prefix caching), a
    CPU pool of 0, 1 or 2 times it, the KV options ``kv``; the model raises on poisoned prompts.
    With prefix caching, one run in two hashes blocks into 4 values, so that most children
    collide (a collision is a miss)."""
    chunked = rng.random() < 0.5
    block_size = rng.choice([1, 4, 16])
    pool_tokens = rng.randint(24, 96) if kv.get("enable_prefix_caching") else rng.randint(8, 48)
    num_gpu_blocks = max(2, pool_tokens // block_size)
    engine = LLMEngine(
        folder,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=rng.choice([0, 1, 2]) * num_gpu_blocks,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=rng.choice([2, 4, 8]),
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=rng.choice([16, 64]) if chunked else None,
        preemption_mode=rng.choice(["swap", "recompute"]),
        dtype=EXACT_DTYPE,
        **kv,
    )
    engine.runner.model = PoisonedModel(engine.runner.model)
    manager = engine.scheduler.block_manager
    if kv.get("enable_prefix_caching") and rng.random() < 0.5:
        manager.hash_function = lambda parent, tokens: block_hash(parent, tokens) % 4
    if engine.cache_engine.residual is not None:
        check_residual_after_each_apply(engine)
    return engine


def check_residual_after_each_apply(engine: LLMEngine) -> None:
    """Keys per channel: once a step's maps are applied, only partial blocks hold residual
    rows: the running sequences' on the GPU, the swapped ones' on the CPU."""
    apply, residual = engine.runner.apply_block_maps, engine.cache_engine.residual
    size = engine.config.block_size

    def checked(out, running, swapped) -> None:
        apply(out, running, swapped)
        for blocks, seqs, where in (
            (residual.gpu_blocks, running, "GPU"),
            (residual.cpu_blocks, swapped, "CPU"),
        ):
            partial = partial_blocks(seqs, size)
            assert blocks <= partial, f"{where} blocks {blocks - partial} hold stale residual rows"

    engine.runner.apply_block_maps = checked


def check_invariants(engine: LLMEngine) -> None:
    scheduler, manager = engine.scheduler, engine.scheduler.block_manager
    queues = {
        SequenceStatus.WAITING: (list(scheduler.waiting), None),
        SequenceStatus.RUNNING: (scheduler.running, Device.GPU),
        SequenceStatus.SWAPPED: (scheduler.swapped, Device.CPU),
    }
    queued = [seq.seq_id for queue, _ in queues.values() for seq in queue]
    assert len(queued) == len(set(queued)) == scheduler.num_unfinished, "one queue each"
    for status, (queue, device) in queues.items():
        for seq in queue:
            assert seq.status is status, f"{seq} is queued as {status.name}"
            assert manager.device_of(seq) is device, f"{seq}: blocks on {manager.device_of(seq)}"
    for device, allocator, queue in (
        (Device.GPU, manager.gpu_allocator, scheduler.running),
        (Device.CPU, manager.cpu_allocator, scheduler.swapped),
    ):
        holders = [0] * allocator.num_blocks
        for seq in queue:
            for block_id in seq.block_table:
                holders[block_id] += 1
        refs = [block.ref_count for block in allocator.blocks]
        assert refs == holders, f"{device.value}: ref counts {refs}, holders {holders}"
        used = sum(count > 0 for count in holders)
        assert allocator.num_free_blocks + used == allocator.num_blocks, f"{device.value} leak"
    for request_id in range(engine._next_id):
        seq = engine.sequence(request_id)
        if seq.is_finished:
            assert seq.block_table == [] and manager.device_of(seq) is None, f"{seq} holds blocks"
    residual = engine.cache_engine.residual
    if residual is not None:
        check_key_residual(engine, residual)
    if engine.config.enable_prefix_caching:
        check_prefix_cache(manager, scheduler.running)


def check_key_residual(engine: LLMEngine, residual) -> None:
    """Keys per channel: every partial block's keys are held (on the GPU for a running
    sequence, on the CPU for a swapped one), and the slots in use stay within the pool."""
    scheduler, size = engine.scheduler, engine.config.block_size
    for queue, held in (
        (scheduler.running, residual.gpu_blocks),
        (scheduler.swapped, residual.cpu_blocks),
    ):
        lost = partial_blocks(queue, size) - held
        assert not lost, f"the keys of partial blocks {lost} are lost"
    assert residual.num_used <= 2 * engine.config.max_num_seqs


def drive(
    folder, alone, seed: int, steps: int, kv: dict[str, str | bool] | None = None
) -> dict[str, int]:
    """One randomized run; returns what happened, by kind. With a quantized ``kv`` format the
    completions are not compared with those served alone (a recomputed or chunked prefill reads
    a block's keys quantized where a decode read them in full precision), only counted. With
    prefix caching, prompts share prefixes: one in two starts with one of three 16-token
    prefixes, one in four repeats an earlier prompt with what it has generated so far (a next
    turn of a chat), and the completions must equal those served alone without caching."""
    rng = random.Random(seed)
    engine = make_engine(folder, rng, kv or {})
    caching = engine.config.enable_prefix_caching
    quantized = engine.config.kv_cache_dtype != "auto"
    prompts: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    seen = dict.fromkeys(("added", "refused", "aborted", "abort refused", "finished"), 0)

    def step() -> None:
        for output in engine.step():
            if output.finished:
                reasons[output.request_id] = output.finish_reason
                seen["finished"] += 1

    for _ in range(steps):
        roll = rng.random()
        if roll < 0.2:
            prompt = [rng.randrange(POISON) for _ in range(rng.choice([1, 5, 20, 40, 70]))]
            if caching:
                prompt = shared_prefix(rng, engine, prompts) + prompt[: rng.choice([1, 8, 30])]
            prompt[0] = POISON if rng.random() < 0.15 else prompt[0]
            n = min(rng.choice([1, 1, 1, 2, 3]), engine.config.max_num_seqs)
            params = SamplingParams(max_tokens=rng.randint(1, 30), n=n, **GREEDY)
            try:
                request = engine.add_request(prompt, params)
            except ValueError:
                assert len(prompt) > MAX_MODEL_LEN, f"a {len(prompt)}-token prompt was refused"
                seen["refused"] += 1
            else:
                prompts[request] = prompt
                seen["added"] += 1
        elif roll < 0.25:
            request = rng.randrange(engine._next_id + 2)  # the last ids are unknown
            finished = request not in prompts or all(
                sample.is_finished for sample in engine.samples(request)
            )
            try:
                engine.abort(request)
            except ValueError:
                assert finished, f"abort({request}) refused a request that is not finished"
                seen["abort refused"] += 1
            else:
                assert not finished, f"abort({request}) accepted a finished or unknown id"
                reasons[request] = "abort"
                seen["aborted"] += 1
        else:
            step()
        check_invariants(engine)
    bound = sum(MAX_MODEL_LEN + 1 for _ in prompts) + 10  # a token a step at least, alone
    for _ in range(bound):  # no more arrivals: everything must finish (no livelock)
        if not engine.has_unfinished_requests():
            break
        step()
        check_invariants(engine)
    assert not engine.has_unfinished_requests(), f"seed {seed}: unfinished after {bound} steps"
    seen["preemptions"] = engine.scheduler.num_preemptions
    seen["ignored"] = sum(
        engine.sequence(request).status is SequenceStatus.FINISHED_IGNORED for request in prompts
    )
    seen["failed"] = sum(reason == "error" for reason in reasons.values())
    seen["prefix hit tokens"] = getattr(engine.scheduler.block_manager, "num_hit_tokens", 0)
    for request, prompt in prompts.items():
        got = engine.sequence(request).completion_token_ids
        if prompt[0] == POISON:
            assert reasons.get(request) in ("error", "ignored", "abort") and got == [], (
                f"seed {seed}, poisoned request {request}: {reasons.get(request)}, {got}"
            )
            continue
        assert reasons.get(request) != "error", f"seed {seed}: request {request} failed"
        if quantized:
            continue
        for sample in engine.samples(request):  # n > 1: every greedy sample is the same
            got = sample.completion_token_ids
            expected = alone(prompt)[: len(got)]
            assert got == expected, f"seed {seed}, request {request}: {got} != alone {expected}"
    return seen


def shared_prefix(rng: random.Random, engine: LLMEngine, prompts: dict[int, list[int]]):
    """The start of a prompt that shares a prefix: nothing, one of three fixed 16-token
    prefixes, or an earlier prompt with the tokens it has generated so far."""
    roll = rng.random()
    if roll < 0.5:
        which = rng.randrange(3)
        return [(7 * i + 3 * which) % POISON for i in range(16)]
    if roll < 0.75 and prompts:
        earlier = engine.sequence(rng.choice(list(prompts)))
        return list(earlier.token_ids)
    return []


@pytest.mark.parametrize("seed", range(8))
def test_short_randomized_runs_keep_the_invariants_and_the_outputs(folder, alone, seed):
    seen = drive(folder, alone, seed, steps=300)
    assert seen["added"] and seen["finished"] and seen["failed"], seen


@pytest.mark.parametrize("seed", range(4))
def test_randomized_runs_with_keys_per_channel_never_lose_a_partial_block(folder, alone, seed):
    kv = {"kv_cache_dtype": "int8", "key_granularity": "per_channel"}
    seen = drive(folder, alone, 50 + seed, steps=300, kv=kv)
    assert seen["added"] and seen["finished"] and seen["preemptions"] and seen["failed"], seen


@pytest.mark.parametrize("seed", range(6))
def test_randomized_runs_with_prefix_caching_give_the_outputs_served_alone(folder, alone, seed):
    seen = drive(folder, alone, 200 + seed, steps=300, kv={"enable_prefix_caching": True})
    assert seen["added"] and seen["finished"] and seen["prefix hit tokens"], seen


@pytest.mark.slow
def test_long_randomized_runs_keep_the_invariants_and_the_outputs(folder, alone, request):
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("the long run: uv run pytest -m slow tests/runtime/test_fault_driver.py")
    totals: dict[str, int] = {}
    for seed in range(20):
        for kind, count in drive(folder, alone, 100 + seed, steps=1000).items():
            totals[kind] = totals.get(kind, 0) + count
    print(f"20 seeds x 1,000 steps: {totals}")
