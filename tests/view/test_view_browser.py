"""`lightning view` in a real browser: Debian's chromium, driven by Playwright
(never a downloaded browser), against a store written by a real gateway. The
page loads, its charts follow metrics lines as they land, a rollout opens with
its tokens, a group and a comparison render; screenshots are kept in
``$LIGHTNING_ARTIFACTS/view`` (else the test's tmp dir), printed."""

from __future__ import annotations

import itertools
import math
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from fake_vllm import FakeEngine
from gateways import wait_until
from lightning.view.data import View
from lightning.view.server import create_app
from view_run import ByteDecoder, append_metrics, record_online, record_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's chromium)"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Any]]:
    """The view of a fresh run, served by uvicorn on a loopback port."""
    engine = FakeEngine("S")
    run_dir = tmp_path_factory.mktemp("view-browser") / "run"
    try:
        ids = record_run(engine.url, run_dir)
    finally:
        engine.stop()
    view = View(run_dir / "lightning.db", run_dir / "metrics.jsonl", ByteDecoder())
    server = uvicorn.Server(
        uvicorn.Config(create_app(view), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the view's server to start")
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/", run_dir, ids
    server.should_exit = True
    thread.join(10)


def serve(view: View) -> tuple[uvicorn.Server, threading.Thread, str]:
    server = uvicorn.Server(
        uvicorn.Config(create_app(view), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the view's server to start")
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="module")
def served_online(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """The view of an online-mode store written by a gateway process."""
    engine = FakeEngine("W", unique_ids=True)
    db = tmp_path_factory.mktemp("view-browser-online") / "online.db"
    try:
        got = record_online(engine, db)
    finally:
        engine.stop()
    server, thread, url = serve(View(db, tokenizer=ByteDecoder()))
    yield url, got
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("LIGHTNING_ARTIFACTS")
    out = Path(root) / "view" if root else tmp_path_factory.mktemp("view-screenshots")
    out.mkdir(parents=True, exist_ok=True)
    print(f"\n[view] screenshots in {out}")
    return out


@pytest.fixture(scope="module")
def page(served: Any) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.errors = errors
        yield page
        browser.close()


def points(page: Any, chart: str) -> int:
    return int(page.get_attribute(f"#chart-{chart}", "data-points") or 0)


def test_charts_update_live_as_steps_land(page: Any, served: Any, artifacts: Path) -> None:
    url, run_dir, _ = served
    page.goto(url)
    page.wait_for_selector("#chart-reward[data-points]")
    for chart in ("reward", "loss", "kl", "entropy", "staleness", "idle"):
        assert page.is_visible(f"#chart-{chart}"), chart
    before = points(page, "loss")
    assert before == 3
    assert page.locator("#chart-reward line.ci").count() == 1  # step 2's eval interval
    page.screenshot(path=str(artifacts / "1-run-3-steps.png"), full_page=True)
    append_metrics(run_dir, range(4, 8))
    page.wait_for_function("document.querySelector('#chart-loss').dataset.points === '7'")
    assert page.locator("#chart-reward line.ci").count() == 3
    page.wait_for_function("document.querySelector('#live').dataset.steps === '7'")
    assert page.locator("#rollouts tbody tr").count() == 4
    assert "in flight" in page.inner_text("#counts")
    # Calls per second and errors, from the store: 8 calls, none failed.
    page.wait_for_selector("#chart-rate[data-calls]")
    assert page.get_attribute("#chart-rate", "data-calls") == "8"
    assert page.get_attribute("#chart-rate", "data-errors") == "0"
    page.screenshot(path=str(artifacts / "2-run-7-steps.png"), full_page=True)
    assert page.errors == []


def test_a_rollout_opens_with_its_tokens(page: Any, served: Any, artifacts: Path) -> None:
    url, _, ids = served
    page.goto(url)
    rid = ids["g0"][1]
    page.click(f'tr.rollout[data-id="{rid}"]')
    page.wait_for_selector("#samples .tok.gen")
    assert rid in page.inner_text("#detail h2")
    # The first call's completion, decoded from its exact ids, is in the DOM as tokens.
    from starlette.testclient import TestClient

    view = View(served[1] / "lightning.db", tokenizer=ByteDecoder())
    with TestClient(create_app(view), base_url="http://127.0.0.1") as c:
        completion = c.get(f"/api/rollouts/{rid}").json()["calls"][0]["completion"]
    tokens = page.locator("#calls .call").first.locator(".tokens").last.locator(".tok")
    assert tokens.all_inner_texts() == completion
    assert tokens.first.get_attribute("style").startswith("background:hsl(")
    assert "logprob" in (tokens.first.get_attribute("title") or "")
    assert page.locator("#samples .split-label").count() == 2  # one split, in each sample
    assert "unclassified" in page.inner_text("#samples")
    page.screenshot(path=str(artifacts / "3-rollout.png"), full_page=True)
    assert page.errors == []


def round_ticks(text: str) -> bool:
    """Whether axis tick labels are evenly spaced by 1, 2 or 5 x 10^k."""
    values = [float(v) for v in text.split()]
    steps = {round(b - a, 12) for a, b in itertools.pairwise(values)}
    if len(values) < 2 or len(steps) != 1:
        return False
    (step,) = steps
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    on_grid = all(abs(v / step - round(v / step)) < 1e-6 for v in values)
    return on_grid and any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5))


def test_round_ticks_check_can_fail() -> None:
    assert round_ticks("0.0 0.5 1.0") and round_ticks("-400 -300 -200") and round_ticks("0 2 4")
    assert not round_ticks("-0.6 2.67 6.33") and not round_ticks("0 3 6") and not round_ticks("1")
    assert not round_ticks("0.1 0.6 1.1")  # 0.5 apart, but off the grid of 0.5


def test_chart_axes_tick_at_round_values(page: Any, served: Any, artifacts: Path) -> None:
    url, _, _ = served
    page.goto(url)
    page.wait_for_selector("#chart-loss[data-yticks]")
    for chart in ("reward", "loss", "kl", "entropy"):
        for axis in ("yticks", "xticks"):
            ticks = page.get_attribute(f"#chart-{chart}", f"data-{axis}") or ""
            assert round_ticks(ticks), f"{chart} {axis}: {ticks!r}"
    # What the reader sees is those labels.
    labels = page.locator("#chart-loss text.tick").all_text_contents()
    ticks = (
        page.get_attribute("#chart-loss", "data-yticks")
        + " "
        + page.get_attribute("#chart-loss", "data-xticks")
    )
    assert labels == ticks.split()
    page.locator("#charts").screenshot(path=str(artifacts / "8-charts-round-ticks.png"))
    assert page.errors == []


@pytest.mark.parametrize("kind", ["rollout", "group", "compare"])
def test_a_link_opens_with_its_detail_first(
    page: Any, served: Any, artifacts: Path, kind: str
) -> None:
    """A link to a rollout, a group or a comparison (pasted, or opened from a report)
    shows that detail at the top of the page, above the charts and the rollout list."""
    url, _, ids = served
    a, b = ids["g0"][0], ids["g0"][1]
    link = {"rollout": f"#/rollout/{a}", "group": "#/group/g0", "compare": f"#/compare/{a}/{b}"}
    page.goto("about:blank")
    page.goto(url + link[kind])
    page.wait_for_selector("#detail .tok")
    page.wait_for_selector("#rollouts tbody tr")  # the list has loaded too, below
    detail = page.locator("#detail").bounding_box()
    for below in ("#charts", "#rollouts"):
        assert page.locator(below).bounding_box()["y"] >= detail["y"] + detail["height"], below
    assert page.evaluate("window.scrollY") == 0
    assert detail["y"] < 900  # in the first screen
    page.screenshot(path=str(artifacts / f"9-link-{kind}.png"))
    assert page.errors == []


def test_a_session_link_opens_with_its_conversation_first(
    page: Any, served_online: Any, artifacts: Path
) -> None:
    url, got = served_online
    page.goto("about:blank")
    page.goto(url + f"#/session/{got['sessions']['conv-1']}")
    page.wait_for_selector("#conversation .turn")
    page.wait_for_selector("#session-list tbody tr.session")  # the list loaded, below
    detail = page.locator("#detail").bounding_box()
    below = page.locator("#session-list").bounding_box()
    assert below["y"] >= detail["y"] + detail["height"]
    assert page.evaluate("window.scrollY") == 0
    page.screenshot(path=str(artifacts / "9-link-session.png"))
    assert page.errors == []


def test_group_and_compare_render(page: Any, served: Any, artifacts: Path) -> None:
    url, _, ids = served
    page.goto(url + "#/group/g0")
    page.wait_for_selector("#group-cols .col .tok")
    heads = page.locator("#group-cols .col h3").all_inner_texts()
    assert [h.split("reward ")[1] for h in heads] == ["1", "0.5", "0"]
    page.screenshot(path=str(artifacts / "4-group.png"), full_page=True)
    a, b = ids["g0"][0], ids["g0"][1]
    page.goto(url + f"#/compare/{a}/{b}")
    page.wait_for_selector(".tok.diff")
    assert page.locator(".tok.diff").count() == 2
    assert "first diverging token" in page.inner_text("#first-diff")
    page.screenshot(path=str(artifacts / "5-compare.png"), full_page=True)
    assert page.errors == []


def test_sessions_page_and_a_sessions_conversation(
    page: Any, served_online: Any, artifacts: Path
) -> None:
    url, got = served_online
    page.goto(url + "#/sessions")
    page.wait_for_selector("#session-list tbody tr.session")
    assert page.locator("#session-list tbody tr").count() == 3
    assert page.is_hidden("#run")
    row = page.locator(f'tr.session[data-id="{got["sessions"]["conv-1"]}"]')
    cells = row.locator("td").all_inner_texts()
    assert cells[1:6] == ["support-bot", "support", "3", "2", "0.75"]
    page.select_option("#s-feedback", "0")
    page.wait_for_function("document.querySelectorAll('#session-list tbody tr').length === 1")
    assert "other-bot" in page.inner_text("#session-list tbody")
    page.screenshot(path=str(artifacts / "6-sessions-filtered.png"), full_page=True)
    page.select_option("#s-feedback", "")
    page.wait_for_function("document.querySelectorAll('#session-list tbody tr').length === 3")
    page.screenshot(path=str(artifacts / "6-sessions.png"), full_page=True)
    row.click()
    page.wait_for_selector("#conversation .turn")
    turns = page.locator("#conversation .turn")
    assert [turns.nth(i).get_attribute("data-protocol") for i in range(3)] == [
        "openai_chat",
        "openai_responses",
        "anthropic_messages",
    ]
    assert "second, via responses" in turns.nth(1).inner_text()
    assert turns.nth(2).locator(".tok").count() > 0
    assert "reward 0.75" in page.inner_text("#detail")
    assert page.locator("#feedback tbody tr").count() == 2
    page.screenshot(path=str(artifacts / "7-session.png"), full_page=True)
    page.goto(url)
    page.wait_for_selector("#chart-rate[data-errors]")
    assert page.get_attribute("#chart-rate", "data-errors") == "1"
    page.screenshot(path=str(artifacts / "8-online-calls-chart.png"), full_page=True)
    assert page.errors == []


SECRET = "4111-SECRET"
LONG_CALLS = 23  # more than one page (CALLS_PAGE = 20) and more than one page of samples


@pytest.fixture(scope="module")
def served_private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any]]:
    """The view of an online store with a redacting key's session (its prompt holds
    ``SECRET``) and a long session of ``LONG_CALLS`` unrelated calls (a sample each),
    both written by a gateway process; served without and with ``--with-ids``."""
    import openai

    from online_gateway import Gw, new_key

    engine = FakeEngine("P", unique_ids=True)
    db = tmp_path_factory.mktemp("view-browser-private") / "private.db"
    gw = Gw(db, engine.url, "idle_timeout_s = 600")
    try:
        private, plain = new_key(gw, "private-bot", redact=True), new_key(gw, "long-bot")
        with openai.OpenAI(base_url=gw.url + "/v1", api_key=private, max_retries=0) as oa:
            oa.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"my card is {SECRET} [[len:5]]"}],
                extra_headers={"x-session-id": "private"},
            )
        with openai.OpenAI(base_url=gw.url + "/v1", api_key=plain, max_retries=0) as oa:
            for i in range(LONG_CALLS):
                oa.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"question {i} [[len:3]]"}],
                    extra_headers={"x-session-id": "long"},
                )
        sessions = {s.session_key: s.session_id for s in gw.api.sessions()}
    finally:
        gw.stop()
        engine.stop()
    hidden, thread, url = serve(View(db, tokenizer=ByteDecoder()))
    shown, thread_ids, url_ids = serve(View(db, tokenizer=ByteDecoder(), with_ids=True))
    yield url, url_ids, sessions
    for server, t in ((hidden, thread), (shown, thread_ids)):
        server.should_exit = True
        t.join(10)


@pytest.mark.parametrize("kind", ["session", "rollout"])
def test_a_redacted_sessions_page_shows_no_ids_or_decoded_text(
    page: Any, served_private: Any, artifacts: Path, kind: str
) -> None:
    url, url_ids, sessions = served_private
    sid = sessions["private"]
    block = "#conversation .turn" if kind == "session" else "#calls .call"
    page.goto("about:blank")
    page.goto(url + f"#/{kind}/{sid}")
    page.wait_for_selector(block)
    assert "redacted: ids hidden" in page.inner_text("#detail")
    # Tokens are one span each: the text is what they read joined, hidden parts included.
    assert SECRET not in page.locator("#detail").text_content()
    assert SECRET not in page.content()  # nor in any attribute
    assert page.locator("#detail .tok").count() == 0
    assert page.locator("#detail [data-id]").count() == 0
    page.screenshot(path=str(artifacts / f"10-redacted-{kind}.png"), full_page=True)
    # The same page under `lightning view --with-ids` decodes them: the check can fail.
    page.goto("about:blank")
    page.goto(url_ids + f"#/{kind}/{sid}")
    page.wait_for_selector(f"{block} .tok[data-id]", state="attached")
    if kind == "rollout":  # the session page shows the answer; the prompt is under its call
        assert SECRET in page.locator("#detail").text_content()
    assert "redacted: ids hidden" not in page.inner_text("#detail")
    assert page.errors == []


def click_more(page: Any, button: str, items: str, want: int) -> None:
    page.click(button)
    page.wait_for_function(f"document.querySelectorAll({items!r}).length === {want}")


def test_a_long_sessions_calls_page_with_a_more_control(
    page: Any, served_private: Any, artifacts: Path
) -> None:
    url, _, sessions = served_private
    page.goto("about:blank")
    page.goto(url + f"#/session/{sessions['long']}")
    page.wait_for_selector("#conversation .turn")
    turns = page.locator("#conversation .turn")
    assert turns.count() == 20
    assert page.inner_text("#more-turns-pager").startswith(f"20 of {LONG_CALLS} calls")
    assert "question 19" in turns.last.inner_text()
    click_more(page, "#more-turns", "#conversation .turn", LONG_CALLS)
    assert page.inner_text("#more-turns-pager").startswith(f"{LONG_CALLS} of {LONG_CALLS} calls")
    assert page.is_hidden("#more-turns")
    assert turns.nth(20).inner_text().split(" · ")[0].endswith("call 20")
    assert f"question {LONG_CALLS - 1}" in turns.last.inner_text()
    assert turns.last.locator(".tok").count() > 0
    page.screenshot(path=str(artifacts / "11-session-paged.png"), full_page=True)
    assert page.errors == []


def test_a_long_rollouts_calls_and_samples_page_with_a_more_control(
    page: Any, served_private: Any, artifacts: Path
) -> None:
    url, _, sessions = served_private
    page.goto("about:blank")
    page.goto(url + f"#/rollout/{sessions['long']}")
    page.wait_for_selector("#calls .call .tok.gen")
    assert page.locator("#calls .call").count() == 20
    assert page.inner_text("#more-calls-pager").startswith(f"20 of {LONG_CALLS} calls")
    click_more(page, "#more-calls", "#calls .call", LONG_CALLS)
    assert page.is_hidden("#more-calls")
    assert page.locator("#calls .call h4").last.inner_text().startswith(f"call {LONG_CALLS - 1} ")
    # Samples come 4 at a time, their own control.
    samples = page.locator("#samples .tokens")
    assert samples.count() == 4
    total = int(page.inner_text("#more-samples-pager").split(" of ")[1].split()[0])
    assert total > 8
    click_more(page, "#more-samples", "#samples .tokens", 8)
    assert page.inner_text("#more-samples-pager").startswith(f"8 of {total} samples")
    assert page.locator("#samples h4").nth(4).inner_text().startswith("sample 4 ")
    assert page.is_visible("#more-samples")
    page.screenshot(path=str(artifacts / "12-rollout-paged.png"), full_page=True)
    assert page.errors == []


BIG_GROUP, BIG_SAMPLES = 11, 6  # more rollouts than a page (8), more samples than one (4)


@pytest.fixture(scope="module")
def served_big_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A group of ``BIG_GROUP`` rollouts written by a real gateway, each with
    ``BIG_SAMPLES`` unrelated calls (a sample each); rewards 0, 0.1, ..."""
    import openai

    from gateways import start_gateway

    engine = FakeEngine("B", unique_ids=True)
    db = tmp_path_factory.mktemp("view-browser-group") / "group.db"
    try:
        with start_gateway(engine.url, db) as gw, gw.client() as client:
            for k in range(BIG_GROUP):
                r = client.create_rollout({"task": "big"}, group="big")
                with openai.OpenAI(base_url=r.base_url, api_key=r.token, max_retries=0) as sdk:
                    for i in range(BIG_SAMPLES):
                        sdk.chat.completions.create(
                            model="m",
                            messages=[{"role": "user", "content": f"r{k} q{i} [[len:3]]"}],
                        )
                client.reward(r.id, k / 10)
                client.set_status(r.id, "succeeded")
    finally:
        engine.stop()
    server, thread, url = serve(View(db, tokenizer=ByteDecoder()))
    yield url
    server.should_exit = True
    thread.join(10)


def test_a_big_groups_rollouts_and_samples_page_with_more_controls(
    page: Any, served_big_group: Any, artifacts: Path
) -> None:
    url = served_big_group
    page.goto("about:blank")
    page.goto(url + "#/group/big")
    page.wait_for_selector("#group-cols .col .tok")
    cols = page.locator("#group-cols .col")
    assert cols.count() == 8
    assert page.inner_text("#more-rollouts-pager").startswith(f"8 of {BIG_GROUP} rollouts")
    # Highest reward first, across pages.
    click_more(page, "#more-rollouts", "#group-cols .col", BIG_GROUP)
    assert page.is_hidden("#more-rollouts")
    rewards = [float(h.split("reward ")[1]) for h in cols.locator("h3").all_inner_texts()]
    assert rewards == sorted(rewards, reverse=True) and len(rewards) == BIG_GROUP
    # Each column: 4 samples, then its own control for the rest.
    for k in (0, BIG_GROUP - 1):
        col = cols.nth(k)
        assert col.locator(".tokens").count() == 4
        assert page.inner_text(f"#more-samples-{k}-pager").startswith(f"4 of {BIG_SAMPLES} samples")
        page.click(f"#more-samples-{k}")
        page.wait_for_function(
            f"document.querySelectorAll('#group-cols .col')[{k}]"
            f".querySelectorAll('.tokens').length === {BIG_SAMPLES}"
        )
        assert page.is_hidden(f"#more-samples-{k}")
    assert cols.nth(1).locator(".tokens").count() == 4  # the others are untouched
    page.screenshot(path=str(artifacts / "13-group-paged.png"), full_page=True)
    assert page.errors == []
