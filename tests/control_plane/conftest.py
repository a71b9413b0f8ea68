"""The control-plane tests reuse the HTTP tests' kit (fake-model engines served over real sockets)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
