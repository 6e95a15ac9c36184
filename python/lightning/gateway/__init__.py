"""The gateway from Python: start it (``server``), talk to it over HTTP
(``client``), and read its store directly (``store``). Nothing here imports torch."""
