"""Command-line tools beside ``serve`` and ``generate``: ``tail`` (live telemetry) and ``report`` (a run file)."""
