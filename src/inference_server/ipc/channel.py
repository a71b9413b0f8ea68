"""A trio channel between two processes over one connected Unix stream socket.

:func:`open_socket_channel` turns a socket end into a :class:`SocketChannel`, one endpoint carrying both
directions. Each direction keeps a trio memory channel's contract:

* **bounded, with backpressure**: the receiving end buffers at most its ``capacity`` messages not yet taken;
  the peer's ``send`` blocks while that many are in flight (credit flow control, see :mod:`.flow`) and
  resumes as soon as one is taken. Each end picks its own receive capacity; capacity 0 (a rendezvous) is not
  supported.
* **ordered**: messages arrive in the order they were sent.
* **close seen by the other side**: after ``aclose()`` on one end, the other end's ``receive()`` delivers
  everything sent before the close, then raises :class:`trio.EndOfChannel`, and its ``send()`` raises
  :class:`trio.BrokenResourceError`.
* **death seen by the other side**: when the peer vanishes without closing (its process died: EOF or reset on
  the socket with no close frame), or writes bytes that are not frames, ``receive()`` -- after the messages
  that had fully arrived -- and ``send()`` raise :class:`trio.BrokenResourceError`. This, not
  ``EndOfChannel``, is the signal that the other process is gone.
* on an end its own user closed, ``send()`` and ``receive()`` raise :class:`trio.ClosedResourceError`.

A message msgspec cannot encode, or one over ``max_message_bytes``, raises
:class:`~.frames.UnsendableMessageError` from ``send`` before anything is sent; the channel stays usable.
Messages are msgspec Structs or plain msgpack values; the receiving end decodes into ``receive_type``
(``Any`` by default: Structs then arrive as dicts; give the Struct type, or a tagged union, to get Structs).

Two background tasks serve an endpoint: a reader that decodes frames as they arrive (so credits and close
frames are seen even while the user is not receiving) and a writer that sends queued frames. ``send`` only
queues a frame (so a cancelled send never tears a frame); the writer coalesces what is queued -- data and
credit grants -- into one write whenever several are ready within a scheduling round.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio

from .flow import ReceiveWindow, SendCredit
from .frames import (
    CLOSE_FRAME,
    DEFAULT_MAX_MESSAGE_BYTES,
    DataFrameEncoder,
    FrameDecoder,
    FrameKind,
    ProtocolError,
    credit_frame,
)

_READ_SIZE = 1 << 16
_COALESCE_ROUNDS = 32
"""At most this many scheduling rounds of waiting for more frames before a write."""


class SocketChannel:
    """One end of a cross-process channel (both directions). Made by :func:`open_socket_channel`, which runs
    its reader and writer tasks; ``aclose()`` (or leaving ``async with``) closes it."""

    def __init__(
        self,
        stream: trio.SocketStream,
        capacity: int,
        receive_type: Any = Any,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._stream = stream
        self._window = ReceiveWindow(capacity)
        self._credit = SendCredit()
        self._encoder = DataFrameEncoder(max_message_bytes)
        self._frames = FrameDecoder(max_message_bytes)
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(receive_type)
        self._inbox: deque[Any] = deque()
        self._outbox: list[bytes | bytearray] = []
        self._closed = False  # this end's user closed it
        self._peer_closed = False  # a CLOSE frame arrived
        self._broken: BaseException | None = None  # the peer died or broke the protocol
        self._write_failed = False  # a write found the peer's end closed
        self._receivers = trio.lowlevel.ParkingLot()
        self._senders = trio.lowlevel.ParkingLot()
        self._writer_lot = trio.lowlevel.ParkingLot()
        self._writer_done = trio.Event()
        self._tasks = trio.CancelScope()

    @property
    def capacity(self) -> int:
        """How many received messages this end buffers before the peer's sends block."""
        return self._window.capacity

    # ---- the user's side -------------------------------------------------------------------------------

    async def send(self, message: Any) -> None:
        """Sends ``message``; blocks while the peer has ``capacity`` messages it has not taken."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_send()
        frame = self._encoder.encode(message)
        while not self._credit.take():
            await self._senders.park()
            self._check_send()
        self._outbox.append(frame)
        self._wake_writer()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive(self) -> Any:
        """The next message; raises ``EndOfChannel`` after the peer's clean close, ``BrokenResourceError``
        after its death (each once the messages that arrived before are taken)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._inbox:
            if self._closed:
                raise trio.ClosedResourceError("receive on a closed channel end")
            if self._broken is not None:
                raise trio.BrokenResourceError("the peer process is gone") from self._broken
            if self._peer_closed:
                raise trio.EndOfChannel
            await self._receivers.park()
        if self._closed:
            raise trio.ClosedResourceError("receive on a closed channel end")
        message = self._inbox.popleft()
        self._window.taken()
        if self._window.grant_due:
            self._wake_writer()
        await trio.lowlevel.cancel_shielded_checkpoint()
        return message

    def __aiter__(self) -> SocketChannel:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> SocketChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes this end: what was sent is flushed, then a close frame tells the peer; the background
        tasks stop and the socket is closed. Idempotent. If cancelled, the socket is closed at once."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        self._receivers.unpark_all()
        self._senders.unpark_all()
        try:
            if self._broken is None:
                self._wake_writer()
                await self._writer_done.wait()
            else:
                await trio.lowlevel.checkpoint()
        finally:
            self._tasks.cancel()
            self._stream.socket.close()

    def _check_send(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("send on a closed channel end")
        if self._broken is not None:
            raise trio.BrokenResourceError("the peer process is gone") from self._broken
        if self._peer_closed:
            raise trio.BrokenResourceError("the peer closed its end")

    # ---- the background tasks ------------------------------------------------------------------------------

    def _wake_writer(self) -> None:
        if self._writer_lot:
            self._writer_lot.unpark_all()

    def _break(self, cause: BaseException) -> None:
        if self._broken is None and not self._closed and not self._peer_closed:
            self._broken = cause
        self._receivers.unpark_all()
        self._senders.unpark_all()
        self._wake_writer()

    async def run(self) -> None:
        """The reader and writer, until ``aclose`` (run by :func:`open_socket_channel`)."""
        with self._tasks:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_loop)
                nursery.start_soon(self._write_loop)

    async def _read_loop(self) -> None:
        """Decodes frames until the peer's close frame (a clean end) or an EOF, reset or bad frame without one
        (the peer is gone). The reader alone decides which: a failed write may precede a close frame still
        unread in our socket."""
        try:
            while True:
                data = await self._stream.receive_some(_READ_SIZE)
                if not data:
                    torn = self._frames.pending_bytes
                    raise EOFError(f"the peer's socket ended without a close frame ({torn} bytes of a torn frame)")
                arrived = False
                for kind, payload in self._frames.feed(data):
                    if kind is FrameKind.DATA:
                        self._window.arrived()
                        self._inbox.append(self._decoder.decode(payload))
                        arrived = True
                    elif kind is FrameKind.CREDIT:
                        self._credit.grant(payload)
                        self._senders.unpark(count=payload)
                    else:
                        self._peer_closed = True
                        self._receivers.unpark_all()
                        self._senders.unpark_all()
                        self._wake_writer()
                        return
                if arrived:
                    self._receivers.unpark_all()
                    if self._window.grant_due:
                        self._wake_writer()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, EOFError, ProtocolError,
                msgspec.DecodeError) as exc:
            self._break(exc)

    async def _write_loop(self) -> None:
        try:
            while True:
                if not self._outbox and not self._window.grant_due and not self._closed:
                    await self._writer_lot.park()
                    continue
                # Let the tasks runnable now add to the batch (a producer's loop of sends, a consumer's loop of
                # receives): one write per burst rather than per message, bounded so a steady stream still
                # goes out promptly.
                for _ in range(_COALESCE_ROUNDS):
                    queued = len(self._outbox) + self._window.owed
                    await trio.lowlevel.checkpoint()
                    if len(self._outbox) + self._window.owed == queued:
                        break
                frames = self._outbox
                self._outbox = []
                owed = self._window.take_owed() if self._window.grant_due else 0
                closing = self._closed  # read once: aclose may come while this write is under way
                if self._peer_closed or self._broken is not None or self._write_failed:
                    # Nothing written now can be read: the peer closed its end or is gone.
                    if closing:
                        return
                    continue
                if closing:
                    frames.append(CLOSE_FRAME)
                elif owed:
                    frames.append(credit_frame(owed))
                await self._stream.send_all(frames[0] if len(frames) == 1 else b"".join(frames))
                if closing:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            # The peer's end is closed: the reader will see its close frame (a clean close that crossed our
            # write) or an EOF without one (a death) and say which; until then frames are dropped.
            self._write_failed = True
            if self._closed:
                return
            await self._drop_frames_until_closed()
        finally:
            self._writer_done.set()

    async def _drop_frames_until_closed(self) -> None:
        while not self._closed:
            self._outbox.clear()
            self._window.take_owed()
            await self._writer_lot.park()


@asynccontextmanager
async def open_socket_channel(
    sock: socket.socket | trio.SocketStream,
    capacity: int,
    *,
    receive_type: Any = Any,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> AsyncIterator[SocketChannel]:
    """A :class:`SocketChannel` on ``sock`` -- a connected ``AF_UNIX``/``SOCK_STREAM`` socket (one end of a
    ``socket.socketpair()``, an inherited descriptor wrapped with ``socket.socket(fileno=fd)``, or a stream
    from ``trio.open_unix_socket(path)``) -- open for the ``async with`` block and closed (with a close frame
    to the peer) when it ends. The channel owns the socket from here on.

    ``capacity`` (>= 1) bounds the messages this end buffers before the peer's sends block;
    ``receive_type`` is the type msgspec decodes each received message into; ``max_message_bytes`` bounds
    each encoded message, both ways (the peer should use the same value).
    """
    stream = sock if isinstance(sock, trio.SocketStream) else trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    channel = SocketChannel(stream, capacity, receive_type, max_message_bytes)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(channel.run)
        try:
            yield channel
        finally:
            await channel.aclose()
