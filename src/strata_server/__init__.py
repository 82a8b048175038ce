"""strata_server: the ``strata`` command (and, later, the HTTP server).

Importing this package does no work.
"""
