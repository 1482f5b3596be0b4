"""The engine's sampling options beyond temperature / top-k / top-p: stop strings, checked by
the engine each step (the request finishes as ``stop`` before another step runs it); presence
and frequency penalties and a logit bias, against a direct computation on Hugging Face's logits
of vkv-tiny; logprobs, the log-softmax of those raw logits. The engine runs on each device in
float32, as Hugging Face's model here (``devices.py``): logprobs agree to 1e-4."""

import math

import pytest
import torch
from devices import EXACT_DTYPE
from transformers import AutoModelForCausalLM

from vkv import LLM, SamplingParams
from vkv.engine.model_runner import adjust_logits, token_logprobs
from vkv.models.loader import DEFAULT_MODEL

PROMPT = "def f(x):\n"


@pytest.fixture(scope="module")
def llm(device):
    return LLM(num_gpu_blocks=64, device=device, dtype=EXACT_DTYPE)


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
    "options",
    [
        {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
        {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, "stop": ["):", "\n    "]},
        {"temperature": 0.9, "seed": 3, "max_tokens": 30, "n": 2, "logprobs": 2, "stop": "\n"},
    ],
    ids=["greedy", "stop strings", "n=2 with logprobs"],
)
def test_a_final_only_request_returns_one_output_holding_what_a_cumulative_one_ends_with(
    llm, options
):
    """The same request twice in one batch, one streamed and one final-only: the final-only
    one returns one output per sample, when it finishes, equal to the streamed one's last in
    everything it holds so far; the metrics count both requests' tokens alike."""
    engine = llm.engine
    before = engine.metrics.value("generation_tokens_total")
    kinds = {
        engine.add_request(PROMPT, SamplingParams(**options, output_kind=kind)): kind
        for kind in ("cumulative", "final_only")
    }
    seen: dict[str, dict[int, list]] = {kind: {} for kind in kinds.values()}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[kinds[output.request_id]].setdefault(output.index, []).append(output)
    streamed, final = seen["cumulative"], seen["final_only"]
    assert sorted(final) == sorted(streamed) == list(range(options.get("n", 1)))
    for index, (output,) in final.items():
        last = streamed[index][-1]
        assert output.finished and len(streamed[index]) > 1
        for field in ("token_ids", "text", "finish_reason", "error"):
            assert getattr(output, field) == getattr(last, field), field
        assert output.new_token_ids == output.token_ids and output.new_text == output.text
        if "logprobs" in options:  # each output holds its new tokens' logprobs
            assert output.logprobs == [entry for o in streamed[index] for entry in o.logprobs]
            assert len(output.logprobs) == len(output.token_ids)
    returned = sum(len(outs[-1].token_ids) for kind in seen.values() for outs in kind.values())
    assert engine.metrics.value("generation_tokens_total") - before == returned
    assert engine.stats["gpu_kv_usage"] == 0


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"stop": [""]}, "stop must be a string or a list of non-empty strings, got ['']"),
        ({"stop": [1]}, "stop must be a string or a list of non-empty strings, got [1]"),
        ({"stop": 5}, "stop must be a string or a list of non-empty strings, got 5"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"frequency_penalty": "x"}, "frequency_penalty must be a finite number, got 'x'"),
        ({"logit_bias": {5: 101}}, "logit_bias values must be in [-100, 100], got 101"),
        ({"logit_bias": {"a": 1}}, "logit_bias token ids must be integers >= 0, got 'a'"),
        ({"logit_bias": {-1: 1}}, "logit_bias token ids must be integers >= 0, got -1"),
        ({"logit_bias": [(1, 1), (1, 2)]}, "logit_bias gives a token id twice"),
        ({"logit_bias": 5}, "logit_bias must be a mapping of token ids to biases, got 5"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
        ({"logprobs": True}, "logprobs must be an integer or None, got True"),
        ({"output_kind": "delta"}, "output_kind must be 'cumulative' or 'final_only', got 'delta'"),
        ({"output_kind": None}, "output_kind must be 'cumulative' or 'final_only', got None"),
    ],
)
def test_bad_sampling_options_are_refused_naming_the_field(options, said):
    with pytest.raises(ValueError) as raised:
        SamplingParams(**options)
    assert str(raised.value) == said


def test_a_single_stop_string_is_kept_as_a_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def direct_greedy(hf, prompt: list[int], count: int, params: SamplingParams) -> list[list]:
    """``count`` greedy tokens, recomputing the whole sequence each time and applying OpenAI's
    formula token by token in plain Python; each as ``[token, raw log-softmax row]``."""
    seq, out = list(prompt), []
    bias = dict(params.logit_bias)
    with torch.no_grad():
        for _ in range(count):
            raw = hf(torch.tensor([seq])).logits[0, -1].tolist()
            generated = seq[len(prompt) :]
            scores = [
                value
                + bias.get(t, 0.0)
                - params.frequency_penalty * generated.count(t)
                - params.presence_penalty * (t in generated)
                for t, value in enumerate(raw)
            ]
            token = max(range(len(scores)), key=scores.__getitem__)
            top = max(raw)
            norm = top + math.log(sum(math.exp(v - top) for v in raw))
            out.append([token, [v - norm for v in raw]])
            seq.append(token)
    return out


@pytest.mark.parametrize(
    "options",
    [
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 0.7, "presence_penalty": -0.5, "logit_bias": {32: -100, 101: 3}},
        {"logit_bias": {ord("z"): 100}},
        {"frequency_penalty": -2.0},
    ],
)
def test_penalties_and_bias_match_a_direct_computation_on_the_logits(llm, hf, options):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5, **options)
    expected = direct_greedy(hf, list(PROMPT.encode()), 16, params)
    result = run(llm, **{**options, "temperature": 0.0, "max_tokens": 16, "ignore_eos": True})
    assert result["token_ids"] == [token for token, _ in expected]
    plain = run(llm, temperature=0.0, max_tokens=16, ignore_eos=True)
    if options != {"frequency_penalty": -2.0}:  # encouraging repeats keeps vkv-tiny's choice
        assert result["token_ids"] != plain["token_ids"], "the options change the greedy choice"


def test_logprobs_are_the_raw_log_softmax_with_the_top_k(llm, hf):
    options = {"presence_penalty": 1.0, "logit_bias": {32: 5.0}}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=4, **options)
    expected = direct_greedy(hf, list(PROMPT.encode()), 12, params)
    engine = llm.engine
    request = engine.add_request(PROMPT, params)
    entries = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert len(output.logprobs) == len(output.new_token_ids)
            entries += output.logprobs
    assert [e.token_id for e in entries] == engine.sequence(request).completion_token_ids
    for entry, (token, row) in zip(entries, expected, strict=True):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token], abs=1e-4), "raw: before the bias"
        ranked = sorted(range(len(row)), key=lambda t: -row[t])[:4]
        assert [t for t, _ in entry.top] == ranked
        assert [v for _, v in entry.top] == pytest.approx([row[t] for t in ranked], abs=1e-4)


def test_each_sample_of_n_gets_its_own_logprobs(llm):
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=6, logprobs=0)
    request = engine.add_request(PROMPT, params)
    got = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == request
            got.setdefault(output.index, []).extend(output.logprobs)
    for index, seq in enumerate(engine.samples(request)):
        assert [e.token_id for e in got[index]] == seq.completion_token_ids
        assert all(e.top == () and e.logprob <= 0 for e in got[index])


def test_adjust_logits_is_openais_formula_and_leaves_the_row_alone():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(
        frequency_penalty=0.5, presence_penalty=-1.25, logit_bias={3: -100, 7: 2.5}
    )
    generated = [7, 7, 7, 2, 39, 2]
    adjusted = adjust_logits(logits, params, generated)
    for t in range(40):
        count = generated.count(t)
        bias = {3: -100.0, 7: 2.5}.get(t, 0.0)
        expected = float(logits[t]) + bias - 0.5 * count + 1.25 * (count > 0)
        assert float(adjusted[t]) == pytest.approx(expected, abs=1e-5), t
    assert adjust_logits(logits, SamplingParams(), generated) is logits
    assert torch.equal(logits, torch.randn(40, generator=torch.Generator().manual_seed(0)))


def test_a_logprob_that_underflows_is_floored_not_minus_infinity():
    logits = torch.tensor([0.0, -1e30, 5.0])
    entry = token_logprobs(logits, 1, 2)
    assert entry.logprob == -9999.0 and [t for t, _ in entry.top] == [2, 0]


def test_a_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 257\)"):
        llm.generate([PROMPT], SamplingParams(logit_bias={257: 1}), use_progress=False)
    assert not llm.engine.has_unfinished_requests()
