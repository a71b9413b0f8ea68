"""Routing policies: which replica gets a request.

* ``round_robin``: the next healthy replica in turn (the baseline).
* ``least_loaded``: the fewest requests in flight from this front, then the lowest KV usage.
* ``prefix_aware``: the llm-d / Gateway API inference-extension filter-then-score scheme. A load filter first
  keeps the replicas whose in-flight count is at most ``max(least * 1.5, least + 4)`` (``least``: the
  smallest among healthy replicas), so no cached prefix or session can pile a hot prefix onto one replica
  while another idles (sending it elsewhere costs one prefill, after which both replicas hold it). Each
  remaining replica gets a weighted sum of scorers in [0, 1] and the highest sum wins:

  - prefix (weight 3): the fraction of the request's whole blocks the replica caches (``PrefixIndex``);
  - queue (weight 2): ``1 - in_flight / max in_flight`` over the candidates (GIE's queue scorer normalises
    min-max, which hands the whole weight to a replica that has one request fewer; relative to the busiest
    replica, a small difference in load moves the score little and a replica with twice the queue of
    another loses half the weight);
  - KV (weight 2): ``1 - kv_usage``;
  - session (weight 1): the replica that served this ``session_id`` last (affinity that yields as soon as
    its cost in load outweighs a third of a full prefix match).

  With no prefix cached anywhere and no session, the load scorers decide: it falls back to least-loaded.
  Ties go to the replica after the last one chosen, so equal replicas are used in turn.

Weights are llm-d's defaults for its precise prefix-cache profile (prefix 3, KV utilisation 2, queue 2).
The router is pure and single-threaded: the front calls ``choose`` and keeps the loads current.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import attrs

from control_plane.prefix_index import PrefixIndex, ReplicaId

POLICIES = ("round_robin", "least_loaded", "prefix_aware")
MAX_SESSIONS = 100_000


@attrs.define
class ReplicaLoad:
    """What the router knows of one replica now."""

    replica_id: ReplicaId
    healthy: bool = False
    in_flight: int = 0  # requests this front sent it that have not ended
    waiting: int = 0  # reported by the replica (``/kv/events`` load lines)
    running: int = 0
    kv_usage: float = 0.0


@attrs.frozen
class RoutingKey:
    """What routing reads of a request: the chained hashes of its prompt's whole blocks (empty when the
    front could not tokenise it) and its session."""

    block_hashes: tuple[int, ...] = ()
    session_id: str | None = None


@attrs.frozen
class Decision:
    replica_id: ReplicaId
    reason: str  # "prefix", "session", "load" or "round_robin"
    matched_blocks: int = 0


class NoReplicaError(RuntimeError):
    """No replica is healthy."""


class Policy(Protocol):
    name: str

    def choose(self, key: RoutingKey, replicas: Sequence[ReplicaLoad]) -> Decision: ...


def _healthy(replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        raise NoReplicaError("no replica is ready")
    return healthy


class _Rotation:
    """Breaks ties in turn: among equal candidates, the first one after the last chosen id."""

    def __init__(self) -> None:
        self.last: ReplicaId = -1

    def order(self, replica_id: ReplicaId) -> tuple[bool, ReplicaId]:
        return (replica_id <= self.last, replica_id)

    def pick(self, candidates: Sequence[ReplicaLoad]) -> ReplicaLoad:
        chosen = min(candidates, key=lambda r: self.order(r.replica_id))
        self.last = chosen.replica_id
        return chosen


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, key: RoutingKey, replicas: Sequence[ReplicaLoad]) -> Decision:
        return Decision(self._rotation.pick(_healthy(replicas)).replica_id, "round_robin")


class LeastLoaded:
    name = "least_loaded"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, key: RoutingKey, replicas: Sequence[ReplicaLoad]) -> Decision:
        healthy = _healthy(replicas)
        least = min((r.in_flight, r.kv_usage) for r in healthy)
        chosen = self._rotation.pick([r for r in healthy if (r.in_flight, r.kv_usage) == least])
        return Decision(chosen.replica_id, "load")


@attrs.frozen
class Weights:
    prefix: float = 3.0
    queue: float = 2.0
    kv: float = 2.0
    session: float = 1.0
    overload_factor: float = 1.5  # the load filter: in flight at most max(least * factor, least + slack)
    overload_slack: int = 4


def _not_overloaded(healthy: list[ReplicaLoad], weights: Weights) -> list[ReplicaLoad]:
    least = min(r.in_flight for r in healthy)
    bound = max(least * weights.overload_factor, least + weights.overload_slack)
    return [r for r in healthy if r.in_flight <= bound]


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, index: PrefixIndex, weights: Weights = Weights()) -> None:
        self.index = index
        self.weights = weights
        self._sessions: OrderedDict[str, ReplicaId] = OrderedDict()  # LRU, bounded
        self._rotation = _Rotation()

    def scores(self, key: RoutingKey, replicas: Sequence[ReplicaLoad],
               matched: dict[ReplicaId, int] | None = None) -> dict[ReplicaId, float]:
        """The weighted score of each replica that passes the load filter (the higher the better);
        ``matched``: the index's answer for ``key`` when the caller already has it."""
        healthy = _not_overloaded(_healthy(replicas), self.weights)
        if matched is None:
            matched = self.index.longest_prefixes(key.block_hashes)
        total = len(key.block_hashes)
        busiest = max(r.in_flight for r in healthy)
        session_replica = self._sessions.get(key.session_id) if key.session_id is not None else None
        w = self.weights
        return {r.replica_id: (w.prefix * (matched.get(r.replica_id, 0) / total if total else 0.0)
                               + w.queue * (1.0 - r.in_flight / busiest if busiest else 1.0)
                               + w.kv * (1.0 - min(max(r.kv_usage, 0.0), 1.0))
                               + w.session * (r.replica_id == session_replica))
                for r in healthy}

    def choose(self, key: RoutingKey, replicas: Sequence[ReplicaLoad]) -> Decision:
        prefixes = self.index.longest_prefixes(key.block_hashes)
        scores = self.scores(key, replicas, prefixes)
        best = max(scores.values())
        chosen = self._rotation.pick([r for r in replicas if scores.get(r.replica_id) == best]).replica_id
        matched = prefixes.get(chosen, 0)
        reason = "prefix" if matched else ("session" if self._sessions.get(key.session_id or "") == chosen
                                          else "load")
        if key.session_id is not None:
            self._sessions[key.session_id] = chosen
            self._sessions.move_to_end(key.session_id)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return Decision(chosen, reason, matched)


def make_policy(name: str, index: PrefixIndex) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_aware":
        return PrefixAware(index)
    raise ValueError(f"unknown routing policy {name!r}; expected one of {', '.join(POLICIES)}")
