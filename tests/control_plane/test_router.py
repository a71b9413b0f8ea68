"""Routing policies: round robin takes turns, least-loaded picks the emptiest, prefix-aware sends a request
where its prefix is cached unless that replica is much busier, keeps sessions, and falls back to load."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from control_plane.prefix_index import PrefixIndex
from control_plane.router import (
    LeastLoaded,
    NoReplicaError,
    PrefixAware,
    ReplicaLoad,
    RoundRobin,
    RoutingKey,
    make_policy,
)
from inference_server.core.block_hashes import chain_hashes

BS = 4


def replicas(*in_flight: int, kv: float = 0.0) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, healthy=True, in_flight=n, kv_usage=kv) for i, n in enumerate(in_flight)]


def test_round_robin_takes_turns_among_healthy_replicas() -> None:
    policy, loads = RoundRobin(), replicas(0, 0, 0)
    loads[1].healthy = False
    assert [policy.choose(RoutingKey(), loads).replica_id for _ in range(4)] == [0, 2, 0, 2]
    with pytest.raises(NoReplicaError):
        policy.choose(RoutingKey(), [ReplicaLoad(0)])


def test_least_loaded_prefers_fewer_requests_then_less_kv() -> None:
    policy = LeastLoaded()
    assert policy.choose(RoutingKey(), replicas(3, 1, 2)).replica_id == 1
    loads = replicas(1, 1)
    loads[0].kv_usage = 0.5
    assert policy.choose(RoutingKey(), loads).replica_id == 1
    assert [policy.choose(RoutingKey(), replicas(0, 0)).replica_id for _ in range(3)] == [0, 1, 0]  # ties rotate


def test_prefix_aware_follows_the_cached_prefix() -> None:
    index = PrefixIndex()
    system = list(range(64))
    index.reset(1, chain_hashes(system, BS))
    policy = PrefixAware(index)
    key = RoutingKey(tuple(chain_hashes(system + [99] * 8, BS)))
    decision = policy.choose(key, replicas(0, 0, 0))
    assert (decision.replica_id, decision.reason, decision.matched_blocks) == (1, "prefix", 16)
    assert policy.choose(key, replicas(2, 3, 2)).replica_id == 1  # a little busier: still worth it
    assert policy.choose(key, replicas(0, 40, 0)).replica_id != 1  # far busier: the load wins


def test_prefix_aware_falls_back_to_least_loaded_and_keeps_sessions() -> None:
    policy = PrefixAware(PrefixIndex())
    assert policy.choose(RoutingKey(), replicas(4, 1, 4)).replica_id == 1
    first = policy.choose(RoutingKey(session_id="s"), replicas(0, 0, 0))
    again = policy.choose(RoutingKey(session_id="s"), replicas(0, 0, 0))
    assert again.replica_id == first.replica_id and again.reason == "session"
    assert policy.choose(RoutingKey(session_id="s"), replicas(*[5 if i == first.replica_id else 0
                                                                  for i in range(3)])).replica_id != first.replica_id


@given(loads=st.lists(st.tuples(st.booleans(), st.integers(0, 20), st.floats(0, 1)), min_size=1, max_size=5),
       cached=st.lists(st.integers(0, 4), max_size=5), name=st.sampled_from(["round_robin", "least_loaded",
                                                                               "prefix_aware"]))
def test_every_policy_picks_a_healthy_replica(loads: list[tuple[bool, int, float]], cached: list[int],
                                              name: str) -> None:
    index = PrefixIndex()
    prompt = list(range(20))
    for replica, blocks in enumerate(cached):
        index.reset(replica, chain_hashes(prompt[: blocks * BS], BS))
    states = [ReplicaLoad(i, healthy=h, in_flight=n, kv_usage=u) for i, (h, n, u) in enumerate(loads)]
    policy = make_policy(name, index)
    key = RoutingKey(tuple(chain_hashes(prompt, BS)))
    if not any(h for h, _, _ in loads):
        with pytest.raises(NoReplicaError):
            policy.choose(key, states)
        return
    decision = policy.choose(key, states)
    assert states[decision.replica_id].healthy
    if name == "least_loaded":
        assert states[decision.replica_id].in_flight == min(s.in_flight for s in states if s.healthy)
    if name == "prefix_aware":
        assert isinstance(policy, PrefixAware)
        scores = policy.scores(key, states)
        assert scores[decision.replica_id] == max(scores.values())  # only replicas past the load filter score
