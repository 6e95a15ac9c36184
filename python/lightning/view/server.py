"""``lightning view RUN_DIR`` (or ``--db gateway.db``): a live web view of a run
or of a production store, served locally, read-only.

Why this shape: the store's reader is Rust (``_core.StoreReader``, reached
through the binding, GIL released), so the server side only routes requests to
it and turns its rows into JSON. That shell is thin, and starlette + uvicorn
(already the embedded engine's server) keep it a page of routes, with no second
server in Rust to keep in step with the store's ongoing restructuring. The page
is plain HTML/CSS/JS with hand-drawn SVG charts (``static/``, shipped in the
package): a few line charts do not need a charting library, and none means
nothing to vendor, nothing fetched from a CDN, and nothing to keep up to date.

Safety: loopback by default, and a key on every request always: a random one
per start, printed in the URL (``?key=``, as Jupyter does), or yours from
``LIGHTNING_VIEW_KEY`` (at least 16 characters). The page sends it on every API
call (header ``Authorization: Bearer KEY``). Another local user, or a web page
that reaches 127.0.0.1, gets nothing without it, and a page that reaches it
under its own name (DNS rebinding) is refused by ``Host`` first
(``lightning.gateway.local_http``). Every route is a GET and the store is
opened read-only: the view cannot change it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from lightning.gateway.local_http import ALLOWED_HOSTS_ENV, LocalGuard, check_key, new_key
from lightning.view.data import (
    CALLS_PAGE,
    CALLS_PAGE_MAX,
    PAGE_MAX,
    RATE_BUCKET_S,
    RATE_MAX_S,
    RATE_MIN_S,
    RATE_WINDOW_S,
    Decoder,
    View,
    run_paths,
)

STATIC = Path(__file__).resolve().parent / "static"
ASSETS = {"view.js": "text/javascript", "view.css": "text/css"}
KEY_ENV = "LIGHTNING_VIEW_KEY"


def create_app(
    view: View,
    admin_key: str | None = None,
    *,
    listen_host: str = "127.0.0.1",
    allowed_hosts: Collection[str] | None = None,
) -> ASGIApp:
    """The view's ASGI app: the page, its assets and the read-only JSON API,
    behind ``LocalGuard`` (Host, with ``allowed_hosts`` or else
    ``$LIGHTNING_ALLOWED_HOSTS``; and ``admin_key`` on every request when given;
    ``main`` always gives one)."""

    async def page(_: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def asset(req: Request) -> Response:
        name = req.path_params["name"]
        if name not in ASSETS:
            return JSONResponse({"error": f"no asset {name!r}"}, status_code=404)
        return FileResponse(STATIC / name, media_type=ASSETS[name])

    async def summary(_: Request) -> Response:
        return JSONResponse(await run_in_threadpool(view.summary))

    async def metrics(req: Request) -> Response:
        offset = _int(req.query_params.get("offset"), 0)
        return JSONResponse(await run_in_threadpool(view.metrics, offset))

    async def rollouts(req: Request) -> Response:
        q = req.query_params
        page_ = await run_in_threadpool(
            view.rollouts,
            q.get("after") or None,
            _int(q.get("limit"), 50, hi=PAGE_MAX),
            q.get("status") or None,
            q.get("mode") or None,
            q.get("group") or None,
        )
        return JSONResponse(page_)

    async def rate(req: Request) -> Response:
        q = req.query_params
        window = _float(q.get("window"), RATE_WINDOW_S)
        bucket = _float(q.get("bucket"), RATE_BUCKET_S)
        for name, value in (("window", window), ("bucket", bucket)):
            if not RATE_MIN_S <= value <= RATE_MAX_S:
                return JSONResponse(
                    {
                        "error": f"{name}={value:g} seconds is outside "
                        f"[{RATE_MIN_S:g}, {RATE_MAX_S:g}]; pick a value in that range"
                    },
                    status_code=400,
                )
        return JSONResponse(await run_in_threadpool(view.call_rate, window, bucket))

    async def sessions(req: Request) -> Response:
        q = req.query_params
        page_ = await run_in_threadpool(
            view.sessions,
            q.get("after") or None,
            _int(q.get("limit"), 50, hi=PAGE_MAX),
            q.get("key") or None,
            q.get("tag") or None,
            _flag(q.get("feedback")),
            _flag(q.get("trained")),
        )
        return JSONResponse(page_)

    async def session(req: Request) -> Response:
        sid = req.path_params["session_id"]
        q = req.query_params
        got = await run_in_threadpool(
            view.session,
            sid,
            _int(q.get("offset"), 0),
            _int(q.get("limit"), CALLS_PAGE, hi=CALLS_PAGE_MAX),
        )
        if got is None:
            return JSONResponse({"error": f"no session {sid!r} in the store"}, status_code=404)
        return JSONResponse(got)

    async def rollout(req: Request) -> Response:
        rid = req.path_params["rollout_id"]
        q = req.query_params
        got = await run_in_threadpool(
            view.rollout,
            rid,
            _int(q.get("offset"), 0),
            _int(q.get("limit"), CALLS_PAGE, hi=CALLS_PAGE_MAX),
            _int(q.get("samples_offset"), 0),
        )
        if got is None:
            return JSONResponse({"error": f"no rollout {rid!r} in the store"}, status_code=404)
        return JSONResponse(got)

    async def group(req: Request) -> Response:
        return JSONResponse(await run_in_threadpool(view.group, req.path_params["group"]))

    async def compare(req: Request) -> Response:
        a, b = req.query_params.get("a", ""), req.query_params.get("b", "")
        got = await run_in_threadpool(view.compare, a, b)
        if got is None:
            return JSONResponse({"error": f"no rollout {a!r} or {b!r}"}, status_code=404)
        return JSONResponse(got)

    app: ASGIApp = Starlette(
        routes=[
            Route("/", page, methods=["GET"]),
            Route("/static/{name}", asset, methods=["GET"]),
            Route("/api/summary", summary, methods=["GET"]),
            Route("/api/metrics", metrics, methods=["GET"]),
            Route("/api/rollouts", rollouts, methods=["GET"]),
            Route("/api/rollouts/{rollout_id:path}", rollout, methods=["GET"]),
            Route("/api/groups/{group:path}", group, methods=["GET"]),
            Route("/api/rate", rate, methods=["GET"]),
            Route("/api/sessions", sessions, methods=["GET"]),
            Route("/api/sessions/{session_id:path}", session, methods=["GET"]),
            Route("/api/compare", compare, methods=["GET"]),
        ]
    )
    return LocalGuard(
        app,
        listen_host=listen_host,
        allowed_hosts=allowed_hosts,
        key=check_key(admin_key, KEY_ENV) if admin_key is not None else None,
        error=lambda _status, code, message: {"error": message, "code": code},
    )


def _int(text: str | None, default: int, hi: int | None = None) -> int:
    try:
        value = int(text) if text is not None else default
    except ValueError:
        value = default
    value = max(0, value)
    return min(value, hi) if hi is not None else value


def _float(text: str | None, default: float) -> float:
    """A positive finite number from a query parameter, else ``default``."""
    try:
        value = float(text) if text is not None else default
    except ValueError:
        return default
    return value if 0 < value < float("inf") else default


def _flag(text: str | None) -> bool | None:
    """``1``/``true``/``yes`` → True, ``0``/``false``/``no`` → False, else None (no filter)."""
    if text is None:
        return None
    t = text.lower()
    return True if t in ("1", "true", "yes") else False if t in ("0", "false", "no") else None


def build_view(
    run_dir: str | None, db: str | None, model: str | None, *, with_ids: bool = False
) -> View:
    """The view of RUN_DIR (its store, metrics and policy tokenizer) or of a
    standalone store (``db``; tokens shown as ids unless ``model`` is given)."""
    from lightning import Tokenizer

    if run_dir is not None:
        root = Path(run_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"run dir {run_dir} does not exist")
        run_db, run_model = run_paths(root)
        store = Path(db) if db else run_db
        metrics: Path | None = root / "metrics.jsonl"
        model_dir = Path(model) if model else run_model
    else:
        assert db is not None
        store, metrics, model_dir = Path(db), None, Path(model) if model else None
    tokenizer: Decoder | None = Tokenizer.from_dir(model_dir) if model_dir else None
    return View(store, metrics, tokenizer, with_ids=with_ids)


def main(argv: list[str]) -> int:
    """``lightning view (RUN_DIR | --db PATH) [--host H] [--port P]``."""
    p = argparse.ArgumentParser(
        prog="lightning view",
        description="Serve a live, read-only web view of a run (RUN_DIR) or a gateway store (--db).",
    )
    p.add_argument(
        "run_dir", nargs="?", help="run directory (its store, metrics.jsonl, config.json)"
    )
    p.add_argument(
        "--db", help="gateway store (SQLite file); default: the run's (RUN_DIR/lightning.db)"
    )
    p.add_argument(
        "--model", help="model dir for the tokenizer (default: from RUN_DIR/config.json)"
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="listen port (default 8765; 0 picks one)")
    p.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a name the page may be opened by besides localhost, loopback addresses and the "
        "address it listens on or is reached at (repeatable; default: "
        f"${ALLOWED_HOSTS_ENV}, comma-separated); other names get 403 (DNS rebinding)",
    )
    p.add_argument(
        "--admin-key",
        default=None,
        help=f"the key every request needs (default: ${KEY_ENV}, else a random one per start, "
        "printed in the URL); prefer the environment variable: a flag shows in `ps`",
    )
    p.add_argument(
        "--with-ids",
        action="store_true",
        help="show the token ids (decoded) of redacted online sessions too, as "
        "`lightning online export --with-ids` does; without it they are left out",
    )
    args = p.parse_args(argv)
    if args.run_dir is None and args.db is None:
        p.error("give a RUN_DIR or --db PATH")
    key = args.admin_key or os.environ.get(KEY_ENV) or new_key()
    try:
        check_key(key, KEY_ENV)
    except ValueError as e:
        print(f"lightning view: {e}", file=sys.stderr)
        return 2
    try:
        view = build_view(args.run_dir, args.db, args.model, with_ids=args.with_ids)
    except FileNotFoundError as e:
        print(f"lightning view: {e}", file=sys.stderr)
        return 2
    import socket

    import uvicorn

    # Bind first, so the printed URL names the real port (also for --port 0).
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"lightning view: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    # Listening before the URL is printed: a client that reads it and connects
    # at once waits in the backlog for uvicorn instead of being refused.
    sock.listen(128)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    config = uvicorn.Config(
        create_app(view, key, listen_host=args.host, allowed_hosts=args.allowed_host),
        log_level="warning",
    )
    # The whole URL, key included, as Jupyter prints it: the terminal that
    # started the view is the one place the key needs to reach.
    print(f"[lightning] view of {view.db} on http://{host}:{port}/?key={key}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
