"""Ready-made runs on the embedded default: ``lightning demo`` and
``lightning demo --online``."""
