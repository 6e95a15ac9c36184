"""Fake vLLM and SGLang weight-update servers: real HTTP on loopback, exact wire shapes.

They stand in for the engines' RL control planes only (no generation). Each keeps a
log of ``(route, body)`` in arrival order and refuses what the real server would
refuse, with the real server's status: a body that does not fit the request model
(vLLM is FastAPI: 422; SGLang answers ``{"success": false}`` with 400), a transfer
before the group exists. The vLLM fake also holds our choreography to the order
vLLM's docs lay out (pause → start → update+ → finish → resume; 400 otherwise),
which is stricter than vLLM itself.

Payload models mirror, field for field:
- vLLM ``vllm/entrypoints/rl/online/api_router.py`` (routes, ``Body(embed=True)``
  wrappers, ``mode`` as a query parameter), ``NCCLWeightTransferInitInfo``,
  ``NCCLWeightTransferUpdateInfo`` (``weight_transfer/nccl_common.py`` and
  ``nccl_engine.py`` of vllm 0.34.0), ``IPCWeightTransferInitInfo`` (``ipc_engine.py``;
  its update info is parsed by vLLM's own class, see ``FakeVllm``) and the sleep
  routes (``entrypoints/serve/dev/sleep/api_router.py``);
- SGLang ``python/sglang/srt/managers/io_struct.py`` (``InitWeightsUpdateGroupReqInput``,
  ``UpdateWeightsFromDistributedReqInput``, ``UpdateWeightFromDiskReqInput``,
  ``UpdateWeightsFromTensorReqInput``, ``PauseGenerationReqInput``,
  ``BeginWeightUpdateReqInput``, ``EndWeightUpdateReqInput``,
  ``Release/ResumeMemoryOccupationReqInput``) of sglang 0.5.23, whose
  scheduler (``managers/scheduler_components/weight_updater.py``) refuses an update
  from distributed or from tensor outside a begin/end weight-update session, and
  receives ``load_format = "flattened_bucket"`` as one broadcast per call.

The data plane is real too: on init the fake starts a process of its own
(tests/support/engine_side.py) that joins the trainer's process group over gloo as
``rank_offset`` — for SGLang with SGLang's own ``init_custom_process_group`` from the
pinned release (tests/support/engine_envs.py), for vLLM (whose receiver is PyNccl, GPU only)
with ``lightning.sync.join_group`` — and on update receives one broadcast
per tensor (or one per flattened bucket: for SGLang, unpacked by SGLang's own
``FlattenedTensorBucket``), so tests compare what arrived with what was sent.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlparse

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- vLLM ---------------------------------------------------------------------------


class VllmNcclInit(_Strict):
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2
    use_load_plan: bool = False
    metadata: list[tuple[str, str, list[int]]] | None = None


class VllmNcclUpdate(_Strict):
    """vLLM 0.34.0: the packed wire params moved to the init info; any other field
    is refused (``update_info_cls(**update_dict)``)."""

    names: list[str] = []
    dtype_names: list[str] = []
    shapes: list[list[int]] = []
    src: int = 0

    @model_validator(mode="after")
    def _lengths(self) -> VllmNcclUpdate:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("`dtype_names` and `shapes` should be of the same size as `names`")
        return self


class VllmIpcInit(_Strict):
    """``IPCWeightTransferInitInfo`` (vllm 0.34.0 ``weight_transfer/ipc_engine.py``)."""

    packed: bool = False


# -- SGLang -------------------------------------------------------------------------


class SglInitGroup(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class SglFromDistributed(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class SglBeginUpdate(_Strict):
    selector: Literal["target", "draft", "all"] = "all"


class SglEndUpdate(_Strict):
    pass


class SglFromDisk(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class SglFromTensor(_Strict):
    serialized_named_tensors: list[str]  # base64 over HTTP, one per TP rank
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class SglMemory(_Strict):
    """``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``: the
    tags are ``srt/constants.py``'s GPU_MEMORY_TYPE_* (None: all of them)."""

    tags: list[Literal["kv_cache", "weights", "cuda_graph"]] | None = None


class SglPause(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class SglContinue(_Strict):
    torch_empty_cache: bool = True


# sglang 0.5.23 srt/constants.py GPU_MEMORY_ALL_TYPES
WEIGHTS = "weights"
ALL_TAGS = ["kv_cache", WEIGHTS, "cuda_graph"]


class _Refused(Exception):
    def __init__(self, status: int, body: Any) -> None:
        self.status, self.body = status, body


class FakeEngine:
    """Base: a threaded HTTP server whose routes are methods ``r_<name>``."""

    def __init__(
        self,
        data_plane: Literal["sglang", "vllm", "lightning"] = "lightning",
        scratch: Path | None = None,
    ) -> None:
        self.data_plane = data_plane
        self.scratch = scratch  # where received tensors pass through (default: temp)
        self.keep = True  # False: the engine side drops what it receives (benches)
        self.side: subprocess.Popen[str] | None = None
        self.log: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.weights: dict[str, Any] = {}
        self.calls: list[int] = []  # tensors received per transfer call
        self.version: str | None = None
        self.group: Any = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                handler = getattr(fake, "g_" + url.path.strip("/").replace("/", "_"), None)
                status, answer = (
                    (200, handler(query)) if handler else (404, {"detail": "Not Found"})
                )
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                url = urlparse(self.path)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else None
                query = {k: v[-1] if len(v) == 1 else v for k, v in parse_qs(url.query).items()}
                route = url.path.strip("/").replace("/", "_")
                with fake.lock:
                    fake.log.append((route, body if body is not None else query))
                handler = getattr(fake, "r_" + route, None)
                try:
                    if handler is None:
                        raise _Refused(404, {"detail": "Not Found"})
                    status, answer = 200, handler(body, query)
                except _Refused as e:
                    status, answer = e.status, e.body
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def routes(self) -> list[str]:
        return [r for r, _ in self.log]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self.side is not None:
            self.side.kill()
            self.side.wait()
            for pipe in (self.side.stdin, self.side.stdout):
                if pipe is not None:
                    pipe.close()

    # -- shared data plane ------------------------------------------------------

    def _join(self, address: str, port: int, rank: int, world: int, name: str) -> None:
        """Join in a process of its own (engine_side.py): with SGLang's own
        ``init_custom_process_group`` when ``data_plane == "sglang"``."""
        self._start_side()
        self._ask(
            {
                "op": "join",
                "address": address,
                "port": port,
                "rank": rank,
                "world": world,
                "name": name,
            }
        )
        self.group = name

    def _start_side(self) -> None:
        if self.side is not None:
            return
        if self.data_plane in ("sglang", "vllm"):
            from engine_envs import engines_python

            python = str(engines_python(self.data_plane))
        else:
            python = sys.executable
        script = Path(__file__).with_name("engine_side.py")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        if self.data_plane in ("sglang", "vllm"):
            env.pop("PYTHONPATH")  # the engine's environment, not ours
        self.side = subprocess.Popen(
            [python, str(script), "--join", self.data_plane],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.side is not None and self.side.stdin and self.side.stdout
        self.side.stdin.write(json.dumps(cmd) + "\n")
        self.side.stdin.flush()
        line = self.side.stdout.readline()
        answer = json.loads(line) if line else {"ok": False, "error": "engine side exited"}
        if not answer["ok"]:
            raise _Refused(400, {"success": False, "message": answer["error"]})
        return answer

    def _receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], flat: bool = False
    ) -> None:
        import tempfile

        import torch

        if self.group is None:
            raise _Refused(400, {"error": "weight transfer not initialized"})
        if not self.keep:
            cmd = {"op": "recv", "names": names, "dtypes": dtypes, "shapes": shapes}
            self._ask({**cmd, "flat": flat, "out": None})
            self.calls.append(len(names))
            return
        with tempfile.TemporaryDirectory(dir=self.scratch) as d:
            out = str(Path(d) / "got.pt")
            cmd = {"op": "recv", "names": names, "dtypes": dtypes, "shapes": shapes}
            self._ask({**cmd, "flat": flat, "out": out})
            self.calls.append(len(names))
            self.weights.update(torch.load(out))

    def _load_dir(self, path: str) -> None:
        from safetensors.torch import load_file

        for f in sorted(Path(path).glob("*.safetensors")):
            self.weights.update(load_file(str(f)))


def _parse(model: type[BaseModel], body: Any, status: int, shape: str = "fastapi") -> Any:
    try:
        return model.model_validate(body if body is not None else {})
    except ValidationError as e:
        if shape == "fastapi":
            raise _Refused(status, {"detail": json.loads(e.json())}) from e
        raise _Refused(status, {"success": False, "message": str(e)}) from e


# What the fake's "GPU" reports as its UUID (vLLM keys IPC handles by the GPU's UUID).
FAKE_GPU_UUID = "GPU-lightning-fake"
# vllm 0.34.0 ``v1/engine/__init__.py`` PauseMode; ``device_allocator`` DEFERRABLE_TAGS.
VLLM_PAUSE_MODES = ("abort", "wait", "keep")
VLLM_SLEEP_TAGS = ("weights", "kv_cache")


class FakeVllm(FakeEngine):
    """vLLM ``--weight-transfer-config '{"backend": ...}'`` with VLLM_SERVER_DEV_MODE=1.

    ``ipc``: ``/init_weight_transfer_engine`` takes ``IPCWeightTransferInitInfo
    {packed}`` (strict, as ``init_info_cls(**init_dict)``); every ``/update_weights``
    goes to the engine side (tests/support/engine_side.py ``vllm_ipc``, the pinned vLLM's
    environment), where vLLM's own ``parse_update_info`` builds its
    ``IPCWeightTransferUpdateInfo`` (unpickling ``ipc_handles_pickled``, as a server
    with VLLM_ALLOW_INSECURE_SERIALIZATION=1 does) and vLLM's ``unpack_tensor`` splits a
    packed buffer. Sleep mode (``--enable-sleep-mode``; ``entrypoints/serve/dev/sleep/
    api_router.py``): ``/sleep?level&mode`` (levels 0-2; 1 and 2 put ``weights`` and
    ``kv_cache`` to sleep and pause the scheduler), ``/wake_up?tags=`` (answers
    ``{"status": "awake"|"sleeping", "tags"}``; scheduling resumes once nothing
    sleeps). Stricter than vLLM, which logs a warning and goes on: waking a tag that
    is not asleep, ``/update_weights`` with the weights asleep, ``/resume`` with the KV
    cache asleep (400).

    ``nccl`` with ``vllm_worker``: both bodies go instead to a vLLM worker of the NCCL
    backend in the pinned vLLM's environment (tests/support/engine_side.py
    ``_VllmNcclWorker``): vLLM's own ``parse_init_info`` / ``init_transfer_engine``
    and ``parse_update_info``, their answers kept in ``worker_inits`` /
    ``worker_updates``. The fake joins no group (the trainer's communicator is a
    stand-in too, tests/support/vllm_nccl_trainer.py); :meth:`replay` later feeds the
    trainer's recorded broadcasts to vLLM's ``receive_weights``."""

    def __init__(self, backend: Literal["nccl", "ipc"] = "nccl", vllm_worker: bool = False) -> None:
        super().__init__("vllm" if backend == "ipc" or vllm_worker else "lightning")
        self.backend = backend
        self.vllm_worker = vllm_worker
        self.worker_inits: list[dict[str, Any]] = []
        self.worker_updates: list[dict[str, Any]] = []
        self.paused = False
        self.pause_modes: list[str] = []
        self.session = False
        self.updates_in_session = 0
        self.initialized = False
        self.packed = False
        self.asleep: list[str] = []  # sleep tags not yet woken
        self.refuse: dict[str, str] = {}  # route -> error message to answer with
        self.sleep_levels: list[int] = []
        self.dtype = "torch.bfloat16"  # ModelConfig.dtype, resolved, as dumped

    def g_server_info(self, query: dict[str, str]) -> Any:
        """vllm 0.34.0 dev-mode ``GET /server_info``: with ``config_format=json`` the
        ``VllmConfig`` dumped with ``fallback=str`` (a few of its fields here)."""
        if query.get("config_format") != "json":
            return {"vllm_config": f"model_config=ModelConfig(dtype={self.dtype}, ...)"}
        return {"vllm_config": {"model_config": {"dtype": self.dtype}}, "vllm_env": {}}

    def _embedded(self, body: Any, key: str) -> Any:
        if not isinstance(body, dict) or set(body) != {key}:
            raise _Refused(422, {"detail": f"body must be {{{key!r}: ...}}"})
        return body[key]

    def _refused(self, route: str) -> None:
        """vLLM's exception handler: ``{"error": {"message", "type", "code"}}``."""
        if route in self.refuse:
            error = {"message": self.refuse[route], "type": "InternalServerError", "code": 500}
            raise _Refused(500, {"error": error})

    def r_pause(self, body: Any, query: dict[str, str]) -> Any:
        mode = query.get("mode", "abort")
        if mode not in VLLM_PAUSE_MODES:
            raise _Refused(422, {"detail": f"invalid mode {mode!r}"})
        self.paused = True
        self.pause_modes.append(mode)
        return {"status": "paused"}

    def r_resume(self, body: Any, query: dict[str, str]) -> Any:
        if "kv_cache" in self.asleep:
            raise _Refused(400, {"error": "resume with the KV cache asleep"})
        self.paused = False
        return {"status": "resumed"}

    def r_sleep(self, body: Any, query: dict[str, str]) -> Any:
        self._refused("sleep")
        level, mode = query.get("level", "1"), query.get("mode", "abort")
        if level not in ("0", "1", "2") or mode not in VLLM_PAUSE_MODES:
            raise _Refused(422, {"detail": f"level {level!r} / mode {mode!r}"})
        self.paused = True
        self.sleep_levels.append(int(level))
        if level != "0":
            self.asleep = list(VLLM_SLEEP_TAGS)
        return {"status": "sleeping", "level": int(level)}

    def r_wake_up(self, body: Any, query: dict[str, Any]) -> Any:
        self._refused("wake_up")
        raw = query.get("tags")
        tags = [raw] if isinstance(raw, str) else raw
        for tag in tags or list(self.asleep):
            if tag not in self.asleep:
                raise _Refused(400, {"error": f"tag {tag!r} is not asleep ({self.asleep})"})
            self.asleep.remove(tag)
        if not self.asleep:
            self.paused = False
        return {"status": "sleeping" if self.asleep else "awake", "tags": tags}

    def r_init_weight_transfer_engine(self, body: Any, query: dict[str, str]) -> Any:
        info = self._embedded(body, "init_info")
        if self.vllm_worker:
            self._start_side()
            self.worker_inits.append(self._ask({"op": "vllm_nccl_init", "info": info}))
        elif self.backend == "nccl":
            init = _parse(VllmNcclInit, info, 422)
            if init.packed:
                raise _Refused(400, {"error": "fake receives unpacked broadcasts only"})
            self._join(
                init.master_address,
                init.master_port,
                init.rank_offset,
                init.world_size,
                "vllm_fake",
            )
        else:
            self.packed = _parse(VllmIpcInit, info, 422).packed
        self.initialized = True
        return {"message": "Weight transfer initialized"}

    def r_start_weight_update(self, body: Any, query: dict[str, str]) -> Any:
        if not self.initialized:
            raise _Refused(400, {"error": "init_weight_transfer_engine first"})
        if not self.paused:
            raise _Refused(400, {"error": "weight update while generating (pause first)"})
        if self.session:
            raise _Refused(400, {"error": "A weight update is already active"})
        self.session, self.updates_in_session = True, 0
        return {"message": "Weight update started"}

    def r_update_weights(self, body: Any, query: dict[str, str]) -> Any:
        info = self._embedded(body, "update_info")
        if not self.session:
            raise _Refused(400, {"error": "start_weight_update must be called first"})
        if "weights" in self.asleep:
            raise _Refused(400, {"error": "update_weights with the weights asleep"})
        if self.vllm_worker:
            self.worker_updates.append(self._ask({"op": "vllm_nccl_update", "info": info}))
        elif self.backend == "nccl":
            upd = _parse(VllmNcclUpdate, info, 422)
            self._receive(upd.names, upd.dtype_names, upd.shapes)
        else:
            self._receive_ipc(info)
        self.updates_in_session += 1
        return {"message": "Weights updated"}

    def replay(self, broadcasts: Path) -> list[dict[str, Any]]:
        """vLLM's ``receive_weights`` on every update info this fake was sent, in
        order, fed the trainer's recorded broadcasts (``torch.save``d at
        ``broadcasts``); what the model was handed, per update. Refuses (400) if
        a broadcast is left over."""
        import tempfile

        import torch

        with tempfile.TemporaryDirectory(dir=self.scratch) as d:
            out = str(Path(d) / "got.pt")
            answer = self._ask(
                {"op": "vllm_nccl_replay", "broadcasts": str(broadcasts), "out": out}
            )
            if answer["left"]:
                raise _Refused(400, {"error": f"{answer['left']} broadcasts never received"})
            return list(torch.load(out))

    def _receive_ipc(self, info: Any) -> None:
        import tempfile

        import torch

        self._start_side()
        with tempfile.TemporaryDirectory(dir=self.scratch) as d:
            out = str(Path(d) / "got.pt")
            cmd = {"op": "vllm_ipc", "info": info, "packed": self.packed}
            self._ask({**cmd, "uuid": FAKE_GPU_UUID, "out": out})
            got = torch.load(out)
        self.calls.append(len(got))
        self.weights.update(got)

    def r_finish_weight_update(self, body: Any, query: dict[str, str]) -> Any:
        if not isinstance(body, dict) or not set(body) <= {"weight_version"}:
            raise _Refused(422, {"detail": "body must be {'weight_version': str | None}"})
        if not self.session or self.updates_in_session == 0:
            raise _Refused(400, {"error": "No checkpoint was loaded during the update session"})
        self.session = False
        self.version = body.get("weight_version")
        return {"message": "Weight update finished"}


class FakeSglang(FakeEngine):
    """SGLang's control plane; its data plane is SGLang's own group join (the pinned
    release, tests/support/engine_envs.py) unless ``data_plane="lightning"``."""

    def __init__(
        self, data_plane: Literal["sglang", "lightning"] = "sglang", scratch: Path | None = None
    ) -> None:
        super().__init__(data_plane, scratch)
        self.paused: str | None = None
        self.group_name: str | None = None
        self.session = False
        self.versions: list[str | None] = []  # weight_version of every update call
        self.released: list[str] = []  # memory tags released and not yet resumed
        self.refuse_memory: str | None = None  # answer memory calls with this error
        self.ranks: dict[int, dict[str, Any]] = {}  # what each TP rank opened
        self.dtype = "auto"  # --dtype, as GET /server_info reports it
        self.load_s = 0.0  # how long loading a received bucket takes
        self.events: list[tuple[str, float]] = []  # (what, monotonic time) per update call

    def g_server_info(self, query: dict[str, str]) -> Any:
        """sglang 0.5.23 ``GET /server_info``: the server args (a few of them here)."""
        return {"dtype": self.dtype, "tp_size": 1, "dp_size": 1, "pp_size": 1}

    @staticmethod
    def _ok(message: str) -> dict[str, Any]:
        return {"success": True, "message": message}

    def r_pause_generation(self, body: Any, query: dict[str, str]) -> Any:
        self.paused = _parse(SglPause, body, 400, "sglang").mode
        return self._ok("paused")

    def r_continue_generation(self, body: Any, query: dict[str, str]) -> Any:
        _parse(SglContinue, body, 400, "sglang")
        self.paused = None
        return self._ok("continued")

    def r_init_weights_update_group(self, body: Any, query: dict[str, str]) -> Any:
        req = _parse(SglInitGroup, body, 400, "sglang")
        if req.backend != "gloo":
            raise _Refused(400, {"success": False, "message": "fake joins gloo groups only"})
        self._join(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name
        )
        self.group_name = req.group_name
        return self._ok("Succeeded to initialize custom process group.")

    def r_begin_weight_update(self, body: Any, query: dict[str, str]) -> Any:
        _parse(SglBeginUpdate, body, 400, "sglang")
        if self.session:
            raise _Refused(400, {"success": False, "message": "a session is already open"})
        self.session = True
        return self._ok("Success")

    def r_end_weight_update(self, body: Any, query: dict[str, str]) -> Any:
        _parse(SglEndUpdate, body, 400, "sglang")
        if not self.session:
            raise _Refused(400, {"success": False, "message": "no weight-update session"})
        self.session = False
        return self._ok("Success")

    def _in_session(self, route: str) -> None:
        if not self.session:
            message = f"{route} must run between begin_weight_update() and end_weight_update()"
            raise _Refused(400, {"success": False, "message": message})

    def r_update_weights_from_distributed(self, body: Any, query: dict[str, str]) -> Any:
        req = _parse(SglFromDistributed, body, 400, "sglang")
        self._in_session("update_weights_from_distributed")
        if req.group_name != self.group_name:
            raise _Refused(400, {"success": False, "message": f"no group {req.group_name!r}"})
        flat = req.load_format == "flattened_bucket"
        import time

        self.events.append(("request", time.monotonic()))
        self._receive(req.names, req.dtypes, req.shapes, flat=flat)
        self.events.append(("received", time.monotonic()))
        time.sleep(self.load_s)  # the model loads the bucket; the trainer may gather on
        self.events.append(("answered", time.monotonic()))
        self.versions.append(req.weight_version)
        if req.weight_version is not None:
            self.version = req.weight_version
        return self._ok("Succeeded to update parameter online from distributed.")

    def r_update_weights_from_disk(self, body: Any, query: dict[str, str]) -> Any:
        req = _parse(SglFromDisk, body, 400, "sglang")
        if not os.path.isdir(req.model_path):
            raise _Refused(400, {"success": False, "message": f"no such dir {req.model_path}"})
        self._load_dir(req.model_path)
        self.version = req.weight_version
        return self._ok("Succeeded to update model weights.")

    def r_update_weights_from_tensor(self, body: Any, query: dict[str, str]) -> Any:
        """With ``data_plane="sglang"``, every TP rank's payload is opened by SGLang's
        own code in the engine process (engine_side.py ``tensor``), as each rank of
        the real scheduler opens its own; otherwise the payloads are only kept."""
        import tempfile

        import torch

        req = _parse(SglFromTensor, body, 400, "sglang")
        self._in_session("update_weights_from_tensor")
        if WEIGHTS in self.released:  # stricter than SGLang, whose load would fault
            raise _Refused(400, {"success": False, "message": "weights are released"})
        self.tensor_payloads = req.serialized_named_tensors
        if self.data_plane == "sglang":
            self._start_side()
            flat = req.load_format == "flattened_bucket"
            for rank in range(len(req.serialized_named_tensors)):
                with tempfile.TemporaryDirectory(dir=self.scratch) as d:
                    out = str(Path(d) / "got.pt")
                    cmd = {"op": "tensor", "payloads": req.serialized_named_tensors}
                    # The sender's authkey: see engine_side.py _open_tensors.
                    key = multiprocessing.current_process().authkey.hex()
                    self._ask({**cmd, "rank": rank, "flat": flat, "out": out, "authkey": key})
                    got = torch.load(out)
                    self.ranks.setdefault(rank, {}).update(got)
            self.calls.append(len(got))
            self.weights.update(got)
        import time

        time.sleep(self.load_s)  # the model loads the bucket; the trainer may gather on
        self.events.append(("answered", time.monotonic()))
        self.versions.append(req.weight_version)
        if req.weight_version is not None:
            self.version = req.weight_version
        return self._ok("Success")

    def r_release_memory_occupation(self, body: Any, query: dict[str, str]) -> Any:
        req = _parse(SglMemory, body, 400, "sglang")
        if self.refuse_memory:
            raise _Refused(400, {"error": {"message": self.refuse_memory}})
        self.released.extend(t for t in req.tags or ALL_TAGS if t not in self.released)
        return None  # FastAPI's answer for a handler that returns nothing: null

    def r_resume_memory_occupation(self, body: Any, query: dict[str, str]) -> Any:
        req = _parse(SglMemory, body, 400, "sglang")
        for tag in req.tags or ALL_TAGS:
            if tag not in self.released:  # SGLang: offload_tags.remove(tag) raises
                raise _Refused(400, {"error": {"message": f"KeyError: {tag!r}"}})
            self.released.remove(tag)
        return None
