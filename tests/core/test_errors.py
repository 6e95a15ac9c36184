"""One error tree: every exception lightning defines is a `LightningError`, and
gateway failures keep their kind."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import socket
from pathlib import Path

import pytest

import lightning
from lightning import Gateway, GatewayConfig


def lightning_exceptions() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    modules = [lightning, lightning._core]
    for info in pkgutil.walk_packages(lightning.__path__, "lightning."):
        if info.name.endswith("__main__"):
            continue
        modules.append(importlib.import_module(info.name))
    for mod in modules:
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("lightning")
            ):
                found[f"{obj.__module__}.{name}"] = obj
    return list(found.values())


def test_every_lightning_exception_is_a_lightning_error() -> None:
    classes = lightning_exceptions()
    names = {c.__name__ for c in classes}
    # The ones the issue names are among those checked.
    assert {"RunnerError", "EngineError", "RequestError", "GatewayRequestError"} <= names
    assert {"GatewayConfigError", "GatewayBindError", "StoreError", "InvalidCallError"} <= names
    outside = [c.__qualname__ for c in classes if not issubclass(c, lightning.LightningError)]
    assert outside == []


def test_builtin_bases_stay_catchable() -> None:
    from lightning.engine.core import EngineError
    from lightning.run.runner import RunnerError

    assert issubclass(EngineError, ValueError) and issubclass(RunnerError, RuntimeError)
    assert issubclass(lightning.GatewayConfigError, ValueError)
    assert issubclass(lightning.GatewayBindError, OSError)
    assert issubclass(lightning.InvalidCallError, ValueError)


def test_gateway_errors_keep_their_kind(tmp_path: Path) -> None:
    with pytest.raises(lightning.GatewayConfigError, match="admin_key is shorter"):
        Gateway(
            GatewayConfig(listen="127.0.0.1:0", db=str(tmp_path / "a.db"), admin_key="x")
        ).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        cfg = GatewayConfig(listen=f"127.0.0.1:{port}", db=str(tmp_path / "b.db"))
        with pytest.raises(lightning.GatewayBindError, match="cannot listen"):
            Gateway(cfg).start()
    with pytest.raises(lightning.StoreError, match="no gateway store"):
        lightning.Store(tmp_path / "missing.db")
