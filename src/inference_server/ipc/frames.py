"""The wire format of an IPC channel: length-prefixed frames on a byte stream (no trio here).

A frame is a 5-byte header -- the payload's length (unsigned 32-bit, big-endian) and the frame's kind (one
byte) -- then the payload:

* ``DATA``: one message, encoded with ``msgspec.msgpack``.
* ``CREDIT``: the receiver's grant of more sends, an unsigned 32-bit count (see :mod:`.flow`).
* ``CLOSE``: no payload; the sender closed its end cleanly. Nothing follows it on the stream.

The framing is the length prefix only; the messages' encoding is msgspec's, never hand-written.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Any

import msgspec

HEADER = struct.Struct("!IB")
"""Payload length, frame kind."""

_COUNT = struct.Struct("!I")

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The largest encoded message either side accepts unless told otherwise (a long prompt's token ids are
well under a megabyte)."""


class FrameKind(IntEnum):
    DATA = 0
    CREDIT = 1
    CLOSE = 2


class ProtocolError(Exception):
    """The peer wrote bytes that are not a valid frame sequence (a bug or a foreign writer, not a death)."""


class UnsendableMessageError(ValueError):
    """``send`` was given a message msgspec cannot encode; nothing was sent and the channel still works."""


class MessageTooLargeError(UnsendableMessageError):
    """``send`` was given a message whose encoding exceeds the channel's ``max_message_bytes``."""


class DataFrameEncoder:
    """Encodes messages into complete ``DATA`` frames, one allocation per message (msgspec writes the
    payload straight after the header's room)."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if max_message_bytes <= 0 or max_message_bytes > 0xFFFFFFFF:
            raise ValueError(f"max_message_bytes must be in 1..{0xFFFFFFFF}, got {max_message_bytes}")
        self.max_message_bytes = max_message_bytes
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: Any) -> bytearray:
        """The frame carrying ``message``. Raises :class:`UnsendableMessageError` when msgspec cannot encode
        it and :class:`MessageTooLargeError` when it is over the limit."""
        frame = bytearray(HEADER.size)
        try:
            self._encoder.encode_into(message, frame, HEADER.size)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            raise UnsendableMessageError(f"cannot encode a {type(message).__name__} for the channel: {exc}") from exc
        size = len(frame) - HEADER.size
        if size > self.max_message_bytes:
            raise MessageTooLargeError(
                f"a {type(message).__name__} encodes to {size} bytes, over the channel's limit of "
                f"{self.max_message_bytes}"
            )
        HEADER.pack_into(frame, 0, size, FrameKind.DATA)
        return frame


def credit_frame(count: int) -> bytes:
    """A frame granting the peer ``count`` more sends (1 <= count < 2**32)."""
    return HEADER.pack(_COUNT.size, FrameKind.CREDIT) + _COUNT.pack(count)


CLOSE_FRAME = HEADER.pack(0, FrameKind.CLOSE)


class FrameDecoder:
    """Splits a byte stream into frames, whatever the chunking of the reads.

    ``feed`` returns the frames completed by the new bytes, in order: ``(FrameKind.DATA, payload)`` with the
    payload as ``bytes``, ``(FrameKind.CREDIT, count)`` and ``(FrameKind.CLOSE, None)``. Invalid input raises
    :class:`ProtocolError`; after that, and after a ``CLOSE``, the decoder accepts no more bytes.
    """

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._buffer = bytearray()
        self._finished = False

    @property
    def pending_bytes(self) -> int:
        """Bytes held that do not yet make a complete frame (non-zero at EOF means a torn frame)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[tuple[FrameKind, Any]]:
        if self._finished:
            if data:
                raise ProtocolError("bytes after a CLOSE frame or a protocol error")
            return []
        buffer = self._buffer
        buffer += data
        frames: list[tuple[FrameKind, Any]] = []
        start = 0
        end = len(buffer)
        try:
            while end - start >= HEADER.size:
                size, kind = HEADER.unpack_from(buffer, start)
                if kind == FrameKind.DATA:
                    if size > self.max_message_bytes:
                        raise ProtocolError(f"a {size}-byte message, over the limit of {self.max_message_bytes}")
                elif kind == FrameKind.CREDIT:
                    if size != _COUNT.size:
                        raise ProtocolError(f"a CREDIT frame of {size} bytes")
                elif kind == FrameKind.CLOSE:
                    if size != 0:
                        raise ProtocolError(f"a CLOSE frame of {size} bytes")
                else:
                    raise ProtocolError(f"unknown frame kind {kind}")
                body = start + HEADER.size
                if end - body < size:
                    break
                start = body + size
                if kind == FrameKind.DATA:
                    frames.append((FrameKind.DATA, bytes(buffer[body:start])))
                elif kind == FrameKind.CREDIT:
                    (count,) = _COUNT.unpack_from(buffer, body)
                    if count == 0:
                        raise ProtocolError("a CREDIT frame granting nothing")
                    frames.append((FrameKind.CREDIT, count))
                else:
                    frames.append((FrameKind.CLOSE, None))
                    self._finished = True
                    if start != end:
                        raise ProtocolError("bytes after a CLOSE frame")
                    break
        except ProtocolError:
            self._finished = True
            raise
        del buffer[:start]
        return frames
