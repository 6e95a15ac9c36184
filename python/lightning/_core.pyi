"""Type stubs for the private native module. Use the names re-exported by `lightning`."""

__version__: str

class LightningError(Exception):
    """Root of all lightning errors."""

# --- gateway ---

class GatewayError(LightningError):
    """The gateway could not start or run (bad config, port in use, store failure)."""

class GatewayHandle:
    @property
    def url(self) -> str: ...
    @property
    def running(self) -> bool: ...
    def stop(self) -> None: ...

def gateway_start(config_json: str, threads: int = 2) -> GatewayHandle: ...
def gateway_serve(config_json: str, threads: int = 2) -> None: ...
def gateway_main(argv: list[str]) -> int: ...
