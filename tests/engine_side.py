"""An engine's data plane in its own process: joins a weight-update group and
receives broadcasts, driven by JSON lines on stdin (one answer line each on stdout).

``--join sglang`` joins with SGLang's own ``init_custom_process_group``, called as
SGLang's ``WeightUpdater.init_weights_update_group`` calls it (run under the cached
engine environment, tests/engine_envs.py); ``--join lightning`` uses
``lightning.run.weight_sync.join_group`` (for fakes of engines whose real data plane
needs a GPU). Receiving is ``torch.distributed.broadcast(buf, src=0, group=...)`` per
name, as SGLang's ``update_weights_from_distributed`` receives.

Commands: ``{"op": "join", "address", "port", "rank", "world", "name"}``;
``{"op": "recv", "names", "dtypes", "shapes", "out"}`` (the tensors are written to
``out`` with ``torch.save``); ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _join_sglang(cmd: dict[str, Any]) -> Any:
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.utils.network import NetworkAddress

    return init_custom_process_group(
        backend="gloo",
        init_method=NetworkAddress(cmd["address"], cmd["port"]).to_tcp(),
        world_size=cmd["world"],
        rank=cmd["rank"],
        group_name=cmd["name"],
    )


def _join_lightning(cmd: dict[str, Any]) -> Any:
    from lightning.run.weight_sync import join_group

    return join_group(
        cmd["address"],
        cmd["port"],
        rank=cmd["rank"],
        world_size=cmd["world"],
        backend="gloo",
        group_name=cmd["name"],
        timeout_s=60.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--join", choices=["sglang", "lightning"], required=True)
    join = _join_sglang if parser.parse_args().join == "sglang" else _join_lightning

    import torch
    import torch.distributed as dist

    group = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "join":
                group = join(cmd)
                answer: dict[str, Any] = {"ok": True, "module": join.__name__}
            elif cmd["op"] == "recv":
                got = {}
                for name, dtype, shape in zip(
                    cmd["names"], cmd["dtypes"], cmd["shapes"], strict=True
                ):
                    buf = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(buf, src=0, group=group)
                    got[name] = buf
                torch.save(got, cmd["out"])
                answer = {"ok": True}
            else:
                return
        except Exception as e:  # the test reads the message
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
