"""Online mode, trainer side: train from (and export) production sessions
recorded by the gateway under application keys."""
