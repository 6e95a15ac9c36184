"""vLLM's OpenAI-compatible HTTP API in front of an Engine (starlette + uvicorn).

Wire format, field by field, as vLLM serves it (checked against vLLM's source:
vllm/entrypoints/openai/chat_completion/protocol.py and
vllm/entrypoints/openai/completion/protocol.py, and serving.py for streaming):

- request ``return_token_ids: true`` adds token ids (vLLM >= 0.10.2);
- chat: top-level ``prompt_token_ids``; per choice ``token_ids``; with
  ``logprobs: true`` per choice ``logprobs.content[{token, logprob, bytes,
  top_logprobs[{token, logprob, bytes}]}]`` (``top_logprobs: k`` alternatives);
  ``stop_reason`` per choice (the stop string or token id, null for EOS/length);
- completions: per choice ``prompt_token_ids`` and ``token_ids``; with
  ``logprobs: k`` per choice ``logprobs{text_offset, token_logprobs, tokens,
  top_logprobs[{token: logprob}]}``;
- streaming: the first chunk of each chat choice is ``delta{role: assistant,
  content: ""}`` carrying the top-level ``prompt_token_ids``; every later chunk
  carries its delta ``token_ids`` (completions: the choice's first chunk carries
  ``prompt_token_ids``); the chunk with the last token has ``finish_reason``;
  ``stream_options.include_usage`` adds a final chunk with ``choices: []`` and
  ``usage`` (``continuous_usage_stats`` adds usage to every chunk); then
  ``data: [DONE]``. Streamed chunks omit unset fields, as vLLM's
  ``model_dump_json(exclude_unset=True)`` does.

Our additions: ``weight_version`` on every response and chunk; ``GET /health``;
``POST /admin/load_weights {"path", "version"}``; ``GET /metrics``.
Token ids kept on a stop string: like vLLM, ``token_ids`` hold every sampled
token (including the ones that spelled the stop string) while ``text`` is cut
before it; an EOS token is included in ``token_ids`` and left out of the text.
Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Self

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from lightning._core import LightningError
from lightning.engine import tools
from lightning.engine.core import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_PREFILL_CHUNK,
    Engine,
    EngineError,
    Event,
)
from lightning.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from lightning.gateway.local_http import ASGIApp, LocalGuard, check_key, new_key

log = logging.getLogger("lightning.engine")

MAX_N = 64


class RequestError(LightningError):
    """An OpenAI-shaped error answer."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str = "invalid_request",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type, code, param

    def response(self) -> JSONResponse:
        body = {"message": str(self), "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


# ---------------------------------------------------------------------- request parsing
def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int subclass; never accept it where a number is meant.
    if isinstance(value, bool) and bool not in kinds:
        raise RequestError(f"{name} must be {_kind_names(kinds)}, got {value!r}", param=name)
    if not isinstance(value, kinds):
        raise RequestError(f"{name} must be {_kind_names(kinds)}, got {value!r}", param=name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    return " or ".join(
        {
            bool: "a boolean",
            int: "an integer",
            float: "a number",
            str: "a string",
            list: "a list",
            dict: "an object",
        }[k]
        for k in kinds
    )


@dataclass
class Parsed:
    params: list[SamplingParams]  # one per choice (seeds differ per choice)
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    tokens_as_ids: bool
    tool_calls: bool = False  # parse the answer for tool calls (see tools.py)


def check_model(body: dict[str, Any], engine: Engine) -> None:
    model = body.get("model")
    if model not in (None, "", engine.model_name, engine.model_path):
        raise RequestError(
            f"The model `{model}` does not exist; this server serves `{engine.model_name}`.",
            status=404,
            type="NotFoundError",
            code="model_not_found",
            param="model",
        )


def parse_common(
    body: dict[str, Any], *, chat: bool, default_max: int | None, engine: Engine
) -> Parsed:
    check_model(body, engine)
    _refuse_unsupported(body, chat=chat)
    max_tokens = _get(body, "max_completion_tokens", (int,)) if chat else None
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,))
    if max_tokens is None:
        max_tokens = default_max
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    top_k = _get(body, "top_k", (int,), 0)
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must be between 1 and {MAX_N}, got {n}", param="n")
    stops = _stops(body)
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise RequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
    seed = _get(body, "seed", (int,))
    logprobs = _logprobs(body, chat=chat)
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,))
    if options is not None and not stream:
        raise RequestError(
            "stream_options can only be set when stream is true", param="stream_options"
        )
    options = options or {}
    params = []
    for i in range(n):
        try:
            params.append(
                SamplingParams(
                    max_tokens=max_tokens if max_tokens is not None else 16,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    stop=stops,
                    stop_token_ids=tuple(stop_ids),
                    include_stop_str_in_output=bool(body.get("include_stop_str_in_output", False)),
                    ignore_eos=bool(body.get("ignore_eos", False)),
                    # n choices of one seeded request: reproducible, and not all identical.
                    seed=None if seed is None else seed + i,
                    logprobs=logprobs,
                    skip_special_tokens=bool(body.get("skip_special_tokens", True)),
                )
            )
        except ValueError as exc:
            raise RequestError(str(exc)) from None
    return Parsed(
        params=params,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        continuous_usage=bool(options.get("continuous_usage_stats", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids", False)),
    )


def _refuse_unsupported(body: dict[str, Any], *, chat: bool) -> None:
    """A 400 naming the first sampling option this engine cannot honour (set
    to anything but its neutral value), rather than sampling otherwise."""
    for name, neutral in (
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ):
        value = _get(body, name, (int, float))
        if value is not None and float(value) != neutral:
            raise RequestError(
                f"{name} is not supported by this engine; leave it at {neutral}", param=name
            )
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported by this engine", param="logit_bias")
    if (body.get("best_of") or 1) != 1 or body.get("use_beam_search"):
        raise RequestError(
            "best_of and beam search are not supported by this engine", param="best_of"
        )
    if not chat and body.get("echo"):
        raise RequestError("echo is not supported by this engine", param="echo")
    if not chat and body.get("suffix"):
        raise RequestError("suffix is not supported by this engine", param="suffix")


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise RequestError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")


def _logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    """How many top log-probs each token reports (``None``: no log-probs).
    Chat asks with ``logprobs: true`` and ``top_logprobs``; completions with
    an integer ``logprobs``."""
    if chat:
        want = _get(body, "logprobs", (bool,), False)
        top = _get(body, "top_logprobs", (int,), 0)
        if top and not want:
            raise RequestError("top_logprobs requires logprobs: true", param="top_logprobs")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                param="top_logprobs",
            )
        return top if want else None
    logprobs = _get(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}",
            param="logprobs",
        )
    return logprobs


def _message_text(content: Any) -> Any:
    """OpenAI content parts -> one string (text-only models); strings pass through."""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise RequestError("only text content parts are supported", param="messages")
        return "".join(parts)
    return content


def parses_tool_calls(body: dict[str, Any], engine: Engine) -> bool:
    """Validate ``tools``/``tool_choice``; whether the answer is parsed for tool calls.

    Like vLLM, ``tool_choice`` defaults to ``auto`` when tools are given. ``required``
    and named choices need constrained decoding, which this engine does not do: 400.
    """
    given = body.get("tools")
    choice = body.get("tool_choice")
    if given is None:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return False
    if not isinstance(given, list) or not all(_is_function_tool(t) for t in given):
        raise RequestError(
            "tools must be a list of {type: function, function: {name, description, parameters}}",
            param="tools",
        )
    if choice in (None, "auto"):
        if given and engine.tool_parser is None:
            raise RequestError(
                "this model's chat template has no tool-call format the engine parses "
                "(supported: Hermes/Qwen `<tool_call>` JSON); serve it with --chat-template "
                "naming a tool-aware template (e.g. lightning's chatml_tools.jinja), or send "
                'tool_choice: "none"',
                param="tools",
            )
        return bool(given)
    if choice == "none":
        return False
    raise RequestError(
        f"tool_choice {choice!r} is not supported: this engine does not constrain decoding; "
        'use "auto" or "none"',
        param="tool_choice",
    )


def _is_function_tool(tool: Any) -> bool:
    return (
        isinstance(tool, dict)
        and tool.get("type", "function") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """One message as chat templates expect it (vLLM's conversion, chat_utils.py).

    Content parts join into one string and a null content becomes ""; an
    assistant's tool call ``arguments`` (a JSON string on the wire) become the
    object tool-aware templates render with ``tojson``.
    """
    m = dict(m)
    m["content"] = "" if m.get("content") is None else _message_text(m["content"])
    # vLLM's input field is `reasoning`; templates (Qwen3's) read `reasoning_content`,
    # so vLLM hands the template both (chat_utils.py, "interleaved thinking").
    if isinstance(m.get("reasoning"), str):
        m.setdefault("reasoning_content", m["reasoning"])
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and isinstance(calls, list):
        m["tool_calls"] = [_template_tool_call(c) for c in calls]
    return m


def _template_tool_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(
            "each tool call needs function.name and function.arguments", param="messages"
        )
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise RequestError(
                f"tool call {function['name']!r} has arguments that are not JSON: {arguments!r}",
                param="messages",
            ) from None
    return {**call, "function": {**function, "arguments": arguments}}


def chat_prompt(body: dict[str, Any], engine: Engine) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    clean = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError("each message must be an object with a role", param="messages")
        clean.append(_template_message(m))
    try:
        return engine.chat_prompt_ids(
            clean,
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            tools=body.get("tools"),
            chat_template_kwargs=body.get("chat_template_kwargs"),
        )
    except RequestError:
        raise
    except Exception as exc:
        raise RequestError(
            f"the chat template failed on these messages: {exc}", param="messages"
        ) from None


def completion_prompts(body: dict[str, Any], engine: Engine) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [engine.text_prompt_ids(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [engine.text_prompt_ids(p) for p in prompt]
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise RequestError(
        "prompt must be a string, a list of token ids, or a list of either", param="prompt"
    )


# ---------------------------------------------------------------------- running choices
class ChoiceStream:
    """Bridges scheduler-thread events into the request's asyncio queue."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, Event]], index: int
    ):
        self.loop, self.queue, self.index = loop, queue, index

    def __call__(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, event))


@dataclass
class ChoiceResult:
    prompt_ids: list[int]
    token_ids: list[int]
    events: list[Event]
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    weight_version: int = 0


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _tool_delta(
    parser: tools.StreamParser, text: str, finish_reason: str | None, parsed: Parsed
) -> tuple[dict[str, Any] | None, str | None]:
    """A streamed chat delta with tool-call parsing, as vLLM sends it, and the finish reason.

    None: send no chunk (vLLM sends none for a token that adds nothing sendable yet,
    unless the chunk must carry the token's id, its logprob or the finish).
    """
    delta = parser.feed(text, finish_reason is not None)
    if parser.called and finish_reason == "stop":
        finish_reason = "tool_calls"
    if delta is None and finish_reason is None:
        if parsed.params[0].logprobs is None and not parsed.return_token_ids:
            return None, None
    return delta or {}, finish_reason


class Api:
    def __init__(self, engine: Engine, admin_key: str | None = None) -> None:
        self.engine = engine
        self.admin_key = admin_key
        self.created = int(time.time())

    # ------------------------------------------------------------------ helpers
    def _token_str(self, token: int, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else self.engine.token_text(token)[0]

    def _chat_logprob(self, token: int, logprob: float, as_ids: bool) -> dict[str, Any]:
        _, raw = self.engine.token_text(token)
        return {"token": self._token_str(token, as_ids), "logprob": logprob, "bytes": list(raw)}

    def _chat_logprobs(self, events: list[Event], as_ids: bool) -> dict[str, Any]:
        content = []
        for ev in events:
            assert ev.token is not None
            entry = self._chat_logprob(ev.token.token, ev.token.logprob, as_ids)
            entry["top_logprobs"] = [
                self._chat_logprob(t, lp, as_ids) for t, lp in ev.token.top or []
            ]
            content.append(entry)
        return {"content": content}

    def _completion_logprobs(
        self, events: list[Event], as_ids: bool, base_offset: int = 0
    ) -> dict[str, Any]:
        out: dict[str, list[Any]] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        for ev in events:
            assert ev.token is not None
            tok = ev.token
            out["text_offset"].append(base_offset + ev.text_offset)
            out["token_logprobs"].append(tok.logprob)
            out["tokens"].append(self._token_str(tok.token, as_ids))
            top = {self._token_str(t, as_ids): lp for t, lp in tok.top or []}
            top.setdefault(self._token_str(tok.token, as_ids), tok.logprob)
            out["top_logprobs"].append(top)
        return out

    def _submit_all(
        self, prompts: list[list[int]], parsed: Parsed
    ) -> tuple[asyncio.Queue[tuple[int, Event]], list[Any], list[ChoiceResult]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        items: list[Any] = []
        results: list[ChoiceResult] = []
        n = len(parsed.params)
        for pi, prompt in enumerate(prompts):
            for ci, params in enumerate(parsed.params):
                items.append((prompt, params, ChoiceStream(loop, queue, pi * n + ci)))
                results.append(ChoiceResult(prompt, [], []))
        try:
            seqs: list[Any] = self.engine.submit_many(items)
        except EngineError as exc:
            raise RequestError(str(exc), code=exc.code, param=exc.param) from None
        return queue, seqs, results

    @staticmethod
    def _record(result: ChoiceResult, event: Event, seq: Any) -> None:
        if event.error is not None:
            raise RequestError(
                event.error, status=500, type="InternalServerError", code="engine_error"
            )
        if event.token is not None:
            result.token_ids.append(event.token.token)
            result.events.append(event)
        result.text += event.text
        if event.finish_reason is not None:
            result.finish_reason = event.finish_reason
            result.stop_reason = event.stop_reason
            result.weight_version = seq.weight_version

    async def _collect(
        self, queue: asyncio.Queue[tuple[int, Event]], seqs: list[Any], results: list[ChoiceResult]
    ) -> None:
        pending = len(results)
        try:
            while pending:
                index, event = await queue.get()
                self._record(results[index], event, seqs[index])
                if event.finish_reason is not None:
                    pending -= 1
        finally:
            for s in seqs:
                s.cancel()

    # ------------------------------------------------------------------ routes
    async def health(self, request: Request) -> Response:
        return JSONResponse(self.engine.status())

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.engine.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "lightning",
            "root": self.engine.model_path,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(self, request: Request) -> Response:
        status = self.engine.status()
        lines = []
        for key in (
            "weight_version",
            "running",
            "prefilling",
            "waiting",
            "steps",
            "generated_tokens",
            "requests",
            "prefill_tokens",
            "prefill_cached_tokens",
            "prefill_forwards",
            *(k for k in status if k.startswith("kv_cache_")),
        ):
            lines.append(f"lightning_engine_{key} {status[key]}")
        return PlainTextResponse("\n".join(lines) + "\n")

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: a chat request's ``messages`` (+ ``tools``,
        ``add_generation_prompt``, ``chat_template_kwargs``) rendered as ``/v1/chat/completions``
        renders them, or a ``prompt`` as ``/v1/completions`` does; answers vLLM's
        ``TokenizeResponse{count, max_model_len, tokens}`` (vllm/entrypoints/openai/protocol.py)."""
        try:
            body = await self._body(request)
            check_model(body, self.engine)
            if "messages" in body:
                ids = chat_prompt(body, self.engine)
            elif isinstance(body.get("prompt"), str):
                ids = self.engine.text_prompt_ids(body["prompt"])
            else:
                raise RequestError("send `messages` (a chat) or `prompt` (a string) to tokenize")
        except RequestError as exc:
            return exc.response()
        return JSONResponse(
            {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        )

    async def chat(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            prompt = chat_prompt(body, self.engine)
            default_max = max(self.engine.max_model_len - len(prompt), 1)
            parsed = parse_common(body, chat=True, default_max=default_max, engine=self.engine)
            if parses_tool_calls(body, self.engine):
                # Tool-call markers may be special tokens; vLLM's hermes parser keeps
                # them in the text for the same reason.
                parsed.params = [replace(p, skip_special_tokens=False) for p in parsed.params]
                parsed.tool_calls = True
            queue, seqs, results = self._submit_all([prompt], parsed)
        except RequestError as exc:
            return exc.response()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if parsed.stream:
            return self._sse(self._chat_stream(rid, created, parsed, prompt, queue, seqs, results))
        try:
            await self._collect(queue, seqs, results)
        except RequestError as exc:
            return exc.response()
        choices = []
        for i, r in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": r.text, "tool_calls": []}
            finish_reason = r.finish_reason
            found = tools.extract(r.text) if parsed.tool_calls else None
            if found is not None:
                message["content"], message["tool_calls"] = found.content, found.tool_calls
                finish_reason = "tool_calls"
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._chat_logprobs(r.events, parsed.tokens_as_ids)
                    if parsed.params[0].logprobs is not None
                    else None,
                    "finish_reason": finish_reason,
                    "stop_reason": r.stop_reason,
                    "token_ids": r.token_ids if parsed.return_token_ids else None,
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": self.engine.model_name,
                "choices": choices,
                "usage": _usage(len(prompt), sum(len(r.token_ids) for r in results)),
                "prompt_token_ids": prompt if parsed.return_token_ids else None,
                "weight_version": results[0].weight_version,
            }
        )

    async def completions(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            prompts = completion_prompts(body, self.engine)
            parsed = parse_common(body, chat=False, default_max=16, engine=self.engine)
            queue, seqs, results = self._submit_all(prompts, parsed)
        except RequestError as exc:
            return exc.response()
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if parsed.stream:
            return self._sse(
                self._completion_stream(rid, created, parsed, prompts, queue, seqs, results)
            )
        try:
            await self._collect(queue, seqs, results)
        except RequestError as exc:
            return exc.response()
        choices = []
        for i, r in enumerate(results):
            choices.append(
                {
                    "index": i,
                    "text": r.text,
                    "logprobs": self._completion_logprobs(r.events, parsed.tokens_as_ids)
                    if parsed.params[0].logprobs is not None
                    else None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                    "token_ids": r.token_ids if parsed.return_token_ids else None,
                    "prompt_token_ids": r.prompt_ids if parsed.return_token_ids else None,
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.engine.model_name,
                "choices": choices,
                "usage": _usage(
                    sum(len(p) for p in prompts), sum(len(r.token_ids) for r in results)
                ),
                "weight_version": results[0].weight_version,
            }
        )

    async def load_weights(self, request: Request) -> Response:
        # The key (when the server has one) was checked by `LocalGuard` for every route.
        try:
            body = await self._body(request)
            path = _get(body, "path", (str,))
            if not path:
                raise RequestError(
                    "path is required: a directory written by save_pretrained", param="path"
                )
            version = _get(body, "version", (int,))
            try:
                loaded = await asyncio.to_thread(self.engine.load_weights, path, version)
            except EngineError as exc:
                raise RequestError(str(exc), code=exc.code, param=exc.param) from None
            except FileNotFoundError as exc:
                raise RequestError(str(exc), code="not_found", param="path") from None
            except RuntimeError as exc:
                raise RequestError(str(exc), status=409, code="conflict") from None
        except RequestError as exc:
            return exc.response()
        return JSONResponse({"status": "ok", "weight_version": loaded})

    # ------------------------------------------------------------------ streaming
    @staticmethod
    def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _stream_events(
        self, queue: asyncio.Queue[tuple[int, Event]], seqs: list[Any], results: list[ChoiceResult]
    ) -> AsyncIterator[tuple[int, Event]]:
        pending = len(results)
        try:
            while pending:
                index, event = await queue.get()
                self._record(results[index], event, seqs[index])
                if event.finish_reason is not None:
                    pending -= 1
                yield index, event
        finally:
            for s in seqs:  # the client went away, or we are done: stop generating
                s.cancel()

    def _error_chunk(self, exc: RequestError) -> dict[str, Any]:
        return {
            "error": {"message": str(exc), "type": exc.type, "param": exc.param, "code": exc.code}
        }

    async def _chat_stream(
        self, rid, created, parsed, prompt, queue, seqs, results
    ) -> AsyncIterator[dict[str, Any]]:  # type: ignore[no-untyped-def]
        base = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.engine.model_name,
        }
        completion_tokens = 0
        started: set[int] = set()
        parsers = [tools.StreamParser() for _ in results] if parsed.tool_calls else None
        try:
            async for index, event in self._stream_events(queue, seqs, results):
                version = seqs[index].weight_version
                if index not in started:
                    # vLLM's first chunk of a choice: the role, and the prompt ids.
                    started.add(index)
                    first: dict[str, Any] = {
                        **base,
                        "choices": [
                            {
                                "index": index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                    if parsed.return_token_ids:
                        first["prompt_token_ids"] = prompt
                    if parsed.continuous_usage:
                        first["usage"] = _usage(len(prompt), completion_tokens)
                    first["weight_version"] = version
                    yield first
                if event.token is not None:
                    completion_tokens += 1
                if parsers is None:
                    delta: dict[str, Any] | None = (
                        {"content": event.text} if event.text or event.token else {}
                    )
                    finish_reason = event.finish_reason
                else:
                    delta, finish_reason = _tool_delta(
                        parsers[index], results[index].text, event.finish_reason, parsed
                    )
                    if delta is None:
                        continue
                choice: dict[str, Any] = {"index": index, "delta": delta}
                if event.token is not None:
                    if parsed.params[0].logprobs is not None:
                        choice["logprobs"] = self._chat_logprobs([event], parsed.tokens_as_ids)
                    if parsed.return_token_ids:
                        choice["token_ids"] = [event.token.token]
                # vLLM sets finish_reason on every chunk (null until the last).
                choice["finish_reason"] = finish_reason
                if event.finish_reason is not None:
                    choice["stop_reason"] = event.stop_reason
                chunk: dict[str, Any] = {**base, "choices": [choice]}
                if parsed.continuous_usage:
                    chunk["usage"] = _usage(len(prompt), completion_tokens)
                chunk["weight_version"] = version
                yield chunk
        except RequestError as exc:
            yield self._error_chunk(exc)
            return
        if parsed.include_usage:
            yield {
                **base,
                "choices": [],
                "usage": _usage(len(prompt), completion_tokens),
                "weight_version": results[0].weight_version,
            }

    async def _completion_stream(
        self, rid, created, parsed, prompts, queue, seqs, results
    ) -> AsyncIterator[dict[str, Any]]:  # type: ignore[no-untyped-def]
        base = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.engine.model_name,
        }
        started: set[int] = set()
        completion_tokens = 0
        prompt_tokens = sum(len(p) for p in prompts)
        try:
            async for index, event in self._stream_events(queue, seqs, results):
                choice: dict[str, Any] = {"index": index, "text": event.text}
                if event.token is not None:
                    completion_tokens += 1
                    if parsed.params[0].logprobs is not None:
                        choice["logprobs"] = self._completion_logprobs(
                            [event], parsed.tokens_as_ids
                        )
                    if parsed.return_token_ids:
                        choice["token_ids"] = [event.token.token]
                if parsed.return_token_ids and index not in started:
                    choice["prompt_token_ids"] = results[index].prompt_ids
                started.add(index)
                choice["finish_reason"] = event.finish_reason
                if event.finish_reason is not None:
                    choice["stop_reason"] = event.stop_reason
                chunk: dict[str, Any] = {**base, "choices": [choice]}
                if parsed.continuous_usage:
                    chunk["usage"] = _usage(prompt_tokens, completion_tokens)
                chunk["weight_version"] = seqs[index].weight_version
                yield chunk
        except RequestError as exc:
            yield self._error_chunk(exc)
            return
        if parsed.include_usage:
            yield {
                **base,
                "choices": [],
                "usage": _usage(prompt_tokens, completion_tokens),
                "weight_version": results[0].weight_version,
            }


KEY_ENV = "LIGHTNING_ENGINE_KEY"


def _guard_error(status: int, code: str, message: str) -> dict[str, Any]:
    kind = {401: "AuthenticationError", 403: "PermissionDeniedError"}.get(
        status, "invalid_request_error"
    )
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def build_app(
    engine: Engine, *, admin_key: str | None = None, listen_host: str = "127.0.0.1"
) -> ASGIApp:
    """The API behind ``LocalGuard``: ``Host`` checked against ``listen_host``
    and loopback names, JSON bodies only, and with ``admin_key`` every route
    but ``/health`` needs ``Authorization: Bearer KEY`` (``lightning serve``
    always has one)."""
    return LocalGuard(
        _routes(engine, admin_key),
        listen_host=listen_host,
        key=admin_key,
        error=_guard_error,
        open_paths=("/health",),
    )


def _routes(engine: Engine, admin_key: str | None) -> Starlette:
    api = Api(engine, admin_key)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/admin/load_weights", api.load_weights, methods=["POST"]),
    ]
    return Starlette(routes=routes)


# ---------------------------------------------------------------------- running a server
class AppServer:
    """An ASGI app served by uvicorn on a background thread, started when this
    returns (the engine's :class:`RunningServer`; a bench's wrapped app)."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.sock = _bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the engine's HTTP server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RunningServer(AppServer):
    """The engine's HTTP server on a background thread (tests, the in-process loop)."""

    def __init__(
        self, engine: Engine, host: str = "127.0.0.1", port: int = 0, admin_key: str | None = None
    ) -> None:
        self.engine = engine.start()
        super().__init__(build_app(engine, admin_key=admin_key, listen_host=host), host, port)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _exit_with_parent(parent: int) -> None:
    """Stop this process (SIGTERM: uvicorn shuts down) once ``parent`` is gone.

    A child outlives a parent killed by SIGTERM or SIGKILL and is re-parented;
    an engine left behind holds its port, 2+ GB of memory and every core."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        log.warning("parent process %d is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def serve(argv: list[str]) -> int:
    """`lightning serve MODEL_DIR --port P`: the engine as an OpenAI-compatible server."""
    parser = argparse.ArgumentParser(prog="lightning serve", description=serve.__doc__)
    parser.add_argument(
        "model_dir", nargs="?", help="a save_pretrained directory (safetensors, tokenizer)"
    )
    parser.add_argument("--gguf", help="load this GGUF file instead (dequantized)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (logged)")
    parser.add_argument("--max-batch", type=int, default=32, help="most sequences decoded together")
    parser.add_argument(
        "--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: cores)"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--kv-cache-bytes",
        type=_byte_size,
        default=DEFAULT_KV_CACHE_BYTES,
        help="byte budget of the prefix KV cache (keys/values of computed prompts and "
        "completions, reused by later requests); accepts 512M, 2G; 0 turns it off "
        f"(default: {DEFAULT_KV_CACHE_BYTES >> 20} MiB)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help="prompt tokens prefilled per scheduler step, so running sequences keep "
        f"decoding while a long prompt is admitted (default: {DEFAULT_PREFILL_CHUNK})",
    )
    parser.add_argument(
        "--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"]
    )
    parser.add_argument(
        "--api-key",
        "--admin-key",
        dest="api_key",
        default=None,
        help=f"the key every route but /health needs (`Authorization: Bearer KEY`); default: "
        f"${KEY_ENV}, else a random one per start, logged. Prefer the variable: a flag shows in `ps`",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file used instead of the model's (as vLLM's flag); "
        f"for ChatML models without tool support: {tools.CHATML_TOOLS_TEMPLATE}",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=tools.PARSERS,
        help="how tool calls are read from generated text (auto: from the chat template)",
    )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="exit when the process that started this one is gone (even after kill -9)",
    )
    args = parser.parse_args(argv)
    if args.model_dir is None and args.gguf is None:
        parser.error("give MODEL_DIR or --gguf FILE")
    # A key always: the engine answers anyone who can connect, and `/admin`
    # loads other weights. `--host 0.0.0.0` never starts without one.
    key = args.api_key or os.environ.get(KEY_ENV) or new_key()
    try:
        check_key(key, KEY_ENV)
    except ValueError as e:
        print(f"lightning serve: {e}", file=sys.stderr)
        return 2
    if args.exit_with_parent:
        _exit_with_parent(os.getppid())
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    try:
        engine = _engine_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"lightning serve: {e}", file=sys.stderr)
        return 2
    sock = _bind(args.host, args.port)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    log.info(
        "serving %s on http://%s:%d with key %s (device=%s dtype=%s max_batch=%d weight_version=%d "
        "kv_cache_bytes=%d prefill_chunk=%d)",
        engine.model_name,
        host,
        port,
        "from $" + KEY_ENV if key == os.environ.get(KEY_ENV) and not args.api_key else key,
        engine.device,
        args.dtype,
        args.max_batch,
        engine.weight_version,
        args.kv_cache_bytes,
        args.prefill_chunk,
    )
    config = uvicorn.Config(
        build_app(engine, admin_key=key, listen_host=args.host),
        log_level="warning",
        lifespan="off",
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()
    return 0


def _engine_from_args(args: argparse.Namespace) -> Engine:
    return Engine(
        args.model_dir,
        gguf_file=args.gguf,
        device=args.device,
        dtype=args.dtype,
        max_batch=args.max_batch,
        served_model_name=args.served_model_name,
        logprobs_mode=args.logprobs_mode,
        num_threads=args.threads,
        max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        kv_cache_bytes=args.kv_cache_bytes,
        prefill_chunk=args.prefill_chunk,
    ).start()


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _byte_size(text: str) -> int:
    """``1073741824``, ``512M``, ``2G``, ``1.5GiB`` -> bytes (binary units)."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = raw[-1:] if raw[-1:] in _UNITS else ""
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte size; write e.g. 1073741824, 512M or 2G"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; 0 turns the cache off")
    return int(value)
