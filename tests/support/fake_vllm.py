"""A fake vLLM engine: a real HTTP server process speaking vLLM's OpenAI wire format.

Run: ``python tests/support/fake_vllm.py [--port 0] [--name NAME] [--no-ids] [--unique-ids]``; prints
``READY <port>`` once listening. Every answer it produces is kept and served at
``GET /_log`` so tests can check that the gateway recorded exactly what the
engine sent. ``POST /_control`` injects faults (``{"fail_next": N, "fail_status":
503, "delay_s": 0.0, "break_stream_after": K, "extra_stream_id": true}``).

Field sources (vLLM ≥ 0.10.2, ``vllm/entrypoints/openai/protocol.py``):
- ``ChatCompletionRequest.return_token_ids``: "If specified, the result will include
  token IDs alongside the generated text. In streaming mode, prompt_token_ids is
  included only in the first chunk, and token_ids contains the delta tokens for
  each chunk."
- ``ChatCompletionResponse.prompt_token_ids`` (top level);
  ``ChatCompletionResponseChoice.token_ids``, ``.logprobs`` (``ChatCompletionLogProbs``:
  ``content: [ChatCompletionLogProbsContent{token, logprob, bytes, top_logprobs}]``),
  ``.finish_reason``, ``.stop_reason``.
- ``ChatCompletionStreamResponse.prompt_token_ids`` (first chunk only),
  ``ChatCompletionResponseStreamChoice.token_ids`` (delta), ``.delta``
  (``DeltaMessage{role, content, tool_calls}``), ``.logprobs``, ``.finish_reason``;
  ``usage`` on a final chunk with empty ``choices`` when
  ``stream_options.include_usage`` (OpenAI API reference, chat streaming).
- ``CompletionResponseChoice`` / ``CompletionResponseStreamChoice``: per-choice
  ``prompt_token_ids`` and ``token_ids``; ``logprobs`` as ``CompletionLogProbs
  {text_offset, token_logprobs, tokens, top_logprobs}`` when the request's
  integer ``logprobs`` is set.
- answer ids: ``chatcmpl-fake`` / ``cmpl-fake`` (so answers compare equal), or with
  ``--unique-ids`` unique per request like vLLM's ``chatcmpl-{random_uuid()}``
  (one id for all chunks of a stream), which online feedback needs.
- ``UsageInfo{prompt_tokens, completion_tokens, total_tokens}``; SSE framing
  ``data: <json>\\n\\n`` ending with ``data: [DONE]\\n\\n``.

The "tokenizer" is byte-level (id = byte + 10) so texts and ids map exactly; the
chat template is ChatML-like. Message markers steer the answer: ``[[tool]]`` makes a
tool call, ``[[len:N]]`` sets the answer length in tokens, ``[[slow:S]]`` sleeps S
seconds between streamed tokens.

Faults (``POST /_control``): ``fail_next=N, fail_status=S`` answers the next N
requests with status S and a vLLM error body; ``fault_next=N, fault=KIND`` breaks
the next N answers: ``garbage`` sends 200 with a body (or SSE event) that is not
JSON, ``cut`` closes the connection half-way through the body (after the first
streamed event), ``huge`` pads the answer (or the first streamed event) with
``huge_bytes`` bytes (default 1 MiB), ``latin1`` puts a byte that is not UTF-8
into the answer's text (or into the first streamed event).

Cancellation (what vLLM does when its client hangs up): a stream stops at the
first write that fails; a whole answer with ``[[slow:S]]`` generates token by
token and watches its socket between tokens. Either way the request is
counted in ``GET /_log``'s ``cancels`` with the number of tokens generated.

Scripted answers (``--script JSON_OR_FILE``, ``FakeEngine(script=...)`` or ``POST
/_script`` with the list): a list of steps; a chat request whose conversation holds
k assistant messages gets step k (the last step once the list runs out), so each
harness conversation plays the script from its start, whatever else runs at the
same time. A step is ``{"content": "text"}`` and/or ``{"tool_calls": [{"name": ...,
"arguments": {...}}]}``. The model "writes" Hermes tool calls, as Qwen models do
(``content<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``, calls
joined by a newline), and the answer is that text parsed the way vLLM's ``hermes``
tool parser serves it (lightning.engine.tools implements that shape, streamed and
not): ``tool_calls`` with ``chatcmpl-tool-...`` ids and ``arguments`` as a JSON
string, ``finish_reason: tool_calls``, ``token_ids`` the ids of the whole text. In
script mode the template renders tools in a system turn, an assistant's tool calls
back into exactly that text and tool results as ``<tool_response>`` user turns, so
a tool conversation's prompts extend each other (it merges into one sample).
"""

from __future__ import annotations

import argparse
import json
import re
import select
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ID_OFFSET = 10
LOCK = threading.Lock()
LOG: list[dict[str, Any]] = []
CONTROL: dict[str, Any] = {}
STATE: dict[str, Any] = {"requests": 0, "cancels": []}
SCRIPT: list[dict[str, Any]] = []
MAX_MODEL_LEN = 1 << 20


def encode(text: str) -> list[int]:
    return [b + ID_OFFSET for b in text.encode("utf-8")]


def render_chat(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    if SCRIPT:
        return render_hermes(messages, tools)
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if m.get("tool_calls"):
            content = (content or "") + json.dumps(m["tool_calls"], sort_keys=True)
        out.append(f"<|im_start|>{m.get('role', 'user')}\n{content or ''}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def hermes_calls_text(calls: list[dict[str, Any]]) -> str:
    """The text a Hermes/Qwen model writes for these calls ({"name", "arguments": object})."""
    return "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in calls
    )


def render_hermes(messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
    out = []
    if tools:
        out.append(f"<|im_start|>system\n<tools>\n{json.dumps(tools)}\n</tools><|im_end|>\n")
    for m in messages:
        role, content = m.get("role", "user"), _text(m.get("content"))
        if role == "tool":
            out.append(
                f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n"
            )
            continue
        calls = [
            {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
            for c in m.get("tool_calls") or []
        ]
        out.append(f"<|im_start|>{role}\n{content}{hermes_calls_text(calls)}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def scripted(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The scripted answer to this conversation: text, ids, parsed calls, finish reason."""
    from lightning.engine import tools as hermes

    turn = sum(1 for m in messages if m.get("role") == "assistant")
    with LOCK:
        step = SCRIPT[min(turn, len(SCRIPT) - 1)]
    text = step.get("content", "") + hermes_calls_text(step.get("tool_calls", []))
    found = hermes.extract(text)
    return {
        "text": text,
        "ids": encode(text),
        "tool": None,
        "content": found.content if found else text,
        "calls": found.tool_calls if found else [],
        "finish": "tool_calls" if found else "stop",
    }


def logprob_of(token_id: int, position: int) -> float:
    # Deterministic, distinct, exactly representable in float32.
    return -((token_id * 7 + position * 3) % 97) / 32.0


def answer_text(prompt: str, index: int, length: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    seed = sum(prompt.encode("utf-8")) + 31 * index
    text = ""
    i = 0
    while len(text.encode("utf-8")) < length:
        text += words[(seed + i) % len(words)] + " "
        i += 1
    return text.encode("utf-8")[:length].decode("utf-8", errors="ignore")


def parse_len(prompt: str, default: int) -> int:
    m = re.search(r"\[\[len:(\d+)\]\]", prompt)
    return int(m.group(1)) if m else default


class ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_name = "fake"

    def log_message(self, *args: Any) -> None:
        pass

    fault = ""  # set per request from CONTROL["fault"]
    generated = 0  # tokens streamed so far in this request

    def _cancelled(self) -> None:
        with LOCK:
            STATE["cancels"].append(self.generated)

    def _generate_whole(self, n_tokens: int, pause: float) -> None:
        """Spends ``pause`` per token like an engine, stopping if the client hangs up."""
        for pos in range(n_tokens):
            time.sleep(pause)
            self.generated = pos + 1
            ready, _, _ = select.select([self.connection], [], [], 0)
            if ready and self.connection.recv(1, socket.MSG_PEEK) == b"":
                self._cancelled()
                raise ClientGone("client hung up")

    def _json(self, status: int, obj: Any) -> None:
        if self.fault == "huge" and status == 200:
            obj = {**obj, "padding": "x" * int(CONTROL.get("huge_bytes", 1 << 20))}
        body = json.dumps(obj).encode()
        if self.fault == "latin1":
            body = body.replace(b'"content": "', b'"content": "\xff', 1)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-fake-server", self.server_name)
        self.end_headers()
        if self.fault == "cut":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            raise ClientGone("fault: cut")
        self.wfile.write(body)

    def _garbage(self, raw: bytes) -> None:
        stream = b'"stream": true' in raw or b'"stream":true' in raw
        if not stream:
            body = b'{"id": "chatcmpl-garbage", "choices": [ this is not json'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._sse_start()
        self._sse("{not json at all")
        self._sse("[DONE]")

    def do_GET(self) -> None:
        if self.path in ("/health", "/v1/health"):
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [{"id": "fake-model", "object": "model", "owned_by": "vllm"}],
                },
            )
        elif self.path == "/_log":
            with LOCK:
                self._json(
                    200,
                    {"answers": LOG, "requests": STATE["requests"], "cancels": STATE["cancels"]},
                )
        else:
            self._json(
                404, {"error": {"message": "not found", "type": "NotFoundError", "code": 404}}
            )

    def do_POST(self) -> None:
        try:
            self._post()
        except ClientGone:
            self.close_connection = True

    def _post(self) -> None:
        self.fault = ""
        self.generated = 0
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path == "/_script":
            with LOCK:
                SCRIPT[:] = json.loads(raw or b"[]")
            self._json(200, {"ok": True})
            return
        if self.path == "/_control":
            with LOCK:
                CONTROL.clear()
                CONTROL.update(json.loads(raw or b"{}"))
                if CONTROL.get("reset_log"):
                    LOG.clear()
                    STATE["requests"] = 0
                    STATE["cancels"] = []
            self._json(200, {"ok": True})
            return
        with LOCK:
            STATE["requests"] += 1
            fail = CONTROL.get("fail_next", 0)
            if fail:
                CONTROL["fail_next"] = fail - 1
            delay = float(CONTROL.get("delay_s", 0.0))
            fault_n = CONTROL.get("fault_next", 0)
            if fault_n:
                CONTROL["fault_next"] = fault_n - 1
                self.fault = str(CONTROL.get("fault", ""))
        if delay:
            time.sleep(delay)
        if self.fault == "garbage":
            self._garbage(raw)
            return
        if fail:
            status = int(CONTROL.get("fail_status", 503))
            self._json(
                status,
                {
                    "object": "error",
                    "message": "injected failure",
                    "type": "ServiceUnavailable",
                    "code": status,
                },
            )
            return
        try:
            req = json.loads(raw)
        except ValueError:
            self._json(
                400,
                {"object": "error", "message": "bad json", "type": "BadRequestError", "code": 400},
            )
            return
        if self.path == "/v1/chat/completions":
            self.chat(req)
        elif self.path == "/v1/completions":
            self.completion(req)
        elif self.path == "/tokenize":
            self.tokenize(req)
        else:
            self._json(
                404,
                {"object": "error", "message": "no route", "type": "NotFoundError", "code": 404},
            )

    # --- shared -------------------------------------------------------------

    def _choices(self, prompt_text: str, req: dict[str, Any]) -> list[dict[str, Any]]:
        n = int(req.get("n") or 1)
        max_tokens = req.get("max_completion_tokens") or req.get("max_tokens") or 16
        length = parse_len(prompt_text, min(int(max_tokens), 24))
        out = []
        for i in range(n):
            if "[[tool]]" in prompt_text and i == 0:
                args = json.dumps({"city": "Paris", "n": i})
                text = f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>'
                tool = {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": args},
                }
                ids = encode(text)
                out.append({"text": text, "ids": ids, "tool": tool, "finish": "tool_calls"})
            else:
                text = answer_text(prompt_text, i, length)
                ids = encode(text)
                finish = "length" if len(ids) >= int(max_tokens) else "stop"
                out.append({"text": text, "ids": ids, "tool": None, "finish": finish})
        return out

    def _log(
        self, kind: str, prompt_ids: list[list[int]], choices: list[dict[str, Any]], want_lp: bool
    ) -> None:
        with LOCK:
            LOG.append(
                {
                    "kind": kind,
                    "prompt_ids": prompt_ids,
                    "choices": [
                        {
                            "ids": c["ids"],
                            "logprobs": [logprob_of(t, p) for p, t in enumerate(c["ids"])]
                            if want_lp
                            else None,
                            "finish_reason": c["finish"],
                            "text": c["text"],
                        }
                        for c in choices
                    ],
                }
            )

    def _sse_start(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Connection", "close")
        self.send_header("x-fake-server", self.server_name)
        self.end_headers()
        self.close_connection = True

    def _sse(self, obj: Any) -> None:
        if self.fault == "huge" and isinstance(obj, dict):
            obj = {**obj, "padding": "x" * int(CONTROL.get("huge_bytes", 1 << 20))}
            self.fault = ""
        data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
        if self.fault == "latin1" and b'"content": "' in data:
            data = data.replace(b'"content": "', b'"content": "\xff', 1)
            self.fault = ""
        try:
            self.wfile.write(b"data: " + data + b"\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError) as e:
            # The client (the gateway) hung up: vLLM aborts the request here.
            self._cancelled()
            raise ClientGone from e
        if isinstance(obj, dict) and any(c.get("token_ids") for c in obj.get("choices") or []):
            self.generated += 1
        if self.fault == "cut":
            raise ClientGone("fault: cut after the first event")

    def tokenize(self, req: dict[str, Any]) -> None:
        """vLLM's ``POST /tokenize`` (server root, not ``/v1``): ``TokenizeChatRequest``
        (``messages``, ``tools``, ``add_generation_prompt``) or ``TokenizeCompletionRequest``
        (``prompt``) → ``TokenizeResponse{count, max_model_len, tokens}``
        (``vllm/entrypoints/openai/protocol.py``)."""
        if "messages" in req:
            text = render_chat(req.get("messages") or [], req.get("tools"))
            if not req.get("add_generation_prompt", True):
                text = text.removesuffix("<|im_start|>assistant\n")
        else:
            text = str(req.get("prompt", ""))
        ids = encode(text)
        self._json(200, {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids})

    # --- chat ---------------------------------------------------------------

    def chat(self, req: dict[str, Any]) -> None:
        prompt_text = render_chat(req.get("messages") or [], req.get("tools"))
        prompt_ids = encode(prompt_text)
        ids_on = bool(req.get("return_token_ids")) and not self.server.no_ids  # type: ignore[attr-defined]
        want_lp = bool(req.get("logprobs"))
        if SCRIPT:
            choices = [scripted(req.get("messages") or [])]
        else:
            choices = self._choices(prompt_text, req)
        self._log("chat", [prompt_ids], choices, want_lp)
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": sum(len(c["ids"]) for c in choices),
            "total_tokens": len(prompt_ids) + sum(len(c["ids"]) for c in choices),
        }
        created = int(time.time())
        if not req.get("stream"):
            slow = re.search(r"\[\[slow:([0-9.]+)\]\]", json.dumps(req.get("messages")))
            if slow:
                self._generate_whole(max(len(c["ids"]) for c in choices), float(slow.group(1)))
            out_choices = []
            for i, c in enumerate(choices):
                msg: dict[str, Any] = {
                    "role": "assistant",
                    "content": c["text"],
                    "tool_calls": [],
                    "reasoning": None,
                }
                if c["tool"]:
                    msg["content"] = None
                    msg["tool_calls"] = [c["tool"]]
                elif "calls" in c:
                    msg["content"], msg["tool_calls"] = c["content"], c["calls"]
                ch: dict[str, Any] = {
                    "index": i,
                    "message": msg,
                    "logprobs": None,
                    "finish_reason": c["finish"],
                    "stop_reason": None,
                    "token_ids": c["ids"] if ids_on else None,
                }
                if want_lp:
                    ch["logprobs"] = {
                        "content": [self._chat_lp(t, p) for p, t in enumerate(c["ids"])]
                    }
                out_choices.append(ch)
            self._json(
                200,
                {
                    "id": self._answer_id("chatcmpl"),
                    "object": "chat.completion",
                    "created": created,
                    "model": req.get("model", "fake-model"),
                    "choices": out_choices,
                    "usage": usage,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt_ids if ids_on else None,
                    "kv_transfer_params": None,
                },
            )
            return
        self._stream_chat(req, prompt_ids, choices, ids_on, want_lp, usage, created)

    def _answer_id(self, prefix: str) -> str:
        unique = self.server.unique_ids  # type: ignore[attr-defined]
        return f"{prefix}-{uuid.uuid4().hex}" if unique else f"{prefix}-fake"

    @staticmethod
    def _chat_lp(token_id: int, pos: int) -> dict[str, Any]:
        b = [token_id - ID_OFFSET]
        tok = bytes(b).decode("utf-8", errors="replace")
        return {"token": tok, "logprob": logprob_of(token_id, pos), "bytes": b, "top_logprobs": []}

    def _stream_chat(self, req, prompt_ids, choices, ids_on, want_lp, usage, created) -> None:  # type: ignore[no-untyped-def]
        self._sse_start()
        base = {
            "id": self._answer_id("chatcmpl"),
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.get("model", "fake-model"),
        }
        slow = re.search(r"\[\[slow:([0-9.]+)\]\]", json.dumps(req.get("messages")))
        pause = float(slow.group(1)) if slow else 0.0
        with LOCK:
            break_after = CONTROL.get("break_stream_after")
            extra_id = CONTROL.get("extra_stream_id")
        first = dict(base)
        first["choices"] = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": [] if ids_on else None,
            }
            for i in range(len(choices))
        ]
        if ids_on:
            first["prompt_token_ids"] = prompt_ids
        self._sse(first)
        sent = 0
        longest = max(len(c["ids"]) for c in choices)
        for pos in range(longest):
            for i, c in enumerate(choices):
                if pos >= len(c["ids"]):
                    continue
                t = c["ids"][pos]
                if c["tool"]:
                    # Tool calls stream as one name chunk then argument fragments (vLLM's
                    # DeltaToolCall shape); ids follow the raw generated text.
                    if pos == 0:
                        delta: dict[str, Any] = {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": c["tool"]["id"],
                                    "type": "function",
                                    "function": {"name": "get_weather", "arguments": ""},
                                }
                            ]
                        }
                    else:
                        args = c["tool"]["function"]["arguments"]
                        frag = args[pos - 1] if pos - 1 < len(args) else ""
                        delta = (
                            {"tool_calls": [{"index": 0, "function": {"arguments": frag}}]}
                            if frag
                            else {}
                        )
                elif "calls" in c:
                    delta = self._scripted_delta(c, pos)
                    if delta is None and not ids_on:
                        continue  # vLLM sends no chunk for a token with nothing to say
                    delta = delta or {}
                else:
                    delta = {"content": bytes([t - ID_OFFSET]).decode("utf-8", errors="replace")}
                chunk = dict(base)
                ids = [t]
                if extra_id and pos == 0:
                    ids = [t, 3]
                chunk["choices"] = [
                    {
                        "index": i,
                        "delta": delta,
                        "logprobs": {"content": [self._chat_lp(t, pos)]} if want_lp else None,
                        "finish_reason": None,
                        "token_ids": ids if ids_on else None,
                    }
                ]
                self._sse(chunk)
                sent += 1
                if break_after is not None and sent >= int(break_after):
                    # Simulate the engine dying mid-stream: cut the connection.
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                if pause:
                    time.sleep(pause)
        for i, c in enumerate(choices):
            chunk = dict(base)
            chunk["choices"] = [
                {
                    "index": i,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": c["finish"],
                    "stop_reason": None,
                    "token_ids": [] if ids_on else None,
                }
            ]
            self._sse(chunk)
        if (req.get("stream_options") or {}).get("include_usage"):
            chunk = dict(base)
            chunk["choices"] = []
            chunk["usage"] = usage
            self._sse(chunk)
        self._sse("[DONE]")

    @staticmethod
    def _scripted_delta(c: dict[str, Any], pos: int) -> dict[str, Any] | None:
        """vLLM's hermes-parser delta after token ``pos`` of a scripted answer."""
        from lightning.engine import tools as hermes

        parser = c.setdefault("parser", hermes.StreamParser())
        so_far = bytes(t - ID_OFFSET for t in c["ids"][: pos + 1]).decode("utf-8", errors="ignore")
        return parser.feed(so_far, finished=pos == len(c["ids"]) - 1)

    # --- completions --------------------------------------------------------

    def completion(self, req: dict[str, Any]) -> None:
        prompts = req.get("prompt")
        if isinstance(prompts, str):
            prompts = [prompts]
        ids_on = bool(req.get("return_token_ids")) and not self.server.no_ids  # type: ignore[attr-defined]
        lp_n = req.get("logprobs")
        want_lp = lp_n is not None
        all_choices = []
        prompt_ids_all = []
        for p in prompts or [""]:
            pids = encode(p)
            for c in self._choices(p, req):
                all_choices.append((pids, c))
            prompt_ids_all.append(pids)
        self._log("completion", prompt_ids_all, [c for _, c in all_choices], want_lp)
        usage = {
            "prompt_tokens": sum(len(p) for p in prompt_ids_all),
            "completion_tokens": sum(len(c["ids"]) for _, c in all_choices),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]

        def lp_obj(c: dict[str, Any]) -> dict[str, Any]:
            toks = [bytes([t - ID_OFFSET]).decode("utf-8", errors="replace") for t in c["ids"]]
            return {
                "text_offset": list(range(len(toks))),
                "token_logprobs": [logprob_of(t, p) for p, t in enumerate(c["ids"])],
                "tokens": toks,
                "top_logprobs": [None] * len(toks),
            }

        if not req.get("stream"):
            self._json(
                200,
                {
                    "id": self._answer_id("cmpl"),
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": req.get("model", "fake-model"),
                    "choices": [
                        {
                            "index": i,
                            "text": c["text"],
                            "logprobs": lp_obj(c) if want_lp else None,
                            "finish_reason": c["finish"],
                            "stop_reason": None,
                            "token_ids": c["ids"] if ids_on else None,
                            "prompt_logprobs": None,
                            "prompt_token_ids": pids if ids_on else None,
                        }
                        for i, (pids, c) in enumerate(all_choices)
                    ],
                    "usage": usage,
                },
            )
            return
        self._sse_start()
        base = {
            "id": self._answer_id("cmpl"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.get("model", "fake-model"),
        }
        for i, (pids, c) in enumerate(all_choices):
            for pos, t in enumerate(c["ids"]):
                ch: dict[str, Any] = {
                    "index": i,
                    "text": bytes([t - ID_OFFSET]).decode("utf-8", errors="replace"),
                    "logprobs": None,
                    "finish_reason": c["finish"] if pos == len(c["ids"]) - 1 else None,
                    "token_ids": [t] if ids_on else None,
                }
                if pos == 0 and ids_on:
                    ch["prompt_token_ids"] = pids
                if want_lp:
                    ch["logprobs"] = {
                        "text_offset": [pos],
                        "token_logprobs": [logprob_of(t, pos)],
                        "tokens": [ch["text"]],
                        "top_logprobs": [None],
                    }
                chunk = dict(base)
                chunk["choices"] = [ch]
                self._sse(chunk)
        if (req.get("stream_options") or {}).get("include_usage"):
            chunk = dict(base)
            chunk["choices"] = []
            chunk["usage"] = usage
            self._sse(chunk)
        self._sse("[DONE]")


class Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client killed with its keep-alive connection open (the gateway under
        # kill -9) resets it: what vLLM shrugs off, not a traceback on stderr.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeEngine:
    """Runs this file as a subprocess server; ``.url`` is its OpenAI base URL (``.../v1``)."""

    def __init__(
        self,
        name: str = "fake",
        no_ids: bool = False,
        script: list[dict[str, Any]] | None = None,
        unique_ids: bool = False,
    ) -> None:
        import subprocess

        cmd = [sys.executable, __file__, "--name", name]
        if no_ids:
            cmd.append("--no-ids")
        if script is not None:
            cmd += ["--script", json.dumps(script)]
        if unique_ids:
            cmd.append("--unique-ids")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"fake engine did not start: {line!r}")
        self.port = int(line.split()[1])
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = self.root + "/v1"
        self.name = name

    def control(self, **kw: Any) -> None:
        import urllib.request

        req = urllib.request.Request(
            self.root + "/_control", data=json.dumps(kw).encode(), method="POST"
        )
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()

    def log(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(self.root + "/_log", timeout=5) as r:
            return json.loads(r.read())

    def script(self, steps: list[dict[str, Any]]) -> None:
        """Answer chat requests from ``steps`` (see the module doc); ``[]`` turns it off."""
        import urllib.request

        req = urllib.request.Request(
            self.root + "/_script", data=json.dumps(steps).encode(), method="POST"
        )
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()

    def reset(self) -> None:
        self.control(reset_log=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except Exception:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--name", default="fake")
    ap.add_argument("--unique-ids", action="store_true", help="a fresh answer id per request")
    ap.add_argument(
        "--no-ids", action="store_true", help="behave like an engine without return_token_ids"
    )
    ap.add_argument(
        "--script",
        default=None,
        help="scripted chat answers: a JSON list, or a file holding one (see the module doc)",
    )
    args = ap.parse_args(argv)
    if args.script is not None:
        text = args.script
        if not text.lstrip().startswith("["):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        SCRIPT[:] = json.loads(text)
    handler = type("H", (Handler,), {"server_name": args.name})
    server = Server((args.host, args.port), handler)
    server.daemon_threads = True
    server.no_ids = args.no_ids  # type: ignore[attr-defined]
    server.unique_ids = args.unique_ids  # type: ignore[attr-defined]
    print(f"READY {server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
