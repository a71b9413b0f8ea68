"""``serve_bench --dataset shared-prefix``: sessions of turns on shared system prompts, each turn's prompt
extending the previous one (so a replica that served turn t caches all of turn t + 1's prompt but the new
answer and user message), with the session id in the request body."""

from __future__ import annotations

import itertools
import json

import serve_bench


def test_sessions_extend_their_previous_turn_and_share_their_group_s_system_prompt() -> None:
    sessions = serve_bench.shared_prefix_sessions(num_sessions=5, num_groups=2, system_len=16, turns=3, user_len=4,
                                                  output_len=3, vocab_size=1000, seed=7)
    assert len(sessions) == 5 and all(len(s) == 3 for s in sessions)
    for session in sessions:
        assert len({r.session for r in session}) == 1
        for before, after in itertools.pairwise(session):
            assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
            assert len(after.prompt_ids) == len(before.prompt_ids) + 3 + 4  # the answer, then the next message
    assert sessions[0][0].prompt_ids[:16] == sessions[2][0].prompt_ids[:16] != sessions[1][0].prompt_ids[:16]
    assert sessions == serve_bench.shared_prefix_sessions(5, 2, 16, 3, 4, 3, 1000, 7)  # seeded


def test_the_session_travels_in_the_body() -> None:
    request = serve_bench.BenchRequest((1, 2, 3), 4, "session-1")
    assert json.loads(serve_bench.request_body("/v1/completions", None, request))["user"] == "session-1"
    assert json.loads(serve_bench.request_body("/generate", None, request))["session_id"] == "session-1"
    anonymous = serve_bench.BenchRequest((1,), 2)
    assert "user" not in json.loads(serve_bench.request_body("/v1/completions", None, anonymous))
