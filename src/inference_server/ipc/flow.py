"""Credit-based flow control of an IPC channel (no trio here).

Each direction of a channel is bounded the way a trio memory channel is: the receiving end buffers at most
``capacity`` messages that its user has not taken yet, and the sending end may only send what the receiver
has granted. The receiver grants ``capacity`` credits when it opens, then one more for every message its user
takes (batched into CREDIT frames, never so late that a blocked sender waits for a message already taken,
see :class:`ReceiveWindow`). So the messages sent but not yet received never exceed ``capacity``, and a
send blocked at that bound resumes as soon as the receiver takes one, as with a memory channel.
"""

from __future__ import annotations

from .frames import ProtocolError

MAX_CAPACITY = 1 << 24
"""A bound on ``capacity`` that keeps every grant inside a CREDIT frame's 32-bit count."""


class SendCredit:
    """The sending side's count of sends the peer has granted and it has not used."""

    def __init__(self) -> None:
        self.available = 0

    def grant(self, count: int) -> None:
        """The peer granted ``count`` more sends."""
        self.available += count
        if self.available > MAX_CAPACITY:
            raise ProtocolError(f"the peer granted {self.available} sends, more than any capacity allows")

    def take(self) -> bool:
        """Uses one credit; False (and nothing used) when there is none."""
        if self.available == 0:
            return False
        self.available -= 1
        return True


class ReceiveWindow:
    """The receiving side's account: messages buffered and not taken, grants owed to the peer, and grants the
    peer holds or has in flight (``outstanding``).

    Invariant: ``buffered + owed + outstanding == capacity``. A message arriving with nothing outstanding
    is a protocol violation (the peer sent more than it was granted).

    Grants are sent in batches (one CREDIT frame costs a write and a wake-up of the peer), but never late:
    a grant is due when at least half the capacity is owed, or when the peer has nothing outstanding (then
    it may be blocked in ``send``, and one message taken must let one more through, as in a memory
    channel).
    """

    def __init__(self, capacity: int) -> None:
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be in 1..{MAX_CAPACITY} (0, a rendezvous, is not supported), "
                             f"got {capacity}")
        self.capacity = capacity
        self.buffered = 0
        self.outstanding = 0
        self._owed = capacity  # the opening grant
        self._batch = max(1, capacity // 2)

    def arrived(self) -> None:
        """A message arrived from the peer."""
        if self.outstanding == 0:
            raise ProtocolError(f"the peer sent more than the {self.capacity} messages it was granted")
        self.outstanding -= 1
        self.buffered += 1

    def taken(self) -> None:
        """The user took one buffered message: the peer may send one more."""
        if self.buffered == 0:
            raise RuntimeError("taken() with nothing buffered")
        self.buffered -= 1
        self._owed += 1

    @property
    def owed(self) -> int:
        """Grants not yet sent to the peer."""
        return self._owed

    @property
    def grant_due(self) -> bool:
        """Whether the owed grants should go to the peer now."""
        return self._owed >= self._batch or (self._owed > 0 and self.outstanding == 0)

    def take_owed(self) -> int:
        """The grants to send now (all owed ones); they count as outstanding from here."""
        owed, self._owed = self._owed, 0
        self.outstanding += owed
        return owed
