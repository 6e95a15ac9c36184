"""``lightning view``: a live, read-only web view of a run or a production store.

``data`` reads (the store through its Rust reader, the run's metrics);
``server`` serves the page in ``static/`` and the JSON API over it.
"""
