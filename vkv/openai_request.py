"""The body of an OpenAI request to ``vkv serve``, read and checked before the engine sees it.

A body is bounded before it is decoded (``MAX_BODY_BYTES``, and ``MAX_JSON_DEPTH`` levels of
arrays and objects: ``json.loads`` recurses), must name the served model, and may hold only
the fields its endpoint serves (``SERVED``: OpenAI's others are refused by name). Each field's
value is checked (type, range, OpenAI's limits) into ``SamplingParams``; anything wrong raises
``RequestError`` with the message, the parameter and the HTTP status of OpenAI's error body.
Chat messages become one prompt through the checkpoint's chat template (``render_chat``).
"""

import asyncio
import itertools
import json
import re

from fastapi import Request

from vkv.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on a completion's logprobs (chat: MAX_LOGPROBS)
MAX_BODY_BYTES = 8 << 20  # a request body's size bound
MAX_JSON_DEPTH = 32  # how deeply a body may nest arrays and objects (json.loads recurses)
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
NOT_BRACKETS = re.compile(r"[^\[\]{}]")
SERVED_BY_BOTH = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "stream",
    "user",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream_options",
}
SERVED = {  # the fields each endpoint serves; OpenAI's others are refused by name
    "completions": SERVED_BY_BOTH | {"prompt", "echo"},
    "chat": SERVED_BY_BOTH | {"messages", "top_logprobs"},
}


class RequestError(ValueError):
    """Bad input: becomes an OpenAI-style error body with this status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code=None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


async def read_body(request: Request, model_name: str, served: set[str]) -> dict:
    """The request's JSON object, checked: its size and depth bounded before it is decoded, its
    fields those the endpoint serves, its ``model`` given and this server's, ``stream`` a
    boolean (``RequestError`` names what is wrong)."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(f"the body has {len(raw):,} bytes, more than {MAX_BODY_BYTES:,}")
    try:
        body = await asyncio.to_thread(decode_bounded, raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unserved = sorted(body.keys() - served)
    if unserved:
        raise RequestError(
            f"`{unserved[0]}` is not supported by vkv serve (it serves "
            f"{', '.join(sorted(served))})",
            unserved[0],
        )
    if "model" not in body:
        raise RequestError("model is required: the model to use", "model")
    if body["model"] != model_name:
        raise RequestError(
            f"The model `{body['model']}` does not exist: this server serves `{model_name}`",
            "model",
            status=404,
            code="model_not_found",
        )
    if not isinstance(body.get("stream", False), bool):
        raise RequestError(f"stream must be true or false, got {body['stream']!r}", "stream")
    return body


def decode_bounded(raw: bytes) -> object:
    """``json.loads`` of a body that nests at most ``MAX_JSON_DEPTH`` arrays and objects; a
    deeper one raises ``RequestError`` before the decoder recurses into it. A body with no
    more opening brackets than that cannot nest deeper, and skips the scan (whose regular
    expressions hold the GIL: 0.2 s on a 1 MB prompt, while the engine's thread waits)."""
    text = raw.decode()
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return json.loads(text)
    brackets = NOT_BRACKETS.sub("", JSON_STRING.sub("", text))
    steps = (1 if bracket in "[{" else -1 for bracket in brackets)
    depth = max(itertools.accumulate(steps), default=0)
    if depth > MAX_JSON_DEPTH:
        raise RequestError(f"the body nests {depth} levels deep, more than {MAX_JSON_DEPTH}")
    return json.loads(text)


def sampling_params(body: dict, max_model_len: int, chat: bool) -> SamplingParams:
    """The request's sampling options, checked (``RequestError`` names the bad one): OpenAI's
    ranges for ``logprobs`` (completions: 0 to 5) and ``top_logprobs`` (chat: 0 to 20, with
    ``logprobs: true``); ``logit_bias`` keys are token ids written as strings (JSON's)."""
    stop = body.get("stop") or ()
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    max_tokens = body.get("max_tokens", 16)
    if (
        isinstance(max_tokens, int)
        and not isinstance(max_tokens, bool)
        and (max_tokens > max_model_len)
    ):
        raise RequestError(
            f"max_tokens ({max_tokens}) is more than the model's length ({max_model_len})",
            "max_tokens",
        )
    options = {
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_tokens": max_tokens,
        "n": body.get("n", 1),
        "seed": body.get("seed"),
        "stop": stop,
        "presence_penalty": optional(body, "presence_penalty", 0.0),
        "frequency_penalty": optional(body, "frequency_penalty", 0.0),
        "logit_bias": logit_bias(optional(body, "logit_bias", {})),
        "logprobs": chat_logprobs_option(body) if chat else completion_logprobs_option(body),
    }
    try:
        return SamplingParams(**options)
    except (ValueError, TypeError) as error:
        param = str(error).split()[0]
        raise RequestError(str(error), param if param in options else None) from None


def optional(body: dict, name: str, default: object) -> object:
    """A field's value; its default when it is absent or null (OpenAI's optional fields)."""
    value = body.get(name)
    return default if value is None else value


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def logit_bias(bias: object) -> dict[int, object]:
    """OpenAI's ``logit_bias`` (token ids as JSON strings -> biases) with integer keys."""
    if not isinstance(bias, dict) or not all(
        isinstance(key, str) and key.isdecimal() for key in bias
    ):
        raise RequestError(
            f"logit_bias must map token ids (as strings of digits) to biases, got {bias!r}",
            "logit_bias",
        )
    return {int(key): value for key, value in bias.items()}


def completion_logprobs_option(body: dict) -> int | None:
    """``logprobs`` of a completion: None, or how many alternatives per token, 0 to 5."""
    value = body.get("logprobs")
    if value is not None and (not is_int(value) or not 0 <= value <= MAX_COMPLETION_LOGPROBS):
        raise RequestError(
            f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] or null, got {value!r}",
            "logprobs",
        )
    if value is not None and body.get("echo"):
        raise RequestError(
            "echo with logprobs is not supported by vkv serve: it would need the prompt's "
            "logprobs, which vkv does not compute",
            "echo",
        )
    return value


def chat_logprobs_option(body: dict) -> int | None:
    """A chat's ``logprobs`` (true or false) and ``top_logprobs`` (0 to 20, with logprobs)
    as ``SamplingParams.logprobs``: None without logprobs."""
    wanted, top = optional(body, "logprobs", False), body.get("top_logprobs")
    if not isinstance(wanted, bool):
        raise RequestError(f"logprobs must be true or false, got {wanted!r}", "logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise RequestError(
            f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {top!r}",
            "top_logprobs",
        )
    if top is not None and not wanted:
        raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if wanted else None


def stream_options(body: dict) -> bool:
    """Whether the stream ends with a usage chunk: ``stream_options`` is null or
    ``{"include_usage": bool}``, and only for a streamed request."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or not options.keys() <= {"include_usage"}:
        raise RequestError(
            f'stream_options must be {{"include_usage": true or false}}, got {options!r}',
            "stream_options",
        )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError(
            f"stream_options.include_usage must be true or false, got {include!r}",
            "stream_options",
        )
    return include


def render_chat(messages: object, template: str | None) -> str:
    """The prompt of a chat: the checkpoint's template, or ``role: content`` lines."""
    valid = isinstance(messages, list) and messages
    valid = valid and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not valid:
        raise RequestError(
            "messages must be a non-empty list of {role, content} strings", "messages"
        )
    if template is not None:
        import jinja2

        return jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
    lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return lines + "assistant: "
