"""strata_server: the ``strata`` command and the OpenAI-compatible server.

``cli.py`` parses arguments (and is the only reader of the environment),
``app.py`` holds the HTTP routes, ``supervisor.py`` keeps the engine process
alive, ``worker.py`` is that process, ``openai_api.py`` checks requests and
shapes replies, ``metrics.py`` exports Prometheus metrics.

Importing this package does no work.
"""
