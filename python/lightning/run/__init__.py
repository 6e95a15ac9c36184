"""The closed loop of ``lightning train``: tasks, the runner that launches the
harness (locally or on Ray), the embedded engine's process, weight sync, the
staleness bound, tracking, statistics and the report."""
