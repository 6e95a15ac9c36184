"""Issue 39's hostile findings, replayed against real processes; one line each.

Every check starts the real commands (``lightning-gateway``, ``lightning view``,
``lightning serve``, ``lightning train --online``) on loopback, attacks them
from outside as the probe did, and prints ``PASS`` or ``FAIL`` with what it saw:

    1  two writers: a second gateway through a hard link, a symlink
    2  the view: DNS rebinding (a foreign Host), no key, 0.0.0.0 with a foreign Host
    3  cross-site POSTs (text/plain) and foreign Hosts: gateway (loopback and 0.0.0.0),
       lightning serve (and its key on 0.0.0.0)
    4  the view honours redaction
    5  the secret file at 0644, and deleted on a store with rollouts
    6  train --online without `gateway = URL` on a store a gateway writes
    7  small ones: a reward of 1e308, /api/rate with 1e-300, export file mode
    8  the exact tool-argument text across a gateway restart

    python benches/probe_doors.py            # about a minute (lightning serve loads SmolLM2)
    python benches/probe_doors.py --no-serve # without the engine checks

Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent
ADMIN = "probe-admin-key-0123"
SECRET = "4111-1111-SECRET"
ARGS = '{"city": "Paris"}'  # the engine's own text; compact JSON would differ
results: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, saw: str) -> None:
    results.append((name, ok, saw))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {saw}", flush=True)


def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
    try:
        ok, saw = fn()
    except Exception as e:  # a crash in a check is its failure, not the probe's
        ok, saw = False, f"{type(e).__name__}: {e}"[:300]
    report(name, ok, saw)


# ---------------------------------------------------------------- processes


class Proc:
    """A started command whose stderr (and stdout) lines are collected."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.p = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "RUST_LOG": "info", **(env or {})},
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match[str] | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.lines):
                m = re.search(pattern, re.sub(r"\x1b\[[0-9;]*m", "", line))
                if m:
                    return m
            if self.p.poll() is not None:
                time.sleep(0.1)
                return None
            time.sleep(0.05)
        return None

    def exited(self, timeout: float = 30) -> int | None:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def text(self) -> str:
        return " | ".join(self.lines)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@contextmanager
def gateway(db: Path, *flags: str, listen: str = "127.0.0.1:0") -> Iterator[tuple[Proc, str]]:
    g = Proc([str(BIN / "lightning-gateway"), "--listen", listen, "--db", str(db), *flags])
    try:
        m = g.wait_for(r"gateway listening.*?(\d+\.\d+\.\d+\.\d+):(\d+)")
        if m is None:
            raise RuntimeError("the gateway did not start: " + g.text()[-400:])
        yield g, f"http://127.0.0.1:{m.group(2)}"
    finally:
        g.stop()


def keyed(*flags: str) -> tuple[str, ...]:
    return ("--admin-key", ADMIN, *flags)


def admin(url: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


class Engine:
    """A vLLM-wire engine on loopback: every chat answer is one tool call whose
    argument text is ``ARGS`` (spaced, not compact), with ids and logprobs."""

    def __init__(self) -> None:
        seen: list[dict[str, Any]] = []
        self.seen = seen

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._send({"object": "list", "data": [{"id": "m", "object": "model"}]})

            def do_POST(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                seen.append(json.loads(self.rfile.read(n) or b"{}"))
                call = {"id": "call_7", "type": "function"}
                call["function"] = {"name": "weather", "arguments": ARGS}
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                lp = [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -0.5}]
                choice = {"index": 0, "message": message, "token_ids": [7, 8]}
                choice.update(logprobs={"content": lp}, finish_reason="tool_calls")
                usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                self._send(
                    {
                        "object": "chat.completion",
                        "prompt_token_ids": [1, 2, 3],
                        "choices": [choice],
                        "usage": usage,
                    }
                )

            def _send(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


# ---------------------------------------------------------------- the findings


def two_writers(tmp: Path) -> tuple[bool, str]:
    db = tmp / "w.db"
    with gateway(db, *keyed()) as (first, _):
        hard, soft = tmp / "hard.db", tmp / "soft.db"
        os.link(db, hard)
        g2 = Proc(
            [str(BIN / "lightning-gateway"), "--listen", "127.0.0.1:0", "--db", str(hard), *keyed()]
        )
        rc_hard, why_hard = g2.exited(), g2.text()
        os.unlink(hard)
        soft.symlink_to(db)
        g3 = Proc(
            [str(BIN / "lightning-gateway"), "--listen", "127.0.0.1:0", "--db", str(soft), *keyed()]
        )
        rc_soft, why_soft = g3.exited(), g3.text()
        pid = f"pid {first.p.pid}"
    ok = (
        rc_hard not in (None, 0)
        and "hard links" in why_hard
        and rc_soft not in (None, 0)
        and pid in why_soft
        and not Path(f"{db}.lock").exists()
    )
    return ok, (
        f"hard link: exit {rc_hard} ({'names the links' if 'hard links' in why_hard else why_hard[-120:]}); "
        f"symlink: exit {rc_soft} ({'names ' + pid if pid in why_soft else why_soft[-120:]}); "
        "no lock file to delete"
    )


def view_doors(db: Path) -> tuple[bool, str]:
    saw = []
    ok = True
    for host in ("127.0.0.1", "0.0.0.0"):
        v = Proc(
            [str(BIN / "lightning"), "view", "--db", str(db), "--host", host, "--port", "0"],
            env={"LIGHTNING_VIEW_KEY": "", "LIGHTNING_ALLOWED_HOSTS": ""},
        )
        try:
            m = v.wait_for(r"http://\S+?:(\d+)/\?key=(\S+)")
            if m is None:
                return False, "the view did not start: " + v.text()[-300:]
            port, key = m.group(1), m.group(2)
            root = f"http://127.0.0.1:{port}/api/summary"
            bare = httpx.get(root, timeout=10).status_code
            rebound = httpx.get(
                root,
                headers={"Authorization": f"Bearer {key}", "Host": f"rebind.example:{port}"},
                timeout=10,
            )
            good = httpx.get(root, headers={"Authorization": f"Bearer {key}"}, timeout=10)
            ok &= bare == 401 and rebound.status_code == 403 and good.status_code == 200
            saw.append(
                f"{host}: no key {bare}, foreign Host {rebound.status_code}, key {good.status_code}"
            )
        finally:
            v.stop()
    return ok, "; ".join(saw)


def gateway_doors(tmp: Path) -> tuple[bool, str]:
    saw, ok = [], True
    upstreams = {"upstreams": [{"url": "http://203.0.113.9:1/v1"}]}
    with gateway(tmp / "local.db", "--insecure-local") as (_, url):
        blind = httpx.post(
            url + "/admin/upstreams",
            content=json.dumps(upstreams),
            headers={"Content-Type": "text/plain"},
            timeout=10,
        )
        rebound = httpx.post(
            url + "/admin/upstreams", json=upstreams, headers={"Host": "rebind.example"}, timeout=10
        )
        after = httpx.get(url + "/admin/upstreams", timeout=10).text
        ok &= blind.status_code == 415 and rebound.status_code == 403 and "203.0.113.9" not in after
        saw.append(
            f"--insecure-local: text/plain POST {blind.status_code}, foreign Host "
            f"{rebound.status_code}, upstreams unchanged {'203.0.113.9' not in after}"
        )
    flags = keyed("--allowed-host", "gw.example")
    with gateway(tmp / "any.db", *flags, listen="0.0.0.0:0") as (_, url):
        h = admin(url)
        evil = httpx.get(url + "/rollouts", headers={**h, "Host": "evil.example"}, timeout=10)
        named = httpx.get(url + "/rollouts", headers={**h, "Host": "gw.example"}, timeout=10)
        ok &= evil.status_code == 403 and named.status_code == 200
        saw.append(
            f"0.0.0.0: Host evil.example {evil.status_code}, allowed name {named.status_code}"
        )
    return ok, "; ".join(saw)


def serve_doors() -> tuple[bool, str]:
    """On 0.0.0.0, the hardest case: a key is required, names are still checked."""
    from lightning.model_cache import smollm2_dir

    s = Proc(
        [
            str(BIN / "lightning"),
            "serve",
            str(smollm2_dir()),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--threads",
            "1",
        ],
        env={"LIGHTNING_ENGINE_KEY": ""},
    )
    try:
        m = s.wait_for(r"on http://\S+?:(\d+) with key (\S+)", timeout=300)
        if m is None:
            return False, "lightning serve --host 0.0.0.0 did not start: " + s.text()[-300:]
        url, auth = f"http://127.0.0.1:{m.group(1)}", {"Authorization": f"Bearer {m.group(2)}"}
        # The engine logs its URL as uvicorn starts; wait until it answers.
        for _ in range(100):
            try:
                httpx.get(url + "/health", timeout=5)
                break
            except httpx.ConnectError:
                time.sleep(0.2)
        body = json.dumps({"path": "/tmp/elsewhere", "weight_version": 9})
        blind = httpx.post(
            url + "/admin/load_weights",
            content=body,
            headers={**auth, "Content-Type": "text/plain"},
            timeout=30,
        )
        rebound = httpx.get(
            url + "/v1/models", headers={**auth, "Host": "rebind.example"}, timeout=30
        )
        bare = httpx.get(url + "/v1/models", timeout=30).status_code
        good = httpx.get(url + "/v1/models", headers=auth, timeout=30).status_code
    finally:
        s.stop()
    ok = blind.status_code == 415 and rebound.status_code == 403 and bare == 401 and good == 200
    return ok, (
        f"0.0.0.0 with a random key: text/plain load_weights {blind.status_code}, "
        f"foreign Host {rebound.status_code}, no key {bare}, key {good}"
    )


def redaction(db: Path, engine: Engine) -> tuple[bool, str]:
    from lightning import GatewayClient

    with gateway(db, *keyed("--upstream", engine.url)) as (_, url):
        with GatewayClient(url, ADMIN) as client:
            key = client.create_app_key("private-bot", redact=True).key
        assert key is not None
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {key}", "x-session-id": "s"},
            json={"model": "m", "messages": [{"role": "user", "content": f"card {SECRET}"}]},
        )
        assert r.status_code == 200, r.text
    v = Proc(
        [str(BIN / "lightning"), "view", "--db", str(db), "--port", "0"],
        env={"LIGHTNING_VIEW_KEY": ""},
    )
    try:
        m = v.wait_for(r"http://\S+?:(\d+)/\?key=(\S+)")
        if m is None:
            return False, "the view did not start: " + v.text()[-300:]
        root, auth = (
            f"http://127.0.0.1:{m.group(1)}/api/",
            {"Authorization": f"Bearer {m.group(2)}"},
        )
        sessions = httpx.get(root + "sessions", headers=auth, timeout=10).json()["sessions"]
        sid = sessions[0]["rollout_id"]
        pages = [
            httpx.get(root + f"{k}/{sid}", headers=auth, timeout=10).text
            for k in ("sessions", "rollouts")
        ]
    finally:
        v.stop()
    leaked = [SECRET in p for p in pages]
    ids = [json.loads(p).get("ids_hidden") for p in pages]
    ok = not any(leaked) and all(ids)
    return ok, f"secret text in session/rollout pages: {leaked}; ids hidden: {ids}"


def secret_file(db: Path) -> tuple[bool, str]:
    secret = Path(f"{db}.secret")
    secret.chmod(0o644)
    with gateway(db, *keyed()):
        mode = stat.S_IMODE(secret.stat().st_mode)
    secret.unlink()
    g = Proc([str(BIN / "lightning-gateway"), "--listen", "127.0.0.1:0", "--db", str(db), *keyed()])
    rc, why = g.exited(), g.text()
    g.stop()
    ok = mode == 0o600 and rc not in (None, 0) and "secret" in why
    return (
        ok,
        f"0644 key file tightened to {mode:o}; deleted key file on a store with rollouts: exit {rc}",
    )


def train_online(tmp: Path, engine: Engine) -> tuple[bool, str]:
    from lightning import GatewayClient

    db, out, cfg = tmp / "online.db", tmp / "online-run", tmp / "online.toml"
    cfg.write_text(f'output_dir = "{out}"\n[model]\nbuiltin = "tiny"\n[source]\ndb = "{db}"\n')
    # A closed session with feedback: something to train.
    with gateway(db, *keyed("--upstream", engine.url)) as (_, url), GatewayClient(url, ADMIN) as c:
        key = c.create_app_key("bot").key
        assert key is not None
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {key}", "x-session-id": "s"},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
        c.feedback(key, "f0", name="thumbs", value=1.0, session_id="s")
        c.sweep(idle_timeout_s=0)
    with gateway(db, *keyed()) as (g, _):
        t0 = time.monotonic()
        run = subprocess.run(
            [str(BIN / "lightning"), "train", "--online", str(cfg)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        took = time.monotonic() - t0
        told = (
            "gateway = URL" in run.stderr + run.stdout
            and f"pid {g.p.pid}" in run.stderr + run.stdout
        )
    trained = (out / "weights").exists() or (out / "metrics.jsonl").exists()
    tb = "Traceback" in run.stderr
    if tb:
        print(run.stderr[-3000:], file=sys.stderr)
    ok = run.returncode != 0 and told and not trained and not tb
    return ok, (
        f"exit {run.returncode} in {took:.1f} s, names the gateway's pid and `gateway = URL`: "
        f"{told}, weights or metrics written: {trained}, traceback: {tb}"
    )


def small_ones(tmp: Path, db: Path) -> tuple[bool, str]:
    from lightning import GatewayClient

    with gateway(db, *keyed()) as (_, url), GatewayClient(url, ADMIN) as client:
        ro = client.create_rollout({"t": 1}, group="g")
        huge = httpx.post(
            f"{url}/rollouts/{ro.id}/reward",
            json={"value": 1e308},
            headers={"Authorization": f"Bearer {ro.token}"},
            timeout=10,
        )
    v = Proc(
        [str(BIN / "lightning"), "view", "--db", str(db), "--port", "0"],
        env={"LIGHTNING_VIEW_KEY": ""},
    )
    try:
        m = v.wait_for(r"http://\S+?:(\d+)/\?key=(\S+)")
        assert m is not None, v.text()[-300:]
        rate = httpx.get(
            f"http://127.0.0.1:{m.group(1)}/api/rate?window=1e-300&bucket=1e-300",
            headers={"Authorization": f"Bearer {m.group(2)}"},
            timeout=10,
        )
    finally:
        v.stop()
    export = tmp / "export.jsonl"
    old = os.umask(0o022)
    try:
        run = subprocess.run(
            [str(BIN / "lightning"), "online", "export", "--db", str(db), "--out", str(export)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        os.umask(old)
    mode = stat.S_IMODE(export.stat().st_mode) if export.exists() else None
    ok = huge.status_code == 400 and rate.status_code == 400 and mode == 0o600
    return ok, (
        f"reward 1e308: {huge.status_code}; /api/rate 1e-300: {rate.status_code}; "
        f"export file mode: {oct(mode) if mode is not None else 'none: ' + run.stderr[-200:]}"
    )


def tool_args_restart(db: Path, engine: Engine) -> tuple[bool, str]:
    from lightning import GatewayClient

    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    with gateway(db, *keyed("--upstream", engine.url)) as (_, url):
        with GatewayClient(url, ADMIN) as client:
            ro = client.create_rollout({"t": "tools"})
        auth = {"Authorization": f"Bearer {ro.token}"}
        first = httpx.post(
            f"{url}/rollouts/{ro.id}/v1/messages",
            headers=auth,
            timeout=30,
            json={
                "model": "m",
                "max_tokens": 16,
                "tools": tools,
                "messages": [{"role": "user", "content": "weather?"}],
            },
        ).json()
    use = next(b for b in first["content"] if b["type"] == "tool_use")
    # A new gateway process: the first one's memory of the tool call is gone.
    with gateway(db, *keyed("--upstream", engine.url)) as (_, url):
        messages = [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}],
            },
        ]
        r = httpx.post(
            f"{url}/rollouts/{ro.id}/v1/messages",
            headers=auth,
            timeout=30,
            json={"model": "m", "max_tokens": 16, "tools": tools, "messages": messages},
        )
        assert r.status_code == 200, r.text
    sent = engine.seen[-1]["messages"]
    resent = next(m for m in sent if m.get("tool_calls"))["tool_calls"][0]["function"]["arguments"]
    return (
        resent == ARGS,
        f"argument text re-sent after the restart: {resent!r} (engine's: {ARGS!r})",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-serve", action="store_true", help="skip the lightning serve checks")
    ap.add_argument("--only", metavar="N,N", help="run only these findings (e.g. 3,6)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None

    def check_if(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        if only is None or name.split()[0] in only:
            check(name, fn)

    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="probe-doors-"))
    engine = Engine()
    with gateway(tmp / "view.db", *keyed()) as (_, url):  # a store for the view to serve
        from lightning import GatewayClient

        with GatewayClient(url, ADMIN) as c:
            c.create_rollout({"t": 0}, group="g")
    check_if("1 two writers through a hard link and a symlink", lambda: two_writers(tmp))
    check_if("2 view: rebinding Host, key, 0.0.0.0", lambda: view_doors(tmp / "view.db"))
    check_if("3 gateway: cross-site POST, rebinding Host, 0.0.0.0", lambda: gateway_doors(tmp))
    if not args.no_serve:
        check_if("3 lightning serve: cross-site POST, rebinding Host, key", serve_doors)
    check_if("4 view honours redaction", lambda: redaction(tmp / "private.db", engine))
    check_if("5 secret file at 0644 / deleted", lambda: secret_file(tmp / "view.db"))
    check_if("6 train --online without gateway = URL", lambda: train_online(tmp, engine))
    check_if("7 reward 1e308, rate 1e-300, export mode", lambda: small_ones(tmp, tmp / "small.db"))
    check_if(
        "8 tool-argument text across a restart", lambda: tool_args_restart(tmp / "tools.db", engine)
    )
    failed = [n for n, ok, _ in results if not ok]
    print(
        f"{len(results) - len(failed)} of {len(results)} checks pass in "
        f"{time.monotonic() - t0:.0f} s",
        flush=True,
    )
    engine.server.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
