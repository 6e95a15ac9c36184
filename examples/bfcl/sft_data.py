"""SFT examples from BFCL's own prompt code and its own gold answers.

Runs in BFCL's cached environment (``python -m lightning.apps.bfcl setup``), like
the harness. For each requested test id it builds the messages exactly as BFCL's
``OpenAICompletionsHandler`` in prompt mode sends them (``load_dataset_entry``,
then the handler's ``_pre_query_processing_prompting`` — BFCL's system prompt
with the function docs — and ``add_first_turn_message_prompting``; nothing
re-typed), and the target answer from BFCL's ``possible_answer`` rendered in the
call format that prompt asks for, ``[func(arg=value, ...)]``: for each
parameter the first value BFCL accepts other than ``""`` (its mark for "may be
omitted"; a parameter with no other value is left out), nested dicts alike.

Every target is then run through BFCL's own decoder (``decode_ast``) and checker
(``ast_checker``) against the same possible answer, so a target BFCL would not
score as correct is reported (``"gold_valid": false``) instead of trained on.

    python sft_data.py IDS.json OUT.jsonl     # IDS.json: {"category": [test ids]}

Each output line: ``{"id", "category", "messages": [..., {"role": "assistant",
"content": target}], "gold_valid", "gold_error"}``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any


def first_accepted(accepted: list[Any]) -> Any:
    """The first value BFCL accepts other than "" (its mark for "may be omitted"),
    or "" when omitting is all it accepts; a dict value is itself a map of
    accepted values per key (BFCL's nested possible answers), chosen the same way."""
    for value in accepted:
        if value == "":
            continue
        if isinstance(value, dict):
            return {k: v for k, acc in value.items() if (v := first_accepted(acc)) != ""}
        return value
    return ""


def gold_call(ground_truth: list[dict[str, dict[str, list[Any]]]]) -> str:
    """``[f(a=1, b='x'), g()]`` from BFCL's possible answer: per parameter the
    first accepted value that is not "", the parameter left out when "" is all
    that is accepted besides nothing (an optional one BFCL lets the answer omit
    is kept when it has a value: omitting it is also right, naming it teaches the
    argument)."""
    calls = []
    for item in ground_truth:
        ((name, params),) = item.items()
        args = []
        for key, accepted in params.items():
            value = first_accepted(accepted)
            if value == "":
                continue
            args.append(f"{key}={value!r}")
        calls.append(f"{name}({', '.join(args)})")
    return "[" + ", ".join(calls) + "]"


def main(argv: list[str]) -> int:
    ids_file, out_file = Path(argv[0]), Path(argv[1])
    wanted: dict[str, list[str]] = json.loads(ids_file.read_text())
    # The handler builds an OpenAI client (which wants a key) but is never asked.
    os.environ.setdefault("OPENAI_API_KEY", "unused-when-only-building-prompts")
    from bfcl_eval.constants.enums import Language, ReturnFormat
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.api_inference.openai_completion import (
        OpenAICompletionsHandler,
    )
    from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bfcl_harness import MODEL_ID, register

    register(None, "", None)  # the checker looks the model up in BFCL's table
    handler = OpenAICompletionsHandler(
        model_name=MODEL_ID,
        temperature=0.0,
        registry_name=MODEL_ID,
        is_fc_model=False,
    )
    rows = []
    for category, ids in wanted.items():
        if "chatable" in category:
            raise SystemExit(f"refusing {category!r}: it repeats simple_python questions")
        entries = {e["id"]: e for e in load_dataset_entry(category)}
        answers = {a["id"]: a["ground_truth"] for a in load_ground_truth_entry(category)}
        for test_id in ids:
            entry = copy.deepcopy(entries[test_id])
            data = handler._pre_query_processing_prompting(entry)
            data = handler.add_first_turn_message_prompting(data, entry["question"][0])
            messages = [dict(m) for m in data["message"]]
            target = gold_call(answers[test_id])
            try:
                decoded = handler.decode_ast(target, ReturnFormat.PYTHON, False)
                verdict = ast_checker(
                    entries[test_id]["function"],
                    decoded,
                    answers[test_id],
                    Language.PYTHON,
                    category,
                    MODEL_ID,
                )
                valid, error = bool(verdict["valid"]), verdict.get("error_type")
            except Exception as e:  # BFCL's decoder raising is its verdict
                valid, error = False, f"decoder: {e}"
            rows.append(
                {
                    "id": test_id,
                    "category": category,
                    "messages": [*messages, {"role": "assistant", "content": target}],
                    "gold_valid": valid,
                    "gold_error": error,
                }
            )
    out_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"rows": len(rows), "gold_invalid": sum(not r["gold_valid"] for r in rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
