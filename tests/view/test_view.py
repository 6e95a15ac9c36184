"""`lightning view`: the JSON API over a store written by a real gateway (the fake
engine behind it), the live metrics, paging, the admin key and read-only-ness."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from fake_vllm import FakeEngine
from lightning.gateway.local_http import is_loopback
from lightning.view.data import View, first_difference, read_metrics
from lightning.view.server import create_app, main
from view_run import ByteDecoder, append_metrics, record_online, record_run

LOCAL = "http://127.0.0.1:8765"  # TestClient's own default Host, `testserver`, is refused
KEY = "view-key-0123456789"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, list[str]]]]:
    engine = FakeEngine("S")
    try:
        run_dir = tmp_path_factory.mktemp("view") / "run"
        yield run_dir, record_run(engine.url, run_dir)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def online(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A store written by a gateway process in online mode (see ``record_online``)."""
    engine = FakeEngine("V", unique_ids=True)
    try:
        db = tmp_path_factory.mktemp("view-online") / "online.db"
        yield db, record_online(engine, db)
    finally:
        engine.stop()


@pytest.fixture()
def oclient(online: Any) -> Iterator[TestClient]:
    with TestClient(create_app(View(online[0], tokenizer=ByteDecoder())), base_url=LOCAL) as c:
        yield c


@pytest.fixture()
def client(run: Any) -> Iterator[TestClient]:
    run_dir, _ = run
    view = View(run_dir / "lightning.db", run_dir / "metrics.jsonl", ByteDecoder())
    with TestClient(create_app(view), base_url=LOCAL) as c:
        yield c


def test_page_and_assets_are_served_from_the_package(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'src="static/view.js"' in page.text and "http" not in page.text.split("<body>")[1]
    js = client.get("/static/view.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert "fetch(" in js.text and "cdn" not in js.text.lower()
    assert client.get("/static/view.css").status_code == 200
    assert client.get("/static/..%2Fserver.py").status_code == 404


def test_metrics_are_read_from_an_offset_and_follow_appends(client: TestClient, run: Any) -> None:
    first = client.get("/api/metrics").json()
    assert [r["step"] for r in first["rows"]] == [1, 2, 3]
    assert first["rows"][1]["eval_ci_low"] == 0.2
    again = client.get(f"/api/metrics?offset={first['offset']}").json()
    assert again["rows"] == [] and again["offset"] == first["offset"]
    path = run[0] / "metrics.jsonl"
    before = path.read_bytes()
    try:
        append_metrics(run[0], range(4, 5))
        with open(path, "a") as f:
            f.write('{"step": 5, "loss": Na')  # half-written: left for the next poll
        more = client.get(f"/api/metrics?offset={first['offset']}").json()
        assert [r["step"] for r in more["rows"]] == [4]
        assert more["offset"] == len(before) + len(path.read_bytes().splitlines(True)[3])
    finally:
        path.write_bytes(before)


def test_nan_in_metrics_becomes_null(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": NaN, "x": [Infinity, 1.5]}\n')
    rows, offset = read_metrics(path)
    assert rows == [{"step": 1, "loss": None, "x": [None, 1.5]}] and offset == path.stat().st_size


def test_summary_counts_rollouts_per_mode_and_status(client: TestClient) -> None:
    s = client.get("/api/summary").json()
    assert s["store"] is True and s["decoded"] is True and s["rollouts"] == 4
    statuses = {k: v for per in s["by_mode"].values() for k, v in per.items()}
    assert statuses.pop("succeeded") == 3
    assert sum(statuses.values()) == 1  # g1's rollout, still in flight
    assert set(statuses) <= {"queued", "running"}


def test_rollouts_page_with_after_and_limit(client: TestClient, run: Any) -> None:
    _, ids = run
    everyone = ids["g0"] + ids["g1"]
    first = client.get("/api/rollouts?limit=3").json()
    assert [r["rollout_id"] for r in first["rollouts"]] == everyone[:3]
    assert first["next"] == everyone[2]
    rest = client.get(f"/api/rollouts?limit=3&after={first['next']}").json()
    assert [r["rollout_id"] for r in rest["rollouts"]] == everyone[3:] and rest["next"] is None
    done = client.get("/api/rollouts?status=succeeded").json()["rollouts"]
    assert [r["rollout_id"] for r in done] == ids["g0"]
    assert [r["reward"] for r in done] == [1.0, 0.0, 0.5]
    g1 = client.get("/api/rollouts?group=g1").json()["rollouts"]
    assert [r["rollout_id"] for r in g1] == ids["g1"] and g1[0]["task"] == {"task": "g1 task"}


def test_a_rollout_decodes_its_calls_and_shows_samples_and_splits(
    client: TestClient, run: Any
) -> None:
    _, ids = run
    d = client.get(f"/api/rollouts/{ids['g0'][1]}").json()
    assert d["rollout"]["reward"] == 0.0 and d["decoded"] is True
    assert len(d["calls"]) == 2
    first = d["calls"][0]
    assert "g0-1 [[len:12]]" in "".join(first["prompt"])
    assert len(first["completion"]) == len(first["completion_ids"]) == len(first["logprobs"]) == 12
    assert all(lp is not None and lp <= 0 for lp in first["logprobs"])
    assert [c["weight_version"] for c in d["calls"]] == [1, 1]
    # The harness sent its first answer back upper-cased: the second call's prompt
    # leaves the first call's path, so there are two samples and one split point.
    assert len(d["samples"]) == 2 and len(d["divergences"]) == 1
    split = d["divergences"][0]
    assert split["call_index"] == 1 and split["left_call_index"] == 0
    assert split["kind"] == "unclassified"  # a plain decoder, not the policy's Tokenizer
    s0 = d["samples"][0]
    assert s0["tokens"][: split["position"]] == d["samples"][1]["tokens"][: split["position"]]
    generated = [p for p, w in zip(s0["pieces"], s0["weights"], strict=True) if w > 0]
    assert "".join(generated) == "".join(first["completion"])
    assert {v for v, w in zip(s0["weight_version"], s0["weights"], strict=True) if w > 0} == {1}
    later = client.get(f"/api/rollouts/{ids['g0'][2]}").json()
    assert {c["weight_version"] for c in later["calls"]} == {2}
    assert client.get("/api/rollouts/nope").status_code == 404


def test_without_a_tokenizer_ids_are_shown(run: Any) -> None:
    run_dir, ids = run
    with TestClient(create_app(View(run_dir / "lightning.db")), base_url=LOCAL) as c:
        d = c.get(f"/api/rollouts/{ids['g0'][0]}").json()
        assert d["decoded"] is False
        call = d["calls"][0]
        assert call["completion"] == [f"⟨{i}⟩" for i in call["completion_ids"]]
        assert c.get("/api/metrics").json() == {"rows": [], "offset": 0, "file": None}


def test_group_is_sorted_by_reward_and_compare_marks_the_first_difference(
    client: TestClient, run: Any
) -> None:
    _, ids = run
    g = client.get("/api/groups/g0").json()
    assert [r["reward"] for r in g["rollouts"]] == [1.0, 0.5, 0.0]
    a, b = ids["g0"][0], ids["g0"][1]
    c = client.get(f"/api/compare?a={a}&b={b}").json()
    ta, tb = c["a"]["samples"][0]["tokens"], c["b"]["samples"][0]["tokens"]
    i = c["first_diff"]
    assert ta[:i] == tb[:i] and ta[i] != tb[i]
    assert client.get(f"/api/compare?a={a}&b=nope").status_code == 404
    assert first_difference([1, 2], [1, 2]) is None and first_difference([1, 2], [1]) == 1


def test_no_route_writes_and_the_store_is_unchanged(client: TestClient, run: Any) -> None:
    db = run[0] / "lightning.db"
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    rid = run[1]["g0"][0]
    for path in ("/api/rollouts", f"/api/rollouts/{rid}", "/api/summary", "/api/metrics"):
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            # JSON, so the route (not the content-type door) is what refuses.
            assert client.request(method, path, json={}).status_code == 405, (method, path)
    client.get(f"/api/rollouts/{rid}")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest


def test_admin_key_is_checked_on_every_request(run: Any) -> None:
    run_dir, _ = run
    app = create_app(View(run_dir / "lightning.db", run_dir / "metrics.jsonl"), admin_key=KEY)
    with TestClient(app, base_url=LOCAL) as c:
        for path in ("/", "/static/view.js", "/api/summary", "/api/rollouts"):
            assert c.get(path).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/summary", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        # The scheme is case-insensitive (RFC 9110 §11.1).
        assert c.get("/api/summary", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        assert c.get("/api/summary", headers={"x-api-key": KEY}).status_code == 200
        assert c.get(f"/?key={KEY}").status_code == 200
    # A short key is refused where it is given.
    with pytest.raises(ValueError, match="at least 16"):
        create_app(View(run_dir / "lightning.db"), admin_key="s3cret")


def test_a_store_not_yet_written_is_waited_for(tmp_path: Path) -> None:
    with TestClient(
        create_app(View(tmp_path / "later.db", tmp_path / "m.jsonl")), base_url=LOCAL
    ) as c:
        s = c.get("/api/summary").json()
        assert s["store"] is False and s["rollouts"] == 0
        assert c.get("/api/rollouts").json() == {"rollouts": [], "next": None}
    assert not (tmp_path / "later.db").exists()


def test_cli_refuses_a_short_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_VIEW_KEY", "short")
    assert main([str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "LIGHTNING_VIEW_KEY" in capsys.readouterr().err
    monkeypatch.delenv("LIGHTNING_VIEW_KEY")
    assert main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_the_command_serves_a_store_read_only(run: Any) -> None:
    """`lightning view --db PATH --port 0`: the printed URL answers; the store is unchanged."""
    run_dir, ids = run
    db = run_dir / "lightning.db"
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    exe = Path(sys.executable).with_name("lightning")
    with subprocess.Popen(
        [str(exe), "view", "--db", str(db), "--port", "0"], stdout=subprocess.PIPE, text=True
    ) as proc:
        check_served(proc, ids)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest


def check_served(proc: subprocess.Popen[str], ids: dict[str, list[str]]) -> None:
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"(http://\S+/)\?key=(\S+)", line)
        assert url, line
        root, key = url.group(1), url.group(2)
        # A random key per start, printed in the URL: nothing answers without it.
        assert len(key) >= 16
        assert httpx.get(root + "api/summary", timeout=10).status_code == 401
        assert httpx.get(root, timeout=10).status_code == 401
        assert httpx.get(f"{root}?key={key}", timeout=10).status_code == 200
        # DNS rebinding: the right key, but the attacker's name in Host.
        port = root.rsplit(":", 1)[1].rstrip("/")
        rebound = httpx.get(
            root + "api/summary",
            headers={"Authorization": f"Bearer {key}", "Host": f"attacker.example:{port}"},
            timeout=10,
        )
        assert rebound.status_code == 403 and rebound.json()["code"] == "host_not_allowed"
        auth = {"Authorization": f"Bearer {key}"}
        s = httpx.get(root + "api/summary", headers=auth, timeout=10).json()
        assert s["rollouts"] == 4 and s["decoded"] is False and s["metrics"] is None
        page = httpx.get(root + f"api/rollouts/{ids['g0'][0]}", headers=auth, timeout=10).json()
        assert page["calls"][0]["completion"][0].startswith("⟨")
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_run_dir_names_its_store_and_model(tmp_path: Path) -> None:
    from lightning.config import RunConfig
    from lightning.view.data import run_paths

    assert run_paths(tmp_path) == (tmp_path / "lightning.db", None)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(model)},
            "tasks": {"train": "t.jsonl"},
            "harness": {"command": ["true"]},
            "gateway": {"db": "/x/g.db"},
        }
    )
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    assert run_paths(tmp_path) == (Path("/x/g.db"), model)


def test_rollout_pages_come_from_the_reader_and_end(client: TestClient, run: Any) -> None:
    """Keyset pages: every rollout once, in creation order, under each filter; an
    unknown ``after`` is an empty page (a client following ``next`` cannot loop)."""
    _, ids = run
    seen, nxt = [], None
    while True:
        page = client.get("/api/rollouts?limit=1" + (f"&after={nxt}" if nxt else "")).json()
        seen += [r["rollout_id"] for r in page["rollouts"]]
        nxt = page["next"]
        if nxt is None:
            break
    assert seen == ids["g0"] + ids["g1"]
    assert client.get("/api/rollouts?after=gone").json() == {"rollouts": [], "next": None}
    one = client.get(f"/api/rollouts?status=succeeded&limit=2&after={ids['g0'][0]}").json()
    assert [r["rollout_id"] for r in one["rollouts"]] == ids["g0"][1:] and one["next"] is None
    assert client.get("/api/rollouts?mode=eval").json()["rollouts"] == []


def test_the_reader_pages_and_counts_without_python(run: Any) -> None:
    """``StoreReader.rollouts(after=, limit=)`` and ``rollout_counts()`` directly."""
    from lightning._core import StoreReader

    run_dir, ids = run
    r = StoreReader(run_dir / "lightning.db")
    everyone = ids["g0"] + ids["g1"]
    assert [x["rollout_id"] for x in r.rollouts(limit=2)] == everyone[:2]
    assert [x["rollout_id"] for x in r.rollouts(after=everyone[1], limit=10)] == everyone[2:]
    assert [x["reward"] for x in r.rollouts(limit=3)] == [1.0, 0.0, 0.5]
    counts = {(m, s): n for m, s, n in r.rollout_counts()}
    assert counts.pop(("train", "succeeded")) == 3 and sum(counts.values()) == 1
    with pytest.raises(ValueError, match="not both"):
        r.rollouts([everyone[0]], limit=1)
    with pytest.raises(ValueError, match=">= 0"):
        r.rollouts(limit=-1)


def test_calls_per_time_bucket_and_errors(client: TestClient, oclient: TestClient) -> None:
    rate = client.get("/api/rate").json()
    assert rate["bucket_s"] == 5.0 and rate["end"] is not None
    assert sum(b["calls"] for b in rate["buckets"]) == 8  # 4 rollouts x 2 calls
    assert sum(b["upstream_errors"] + b["aborted"] for b in rate["buckets"]) == 0
    starts = [b["start"] for b in rate["buckets"]]
    assert starts == sorted(starts) and all(s % 5 == 0 for s in starts)
    assert starts[-1] <= rate["end"] < starts[-1] + 5 and len(starts) in (120, 121)
    # The online store: six calls, one of which failed upstream mid-stream.
    orate = oclient.get("/api/rate?window=60&bucket=1").json()
    assert orate["bucket_s"] == 1.0
    assert sum(b["calls"] for b in orate["buckets"]) == 6
    assert sum(b["upstream_errors"] for b in orate["buckets"]) == 1
    assert oclient.get("/api/rate?window=-3&bucket=x").json()["bucket_s"] == 5.0


def test_sessions_page_lists_keys_tags_feedback_reward_and_trained(
    oclient: TestClient, online: Any
) -> None:
    _, got = online
    sid = got["sessions"]
    rows = oclient.get("/api/sessions").json()
    assert rows["next"] is None
    by_key = {s["session_key"]: s for s in rows["sessions"]}
    assert set(by_key) == {"conv-1", "conv-2", "conv-3"}
    c1, c2, c3 = by_key["conv-1"], by_key["conv-2"], by_key["conv-3"]
    assert c1["rollout_id"] == sid["conv-1"] and c1["app_key"] == "support-bot"
    assert c1["tags"] == ["support"] and c1["n_calls"] == 3 and c1["feedback"] == 2
    # The default online reward: mean of the latest signal per (name, target).
    assert c1["reward"] == 0.75 and c1["trained"] is None
    assert c3["reward"] == 0.0 and c3["trained"] is not None and c3["feedback"] == 1
    assert c2["reward"] is None and c2["feedback"] == 0 and c2["tags"] == []
    # Newest activity first.
    updated = [s["updated"] for s in rows["sessions"]]
    assert updated == sorted(updated, reverse=True)

    def keys(q: str) -> set[str]:
        return {s["session_key"] for s in oclient.get("/api/sessions?" + q).json()["sessions"]}

    assert keys("key=other-bot") == {"conv-2"}
    assert keys(f"key={got['keys']['support-bot']}") == {"conv-1", "conv-3"}
    assert keys("tag=support") == {"conv-1", "conv-3"} and keys("tag=nope") == set()
    assert keys("feedback=1") == {"conv-1", "conv-3"} and keys("feedback=0") == {"conv-2"}
    assert keys("trained=1") == {"conv-3"} and keys("trained=0") == {"conv-1", "conv-2"}
    assert keys("trained=1&tag=support&feedback=yes") == {"conv-3"}
    # Keyset pages of one reproduce the list, then end.
    seen, nxt = [], None
    while True:
        page = oclient.get("/api/sessions?limit=1" + (f"&after={nxt}" if nxt else "")).json()
        seen += [s["rollout_id"] for s in page["sessions"]]
        nxt = page["next"]
        if nxt is None:
            break
    assert seen == [s["rollout_id"] for s in rows["sessions"]]
    assert oclient.get("/api/sessions?after=gone").json() == {"sessions": [], "next": None}


def test_a_session_shows_its_conversation_across_protocols(
    oclient: TestClient, online: Any
) -> None:
    _, got = online
    d = oclient.get(f"/api/sessions/{got['sessions']['conv-1']}").json()
    assert [c["protocol"] for c in d["calls"]] == [
        "openai_chat",
        "openai_responses",
        "anthropic_messages",
    ]
    assert [c["response_id"] for c in d["calls"]] == got["responses"]
    # What the harness sent each turn (the new messages), whatever the protocol.
    sent = [[m["content"] for m in c["sent"] if m.get("role") == "user"] for c in d["calls"]]
    assert sent == [
        ["first question [[len:6]]"],
        ["second, via responses [[len:5]]"],
        ["third, via messages [[len:4]]"],
    ]
    for c in d["calls"]:  # the answer decoded from its exact ids is the text sent
        assert "".join(c["completion"]) == c["text"] and c["status"] == "ok"
    assert sorted(f["name"] for f in d["feedback"]) == ["rating", "thumbs"]
    assert d["reward"] == 0.75 and d["rollout"]["task"]["app_key"] == "support-bot"
    assert oclient.get("/api/sessions/nope").status_code == 404


# ---------------------------------------------------------------- issue 39: closed doors


def test_a_page_under_another_name_is_refused_before_the_key(run: Any) -> None:
    """DNS rebinding: a page whose name resolves to 127.0.0.1 sends that name."""
    view = View(run[0] / "lightning.db")
    with TestClient(create_app(view, KEY), base_url="http://attacker.example:8765") as c:
        r = c.get(f"/api/summary?key={KEY}")
        assert r.status_code == 403 and r.json()["code"] == "host_not_allowed"
    for base in ("http://localhost:1", "http://[::1]:1", "http://127.0.0.1"):
        with TestClient(create_app(view, KEY), base_url=base) as c:
            assert c.get(f"/api/summary?key={KEY}").status_code == 200, base
    # A listener on every interface checks names too: only those allowed.
    with TestClient(create_app(view, KEY, listen_host="0.0.0.0"), base_url="http://box") as c:
        assert c.get(f"/api/summary?key={KEY}").status_code == 403
    allowed = create_app(view, KEY, listen_host="0.0.0.0", allowed_hosts=["box"])
    with TestClient(allowed, base_url="http://box") as c:
        assert c.get(f"/api/summary?key={KEY}").status_code == 200


def test_a_view_on_every_interface_serves_only_allowed_names(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lightning view --host 0.0.0.0`, a real process: a rebinding name gets 403
    even with the key; `--allowed-host NAME` and `$LIGHTNING_ALLOWED_HOSTS` serve theirs."""
    db = run[0] / "lightning.db"
    exe = Path(sys.executable).with_name("lightning")
    monkeypatch.setenv("LIGHTNING_ALLOWED_HOSTS", "env.example")
    cmd = [str(exe), "view", "--db", str(db), "--host", "0.0.0.0", "--port", "0"]
    for extra, allowed in (
        ([], "env.example"),
        (["--allowed-host", "view.example"], "view.example"),
    ):
        with subprocess.Popen([*cmd, *extra], stdout=subprocess.PIPE, text=True) as proc:
            try:
                assert proc.stdout is not None
                url = re.search(r":(\d+)/\?key=(\S+)", proc.stdout.readline())
                assert url
                port, key = url.group(1), url.group(2)
                root = f"http://127.0.0.1:{port}/api/summary"

                def get(host: str, root: str = root, key: str = key) -> int:
                    h = {"Authorization": f"Bearer {key}", "Host": host}
                    return httpx.get(root, headers=h, timeout=10).status_code

                assert get(f"evil.example:{port}") == 403
                assert get(f"{allowed}:{port}") == 200
                assert get(f"127.0.0.1:{port}") == 200
                # The flag replaces the environment's names.
                assert get("env.example") == (200 if not extra else 403)
            finally:
                proc.terminate()
                proc.wait(10)


def test_rate_parameters_outside_the_range_are_a_400(client: TestClient) -> None:
    for q in ("window=1e-300&bucket=1e-300", "bucket=1e-300", "window=1e300", "bucket=0.0001"):
        r = client.get("/api/rate?" + q)
        assert r.status_code == 400, (q, r.text)
        assert "outside" in r.json()["error"]
    assert client.get("/api/rate?window=60&bucket=0.5").status_code == 200


def test_online_sessions_are_counted_as_online_in_the_summary(oclient: TestClient) -> None:
    s = oclient.get("/api/summary").json()
    assert s["by_mode"] == {"online": {"open": 3}}, s
    assert s["rollouts"] == 3


def test_detail_routes_page_their_calls(oclient: TestClient, online: Any) -> None:
    sid = online[1]["sessions"]["conv-1"]
    whole = oclient.get(f"/api/rollouts/{sid}").json()
    assert whole["calls_total"] == 3 and whole["next_offset"] is None
    seqs = []
    offset: int | None = 0
    while offset is not None:
        page = oclient.get(f"/api/sessions/{sid}?offset={offset}&limit=1").json()
        assert len(page["calls"]) == 1
        seqs.append(page["calls"][0]["seq"])
        # Each page still knows what its turn sent (earlier turns are walked, not sent).
        assert page["calls"][0]["sent"], page["calls"][0]
        offset = page["next_offset"]
    assert seqs == [c["seq"] for c in whole["calls"]]
    big = oclient.get(f"/api/rollouts/{sid}?limit=100000").json()
    assert len(big["calls"]) == 3  # capped at CALLS_PAGE_MAX, never unbounded
    assert "_turns" not in big


def test_a_redacted_session_shows_no_ids_or_decoded_text_unless_with_ids(
    tmp_path: Path,
) -> None:
    """As `lightning online export`: a redacting key's ids decode to the removed text."""
    import openai

    from online_gateway import Gw, new_key

    engine = FakeEngine("R", unique_ids=True)
    db = tmp_path / "redact.db"
    gw = Gw(db, engine.url, "idle_timeout_s = 600")
    try:
        key = new_key(gw, "private-bot", redact=True)
        with openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0) as oa:
            oa.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "my card is 4111-SECRET [[len:5]]"}],
                extra_headers={"x-session-id": "private"},
            )
        sid = gw.api.sessions()[0].session_id
    finally:
        gw.stop()
        engine.stop()
    with TestClient(create_app(View(db, tokenizer=ByteDecoder())), base_url=LOCAL) as c:
        for path in (f"/api/sessions/{sid}", f"/api/rollouts/{sid}"):
            r = c.get(path)
            assert r.status_code == 200
            assert "4111-SECRET" not in r.text, path
            d = r.json()
            assert d["redacted"] is True and d["ids_hidden"] is True
            call = d["calls"][0]
            assert call["prompt_ids"] == [] and call["completion_ids"] == []
            assert call["prompt"] == [] and d["samples"] == []
    with TestClient(
        create_app(View(db, tokenizer=ByteDecoder(), with_ids=True)), base_url=LOCAL
    ) as c:
        d = c.get(f"/api/rollouts/{sid}").json()
        assert d["ids_hidden"] is False and d["calls"][0]["prompt_ids"]
        assert "4111-SECRET" in "".join(d["calls"][0]["prompt"])
