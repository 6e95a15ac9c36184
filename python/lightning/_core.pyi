"""Type stubs for the private native module. Use the names re-exported by `lightning`."""

__version__: str

class LightningError(Exception):
    """Root of all lightning errors."""
