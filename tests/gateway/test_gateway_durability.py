"""Durability (issue 15, section 3, and the store half of section 2): kill -9
the gateway (started through the ``lightning-gateway`` console entry point)
under mixed load again and again on one database; everything the harness saw
complete (chat, Responses and Messages, streamed and not) and every
acknowledged reward and event must be in the store after each restart, byte
for byte, and nothing partial may look complete. Then the disk fills
(``RLIMIT_FSIZE`` lowered on the live gateway): it refuses what it cannot
record, says so on ``/healthz``, and recovers by itself.

``LIGHTNING_LONG=1`` runs the kill loop 40 times instead of 5."""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from fake_vllm import FakeEngine
from gateways import serving, wait_until
from lightning import GatewayClient, Store
from lightning.gateway.client import GatewayRequestError

ADMIN = "durability-admin-key"


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine("D")
    yield e
    e.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    db: Path, upstream: str, extra: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-c", "import sys; from lightning.gateway.server import main; sys.exit(main())",
        "--listen", f"127.0.0.1:{port}", "--upstream", upstream, "--db", str(db),
        "--admin-key", ADMIN, "--threads", "2", *(extra or []),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: serving(url), "the gateway to come up", timeout=20, every=0.05)
    except AssertionError:
        proc.kill()
        raise
    return proc, url


def test_sigterm_drains_and_exits_cleanly(engine: FakeEngine, tmp_path: Path) -> None:
    proc, url = launch(tmp_path / "t.db", engine.url)
    c = GatewayClient(url, ADMIN)
    r = c.create_rollout()
    oa = openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0)
    result: list[str] = []

    def slow() -> None:
        msgs = [{"role": "user", "content": "x [[len:10]] [[slow:0.03]]"}]
        stream = oa.chat.completions.create(model="m", messages=msgs, stream=True)
        result.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))

    t = threading.Thread(target=slow)
    t.start()
    wait_until(lambda: c.state()["in_flight"], "the slow call in flight", every=0.005)
    proc.send_signal(signal.SIGTERM)
    t.join(10)
    oa.close()
    assert proc.wait(10) == 0
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    proc.stderr.close()
    assert "store flushed" in log and ADMIN not in log and r.token not in log
    assert len(result) == 1 and len(result[0]) == 10  # the in-flight call finished
    c.close()
    with Store(tmp_path / "t.db") as s:
        assert [x.status for x in s.records(r.id)] == ["ok"]


def ask(oa: openai.OpenAI, an: anthropic.Anthropic, kind: int, text: str) -> str:
    """One harness call; kinds 0..5 cycle through every protocol, whole and streamed.
    Returns the answer only if the harness saw it end successfully."""
    msgs: Any = [{"role": "user", "content": text}]
    stream = kind % 2 == 1
    if kind < 2:
        if not stream:
            return (
                oa.chat.completions.create(model="m", messages=msgs).choices[0].message.content
                or ""
            )
        with oa.chat.completions.create(model="m", messages=msgs, stream=True) as parts:
            return "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices)
    if kind < 4:
        if not stream:
            return oa.responses.create(model="m", input=text).output_text
        with oa.responses.create(model="m", input=text, stream=True) as events:
            done = [e.response.output_text for e in events if e.type == "response.completed"]
        if not done:
            raise openai.APIError(
                "stream ended without response.completed", httpx.Request("POST", "/"), body=None
            )
        return done[0]
    if not stream:
        msg = an.messages.create(model="m", max_tokens=64, messages=msgs)
        return "".join(b.text for b in msg.content if b.type == "text")
    with an.messages.stream(model="m", max_tokens=64, messages=msgs) as s:
        return "".join(s.text_stream)


# The anthropic SDK streams through its own httpx fork (`httpx2`), whose
# transport errors escape a stream cut by the kill unwrapped.
_anthropic_httpx = sys.modules.get("httpx2")
HARNESS_ERRORS: tuple[type[Exception], ...] = (openai.APIError, anthropic.APIError, httpx.HTTPError)
if _anthropic_httpx is not None:
    HARNESS_ERRORS += (_anthropic_httpx.HTTPError,)
LEN = 8
KILLS = 40 if os.environ.get("LIGHTNING_LONG") == "1" else 5


def encode(text: str) -> list[int]:
    """The fake engine's byte-level tokenizer (id = byte + 10)."""
    return [b + 10 for b in text.encode()]


class Acked:
    """What the harnesses were told is done, per rollout."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[str, list[tuple[str, str]]] = {}  # (prompt marker, answer)
        self.events: dict[str, list[tuple[int, str, Any]]] = {}  # (seq, type, data)

    def call(self, rollout: str, marker: str, answer: str) -> None:
        with self.lock:
            self.calls.setdefault(rollout, []).append((marker, answer))

    def event(self, rollout: str, seq: int, kind: str, data: Any) -> None:
        with self.lock:
            self.events.setdefault(rollout, []).append((seq, kind, data))


def check_store(db: Path, acked: Acked) -> int:
    """Every acknowledged call, reward and event is on disk byte for byte, in
    order; no stored call looks complete unless it is. Returns how many
    acknowledged operations were checked."""
    checked = 0
    with Store(db) as s:
        for rollout, calls in acked.calls.items():
            recs = s.records(rollout)
            for r in recs:
                if r.status == "ok":  # complete: finished, every id and logprob there
                    assert r.finish_reason is not None and r.delivered, r
                    assert r.completion_ids is not None and len(r.completion_ids) == LEN, r
                    assert r.logprobs is not None and len(r.logprobs) == LEN, r
                    assert list(r.completion_ids) == encode(r.text or ""), r
                else:
                    assert not r.delivered, r
            prompts = [
                b"" if r.prompt_ids is None else bytes(int(i) - 10 for i in r.prompt_ids)
                for r in recs
            ]
            at = 0  # acknowledged calls appear in the order they were acknowledged
            for marker, answer in calls:
                m = marker.encode()
                while at < len(recs) and not (m in prompts[at] and recs[at].status == "ok"):
                    at += 1
                assert at < len(recs), f"{rollout}: acknowledged call {marker!r} is not stored"
                assert recs[at].text == answer
                assert recs[at].completion_ids is not None
                assert list(recs[at].completion_ids) == encode(answer)
                checked += 1
                at += 1
        for rollout, events in acked.events.items():
            stored = {e["seq"]: (e["type"], e["data"]) for e in s.events(rollout)}
            for seq, kind, data in events:
                assert stored.get(seq) == (kind, data), (rollout, seq, stored.get(seq))
                checked += 1
    return checked


def load_round(
    url: str, rollouts: list[Any], round_: int, acked: Acked, stop: threading.Event
) -> None:
    """Mixed load until `stop` or the first failure (the kill): every protocol,
    whole and streamed, then a reward and an event per call."""

    def worker(i: int) -> None:
        r = rollouts[i]
        oa = openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0, timeout=5)
        an = anthropic.Anthropic(
            base_url=r.anthropic_base_url, api_key=r.token, max_retries=0, timeout=5
        )
        rc = GatewayClient(url, timeout=5)
        n = 0
        try:
            while not stop.is_set():
                marker = f"<{r.id}.{round_}.{n}>"
                answer = ask(oa, an, (n + i) % 6, f"{marker} [[len:{LEN}]]")
                acked.call(r.id, marker, answer)
                value = float(round_ * 1000 + n)
                seq = rc.reward(r.id, value, source=marker, token=r.token)
                acked.event(r.id, seq, "reward", {"value": value, "source": marker, "data": None})
                data = {"marker": marker, "note": "é✓ \u0000 " * (n % 4), "n": [n, round_]}
                seq = rc.event(r.id, "note", data, token=r.token)
                acked.event(r.id, seq, "note", data)
                n += 1
        except HARNESS_ERRORS:
            pass  # the gateway died under this call: it was never acknowledged
        finally:
            oa.close()
            an.close()
            rc.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(rollouts))]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(15)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    if proc.stderr:
        proc.stderr.close()


def kill_round(
    proc: subprocess.Popen[bytes], url: str, db: Path, round_: int, acked: Acked, rng: random.Random
) -> int:
    """Checks what earlier rounds acknowledged, loads the gateway, kills it at a random moment."""
    if round_:
        check_store(db, acked)  # the restarted gateway recovered everything so far
    with GatewayClient(url, ADMIN) as c:
        # Same ids every round: same tokens, and seqs continue after each restart.
        rollouts = [c.create_rollout(rollout_id=f"r{i}") for i in range(6)]
    stop = threading.Event()
    load = threading.Thread(target=load_round, args=(url, rollouts, round_, acked, stop))
    before = sum(len(v) for v in acked.calls.values())
    load.start()
    wait_until(
        lambda: sum(len(v) for v in acked.calls.values()) >= before + 6,
        f"round {round_}: six acknowledged calls",
        timeout=30,
        every=0.01,
    )
    time.sleep(rng.uniform(0.0, 0.4))  # a random moment: mid-stream, mid-commit, mid-post
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    stop.set()
    load.join(30)
    assert sum(len(v) for v in acked.calls.values()) > before, f"round {round_}: no traffic"
    return 1


def test_kill9_loop_keeps_every_acknowledged_write(engine: FakeEngine, tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    rng = random.Random(15)
    acked = Acked()
    kills = 0
    for round_ in range(KILLS):
        proc, url = launch(db, engine.url)
        try:
            kills += kill_round(proc, url, db, round_, acked, rng)
        finally:
            stop_process(proc)
    proc, url = launch(db, engine.url)
    try:
        checked = check_store(db, acked)
        with GatewayClient(url, ADMIN) as c, Store(db) as s:  # the restart serves the same data
            assert len(c.records("r0")) == len(s.records("r0"))
    finally:
        stop_process(proc)
    print(f"\nkill -9 loop: {kills} kills, {checked} acknowledged operations checked")
    assert kills == KILLS and checked > 0


def set_fsize(pid: int, limit: int) -> None:
    """The disk "fills" for the live gateway: no write may reach offset `limit`
    (it gets EFBIG); `RLIM_INFINITY` frees it again."""
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def health(url: str) -> tuple[int, dict[str, Any]]:
    r = httpx.get(url + "/healthz", timeout=5)
    return r.status_code, r.json()


def test_full_disk_refuses_work_and_recovers(engine: FakeEngine, tmp_path: Path) -> None:
    db = tmp_path / "full.db"
    proc, url = launch(db, engine.url)
    try:
        c = GatewayClient(url, ADMIN)
        r = c.create_rollout()
        oa = openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0, timeout=10)
        an = anthropic.Anthropic(
            base_url=r.anthropic_base_url, api_key=r.token, max_retries=0, timeout=10
        )
        acked: list[str] = [ask(oa, an, k, f"before {k} [[len:{LEN}]]") for k in range(6)]
        # Calls in flight when the disk fills: none may end successfully.
        outcome: dict[int, str | Exception] = {}

        def inflight(k: int) -> None:
            try:
                outcome[k] = ask(oa, an, k, f"inflight {k} [[len:{LEN}]] [[slow:0.15]]")
            except HARNESS_ERRORS as e:
                outcome[k] = e

        threads = [threading.Thread(target=inflight, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        wait_until(lambda: c.state()["in_flight"] >= 6, "six calls in flight", every=0.01)
        assert c.state()["in_flight"] == 6
        set_fsize(proc.pid, 0)
        for t in threads:
            t.join(20)
        assert all(isinstance(o, Exception) for o in outcome.values()), outcome
        assert len(outcome) == 6
        status, h = health(url)
        assert status == 503 and h["status"] == "store_unwritable", h
        assert c.healthz() == h
        assert h["store"]["writable"] is False and h["store"]["error"]
        assert "\nlightning_store_writable 0\n" in httpx.get(url + "/metrics", timeout=5).text
        # New work is refused in each protocol's shape; the engine sees none of it.
        before = engine.log()["requests"]
        for k in range(6):
            sdk = anthropic if k >= 4 else openai
            with pytest.raises(sdk.InternalServerError) as e:
                ask(oa, an, k, f"refused {k} [[len:{LEN}]]")
            assert e.value.status_code == 503
            assert e.value.response.headers["retry-after"] == "1"
        assert engine.log()["requests"] == before
        with pytest.raises(GatewayRequestError) as refused:  # a reward it cannot store: no ack
            c.reward(r.id, 1.0)
        assert (refused.value.status, refused.value.code) == (503, "store_unavailable")
        # The disk frees up: the gateway notices by itself and serves again.
        set_fsize(proc.pid, resource.RLIM_INFINITY)
        wait_until(lambda: health(url)[0] == 200, "the gateway to recover", every=0.05)
        assert health(url)[1]["store"] == {"writable": True, "error": None}
        acked += [ask(oa, an, k, f"after {k} [[len:{LEN}]]") for k in range(6)]
        seq = c.reward(r.id, 2.0)
        oa.close()
        an.close()
        c.close()
    finally:
        stop_process(proc)
    with Store(db) as s:
        recs = s.records(r.id)
        # On disk: exactly the calls the harness saw complete, nothing from the full disk.
        assert [x.text for x in recs if x.status == "ok"] == acked
        assert all(x.delivered for x in recs)
        assert [(e["seq"], e["data"]["value"]) for e in s.events(r.id)] == [(seq, 2.0)]


def test_full_disk_can_serve_unrecorded(engine: FakeEngine, tmp_path: Path) -> None:
    """`on_store_failure = "serve"`: the harness keeps getting answers, unrecorded."""
    conf = tmp_path / "gw.toml"
    conf.write_text('on_store_failure = "serve"\n')
    db = tmp_path / "serve.db"
    proc, url = launch(db, engine.url, ["--config", str(conf)])
    try:
        with GatewayClient(url, ADMIN) as c:
            r = c.create_rollout()
            with openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0) as oa:
                first = ask(oa, None, 1, "first [[len:8]]")  # type: ignore[arg-type]
                set_fsize(proc.pid, 0)
                served = ask(oa, None, 0, "unrecorded [[len:8]]")  # type: ignore[arg-type]
                assert len(served) == LEN
                status, h = health(url)
                assert status == 200 and h["status"] == "serving_unrecorded", h
                metrics = httpx.get(url + "/metrics", timeout=5).text
                assert "\nlightning_unrecorded_calls_total 1\n" in metrics
                set_fsize(proc.pid, resource.RLIM_INFINITY)
                wait_until(
                    lambda: health(url)[1]["status"] == "ok", "the store to recover", every=0.05
                )
                last = ask(oa, None, 1, "last [[len:8]]")  # type: ignore[arg-type]
    finally:
        stop_process(proc)
    with Store(db) as s:
        assert [x.text for x in s.records(r.id)] == [first, last]
