"""A child process for the cross-process channel tests: echoes every message back on the socket it inherited
(descriptor number in argv[1]) until it receives "bye", then closes its end cleanly and exits 0."""

from __future__ import annotations

import socket
import sys

import trio

from inference_server.ipc.channel import open_socket_channel


async def echo(fd: int) -> None:
    async with open_socket_channel(socket.socket(fileno=fd), capacity=16) as channel:
        async for message in channel:
            if message == "bye":
                return
            await channel.send(message)


if __name__ == "__main__":
    trio.run(echo, int(sys.argv[1]))
