"""``vkv serve``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

One background thread runs the engine: whenever a request is unfinished it calls
``LLMEngine.step``, so requests from every HTTP client join the running batch as soon as the
scheduler admits them (continuous batching across clients). Handlers add requests and read
their outputs from an ``asyncio.Queue`` each; a lock serializes the engine's calls. A client that
disconnects aborts its request, which frees its blocks at once.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as server-sent
events with ``"stream": true``, and ``stream_options.include_usage`` for a last chunk with the
usage and no choices; ``n``, ``temperature``, ``top_p``, ``max_tokens``, ``stop``, ``seed``,
``user``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``; completions:
``logprobs`` (0 to 5), ``echo``; chat: ``logprobs`` with ``top_logprobs`` (0 to 20)),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (the engine's Prometheus registry).
Logprobs are the log-softmax of the model's raw logits (before penalties, bias and
temperature: vLLM's default), in OpenAI's shapes. Bad input gets an OpenAI-style error body,
``{"error": {"message", "type", "param", "code"}}``, with status 400 (404 for an unknown
model), and the engine is untouched: any other field (``best_of``, ``suffix``, ``tools``,
``response_format``...) is refused naming it, as is ``echo`` with ``logprobs`` (the prompt's
logprobs are not computed), a missing ``model``, a ``stream`` that is not a boolean, a body
over 8 MiB or nested more than 32 deep (checked before it is decoded), and a prompt that could
never fit the KV pool. A prompt is tokenized and checked off the engine's thread and the event
loop, so a large one does not pause the other streams.

The body is read and checked in ``vkv/openai_request.py``. Chat prompts: the checkpoint's
``chat_template`` (``tokenizer_config.json``, Jinja) when it has one; otherwise, as for
vkv-tiny, each message as ``"{role}: {content}\\n"`` followed by ``"assistant: "``.
"""

import asyncio
import itertools
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, SimpleQueue

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vkv.engine.llm_engine import LLMEngine
from vkv.engine.model_runner import TokenLogprobs
from vkv.engine.outputs import RequestOutput
from vkv.net import free_port
from vkv.openai_request import (
    SERVED,
    RequestError,
    optional,
    read_body,
    render_chat,
    sampling_params,
    stream_options,
)
from vkv.sampling_params import SamplingParams

WAIT_SECONDS = 0.2  # the longest a request waits for output before it looks for a gone client


class AsyncEngine:
    """The engine, owned by one background thread; requests and their outputs for asyncio.

    Handlers never touch the engine nor wait for it: ``add`` and ``abort`` post a command that
    the engine's thread carries out before its next step (a lock would let the stepping thread
    starve the event loop), and each request's outputs come back on its ``asyncio.Queue``.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.commands: SimpleQueue = SimpleQueue()
        self.work = threading.Event()
        self.queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stopped = False
        self.failed: str | None = None  # why the engine stopped for good (its step raised)
        self.thread = threading.Thread(target=self._run, name="vkv-engine", daemon=True)
        self.thread.start()

    async def add(self, prompt: str | list[int], params: SamplingParams):
        """Queue a request; return its id and the queue its outputs arrive on (``ValueError``
        if the engine refuses it)."""
        queue: asyncio.Queue = asyncio.Queue()
        done: Future = Future()
        self._post(("add", prompt, params, asyncio.get_running_loop(), queue, done))
        if self.failed is not None:  # no thread carries it out: refuse it here
            self._refuse_commands()
        return await asyncio.wrap_future(done), queue

    def release(self, request_id: int) -> None:
        """Stop delivering a request's outputs, abort what of it is unfinished (its client
        left) and make the engine forget it (``LLMEngine.forget``): called once a request is
        answered or abandoned, so the engine holds only the requests in flight."""
        self._post(("release", request_id))

    def stop(self) -> None:
        self.stopped = True
        self.work.set()
        self.thread.join(timeout=5)

    def _post(self, command: tuple) -> None:
        self.commands.put(command)
        self.work.set()

    def _run(self) -> None:
        """Carry out the commands and step while there is work. A step that raises (a
        tensor-parallel worker lost, a bug) stops the engine for good: each request in flight
        ends with ``finish_reason`` error, later ones are refused with 503."""
        try:
            self._serve()
        except Exception as error:
            self.failed = f"the engine stopped: {type(error).__name__}: {error}"
            print(f"vkv serve: {self.failed}", file=sys.stderr)
            self._end_requests_in_flight()
            self._refuse_commands()

    def _end_requests_in_flight(self) -> None:
        for request_id, (loop, queue) in list(self.queues.items()):
            for index, seq in enumerate(self.engine.samples(request_id)):
                if not seq.is_finished:
                    output = RequestOutput(
                        request_id, index, "", [], seq.completion_token_ids, True, "error",
                        error=self.failed,
                    )  # fmt: skip
                    loop.call_soon_threadsafe(queue.put_nowait, output)

    def _refuse_commands(self) -> None:
        """After a failure: refuse every request still queued (503), drop the rest."""
        while True:
            try:
                kind, *args = self.commands.get_nowait()
            except Empty:
                return
            done = args[-1] if kind == "add" else None
            if done is not None and not done.done():
                done.set_exception(RequestError(self.failed or "", status=503))

    def _serve(self) -> None:
        while not self.stopped:
            self._carry_out_commands()
            if not self.engine.has_unfinished_requests():
                self.work.wait(timeout=1.0)
                self.work.clear()
                continue
            for output in self.engine.step():
                target = self.queues.get(output.request_id)
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, output)

    def _carry_out_commands(self) -> None:
        while not self.commands.empty():
            kind, *args = self.commands.get()
            if kind == "add":
                prompt, params, loop, queue, done = args
                try:
                    request_id = self.engine.add_request(prompt, params)
                except ValueError as error:
                    done.set_exception(error)
                    continue
                self.queues[request_id] = (loop, queue)
                done.set_result(request_id)
            else:
                self.queues.pop(args[0], None)
                if any(not s.is_finished for s in self.engine.samples(args[0])):
                    self.engine.abort(args[0])
                self.engine.forget(args[0])


@dataclass(slots=True)
class Sample:
    """What a client has been sent of one of a request's samples."""

    text: str = ""  # what it generated, cut before a stop string
    tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # its tokens', if asked
    offset: int = 0  # where its next token's text begins in the choice's text (text_offset)
    finish_reason: str | None = None


def create_app(engine: LLMEngine, model_name: str, chat_template: str | None = None) -> FastAPI:
    """The HTTP API over ``engine``; ``app.state.engine`` is its ``AsyncEngine``."""
    served = AsyncEngine(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        served.stop()

    app = FastAPI(title="vkv serve", lifespan=lifespan)
    app.state.engine = served
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def request_error(_: Request, error: RequestError) -> JSONResponse:
        return error_response(error)

    @app.get("/health")
    async def health():
        if served.failed is not None:
            return JSONResponse({"status": "failed", "error": served.failed}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        model = {"id": model_name, "object": "model", "created": created, "owned_by": "vkv"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, model_name, SERVED["completions"])
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string", "prompt")
        return await respond(request, served, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, model_name, SERVED["chat"])
        prompt = render_chat(body.get("messages"), chat_template)
        return await respond(request, served, body, prompt, chat=True)

    return app


@dataclass(slots=True)
class Reply:
    """How a request's answer is written: its head (id, created, model), the endpoint's shape,
    the text echoed before each completion, whether logprobs and a usage chunk go out."""

    head: dict
    chat: bool
    decode: Callable[[list[int]], str]
    prompt_tokens: int
    echo: str = ""
    logprobs: bool = False
    include_usage: bool = False

    def usage(self, samples: list["Sample"]) -> dict:
        completion_tokens = sum(s.tokens for s in samples)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def logprobs_of(self, sample: "Sample", entries: list[TokenLogprobs]) -> dict | None:
        """OpenAI's ``logprobs`` of a choice for these tokens of ``sample`` (None when not
        asked). Completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the top k and
        the token itself, as OpenAI documents: up to k + 1) and ``text_offset`` (each token's
        place in the choice's text, echo included); chat: a ``content`` list of ``{token,
        logprob, bytes, top_logprobs}``."""
        if not self.logprobs:
            return None
        tokens = [self.decode([e.token_id]) for e in entries]
        if self.chat:
            content = [
                {
                    **token_info(token, entry.logprob),
                    "top_logprobs": [token_info(self.decode([t]), v) for t, v in entry.top],
                }
                for token, entry in zip(tokens, entries, strict=True)
            ]
            return {"content": content, "refusal": None}
        offsets = list(itertools.accumulate(map(len, tokens), initial=sample.offset))
        sample.offset = offsets.pop()
        top = [
            {**{self.decode([t]): v for t, v in e.top}, token: e.logprob}
            for token, e in zip(tokens, entries, strict=True)
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }


def token_info(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


async def respond(request: Request, served: AsyncEngine, body: dict, prompt: str, chat: bool):
    engine = served.engine
    params = sampling_params(body, engine.config.max_model_len, chat)
    include_usage = stream_options(body)
    echo = optional(body, "echo", False)
    if not isinstance(echo, bool):
        raise RequestError(f"echo must be true or false, got {echo!r}", "echo")
    try:  # tokenizing and checking off the engine's thread and the event loop
        token_ids, params = await asyncio.to_thread(engine.check_request, prompt, params)
    except ValueError as error:
        param = str(error).split()[0]
        param = {"n": "n", "logit_bias": "logit_bias"}.get(param, "messages" if chat else "prompt")
        raise RequestError(str(error), param) from None
    never = engine.never_fits(len(token_ids))
    if never is not None:
        raise RequestError(
            f"this request can never be served: {never}", "messages" if chat else "prompt"
        )
    request_id, queue = await served.add(token_ids, params)
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body["model"],
    }
    reply = Reply(
        head,
        chat,
        engine.decode,
        len(token_ids),
        prompt if echo else "",
        params.logprobs is not None,
        include_usage,
    )
    samples = [Sample(offset=len(reply.echo)) for _ in range(params.n)]
    gone = asyncio.Event()
    watcher = asyncio.create_task(watch_disconnect(request, gone))
    events = follow(gone, served, request_id, queue, samples)
    if body.get("stream"):
        return StreamingResponse(
            stream(events, reply, samples, watcher), media_type="text/event-stream"
        )
    try:
        async for _ in events:
            pass
    finally:
        watcher.cancel()
    if any(s.finish_reason is None for s in samples):  # the client left
        return Response(status_code=499)
    for sample in samples:
        sample.offset = len(reply.echo)
    return {
        **head,
        "object": "chat.completion" if chat else "text_completion",
        "choices": [
            choice(i, reply.echo + s.text, s.finish_reason, chat, reply.logprobs_of(s, s.logprobs))
            for i, s in enumerate(samples)
        ],
        "usage": reply.usage(samples),
    }


async def watch_disconnect(request: Request, gone: asyncio.Event) -> None:
    """Set ``gone`` when the client disconnects (the server's next ASGI message says so)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


async def follow(
    gone: asyncio.Event,
    served: AsyncEngine,
    request_id: int,
    queue: asyncio.Queue,
    samples: list[Sample],
) -> AsyncIterator[tuple[int, str, list[TokenLogprobs]]]:
    """Yield ``(sample index, new text, the new tokens' logprobs)`` as the engine produces
    them (the logprobs empty when not asked), until every sample is done (the engine ends a
    sample at a stop string, its text cut before it); a gone client aborts all."""
    try:
        while not all(s.finish_reason for s in samples):
            if gone.is_set():
                return
            try:
                output: RequestOutput = await asyncio.wait_for(queue.get(), WAIT_SECONDS)
            except TimeoutError:
                continue
            sample = samples[output.index]
            if sample.finish_reason:
                continue
            sample.tokens += len(output.new_token_ids)
            sample.text += output.new_text
            sample.finish_reason = output.finish_reason
            logprobs = output.logprobs or []
            sample.logprobs += logprobs
            if output.new_text or logprobs:
                yield output.index, output.new_text, logprobs
    finally:
        served.release(request_id)


async def stream(
    events, reply: Reply, samples: list[Sample], watcher: asyncio.Task
) -> AsyncIterator[str]:
    """The answer as server-sent events: a chat's role first, a completion's echoed prompt
    first; then each piece of text with its logprobs; each sample's finish reason; with
    ``include_usage``, a last chunk of no choices and the usage (``usage`` is null before)."""
    chat = reply.chat
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if reply.include_usage else {}

    def chunk(choices: list[dict]) -> str:
        return sse({**reply.head, "object": kind, "choices": choices, **extra})

    for index in range(len(samples)):
        if chat:
            yield chunk([delta(index, "", None, chat, role=True)])
        elif reply.echo:
            yield chunk([delta(index, reply.echo, None, chat)])
    try:
        async for index, text, logprobs in events:
            logprobs = reply.logprobs_of(samples[index], logprobs)
            yield chunk([delta(index, text, None, chat, logprobs=logprobs)])
    finally:
        await events.aclose()  # a client that left: its request is released now
        watcher.cancel()
    for index, sample in enumerate(samples):
        yield chunk([delta(index, "", sample.finish_reason, chat)])
    if reply.include_usage:
        yield sse({**reply.head, "object": kind, "choices": [], "usage": reply.usage(samples)})
    yield "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def choice(index: int, text: str, reason: str | None, chat: bool, logprobs: dict | None) -> dict:
    if chat:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "finish_reason": reason, "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}


def delta(
    index: int,
    text: str,
    reason: str | None,
    chat: bool,
    role: bool = False,
    logprobs: dict | None = None,
) -> dict:
    if chat:
        content = {"role": "assistant", "content": ""} if role else {"content": text}
        return {"index": index, "delta": content, "finish_reason": reason, "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}


def error_response(error: RequestError) -> JSONResponse:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    body = {"message": str(error), "type": kind, "param": error.param, "code": error.code}
    return JSONResponse({"error": body}, status_code=error.status)


def chat_template_of(model: str | Path | None) -> str | None:
    """The checkpoint's Jinja chat template, if its ``tokenizer_config.json`` has one."""
    if model is None:
        return None
    config = Path(model) / "tokenizer_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("chat_template")


def serve_in_thread(engine: LLMEngine, model_name: str) -> tuple[uvicorn.Server, str]:
    """Serve ``engine`` on a free port of 127.0.0.1 from a daemon thread (tests, benchmarks,
    notebooks); returns the server (``server.should_exit = True`` stops it) and its URL."""
    port = free_port()
    config = uvicorn.Config(
        create_app(engine, model_name), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, name="vkv-serve", daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"
