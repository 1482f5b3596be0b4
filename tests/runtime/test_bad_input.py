"""Bad input and faults at the public surface, on vkv-tiny: nothing bricks the engine.

One row per case a new user met (the table of the issue on the public surface). Every bad input
is refused with one clear line (a ``ValueError``, or from the CLI one line on stderr and exit
code 2) before anything is queued, and the engine then serves the next request; a fault while
the model runs fails only the request it belongs to. A damaged checkpoint (truncated, garbled,
random bytes, missing tensor or key) is ``test_llm.py``'s table; the randomized driver is
``test_fault_driver.py``. The engine runs on its default device, in float32 (``devices.py``): a
request served in a batch must gain what it gains alone.
"""

import re

import pytest
from devices import EXACT_DTYPE

import vkv.engine.startup as startup
from vkv import LLM, SamplingParams
from vkv.cli import main

ENDOFTEXT = 256  # vkv-tiny's one special token
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(block_size=4, num_gpu_blocks=64, dtype=EXACT_DTYPE)


def serves_the_next_request(llm: LLM) -> None:
    assert llm.engine.scheduler.num_unfinished == 0, "a refused input left something queued"
    assert llm.engine.scheduler.block_manager.num_free_gpu_blocks == 64, "blocks leaked"
    (output,) = llm.generate(["def"], GREEDY, use_progress=False)
    assert len(output["token_ids"]) == 2 and output["finish_reason"] == "length", output


def generate(prompts, params=GREEDY):
    return lambda llm: llm.generate(prompts, params, use_progress=False)


def params(**options):
    return lambda llm: llm.generate(["def"], SamplingParams(**options), use_progress=False)


REFUSED = {
    "seed 1.5": (params(seed=1.5), "seed must be an integer or None, got 1.5"),
    "seed 2**63": (params(seed=2**63), "seed must be in [0, 2**63), got 9223372036854775808"),
    "max_tokens 2.5": (params(max_tokens=2.5), "max_tokens must be an integer, got 2.5"),
    "max_tokens nan": (params(max_tokens=float("nan")), "max_tokens must be an integer, got nan"),
    "temperature inf": (
        params(temperature=float("inf")),
        "temperature must be a finite number, got inf",
    ),
    "token ids [65.7]": (generate([[65.7]]), "a prompt is text or a list of integer token ids"),
    "token ids [True]": (generate([[True]]), "a prompt is text or a list of integer token ids"),
    "a token id outside the vocabulary": (generate([[257]]), "token ids must be in [0, 257)"),
    "a string for the prompt list": (generate("abc"), "prompts is a list of prompts"),
    "an empty prompt after good ones": (generate(["def", "return n", ""]), "the prompt is empty"),
    "fewer params than prompts": (
        generate(["def", "return n"], [GREEDY]),
        "1 sampling params for 2 prompts",
    ),
    "a dict for params": (generate(["def"], [{"temperature": 0}]), "must be a SamplingParams"),
    "a prompt over max_model_len": (generate([[1] * 2049]), "more than max_model_len 2048"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_bad_request_is_one_clear_error_and_the_engine_serves_the_next(llm, case):
    make, said = REFUSED[case]
    with pytest.raises(ValueError, match=re.escape(said)) as raised:
        make(llm)
    assert "\n" not in str(raised.value), "the error is one line"
    serves_the_next_request(llm)


def test_a_seed_up_to_2_63_is_accepted_and_repeats_itself(llm):
    sampled = SamplingParams(temperature=1.0, max_tokens=4, seed=2**45, ignore_eos=True)
    first = llm.generate(["def"], sampled, use_progress=False)
    assert first == llm.generate(["def"], sampled, use_progress=False)
    assert len(first[0]["token_ids"]) == 4
    serves_the_next_request(llm)


UNDECODABLE = b"def \xff(".decode("utf-8", "surrogateescape")  # what a shell passes
COMMANDS = {
    "a non-UTF-8 prompt": (["generate", UNDECODABLE], "the prompt is not valid UTF-8 text"),
    "an empty prompt": (["generate", "def", ""], "the prompt is empty"),
    "--block-size 0": (["generate", "def", "--block-size", "0"], "block_size must be a positive"),
    "--kv-budget-mb 0": (["generate", "def", "--kv-budget-mb", "0"], "holds no block"),
    "--gpu-memory-fraction 7": (
        ["generate", "def", "--gpu-memory-fraction", "7"],
        "gpu_memory_fraction must be in (0, 1], got 7.0",
    ),
    "--max-tokens 0": (["generate", "def", "--max-tokens", "0"], "max_tokens must be >= 1"),
    "--seed 2**63": (["generate", "def", "--seed", str(2**63)], "seed must be in [0, 2**63)"),
    "--backend triton on a CPU": (
        ["generate", "def", "--backend", "triton", "--device", "cpu"],
        "the triton backend needs a CUDA GPU, or TRITON_INTERPRET=1",
    ),
    "demo --max-tokens 0": (["demo", "--max-tokens", "0"], "(--max-tokens) must be >= 1, got 0"),
}


@pytest.mark.parametrize("case", COMMANDS)
def test_a_bad_command_is_one_line_on_stderr_and_exit_code_2(case, capsys, monkeypatch):
    argv, said = COMMANDS[case]
    if case.endswith("on a CPU"):  # a process without Triton's interpreter, as with a GPU
        monkeypatch.setattr(startup, "TRITON_INTERPRETED", False)
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out
    assert main(["generate", "def", "--max-tokens", "2", "--temperature", "0"]) == 0


class FaultyModel:
    """The engine's model, except that a batch holding ``poison`` raises ``error``."""

    def __init__(self, model, poison: int, error: Exception):
        self.model, self.config = model, model.config
        self.poison, self.error = poison, error

    def __call__(self, input_ids, *rest):
        if bool((input_ids == self.poison).any()):
            raise self.error
        return self.model(input_ids, *rest)


@pytest.fixture
def faulty(llm):
    """``llm`` whose model raises on <|endoftext|> (in no prompt's text) until the test ends."""
    model = llm.engine.runner.model
    error = RuntimeError("CUDA error: an illegal\naccess")
    llm.engine.runner.model = FaultyModel(model, ENDOFTEXT, error)
    yield llm
    llm.engine.runner.model = model


def test_a_fault_in_one_request_fails_that_request_and_nothing_else(faulty, capsys):
    prompts = ["def fib(n):", [100, ENDOFTEXT, 101], "import os\n", "class A:"]
    alone = [faulty.generate([p], GREEDY, use_progress=False)[0] for p in prompts[::2]]
    outputs = faulty.generate(prompts, GREEDY, use_progress=False)
    assert [outputs[0], outputs[2]] == alone, "the healthy requests gain what they gain alone"
    assert outputs[3]["finish_reason"] == "length"
    failed = outputs[1]
    assert failed["finish_reason"] == "error" and failed["token_ids"] == [], failed
    assert failed["error"] == "RuntimeError: CUDA error: an illegal access", "one line"
    assert "failed: RuntimeError: CUDA error" in capsys.readouterr().err
    serves_the_next_request(faulty)


def test_a_fault_in_decode_fails_the_request_with_what_it_generated(llm, monkeypatch):
    """A request fails after its prefill: it keeps its tokens, the rest of the batch goes on."""
    engine = llm.engine
    first = engine.add_request("def", SamplingParams(temperature=0.0, max_tokens=8))
    other = engine.add_request("import", SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()
    execute = engine.runner.execute

    def faulty_execute(scheduled, more_samples=None):
        if any(item.seq.seq_id == first for item in scheduled):
            raise ValueError("boom")
        return execute(scheduled, more_samples)

    monkeypatch.setattr(engine.runner, "execute", faulty_execute)
    outputs = {output.request_id: output for output in engine.step()}
    assert outputs[first].finish_reason == "error" and outputs[first].error == "ValueError: boom"
    assert len(outputs[first].token_ids) == 1, "it keeps the token its prefill sampled"
    assert len(outputs[other].token_ids) == 2, "the other request went on in the same step"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.sequence(other).num_completion_tokens == 8
    serves_the_next_request(llm)


def test_a_missing_part_of_the_assignment_is_not_a_request_fault(llm, monkeypatch):
    engine = llm.engine

    def missing_part(scheduled, more_samples=None):
        raise NotImplementedError("part 1.3: BlockManager.get_slot_mapping")

    monkeypatch.setattr(engine.runner, "execute", missing_part)
    engine.add_request("def", GREEDY)
    with pytest.raises(NotImplementedError, match=r"part 1\.3"):
        engine.step()
    monkeypatch.undo()
    while engine.has_unfinished_requests():
        engine.step()
    serves_the_next_request(llm)
