"""`lightning.Store`: a step's batch read from the gateway's SQLite file in one
Rust call, against a real gateway (the openai SDK as the harness, the fake vLLM
process as the engine). The HTTP path must return the same objects."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lightning
from fake_vllm import FakeEngine
from gateways import start_gateway
from lightning import GatewayClient, LightningError, Store
from lightning.gateway.records import decode_columnar


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine("S")
    yield e
    e.stop()


def conversation(rollout: lightning.Rollout, turns: int, tag: str) -> None:
    """A multi-turn chat: every answer goes back as context of the next call."""
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"{tag} [[len:5]]"},
    ]
    with openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token) as sdk:
        for t in range(turns):
            resp = sdk.chat.completions.create(model="m", messages=messages)
            messages.append({"role": "assistant", "content": resp.choices[0].message.content})
            messages.append({"role": "user", "content": f"more {t} [[len:4]]"})


@pytest.fixture(scope="module")
def recorded(engine: FakeEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two groups of two rollouts; rewards on three of them; the second group's
    later calls served by weight version 5."""
    db = tmp_path_factory.mktemp("store") / "gw.db"
    with start_gateway(engine.url, db, weight_version=3) as gw, gw.client() as client:
        ids = []
        for g, rewards in (("g0", [1.0, 0.0]), ("g1", [0.5, None])):
            for k, reward in enumerate(rewards):
                r = client.create_rollout({"task": g}, group=g)
                conversation(r, 2, f"{g}-{k}")
                if g == "g1":
                    client.set_upstreams([{"url": engine.url, "weight_version": 5}])
                    conversation(r, 1, f"{g}-{k}-late")
                if reward is not None:
                    client.reward(r.id, 0.25)  # superseded: the latest reward counts
                    client.reward(r.id, reward)
                ids.append(r.id)
        yield gw, db, ids


def test_step_reads_rewards_groups_and_calls_in_one_call(recorded: Any) -> None:
    _, db, ids = recorded
    with Store(db) as store:
        batch = store.read_step(ids[::-1])
    assert [r.rollout_id for r in batch.rollouts] == ids[::-1]
    info = {r.rollout_id: r for r in batch.rollouts}
    assert [info[i].reward for i in ids] == [1.0, 0.0, 0.5, None]
    assert [info[i].group for i in ids] == ["g0", "g0", "g1", "g1"]
    assert {r.mode for r in batch.rollouts} == {"train"}
    assert batch.stats.calls == 2 + 2 + 3 + 3 and batch.stats.skipped_calls == 0
    # Each conversation collapses into one sample (g1's late call starts a second
    # one); samples point at their rollout.
    per_rollout = [sum(s.rollout_id == i for s in batch.samples) for i in ids]
    assert per_rollout == [1, 1, 2, 2]
    for s in batch.samples:
        r = batch.rollouts[s.rollout_index]
        assert (s.rollout_id, s.group) == (r.rollout_id, r.group)
        versions = s.weight_version
        ci = s.call_index
        expect = np.array([-1 if c < 0 else batch.calls[c].weight_version for c in ci])
        np.testing.assert_array_equal(versions, expect)
        assert set(versions[s.weights > 0]) <= {3, 5}
    late = [s for s in batch.samples if s.rollout_id == ids[2]]
    assert [set(s.weight_version[s.weights > 0]) for s in late] == [{3}, {5}]


def test_step_is_a_deprecated_name_of_read_step(recorded: Any) -> None:
    """``Store.step`` was documented; it stays as a warning alias of ``read_step``."""
    _, db, ids = recorded
    with Store(db) as store:
        want = store.read_step(ids)
        with pytest.warns(DeprecationWarning, match="Store.read_step"):
            got = store.step(ids)
    assert [r.rollout_id for r in got.rollouts] == [r.rollout_id for r in want.rollouts]
    assert [s.tokens.tolist() for s in got.samples] == [s.tokens.tolist() for s in want.samples]


def test_packed_tree_carries_rollout_group_and_version(recorded: Any) -> None:
    _, db, ids = recorded
    batch = Store(db).read_step(ids)
    t = batch.packed(across_rollouts=True)
    assert t.rollout_ids == ids and t.groups == ["g0", "g1"]
    assert t.tree_keys == ["g0", "g1"]
    gen_offsets, gen_call = t.gen_offsets, t.gen_call
    call_rollout = [ids.index(c.rollout_id) for c in batch.calls]
    np.testing.assert_array_equal(t.call_rollout, call_rollout)
    for i in range(len(t)):
        gens = gen_call[gen_offsets[i] : gen_offsets[i + 1]]
        tree = int(np.searchsorted(t.tree_offsets, i, side="right")) - 1
        assert t.group[i] == tree  # one tree per group, in group order
        if len(gens) == 0:
            assert (t.rollout[i], t.weight_version[i]) == (-1, -1)
        else:
            first = batch.calls[gens[0]]
            assert t.rollout[i] == ids.index(first.rollout_id)
            assert t.weight_version[i] == first.weight_version
    # The group's shared system prompt is one set of nodes.
    assert (t.parent == -1).sum() == 2


def test_http_path_returns_the_same_batch(recorded: Any) -> None:
    gw, db, ids = recorded
    with (
        GatewayClient(gw.url, gw.admin_key) as remote,
        GatewayClient(gw.url, gw.admin_key, store=db) as local,
    ):
        a, b = remote.read_step(ids), local.read_step(ids)
        for rid in ids:
            ta, tb = remote.trace(rid), local.trace(rid)
            assert len(ta) == len(tb)
            for x, y in zip(ta, tb, strict=True):
                np.testing.assert_array_equal(x.prompt_ids, y.prompt_ids)
                np.testing.assert_array_equal(x.logprobs, y.logprobs)
                assert (x.group, x.weight_version) == (y.group, y.weight_version)
    key = [(r.rollout_id, r.group, r.mode, r.status, r.reward) for r in a.rollouts]
    assert key == [(r.rollout_id, r.group, r.mode, r.status, r.reward) for r in b.rollouts]
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples, strict=True):
        for field in ("tokens", "weights", "call_index", "weight_version"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field))


def columnar(gw: Any, rollout_id: str) -> bytes:
    r = httpx.get(
        f"{gw.url}/rollouts/{rollout_id}/trace?format=columnar",
        headers={"Authorization": f"Bearer {gw.admin_key}"},
    )
    r.raise_for_status()
    return r.content


def test_columnar_trace_decodes_to_the_stored_records(recorded: Any) -> None:
    gw, db, ids = recorded
    with Store(db) as store:
        for rid in ids:
            got, want = decode_columnar(columnar(gw, rid)), store.records(rid)
            assert [r.seq for r in got] == [r.seq for r in want] and len(got) > 0
            for x, y in zip(got, want, strict=True):
                np.testing.assert_array_equal(x.prompt_ids, y.prompt_ids)
                np.testing.assert_array_equal(x.completion_ids, y.completion_ids)
                np.testing.assert_array_equal(x.logprobs, y.logprobs)


@pytest.fixture(scope="module")
def trace_bytes(recorded: Any) -> bytes:
    gw, _, ids = recorded
    return columnar(gw, ids[2])


# A trace cut off inside its header, just after it, and one byte short.
@example(cut=13, flips=[])
@example(cut=-4, flips=[])
@example(cut=-1, flips=[])
@example(cut=None, flips=[(14, 0x2D)])  # a '-' into the header's JSON
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cut=st.none() | st.integers(-64, 4096),
    flips=st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)), max_size=4),
)
def test_a_damaged_columnar_trace_is_a_lightning_error(
    trace_bytes: bytes, cut: int | None, flips: list[tuple[int, int]]
) -> None:
    """A trace from another machine may arrive cut off or damaged: decoding it
    gives whole records or a ``LightningError``, never another exception or
    arrays silently shorter than the header says."""
    buf = bytearray(trace_bytes if cut is None else trace_bytes[:cut])
    for at, value in flips:
        if buf:
            buf[at % len(buf)] = value
    try:
        records = decode_columnar(bytes(buf))
    except LightningError:
        return
    for r in records:
        if r.completion_ids is not None and r.logprobs is not None:
            assert len(r.logprobs) == len(r.completion_ids)
    if len(buf) < len(trace_bytes):
        raise AssertionError(f"a trace cut to {len(buf)} of {len(trace_bytes)} bytes decoded")


def test_a_deeply_nested_columnar_header_is_a_lightning_error() -> None:
    header = b"[" * 100_000  # json.loads gives up with RecursionError
    buf = b"LTRC" + struct.pack("<II", 1, len(header)) + header
    with pytest.raises(LightningError, match="malformed columnar trace"):
        decode_columnar(buf)


def test_store_reads_records_events_and_rewards(recorded: Any) -> None:
    _, db, ids = recorded
    store = Store(db)
    assert store.rewards() == {ids[0]: 1.0, ids[1]: 0.0, ids[2]: 0.5}
    assert store.rewards(group="g1") == {ids[2]: 0.5}
    assert store.rollout_ids(group="g0") == ids[:2]
    rows = store.rollouts()
    assert rows[0]["task"] == {"task": "g0"} and rows[3]["reward"] is None
    recs = store.records(ids[2])
    assert [r.weight_version for r in recs] == [3, 3, 5]
    assert all(r.trainable and r.group == "g1" for r in recs)
    assert [e["type"] for e in store.events(ids[0])] == ["reward", "reward"]
    assert store.read_step(group="g1").rollouts[0].rollout_id == ids[2]


def test_missing_store_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(lightning.StoreError, match="no gateway store") as e:
        Store(tmp_path / "nope.db")
    assert isinstance(e.value, lightning.LightningError)


def test_merge_calls_checks_rollout_records() -> None:
    call = lightning.Call("r", [1, 2], [3], group="g")
    other = lightning.RolloutInfo("r", group="h")
    with pytest.raises(lightning.InvalidCallError, match='group "g" differs from group "h"'):
        lightning.merge_calls([call], rollouts=[other])
    with pytest.raises(lightning.InvalidCallError, match="twice"):
        lightning.merge_calls([call], rollouts=[other, other])
    empty = lightning.RolloutInfo("quiet", group="g", reward=0.0)
    m = lightning.merge_calls([call], rollouts=[empty])
    assert [r.rollout_id for r in m.rollouts] == ["quiet", "r"]
    assert m.samples[0].rollout_index == 1 and m.rollouts[1].reward is None


def test_the_database_file_alone_cannot_mint_a_rollout_token(
    engine: FakeEngine, tmp_path: Path
) -> None:
    """Issue 26, bug 5: tokens are HMAC-SHA256(secret, rollout id), and the
    secret sat in the store's ``meta`` table, so whoever could read the file
    could mint a token. It lives in ``<db>.secret`` (0600) now; the store's
    files are 0600 too."""
    import hashlib
    import hmac
    import stat

    import store_sql

    db = tmp_path / "gw.db"
    handle = start_gateway(engine.url, db)
    try:
        with handle.client() as client:
            ro = client.create_rollout(rollout_id="ro-1")
            # What a script with the database could try: every value in `meta`
            # as the HMAC key; and the real key is nowhere in the file's bytes.
            # (from another process: this one has the store open in Rust)
            meta = dict(store_sql.rows(db, "SELECT key, value FROM meta"))
            assert "token_secret" not in meta
            blob = db.read_bytes() + Path(f"{db}-wal").read_bytes()

            def token(key: bytes) -> str:
                return "lt-" + hmac.new(key, b"ro-1", hashlib.sha256).hexdigest()

            assert all(token(v) != ro.token for v in meta.values() if isinstance(v, bytes))
            secret = Path(f"{db}.secret").read_bytes()
            assert secret not in blob
            assert token(secret) == ro.token  # the key file is what mints them
            for suffix in ("", "-wal", "-shm", ".secret"):
                mode = stat.S_IMODE(Path(f"{db}{suffix}").stat().st_mode)
                assert mode == 0o600, f"{db}{suffix} is {mode:o}"
            # The existing token still works, and asking again gives the same one.
            assert client.create_rollout(rollout_id="ro-1").token == ro.token
    finally:
        handle.stop()
