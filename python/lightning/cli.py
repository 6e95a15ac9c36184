"""The `lightning` command: one entry point, one subcommand per module.

Each subcommand lives with the code it drives and is imported only when used,
so `lightning report` never pays for importing torch.
"""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help). The function takes argv (list[str])
# and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "lightning.run.loop:train_main",
        "run RL training from a TOML config (see examples/)",
    ),
    "sft": (
        "lightning.run.loop:sft_main",
        "supervised fine-tuning from JSONL conversations or a store (see docs/sft.md)",
    ),
    "demo": (
        "lightning.apps.demo:main",
        "the offline CPU demo: an arithmetic agent improves by RL",
    ),
    "serve": ("lightning.engine.server:serve", "run the embedded OpenAI-compatible engine"),
    "data": (
        "lightning.data.cli:main",
        "clean tasks: normalize, dedupe, filter, split, decontaminate",
    ),
    "report": (
        "lightning.run.report:main",
        "write RUN_DIR/report.html (plots and traces, offline)",
    ),
    "show": ("lightning.view.show:main", "print one rollout's merged trace, coloured"),
    "view": (
        "lightning.view.server:main",
        "serve a live, read-only web view of a run or a gateway store",
    ),
    "gateway": (
        "lightning.gateway.server:main",
        "run the recording gateway (same as lightning-gateway)",
    ),
    "online": (
        "lightning.online.cli:main",
        "online mode: train on sessions in a store, list them, export them to JSONL",
    ),
}
# `lightning train --online` and `lightning demo --online`: flags of the offline
# commands, each a command of its own in online mode.
ONLINE = {
    "train": "lightning.online.train:train_main",
    "demo": "lightning.apps.online_demo:main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lightning <command> [options]\n\ncommands:")
        for name, (_, help_) in SUBCOMMANDS.items():
            print(f"  {name:<10} {help_}")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from lightning import __version__

        print(f"lightning {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        known = ", ".join(SUBCOMMANDS)
        print(f"lightning: unknown command {name!r}; known commands: {known}", file=sys.stderr)
        return 2
    target, _ = SUBCOMMANDS[name]
    if "--online" in rest and name in ONLINE:
        # Online mode sits above the closed loop and the demo it varies, so the
        # choice between them is made here, not by the offline command.
        target, rest = ONLINE[name], [a for a in rest if a != "--online"]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
