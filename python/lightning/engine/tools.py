"""Tool calls in the embedded engine: which format a chat template uses, and parsing it.

One family is supported: **Hermes** (Hermes 2 Pro/3, Qwen2.5, Qwen3, QwQ and the
engine's own ``templates/chatml_tools.jinja``), where the model writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A template is taken
to be Hermes when it contains ``<tool_call>``. Other formats (Llama 3 JSON,
Mistral ``[TOOL_CALLS]``, Qwen3-Coder XML, ...) are not parsed: a request with
``tools`` on such a template is refused with a 400, as vLLM refuses it without a
``--tool-call-parser``.

The answers follow vLLM's ``hermes`` parser (vllm/tool_parsers/hermes_tool_parser.py)
and chat serving (vllm/entrypoints/openai/chat_completion/serving.py):

- not streamed: every ``<tool_call>`` region (closed, or running to the end of the
  text) must hold a JSON object with ``name`` and ``arguments``; the calls come back
  as ``{"id": "chatcmpl-tool-<hex>", "type": "function", "function": {"name",
  "arguments": json.dumps(arguments, ensure_ascii=False)}}``, ``content`` is the text
  before the first ``<tool_call>`` (null when empty) and ``finish_reason`` is
  ``tool_calls``. If any region fails to parse, the whole text stays content.
- streamed: text before ``<tool_call>`` streams as ``content`` (a suffix that could
  be the start of the tag is held back); a call's first delta is ``{"index", "type":
  "function", "id", "function": {"name"}}`` once its name is complete, then
  ``{"index", "function": {"arguments": <new raw text>}}`` fragments of the
  arguments value *as generated* (vLLM streams the raw text, so the streamed string
  can differ in spacing from the non-streamed ``json.dumps``). Each delta carries
  ``content`` (null when none) and ``tool_calls``. ``finish_reason`` becomes
  ``tool_calls`` when a call was streamed and the sequence stopped normally.
  One deliberate difference from vLLM: if the sequence ends and no call could be
  started (say ``<tool_call>`` followed by garbage), the held-back text is sent as
  content, so text that fails to parse stays text in both modes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START = "<tool_call>"
END = "</tool_call>"
_REGION = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')

PARSERS = ("auto", "hermes", "none")
# A ChatML template with Hermes tool calls, for ChatML models whose own template
# ignores tools (SmolLM2, the tiny test model): `lightning serve --chat-template`.
CHATML_TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"


def resolve_parser(choice: str, template: str | None) -> str | None:
    """The tool-call parser to use: ``choice`` from ``PARSERS``; ``auto`` reads the template."""
    if choice not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {PARSERS}, got {choice!r}")
    if choice == "auto":
        return "hermes" if template and START in template else None
    return None if choice == "none" else choice


def tool_call_id() -> str:
    """vLLM's default tool call id (``make_tool_call_id``): ``chatcmpl-tool-`` + uuid4 hex."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class Extracted:
    content: str | None
    tool_calls: list[dict[str, Any]]


def extract(text: str) -> Extracted | None:
    """The tool calls in a finished completion, or None when it stays plain text."""
    if START not in text:
        return None
    calls = []
    for closed, open_ended in _REGION.findall(text):
        try:
            call = json.loads(closed or open_ended)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, TypeError, KeyError):
            return None
        if not isinstance(name, str):
            return None
        calls.append(
            {
                "id": tool_call_id(),
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    content = text[: text.find(START)]
    return Extracted(content=content or None, tool_calls=calls)


def _tag_prefix_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _arguments_text(region: str) -> str | None:
    """The arguments value as generated so far: up to its matching close bracket."""
    m = _ARGS.search(region)
    if m is None:
        return None
    raw = region[m.end() :]
    if not raw or raw[0] not in "{[":
        return None  # a scalar (or nothing yet): wait for the complete call
    close = "}" if raw[0] == "{" else "]"
    depth, in_string, escaped = 0, False, False
    for i, c in enumerate(raw):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == raw[0]:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return raw[: i + 1]
    return raw


@dataclass
class StreamParser:
    """Turns a growing completion text into vLLM-shaped streamed deltas (one per choice)."""

    sent_content: int = 0
    names: list[str] = field(default_factory=list)
    sent_args: list[str] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.names)

    def feed(self, text: str, finished: bool) -> dict[str, Any] | None:
        """The delta for ``text`` (everything generated so far), or None if nothing is new."""
        start = text.find(START)
        if start < 0:
            until = len(text) if finished else len(text) - _tag_prefix_overlap(text, START)
        elif finished and not self.called and extract(text) is None:
            until = len(text)  # no call ever started and none parses: it stays text
        else:
            until = start
        content = None
        if until > self.sent_content:
            content = text[self.sent_content : until]
            self.sent_content = until
        deltas = self._tool_deltas(text) if start >= 0 and until == start else []
        if content is None and not deltas:
            return None
        return {"content": content, "tool_calls": deltas}

    def _tool_deltas(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for i, region in enumerate(self._regions(text)):
            if i == len(self.names):
                name = _NAME.search(region)
                if name is None:
                    break  # later calls wait until this one's name is complete
                self.names.append(name.group(1))
                self.sent_args.append("")
                deltas.append(
                    {
                        "index": i,
                        "type": "function",
                        "id": tool_call_id(),
                        "function": {"name": name.group(1)},
                    }
                )
            args = _arguments_text(region)
            if args is not None and len(args) > len(self.sent_args[i]):
                deltas.append(
                    {"index": i, "function": {"arguments": args[len(self.sent_args[i]) :]}}
                )
                self.sent_args[i] = args
        return deltas

    @staticmethod
    def _regions(text: str) -> list[str]:
        out = []
        pos = text.find(START)
        while pos >= 0:
            body = pos + len(START)
            end = text.find(END, body)
            if end < 0:
                tail = text[body:]
                out.append(tail[: len(tail) - _tag_prefix_overlap(tail, END)])
                break
            out.append(text[body:end])
            pos = text.find(START, end + len(END))
        return out
