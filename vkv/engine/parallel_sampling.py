"""Parallel sampling (``SamplingParams.n > 1``): a request's prompt is computed once, for its
first sample; the step that completes the prompt draws every sample's first token from the same
logits, and the engine then forks the others from the first (``Scheduler.fork``: they share the
prompt's blocks, copy-on-write for the last one). Each sample draws from its own seed."""

import hashlib
from dataclasses import replace

from vkv.engine.scheduler import ScheduledSequence
from vkv.engine.sequence import Sequence
from vkv.sampling_params import MAX_SEED, SamplingParams


def forks_due(
    scheduled: list[ScheduledSequence], samples: dict[int, list[Sequence]]
) -> dict[int, list[SamplingParams]]:
    """For each request of ``n > 1`` samples (``samples``: request id -> its samples so far)
    whose prompt this step completes, the params of its other ``n - 1`` samples."""
    due = {}
    for item in scheduled:
        seq = item.seq
        params = seq.sampling_params
        unforked = params.n > len(samples.get(seq.seq_id, ())) == 1
        if unforked and seq.num_computed_tokens + item.num_tokens == seq.num_tokens:
            due[seq.seq_id] = [
                replace(params, n=1, seed=sample_seed(params.seed, index))
                for index in range(1, params.n)
            ]
    return due


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's sample ``index`` (> 0): its own draws, reproducible."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SEED
