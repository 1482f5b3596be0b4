"""The engine's sampling options beyond temperature / top-k / top-p: stop strings, checked by
the engine each step (the request finishes as ``stop`` before another step runs it)."""

import pytest

from vkv import LLM, SamplingParams

PROMPT = "def f(x):\n"


@pytest.fixture(scope="module")
def llm():
    return LLM(num_gpu_blocks=64)


def run(llm: LLM, **options) -> dict:
    (result,) = llm.generate([PROMPT], SamplingParams(**options), use_progress=False)
    return result


def test_a_stop_string_cuts_the_text_and_finishes_as_stop(llm):
    full = run(llm, temperature=0.0, max_tokens=40, ignore_eos=True)
    stop = full["text"][12:15]  # three characters, likely across a token boundary
    before = llm.engine.metrics.value("request_success_total", finished_reason="stop")
    cut = run(llm, temperature=0.0, max_tokens=40, ignore_eos=True, stop=["\x00never", stop])
    assert cut["text"] == full["text"][: full["text"].find(stop)]
    assert cut["finish_reason"] == "stop"
    assert full["token_ids"][: len(cut["token_ids"])] == cut["token_ids"]
    assert len(cut["token_ids"]) < len(full["token_ids"]), "no token after the stop string"
    assert stop in llm.engine.decode(cut["token_ids"]), "the last token completed the string"
    after = llm.engine.metrics.value("request_success_total", finished_reason="stop")
    assert after - before == 1 and llm.engine.stats["gpu_kv_usage"] == 0


def test_streamed_text_holds_back_what_may_begin_a_stop_string(llm):
    full = run(llm, temperature=0.0, max_tokens=40, ignore_eos=True)["text"]
    stop = full[20:24]
    engine = llm.engine
    request = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, stop=stop))
    pieces, outputs = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == request
            pieces.append(output.new_text)
            outputs.append(output)
            assert stop not in "".join(pieces), "text past a stop string went out"
    assert "".join(pieces) == outputs[-1].text == full[: full.find(stop)]
    assert outputs[-1].finish_reason == "stop"
    tokens = sum(len(o.new_token_ids) for o in outputs)
    assert tokens == len(engine.sequence(request).completion_token_ids)


def test_the_generation_tokens_counted_are_the_tokens_returned(llm):
    engine = llm.engine
    before = engine.metrics.value("generation_tokens_total")
    params = [
        SamplingParams(temperature=0.9, seed=seed, max_tokens=64, stop=["\n"], n=2)
        for seed in range(4)
    ]
    results = llm.generate([PROMPT] * 4, params, use_progress=False)
    outputs = [o for result in results for o in result["outputs"]]
    assert all("\n" not in o["text"] for o in outputs)
    assert any(o["finish_reason"] == "stop" and len(o["token_ids"]) < 64 for o in outputs)
    returned = sum(len(o["token_ids"]) for o in outputs)
    assert engine.metrics.value("generation_tokens_total") - before == returned


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"stop": [""]}, "stop must be a string or a list of non-empty strings, got ['']"),
        ({"stop": [1]}, "stop must be a string or a list of non-empty strings, got [1]"),
        ({"stop": 5}, "stop must be a string or a list of non-empty strings, got 5"),
    ],
)
def test_bad_sampling_options_are_refused_naming_the_field(options, said):
    with pytest.raises(ValueError) as raised:
        SamplingParams(**options)
    assert str(raised.value) == said


def test_a_single_stop_string_is_kept_as_a_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
