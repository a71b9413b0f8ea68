"""A real ``inference-server`` process (``server.run_server``: Hypercorn, the app, every actor and the
telemetry sinks) around the tests' fake step function and tiny word-level tokenizer; settings come from the
environment (``PORT=0``, ``TELEMETRY_DIR``, ...). Prints ``inference-server listening on URL``.

    python tests/telemetry/fake_server.py [STEP_SECONDS]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the fake engine the kit uses: tests/fake_engine.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))

from http_testkit import make_parts, word_engine, write_tokenizer_folder

from inference_server.config import load_settings
from inference_server.models.tokenizer import Tokenizer
from inference_server.server import run_server


def main() -> int:
    import logging

    delay = float(sys.argv[1]) if len(sys.argv) > 1 else 0.005
    settings = load_settings(dotenv_path=None)
    logging.basicConfig(level=settings.log_level.upper())
    tokenizer = Tokenizer.from_pretrained_dir(write_tokenizer_folder(Path(tempfile.mkdtemp()) / "tok"))
    parts = make_parts(word_engine(step_seconds=delay), tokenizer, num_blocks=64, max_batch_size=16)
    return run_server(parts, settings)


if __name__ == "__main__":
    sys.exit(main())
