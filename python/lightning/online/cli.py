"""``lightning online``: online mode's commands — ``train`` (one training pass
on the store's sessions; ``lightning train --online`` is the same), ``sessions``
(list them with their signals and reward) and ``export`` (to JSONL).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning.online.export import export_sessions
from lightning.online.rewards import BadReward, OnlineRewardSection, session_reward
from lightning.online.select import SourceSection, select_sessions

_EXPORT_HELP = """\
Writes one JSON line per session: chat-style messages (whatever protocol the
harness spoke), each call's response id and token ids, the feedback signals and
the session's reward. Reads the store file directly (no gateway, no admin key);
a call whose recorded request it cannot read is left out and reported on stderr.
Sessions recorded under a key with defaults.redact = true carry no text and, unless
--with-ids, no token ids: the ids decode to the text redaction removed."""


def main(argv: list[str]) -> int:
    if argv[:1] == ["train"]:
        # The pass has its own parser (shared with `lightning train --online`).
        from lightning.online.train import train_main

        return train_main(argv[1:], prog="lightning online train")
    p = argparse.ArgumentParser(prog="lightning online", description="online mode: train on, "
                                "list and export the sessions in a store")  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "train",
        help="one training pass on the store's sessions (CONFIG.toml; see --help)",
        add_help=False,
    )
    e = sub.add_parser(
        "export",
        help="sessions to JSONL (messages, token ids, signals, reward)",
        description=_EXPORT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("--db", required=True, metavar="PATH",
                   help="the gateway's store (its --db / `db` path); read-only")  # fmt: skip
    e.add_argument("--out", required=True, metavar="PATH", help="the JSONL file to write")
    e.add_argument("--only-feedback", action="store_true",
                   help="only sessions with at least one feedback signal")  # fmt: skip
    e.add_argument("--with-ids", action="store_true",
                   help="keep token ids of redacted sessions too (they decode to the "
                   "redacted text: handle the file as you would the text)")  # fmt: skip
    ls = sub.add_parser(
        "sessions",
        help="list sessions with their signals and reward",
        description="One line per session: id, key, calls, state, signals, reward.",
    )
    ls.add_argument("--db", required=True, metavar="PATH", help="the gateway's store; read-only")
    args = p.parse_args(argv)
    if args.cmd == "export":
        try:
            done = export_sessions(
                args.db, args.out, only_feedback=args.only_feedback, with_ids=args.with_ids
            )
        except FileNotFoundError as err:
            print(f"lightning online export: {err}", file=sys.stderr)
            return 1
        for x in done.skipped:
            print(
                f"lightning online export: skipped call {x['seq']} of session "
                f"{x['session_id']} ({x['protocol']}): {x['reason']}",
                file=sys.stderr,
            )
        print(done.line(args.out))
        return 0
    src = SourceSection(db=args.db, require_feedback=False, closed_only=False, include_trained=True)
    for s in select_sessions(src):
        try:
            r: Any = session_reward(s.signals, OnlineRewardSection())
        except BadReward as err:
            r = f"refused ({err})"
        state = "trained" if s.trained else ("closed" if s.closed else "open")
        print(
            f"{s.rollout_id}  {s.app_key:<16} calls={s.n_calls:<3} {state:<7} signals={len(s.signals)} reward={r}"
        )
    return 0
