"""``bench/kit/server_process.launched``: a server that cannot start is reported as it failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit.server_process import ServerDidNotStart, launched  # bench/, on sys.path through tests/conftest.py


def test_a_server_that_exits_at_start_is_reported_with_its_status(tmp_path: Path) -> None:
    """An invalid setting stops the server before it listens: the error names the exit status and the server's own
    message at once, instead of waiting out the start timeout and blaming the time."""
    with pytest.raises(ServerDidNotStart, match=r"exited \(status 2\) before it was listening") as raised, \
            launched({"FAULTS": "no_such_fault=1"}, tmp_path / "server.log", start_timeout=300):
        pass
    assert "unknown fault 'no_such_fault'" in str(raised.value)
