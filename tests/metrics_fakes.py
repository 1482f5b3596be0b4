"""Phase 5's stand-ins for the engine, shared by the visible and the hidden graded tests.

``scheduler`` and ``seq`` build what ``StatLogger.record_step`` and its token and finish hooks
read, without Phase 1-2's code: a part of Phase 5 is graded on its own code only.
``tests/runtime/test_metrics.py`` checks that ``FakeSequence`` has every public attribute of a
real ``Sequence``, with the values a real one would have.
"""

from types import SimpleNamespace

import pytest

from vkv.engine.sequence import SequenceStatus
from vkv.metrics.rulecheck import promtool_test
from vkv.sampling_params import SamplingParams


def scheduler(running=0, waiting=0, swapped=0, gpu=0.0, cpu=0.0, queries=0, hits=0):
    """What ``record_step`` reads of a scheduler: its queues and its block manager's figures."""
    manager = SimpleNamespace(
        gpu_usage=gpu, cpu_usage=cpu, num_query_tokens=queries, num_hit_tokens=hits
    )
    return SimpleNamespace(
        running=[object()] * running,
        waiting=[object()] * waiting,
        swapped=[object()] * swapped,
        block_manager=manager,
    )


class FakeSequence:
    """A sequence as the logger sees it, with every public attribute of ``Sequence`` (Phase 1's
    contract: ``tests/runtime/test_metrics.py`` checks that none is missing), built without
    Phase 1's code. Reading anything else fails with the list of what a Sequence has."""

    def __init__(self, seq_id, prompt, completion, arrival, group_id=None, block_size=4):
        self.seq_id = seq_id
        self.status = SequenceStatus.RUNNING
        self.token_ids = [7] * prompt + [9] * completion
        self.num_prompt_tokens = prompt
        self.num_tokens = prompt + completion
        self.block_size = block_size
        self.block_table = list(range(-(-self.num_tokens // block_size)))
        self.sampling_params = SamplingParams()
        self.arrival_time = arrival
        self.num_computed_tokens = self.num_tokens - 1
        self.is_prefill = completion == 0
        self.group_id = seq_id if group_id is None else group_id
        self.block_hashes = []

    def __len__(self) -> int:
        return self.num_tokens

    num_completion_tokens = property(lambda self: self.num_tokens - self.num_prompt_tokens)
    prompt_token_ids = property(lambda self: self.token_ids[: self.num_prompt_tokens])
    completion_token_ids = property(lambda self: self.token_ids[self.num_prompt_tokens :])
    last_token = property(lambda self: self.token_ids[-1])
    is_finished = property(lambda self: self.status.is_finished)
    num_blocks = property(lambda self: -(-self.num_tokens // self.block_size))
    last_block_num_tokens = property(
        lambda self: self.num_tokens - (self.num_blocks - 1) * self.block_size
    )

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_tokens += 1

    def __getattr__(self, name: str):
        public = sorted(n for n in {*vars(self), *vars(type(self))} if not n.startswith("_"))
        raise AttributeError(
            f"the logger read seq.{name}, which a Sequence does not have; its public "
            f"attributes are {', '.join(public)} (vkv/engine/sequence.py)"
        )


def seq(seq_id, prompt=10, completion=1, arrival=100.0, group_id=None):
    """A sequence with ``prompt`` prompt tokens and ``completion`` generated ones."""
    return FakeSequence(seq_id, prompt, completion, arrival, group_id)


def check_rules(tmp_path, rules: list[dict], rule: str, inputs: list[dict], checks=(), alerts=()):
    """Run promtool on ``rules``; on a mismatch, fail with the rule broken, the expressions
    written and promtool's expected-against-got."""
    group = {"input_series": inputs}
    if checks:
        group["promql_expr_test"] = list(checks)
    if alerts:
        group["alert_rule_test"] = list(alerts)
    said = promtool_test(rules, [group], tmp_path)
    if said is not None:
        written = "\n".join(
            f"  {r.get('record') or r.get('alert')}: {r.get('expr')}"
            for r in rules
            if isinstance(r, dict)
        )
        pytest.fail(
            f"{rule}\n\nyour rules:\n{written}\n\npromtool test rules (exp: the rule's answer, "
            f"got: your rules'):\n{said}",
            pytrace=False,
        )
