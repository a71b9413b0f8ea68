"""The IPC wire format and credit accounting, synchronously (no trio, no socket)."""

from __future__ import annotations

import msgspec
import pytest

from inference_server.ipc.flow import MAX_CAPACITY, ReceiveWindow, SendCredit
from inference_server.ipc.frames import (
    CLOSE_FRAME,
    HEADER,
    DataFrameEncoder,
    FrameDecoder,
    FrameKind,
    MessageTooLargeError,
    ProtocolError,
    UnsendableMessageError,
    credit_frame,
)


class TokenEvent(msgspec.Struct):
    request_id: int
    token_ids: list[int]
    finish_reason: str | None = None


def test_frames_survive_any_chunking() -> None:
    encoder = DataFrameEncoder()
    messages = [TokenEvent(i, list(range(i % 8 + 1)), "stop" if i % 5 == 0 else None) for i in range(50)]
    stream = b"".join([bytes(encoder.encode(m)) for m in messages] + [credit_frame(7), CLOSE_FRAME])
    for chunk in (1, 2, 5, 13, len(stream)):
        decoder = FrameDecoder()
        frames = []
        for start in range(0, len(stream), chunk):
            frames += decoder.feed(stream[start : start + chunk])
        data = [msgspec.msgpack.decode(p, type=TokenEvent) for k, p in frames if k is FrameKind.DATA]
        assert data == messages
        assert frames[-2:] == [(FrameKind.CREDIT, 7), (FrameKind.CLOSE, None)]
        assert decoder.pending_bytes == 0


def test_unencodable_and_oversized_messages_are_refused_clearly() -> None:
    encoder = DataFrameEncoder(max_message_bytes=32)
    with pytest.raises(UnsendableMessageError, match="cannot encode a object"):
        encoder.encode(object())
    with pytest.raises(UnsendableMessageError, match="cannot encode a int"):
        encoder.encode(1 << 70)
    with pytest.raises(MessageTooLargeError, match="over the channel's limit of 32"):
        encoder.encode(b"x" * 100)
    assert FrameDecoder().feed(bytes(encoder.encode([1, 2]))) == [(FrameKind.DATA, msgspec.msgpack.encode([1, 2]))]


@pytest.mark.parametrize(
    "garbage",
    [
        HEADER.pack(0, 9),  # unknown kind
        HEADER.pack(3, FrameKind.CREDIT) + b"abc",  # wrong credit size
        credit_frame(1)[:-4] + b"\0\0\0\0",  # a grant of nothing
        HEADER.pack(1, FrameKind.CLOSE) + b"x",  # a close with a body
        HEADER.pack(1000, FrameKind.DATA),  # over the size limit
        CLOSE_FRAME + credit_frame(1),  # bytes after the close
    ],
)
def test_invalid_streams_are_protocol_errors(garbage: bytes) -> None:
    decoder = FrameDecoder(max_message_bytes=100)
    with pytest.raises(ProtocolError):
        decoder.feed(garbage)
    with pytest.raises(ProtocolError):
        decoder.feed(b"\0")


def test_receive_window_grants_capacity_then_batches_without_stalling_the_sender() -> None:
    window = ReceiveWindow(4)
    assert window.grant_due
    assert window.take_owed() == 4
    assert not window.grant_due
    for _ in range(4):
        window.arrived()
    with pytest.raises(ProtocolError, match="more than the 4 messages"):
        window.arrived()
    window.taken()
    assert window.grant_due  # the peer has nothing outstanding: it may be blocked, one taken lets one through
    assert window.take_owed() == 1
    window.taken()
    assert not window.grant_due  # the peer still holds a grant: wait for a batch (half the capacity)
    window.taken()
    assert window.grant_due
    assert window.take_owed() == 2
    assert (window.buffered, window.owed, window.outstanding) == (1, 0, 3)
    window.arrived()
    window.arrived()
    window.arrived()
    assert window.buffered == 4


@pytest.mark.parametrize("capacity", [0, -1, MAX_CAPACITY + 1])
def test_receive_window_refuses_unsupported_capacities(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity must be in 1"):
        ReceiveWindow(capacity)


def test_send_credit_counts_grants() -> None:
    credit = SendCredit()
    assert not credit.take()
    credit.grant(2)
    assert credit.take()
    assert credit.take()
    assert not credit.take()
    with pytest.raises(ProtocolError):
        credit.grant(MAX_CAPACITY + 1)
