"""HTTP client for the gateway's rollout and admin API (httpx).

client = GatewayClient("http://127.0.0.1:8080", admin_key)
rollout = client.create_rollout({"prompt": "..."}, group="task-7")
env = rollout.openai_env()   # OPENAI_BASE_URL / OPENAI_API_KEY for the harness
...                          # the harness runs
client.reward(rollout.id, 1.0)
calls = client.trace(rollout.id)   # list[lightning.Call], what the harness saw

Online mode (a deployed harness with an application key, feedback later)::

key = client.create_app_key("support-bot", tags=["support"])   # key.key: shown once
...                          # production: base_url = GATEWAY/v1, api_key = key.key
client.feedback(key.key, "fb-1", name="thumbs", value=1, response_id="chatcmpl-...")
client.sessions(with_feedback=True)   # list[OnlineSession]
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from lightning._core import Call, LightningError, MergeResult, RolloutInfo, Tokenizer, merge_calls
from lightning.gateway.records import (
    AppKey,
    CallRecord,
    FeedbackReceipt,
    OnlineSession,
    Rollout,
    decode_columnar,
)

RolloutStatus = Literal["queued", "running", "succeeded", "failed", "timed_out"]


class GatewayRequestError(LightningError):
    """The gateway answered with an error; ``status``, ``code`` and the message it sent."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(f"gateway answered {status} ({code}): {message}")
        self.status = status
        self.code = code
        self.message = message


class GatewayClient:
    """Rollout and admin API of a running gateway."""

    def __init__(
        self,
        base_url: str,
        admin_key: str | None = None,
        *,
        timeout: float = 60.0,
        store: str | Path | None = None,
    ) -> None:
        """``store``: the gateway's database file, when it is on this machine;
        traces and step batches are then read from it directly (one Rust read,
        no HTTP), else over HTTP in the compact columnar form."""
        from lightning.gateway.store import Store

        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self.store = Store(store) if store is not None else None

    def close(self) -> None:
        self._http.close()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self, method: str, path: str, *, token: str | None = None, **kw: Any
    ) -> httpx.Response:
        key = token or self.admin_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = self._http.request(method, path, headers=headers, **kw)
        if r.status_code >= 400:
            try:
                err = r.json().get("error", {})
                code, message = err.get("code"), err.get("message", r.text)
            except ValueError:
                code, message = None, r.text
            raise GatewayRequestError(r.status_code, code, message)
        return r

    # --- rollouts -----------------------------------------------------------

    def create_rollout(
        self,
        task: Any = None,
        group: str | None = None,
        mode: Literal["train", "eval"] = "train",
        rollout_id: str | None = None,
    ) -> Rollout:
        """Creates a rollout (idempotent when ``rollout_id`` is given: same id, same token)."""
        body: dict[str, Any] = {"task": task, "group": group, "mode": mode}
        if rollout_id is not None:
            body["rollout_id"] = rollout_id
        d = self._request("POST", "/rollouts", json=body).json()
        return Rollout(
            id=d["rollout_id"],
            token=d["token"],
            base_url=d["base_url"],
            group=d["group"],
            mode=d["mode"],
        )

    def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        return self._request("GET", f"/rollouts/{rollout_id}").json()

    def list_rollouts(
        self, status: RolloutStatus | None = None, group: str | None = None
    ) -> list[dict[str, Any]]:
        params = {k: v for k, v in (("status", status), ("group", group)) if v is not None}
        return self._request("GET", "/rollouts", params=params).json()["rollouts"]

    def set_status(self, rollout_id: str, status: RolloutStatus) -> None:
        self._request("POST", f"/rollouts/{rollout_id}/status", json={"status": status})

    def reward(
        self, rollout_id: str, value: float, source: str | None = None, token: str | None = None
    ) -> int:
        """Records a reward (durable when this returns); returns its event seq."""
        body = {"value": float(value), "source": source}
        return self._request(
            "POST", f"/rollouts/{rollout_id}/reward", token=token, json=body
        ).json()["seq"]

    def event(self, rollout_id: str, type: str, data: Any = None, token: str | None = None) -> int:
        body = {"type": type, "data": data}
        return self._request(
            "POST", f"/rollouts/{rollout_id}/events", token=token, json=body
        ).json()["seq"]

    def events(self, rollout_id: str, token: str | None = None) -> list[dict[str, Any]]:
        return self._request("GET", f"/rollouts/{rollout_id}/events", token=token).json()["events"]

    def records(self, rollout_id: str, token: str | None = None) -> list[CallRecord]:
        """Every recorded completion of a rollout, including failed, aborted and flagged ones."""
        r = self._request(
            "GET", f"/rollouts/{rollout_id}/trace", token=token, params={"format": "columnar"}
        )
        group = None
        return decode_columnar(r.content, group)

    def trace(self, rollout_id: str, token: str | None = None) -> list[Any]:
        """The calls the harness actually saw, with exact ids, as ``lightning.Call``.

        Left out: calls whose answer never reached the harness whole (aborted,
        upstream errors) and calls the engine gave no ids for (see ``records``
        for those, with their ``status`` and ``flags``).
        """
        if self.store is not None:
            return self.store.trace(rollout_id)
        info = self.get_rollout(rollout_id) if self.admin_key or token else {}
        return self._http_trace(rollout_id, info.get("group"), token)

    def _http_trace(self, rollout_id: str, group: str | None, token: str | None) -> list[Call]:
        out = []
        for rec in self.records(rollout_id, token=token):
            rec.group = group
            if rec.trainable:
                out.append(rec.to_call())
        return out

    def read_step(
        self,
        rollout_ids: Sequence[str],
        *,
        max_tokens: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> MergeResult:
        """A training step's batch: the rollouts (group, mode, status, latest
        reward) and their trainable calls, merged. From the store file in one
        read when the client has one (see ``Store.read_step``); else over HTTP (two
        requests per rollout: its record and its columnar trace), returning the
        same ``MergeResult``."""
        if self.store is not None:
            return self.store.read_step(rollout_ids, max_tokens=max_tokens, tokenizer=tokenizer)
        infos, calls = [], []
        for rid in rollout_ids:
            d = self.get_rollout(rid)
            reward = d.get("reward")
            infos.append(
                RolloutInfo(
                    rid,
                    group=d.get("group"),
                    mode=d.get("mode"),
                    status=d.get("status"),
                    reward=None if reward is None else float(reward),
                )
            )
            calls.extend(self._http_trace(rid, d.get("group"), None))
        return merge_calls(calls, max_tokens, tokenizer=tokenizer, rollouts=infos)

    # --- admin --------------------------------------------------------------

    def pause(self, *, drain: bool = True, timeout_s: float = 60.0) -> dict[str, Any]:
        """New calls get 503; with ``drain`` waits until in-flight calls finished."""
        return self._request(
            "POST", "/admin/pause", json={"drain": drain, "timeout_s": timeout_s}
        ).json()

    def resume(self) -> dict[str, Any]:
        return self._request("POST", "/admin/resume", json={}).json()

    def state(self) -> dict[str, Any]:
        return self._request("GET", "/admin/state").json()

    def upstreams(self) -> list[dict[str, Any]]:
        return self._request("GET", "/admin/upstreams").json()["upstreams"]

    def set_upstreams(self, upstreams: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Replaces the upstream set: ``[{"url": ..., "weight_version": N}, ...]``."""
        return self._request("POST", "/admin/upstreams", json={"upstreams": upstreams}).json()[
            "upstreams"
        ]

    # --- online mode --------------------------------------------------------

    def create_app_key(
        self,
        name: str,
        *,
        tags: Sequence[str] = (),
        redact: bool = False,
        mode: Literal["train", "eval"] | None = None,
        temperature: float | None = None,
    ) -> AppKey:
        """A long-lived key for a deployed harness; its ``key`` is shown only here.
        ``redact``: keep token ids but no text; ``temperature``: override
        production's sampling (off unless set)."""
        defaults: dict[str, Any] = {"tags": list(tags), "redact": redact}
        if mode is not None:
            defaults["mode"] = mode
        if temperature is not None:
            defaults["temperature"] = temperature
        d = self._request("POST", "/admin/keys", json={"name": name, "defaults": defaults})
        return AppKey._from(d.json())

    def app_keys(self) -> list[AppKey]:
        """Every application key, revoked ones included (without the keys themselves)."""
        return [AppKey._from(k) for k in self._request("GET", "/admin/keys").json()["keys"]]

    def revoke_app_key(self, key_id: str) -> None:
        """Revokes at once (calls with it get 401); an unknown or revoked id is a 404."""
        self._request("DELETE", f"/admin/keys/{key_id}")

    def feedback(
        self,
        app_key: str,
        feedback_id: str,
        *,
        name: str,
        value: float | bool,
        response_id: str | None = None,
        session_id: str | None = None,
        timestamp: float | None = None,
        data: Any = None,
    ) -> FeedbackReceipt:
        """Attaches a signal to a response id (``chatcmpl-…``, ``resp_…``,
        ``msg_…``) or a session (its ``x-session-id`` or session id), with the
        application key ``app_key``. Durable when it returns; the same
        ``feedback_id`` again is a no-op (``duplicate``). Raises
        ``GatewayRequestError``: 404 ``unknown_target``, 409 ``feedback_id_reused``."""
        if (response_id is None) == (session_id is None):
            raise ValueError("feedback names exactly one of response_id or session_id")
        body: dict[str, Any] = {"feedback_id": feedback_id, "name": name, "value": value}
        for k, v in (("response_id", response_id), ("session_id", session_id),
                     ("timestamp", timestamp), ("data", data)):  # fmt: skip
            if v is not None:
                body[k] = v
        d = self._request("POST", "/v1/feedback", token=app_key, json=body).json()
        return FeedbackReceipt(
            feedback_id=d["feedback_id"],
            session_id=d["session_id"],
            name=d["name"],
            value=float(d["value"]),
            duplicate=bool(d["duplicate"]),
            after_training=bool(d["after_training"]),
        )

    def sessions(
        self,
        *,
        key_id: str | None = None,
        closed: bool | None = None,
        with_feedback: bool | None = None,
        limit: int = 100,
    ) -> list[OnlineSession]:
        """Online sessions, most recently active first."""
        params: dict[str, Any] = {"limit": limit}
        for k, v in (("key_id", key_id), ("closed", closed), ("feedback", with_feedback)):
            if v is not None:
                params[k] = v if isinstance(v, str) else str(v).lower()
        rows = self._request("GET", "/admin/online/sessions", params=params).json()["sessions"]
        return [OnlineSession(**r) for r in rows]

    def sweep(self, idle_timeout_s: float | None = None) -> dict[str, int]:
        """Closes idle sessions (all, with ``idle_timeout_s=0``) and applies
        retention now; returns ``{"closed": n, "deleted": m}``."""
        body = {} if idle_timeout_s is None else {"idle_timeout_s": idle_timeout_s}
        return dict(self._request("POST", "/admin/online/sweep", json=body).json())

    def healthz(self) -> dict[str, Any]:
        """The gateway's health, also while it refuses calls because its store
        cannot write (HTTP 503, ``status == "store_unwritable"``, ``store.error`` says why)."""
        r = self._http.get("/healthz")
        if r.status_code not in (200, 503):
            raise GatewayRequestError(r.status_code, None, r.text)
        return r.json()

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text
