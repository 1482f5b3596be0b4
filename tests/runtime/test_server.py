"""``vkv serve`` through the official ``openai`` client, on 127.0.0.1: completions and chat,
streamed and not, ``n``, ``stop``, ``seed``; bad input gets OpenAI-style errors; a client that
leaves mid-stream frees its blocks. The shared server runs in float32 (``devices.py``): a
request's tokens and logprobs, streamed or not, must not depend on the batch it ran in."""

import itertools
import json
import statistics
import threading
import time

import httpx
import openai
import pytest
from devices import EXACT_DTYPE

from vkv.engine.llm_engine import LLMEngine
from vkv.engine.parallel import WorkerError
from vkv.server import serve_in_thread

MODEL = "vkv-tiny"
UNSERVED_COMPLETION_FIELDS = {  # what OpenAI defines and vkv serve does not do: refused by name
    "best_of": 2,
    "suffix": "x",
    "not_an_openai_field": 1,
}
UNSERVED_CHAT_FIELDS = {
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "response_format": {"type": "json_object"},
}
CHAT = [{"role": "user", "content": "x"}]
BAD_VALUES = [  # served fields with values OpenAI does not allow: (path, extra fields, param)
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"logit_bias": [5]}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"999": 1}}, "logit_bias"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"other": 1}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(
        num_gpu_blocks=600,
        max_model_len=1024,
        max_num_seqs=16,
        enable_prefix_caching=True,
        dtype=EXACT_DTYPE,
    )
    uv, url = serve_in_thread(engine, MODEL)
    yield engine, url
    uv.should_exit = True


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="none", max_retries=0)


def idle(engine: LLMEngine, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests() and engine.scheduler.block_manager.gpu_usage == 0:
            return True
        time.sleep(0.05)
    return False


def gauges_at_rest(url: str, deadline: float) -> bool:
    """Whether ``/metrics`` reads 0 running requests and 0 GPU KV usage by ``deadline``
    (``time.monotonic()``); the engine may not step again, so only an abort can set them."""
    while True:
        text = httpx.get(f"{url}/metrics").text
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vkv_num_requests_running{", "vkv_gpu_cache_usage_perc{"))
        }
        if values == {"vkv_num_requests_running": 0.0, "vkv_gpu_cache_usage_perc": 0.0}:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_a_completion_with_usage(client, server):
    result = client.completions.create(
        model=MODEL, prompt="def f(x):\n", max_tokens=12, temperature=0, seed=1
    )
    choice = result.choices[0]
    assert result.object == "text_completion" and choice.finish_reason == "length"
    assert result.usage.completion_tokens == 12 and result.usage.prompt_tokens == 10
    assert choice.text


def test_greedy_and_seeded_completions_repeat(client):
    for options in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
        a, b = (
            client.completions.create(model=MODEL, prompt="import os\n", max_tokens=16, **options)
            .choices[0]
            .text
            for _ in range(2)
        )
        assert a == b


def test_a_stream_is_well_formed_and_equals_the_plain_answer(client):
    plain = (
        client.completions.create(model=MODEL, prompt="class A:\n", max_tokens=20, temperature=0)
        .choices[0]
        .text
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="class A:\n", max_tokens=20, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == plain
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_plain_and_streamed(client):
    messages = [{"role": "user", "content": "write a function"}]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == plain.choices[0].message.content


def test_n_samples_and_stop_strings(client):
    result = client.completions.create(
        model=MODEL, prompt="def g(y):\n", max_tokens=24, n=3, temperature=0.9, seed=3
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 3 * 24
    full = (
        client.completions.create(model=MODEL, prompt="def h(z):\n", max_tokens=40, temperature=0)
        .choices[0]
        .text
    )
    stop = full[5:7]
    cut = client.completions.create(
        model=MODEL, prompt="def h(z):\n", max_tokens=40, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.text == full[: full.find(stop)] and cut.finish_reason == "stop"


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server[1]}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server[1]}/metrics")
    assert metrics.status_code == 200 and "vkv_generation_tokens_total" in metrics.text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ("{not json", 400, None),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x" * 1100}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "n": 100}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "n": 10**9}, 400, "n"),
        ('{"model": "vkv-tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None),
        ({"prompt": "x"}, 400, "model"),
        ({"model": MODEL, "prompt": "x", "stream": "false"}, 400, "stream"),
        ({"model": MODEL, "prompt": "x", "stream": 1}, 400, "stream"),
        *[
            ({"model": MODEL, "prompt": "x", field: value}, 400, field)
            for field, value in UNSERVED_COMPLETION_FIELDS.items()
        ],
        *[
            (
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], field: value},
                400,
                field,
            )
            for field, value in UNSERVED_CHAT_FIELDS.items()
        ],
        *[
            (
                {"model": MODEL, **({"messages": CHAT} if path == "chat" else {"prompt": "x"})}
                | extra,
                400,
                param,
            )
            for path, extra, param in BAD_VALUES
        ],
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ],
)
def test_bad_input_gets_an_openai_error_and_leaves_the_engine_alone(server, body, status, param):
    engine, url = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        f"{url}{path}", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert idle(engine)
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_the_official_client_gets_a_refused_field_by_name(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=2)
    assert refused.value.body["param"] == "best_of"
    assert "`best_of` is not supported" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=6)
    assert refused.value.body["param"] == "logprobs"
    assert "logprobs must be an integer in [0, 5]" in refused.value.body["message"]


def test_a_temperature_below_the_epsilon_samples_greedily(client):
    tiny, zero = (
        client.completions.create(
            model=MODEL, prompt="import os\n", max_tokens=8, temperature=t
        ).choices[0]
        for t in (1e-300, 0)
    )
    assert tiny.finish_reason == zero.finish_reason == "length"
    assert tiny.text == zero.text


def test_a_prompt_that_could_never_fit_the_pool_is_refused_up_front():
    engine = LLMEngine(num_gpu_blocks=4, max_model_len=1024)
    uv, url = serve_in_thread(engine, MODEL)
    try:
        body = {"model": MODEL, "prompt": "x" * 200, "max_tokens": 2}
        response = httpx.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prompt"
        assert error["message"].startswith("this request can never be served: its 200 prompt ")
        assert not engine.has_unfinished_requests()
        ok = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "x"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    finally:
        uv.should_exit = True


def test_clients_that_leave_mid_stream_hold_no_blocks(server):
    engine, url = server
    aborted_before = engine.metrics.value("request_success_total", finished_reason="abort")
    errors: list[BaseException] = []

    def leave() -> None:
        body = {"model": MODEL, "prompt": "def slow():\n", "max_tokens": 1000, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                for i, _ in enumerate(response.iter_lines()):
                    if i == 3:
                        break  # closes the connection mid-stream
        except BaseException as error:  # a thread's failure must fail the test
            errors.append(error)

    threads = [threading.Thread(target=leave) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    left = time.monotonic()
    assert not errors, errors
    assert gauges_at_rest(url, left + 1.0), "/metrics reads 0 running and 0 usage within 1 s"
    assert idle(engine), "the requests of clients that left are aborted and their blocks freed"
    assert engine.stats["running"] == 0 and engine.stats["gpu_kv_usage"] == 0
    aborted = engine.metrics.value("request_success_total", finished_reason="abort")
    assert aborted - aborted_before == 8, "each request whose client left was aborted"
    assert forgotten(engine), "the engine keeps no record of requests answered or abandoned"


def forgotten(engine: LLMEngine, timeout: float = 10.0) -> bool:
    """Whether the engine holds no request within ``timeout`` (a release reaches its thread as
    a command)."""
    deadline = time.monotonic() + timeout
    while engine.num_held_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.num_held_requests == 0


def test_chat_uses_the_checkpoints_template_when_it_has_one(tmp_path):
    from vkv.openai_request import render_chat
    from vkv.server import chat_template_of

    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(messages, None) == "user: hi\nassistant: "
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    template += "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    template = chat_template_of(tmp_path)
    assert render_chat(messages, template) == "<|user|>hi<|assistant|>"
    assert chat_template_of(None) is None


def test_stop_string_finishes_count_as_stop_with_the_tokens_the_clients_got(client, server):
    engine, _ = server
    reasons = ("stop", "abort", "length")
    before = {r: engine.metrics.value("request_success_total", finished_reason=r) for r in reasons}
    tokens_before = engine.metrics.value("generation_tokens_total")
    results: list = [None] * 5

    def ask(i: int) -> None:
        results[i] = client.completions.create(
            model=MODEL, prompt="def f(x):\n", max_tokens=64, temperature=0.9, seed=i, stop=["\n"]
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is not None for r in results), "a request failed"
    choices = [r.choices[0] for r in results]
    assert all("\n" not in c.text for c in choices)
    assert idle(engine)
    after = {r: engine.metrics.value("request_success_total", finished_reason=r) for r in reasons}
    counted = {r: after[r] - before[r] for r in reasons}
    assert counted == {r: sum(c.finish_reason == r for c in choices) for r in reasons}
    assert counted["abort"] == 0 and counted["stop"] >= 1
    received = sum(r.usage.completion_tokens for r in results)
    assert engine.metrics.value("generation_tokens_total") - tokens_before == received


def test_completion_logprobs_in_openais_shape_streamed_or_not(client):
    options = {"model": MODEL, "prompt": "def f(x):\n", "max_tokens": 10, "temperature": 0}
    result = client.completions.create(**options, logprobs=3)
    choice = result.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == result.usage.completion_tokens == 10
    assert "".join(logprobs.tokens) == choice.text, "vkv-tiny's tokens are its text's bytes"
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(10)]
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0 and top[token] == logprob, "the sampled token is always listed"
        assert 3 <= len(top) <= 4 and max(top.values()) == logprob, "greedy: the most likely"
    streamed = list(client.completions.create(**options, logprobs=3, stream=True))
    pieces = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == logprobs.tokens
    assert [v for p in pieces for v in p.token_logprobs] == pytest.approx(
        logprobs.token_logprobs, abs=1e-4
    )
    assert [o for p in pieces for o in p.text_offset] == logprobs.text_offset
    assert client.completions.create(**options).choices[0].logprobs is None


def test_chat_logprobs_in_openais_shape(client):
    options = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    result = client.chat.completions.create(**options, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == result.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    streamed = client.chat.completions.create(**options, logprobs=True, top_logprobs=2, stream=True)
    pieces = [c.choices[0].logprobs.content for c in streamed if c.choices[0].logprobs]
    streamed_content = [e for p in pieces for e in p]  # the batch differs: compare to 1e-4
    assert [e.token for e in streamed_content] == [e.token for e in content]
    assert [e.logprob for e in streamed_content] == pytest.approx(
        [e.logprob for e in content], abs=1e-4
    )
    plain = client.chat.completions.create(**options, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(**options).choices[0].logprobs is None


def test_echo_puts_the_prompt_before_the_completion(client):
    options = {"model": MODEL, "prompt": "import os\n", "max_tokens": 8, "temperature": 0}
    plain = client.completions.create(**options).choices[0].text
    echoed = client.completions.create(**options, echo=True)
    assert echoed.choices[0].text == "import os\n" + plain
    assert echoed.usage.completion_tokens == 8
    streamed = client.completions.create(**options, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "import os\n" + plain


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_ends_the_stream_with_a_usage_chunk(client, chat):
    options = {"model": MODEL, "max_tokens": 7, "temperature": 0, "n": 2, "stream": True}
    options["stream_options"] = {"include_usage": True}
    if chat:
        chunks = list(client.chat.completions.create(messages=CHAT, **options))
    else:
        chunks = list(client.completions.create(prompt="import os\n", **options))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 2 * 7
    assert last.usage.total_tokens == last.usage.prompt_tokens + 14
    assert all(c.usage is None and c.choices for c in body)
    options.pop("stream_options")
    plain = client.completions.create(prompt="import os\n", **options)
    assert all(c.usage is None for c in plain)


def test_penalties_and_logit_bias_reach_the_sampler(client):
    options = {"model": MODEL, "prompt": "def f(x):\n", "max_tokens": 12, "temperature": 0}
    biased = client.completions.create(**options, logit_bias={str(ord("z")): 100})
    assert biased.choices[0].text == "z" * 12
    plain = client.completions.create(**options).choices[0].text
    for penalty in ("presence_penalty", "frequency_penalty"):
        penalized = client.completions.create(**options, **{penalty: 2.0}).choices[0].text
        assert penalized != plain, f"{penalty} 2.0 changes vkv-tiny's greedy completion"
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logit_bias={str(ord("q")): 100}
    )
    assert chat.choices[0].message.content == "q" * 5


STALL_FACTOR = 40  # a chunk gap may grow to this many times the stream's own median gap...
STALL_FLOOR = 2.0  # ...or to this many seconds, whichever is larger (a busy 2-core machine)


def test_a_huge_prompt_does_not_stall_a_running_stream(server):
    """A 1 MB prompt (refused: far over max_model_len) is read, decoded, tokenized and checked
    while another client streams: that stream's longest chunk gap in the meantime stays within
    ``max(STALL_FACTOR x its median gap, STALL_FLOOR)``. Tokenizing with the GIL held (``encode``
    rather than ``encode_batch``) stalled it 3.55 s against a median gap of 6.8 ms; now the
    longest gap is 0.1-0.6 s on a shared 2-core machine (``-s`` prints the numbers)."""
    engine, url = server
    body = {
        "model": MODEL,
        "prompt": "def f(x):\n",
        "max_tokens": 400,
        "temperature": 0,
        "logit_bias": {"256": -100},  # vkv-tiny's EOS never comes: the stream runs to the end
        "stream": True,
    }
    arrivals: list[float] = []
    huge: dict = {}

    def send_huge() -> None:
        prompt = "x = 1\n" * ((1 << 20) // 6)  # 1 MB
        huge["sent"] = time.monotonic()
        huge["response"] = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt}, timeout=60
        )
        huge["done"] = time.monotonic()

    sender = threading.Thread(target=send_huge)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 40:
                    sender.start()
    sender.join()
    assert huge["response"].status_code == 400, huge["response"].text
    assert huge["response"].json()["error"]["param"] == "prompt"
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    median = statistics.median(gaps)
    during = [
        b - a for a, b in itertools.pairwise(arrivals) if b >= huge["sent"] and a <= huge["done"]
    ]
    bound = max(STALL_FACTOR * median, STALL_FLOOR)
    print(
        f"median gap {median * 1e3:.1f} ms, longest while the huge prompt was handled "
        f"{max(during) * 1e3:.1f} ms over {len(during)} gaps, handled in "
        f"{huge['done'] - huge['sent']:.2f} s; bound {bound:.2f} s"
    )
    assert len(arrivals) > 100 and during, "the huge prompt was handled while the stream ran"
    assert max(during) <= bound, (
        f"a chunk gap of {max(during):.2f} s while a 1 MB prompt was handled (median gap "
        f"{median * 1e3:.1f} ms): the prompt's reading, decoding or tokenizing paused the stream"
    )
    assert idle(engine)


def test_an_engine_that_stops_ends_the_requests_in_flight_and_refuses_the_rest():
    """A step that raises (here as it does when a tensor-parallel worker is lost) stops the
    engine for good: the request in flight ends with finish_reason "error", later ones get a
    503 saying why, and /health says it too."""
    engine = LLMEngine(num_gpu_blocks=64)
    steps, step = 0, engine.step

    def failing_third_step():
        nonlocal steps
        steps += 1
        if steps == 3:
            raise WorkerError("tensor-parallel worker rank 1 (pid 1) died with exit code -9")
        return step()

    engine.step = failing_third_step
    uv, url = serve_in_thread(engine, MODEL)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answer = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=50)
        assert answer.choices[0].finish_reason == "error"
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt="def g(x):", max_tokens=2)
        assert refused.value.status_code == 503 and "worker rank 1" in str(refused.value)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "worker rank 1" in health.json()["error"]
    finally:
        uv.should_exit = True
