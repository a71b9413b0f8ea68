"""A child engine process for the split tests: the real ``Engine`` on the fake step, served by ``serve_engine``
on the socket it inherited, until the front drains it; exits 0 after a clean stop, 1 after a failure.

Run from the repository root: ``python -m tests.ipc.engine_child FD STEP_SECONDS``.
"""

from __future__ import annotations

import socket
import sys

import trio
from tests.fake_engine import FakeEngine
from tests.ipc.split_kit import split_parts

from inference_server.ipc.channel import open_socket_channel
from inference_server.ipc.engine_server import serve_engine
from inference_server.ipc.messages import FRONT_TO_ENGINE
from inference_server.supervisor import Engine


async def main(fd: int, step_seconds: float) -> bool:
    engine = Engine(split_parts(FakeEngine(step_seconds=step_seconds, keep_plans=False)))
    async with open_socket_channel(socket.socket(fileno=fd), 16, receive_type=FRONT_TO_ENGINE) as channel:
        return await serve_engine(engine, channel)


if __name__ == "__main__":
    sys.exit(1 if trio.run(main, int(sys.argv[1]), float(sys.argv[2])) else 0)
