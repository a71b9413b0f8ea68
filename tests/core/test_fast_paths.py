"""The decode fast paths give exactly what the general paths give.

``KVManager.append_in_block`` (one slot without a block-table change) must leave the manager as
``append_slots(seq, 1)`` does, or change nothing and say so; ``Scheduler._scheduled_decode`` must build the
``ScheduledSequence`` that ``_scheduled_general`` builds. Both are checked on random states: the KV manager
against a twin driven through the general path only, and the whole scheduler + allocator loop (with
preemption, prefix sharing, sliding windows, stop tokens, overlap) against a twin with both fast paths off,
step by step (grants, plans and updates must be equal).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.fake_engine import FakeEngine

from inference_server.core.kv_grants import StepGrant, allocate_step
from inference_server.core.kv_manager import UNUSED_BLOCK, BlockTables, KVManager, SequenceId
from inference_server.core.policies import make_policy
from inference_server.core.request import Request
from inference_server.core.scheduler import Scheduler, SchedulerConfig
from inference_server.core.stop_checker import StopChecker
from inference_server.records.requests import RequestUpdate
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan, StepResult

BLOCK = 4


class GeneralKV(KVManager):
    """A manager without the decode fast path: the allocator always takes the general path."""

    def append_in_block(self, seq_id: SequenceId) -> BlockTables | None:
        return None


class CountingKV(KVManager):
    """The real manager, counting how often the fast path was taken (so a test can show it ran)."""

    fast_hits = 0

    def append_in_block(self, seq_id: SequenceId) -> BlockTables | None:
        tables = super().append_in_block(seq_id)
        self.fast_hits += tables is not None
        return tables


class GeneralScheduler(Scheduler):
    """A scheduler whose decodes take ``_scheduled_general``."""

    def _scheduled_decode(self, request: Request, start: int, prompt_len: int,
                          block_tables: tuple[tuple[int, ...], ...]) -> ScheduledSequence:
        return self._scheduled_general(request, 1, block_tables)


def make_kv(cls: type[KVManager], num_blocks: int, window: int | None, prefix_cache: bool) -> KVManager:
    return cls(block_size=BLOCK, num_full_blocks=num_blocks, num_sliding_blocks=0 if window is None else num_blocks,
               sliding_window=window, enable_prefix_cache=prefix_cache)


def kv_state(kv: KVManager, seq_ids: list[int]) -> tuple[object, ...]:
    sliding = kv.sliding_pool.num_available if kv.sliding_pool is not None else None
    return (kv.full_pool.num_available, sliding,
            tuple((s, kv.num_tokens(s), kv.block_tables(s)) for s in seq_ids if s in kv))


# -- the KV manager --------------------------------------------------------------------------------------

kv_ops = st.lists(st.tuples(st.sampled_from(["start", "chunk", "decode", "decode", "decode", "release"]),
                            st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=kv_ops, window=st.sampled_from([None, 3, 5, 8, 13]), prefix_cache=st.booleans(),
       num_blocks=st.integers(6, 40))
def test_append_in_block_is_append_slots_of_one(ops: list[tuple[str, int, int]], window: int | None,
                                                 prefix_cache: bool, num_blocks: int) -> None:
    fast, general = make_kv(CountingKV, num_blocks, window, prefix_cache), make_kv(KVManager, num_blocks, window,
                                                                                  prefix_cache)
    prompts: dict[int, tuple[int, ...]] = {}
    for op, seq_id, size in ops:
        if op == "start" and seq_id not in prompts:
            prompts[seq_id] = tuple((seq_id + i) % 3 for i in range(size * 2))  # shared prefixes, in blocks
            for kv in (fast, general):
                kv.start_sequence(seq_id, prompts[seq_id])
        elif op == "chunk" and seq_id in prompts and general.can_append(seq_id, size):
            for kv in (fast, general):
                kv.append_slots(seq_id, size)
        elif op == "decode" and seq_id in prompts:
            before = kv_state(fast, list(prompts))
            tables = fast.append_in_block(seq_id)
            if tables is None:
                assert kv_state(fast, list(prompts)) == before  # refused: nothing changed
                if not general.can_append(seq_id, 1):
                    continue
                fast.append_slots(seq_id, 1)
            else:
                assert tables == fast.block_tables(seq_id)
            general.append_slots(seq_id, 1)
        elif op == "release" and seq_id in prompts:
            computed = prompts.pop(seq_id)[: general.num_tokens(seq_id)]
            for kv in (fast, general):
                kv.release_sequence(seq_id, computed)
        assert kv_state(fast, list(prompts)) == kv_state(general, list(prompts))
        fast.check_integrity()


def test_append_in_block_takes_the_common_decode_and_refuses_block_boundaries() -> None:
    kv = make_kv(KVManager, 64, 8, True)
    kv.start_sequence(0, (99,) * BLOCK)
    kv.append_slots(0, BLOCK)  # holds block 0, so no block of sequence 1 has the id UNUSED_BLOCK
    kv.start_sequence(1, tuple(range(6)))
    kv.append_slots(1, 6)  # positions 0..5: the first block is written, not yet in the prefix cache
    first_block = kv.block_tables(1).full[0]
    assert not kv.full_pool.is_cached(first_block)
    assert kv.append_in_block(1) == kv.block_tables(1)  # position 6: caches the first block on the way
    assert kv.full_pool.is_cached(first_block)
    assert kv.append_in_block(1) == kv.block_tables(1)  # position 7: room in the second block
    assert kv.append_in_block(1) is None  # position 8 starts a third block
    kv.append_slots(1, 1)
    assert kv.num_tokens(1) == 9
    assert kv.append_in_block(1) is not None and kv.append_in_block(1) is not None  # positions 9, 10
    before = kv.block_tables(1)
    # Position 11: the window of 8 (positions 4..11) no longer sees block 0 (0..3); its sliding block goes.
    after = kv.append_in_block(1)
    assert after is not None and after.full == before.full
    assert after.sliding == (UNUSED_BLOCK, *before.sliding[1:]) != before.sliding
    kv.check_integrity()


# -- the scheduler and allocator loop ---------------------------------------------------------------------

@attrs.frozen
class Spec:
    prompt_len: int
    max_tokens: int
    priority: int
    stop_token: int | None
    family: int  # requests of one family share prompt prefixes
    arrival_step: int


specs = st.lists(st.builds(Spec, st.integers(1, 22), st.integers(1, 14), st.integers(0, 1),
                           st.one_of(st.none(), st.integers(3, 99)), st.integers(0, 2), st.integers(0, 6)),
                 min_size=1, max_size=10)


def build_request(rid: int, spec: Spec) -> Request:
    stops = () if spec.stop_token is None else (spec.stop_token,)
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, stop_token_ids=stops)
    return Request(request_id=rid, prompt_ids=tuple(10 + (spec.family * 7 + i) % 11 for i in range(spec.prompt_len)),
                   params=params, arrival_time=0.0, arrival_index=rid, priority=spec.priority,
                   session_id=f"s{spec.family}", stop_checker=StopChecker.from_params(params, eos_token_ids=()))


class ResolvingRunner(FakeEngine):
    """``FakeEngine`` that, with overlap, resolves a pending token from the previous launched step."""

    def __init__(self) -> None:
        super().__init__()
        self.previous: dict[int, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        sequences = tuple(attrs.evolve(s, token_ids=(*s.token_ids[:-1], self.previous[s.request_id])) if s.pending
                          else s for s in plan.sequences)
        result = super().execute(StepPlan(plan.step_id, sequences, plan.finished_request_ids))
        self.previous = {t.request_id: t.token_id for t in result.tokens}
        return result


Trace = list[tuple[StepGrant, StepPlan | None, list[RequestUpdate]]]


def run_loop(scheduler: Scheduler, kv: KVManager, requests: list[tuple[Spec, Request]], overlap: bool,
             check: Callable[[], None]) -> Trace:
    runner = ResolvingRunner()
    trace: Trace = []
    in_flight: list[StepResult] = []
    for step in range(400):
        for spec, request in requests:
            if spec.arrival_step == step:
                scheduler.add(request)
        grant = allocate_step(kv, scheduler.demand())
        plan = scheduler.apply_grant(grant)
        updates: list[RequestUpdate] = []
        if plan is not None:
            in_flight.append(runner.execute(plan))
        if in_flight and (len(in_flight) > overlap or plan is None):
            updates = scheduler.on_step_result(in_flight.pop(0))
        trace.append((grant, plan, updates))
        check()
        if plan is None and not in_flight and step > 6 and not scheduler.has_work:
            break
    assert not scheduler.has_work
    return trace


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=specs, num_blocks=st.integers(8, 48), window=st.sampled_from([None, 5, 9]),
       prefix_cache=st.booleans(), policy=st.sampled_from(["fcfs", "fair"]),
       mode=st.sampled_from(["chunked", "batched", "monolithic"]), budget=st.integers(4, 24), overlap=st.booleans())
def test_fast_paths_plan_what_the_general_paths_plan(requests: list[Spec], num_blocks: int, window: int | None,
                                                     prefix_cache: bool, policy: str, mode: str, budget: int,
                                                     overlap: bool) -> None:
    config = SchedulerConfig(max_batch_size=6, max_num_batched_tokens=budget, prefill_mode=mode)
    fast_kv = make_kv(CountingKV, num_blocks, window, prefix_cache)
    fast = Scheduler(config, make_policy(policy))
    general_kv = make_kv(GeneralKV, num_blocks, window, prefix_cache)
    general = GeneralScheduler(config, make_policy(policy))
    # A prompt that cannot fit the whole pool would wait forever in both; keep every request servable.
    requests = [r for r in requests if r.prompt_len + r.max_tokens + BLOCK < (num_blocks - 2) * BLOCK]
    fast_trace = run_loop(fast, fast_kv, [(s, build_request(i, s)) for i, s in enumerate(requests)], overlap,
                          lambda: fast.check_integrity(fast_kv))
    general_trace = run_loop(general, general_kv, [(s, build_request(i, s)) for i, s in enumerate(requests)],
                             overlap, lambda: None)
    assert fast_trace == general_trace


def test_fast_paths_run_in_a_plain_decode_loop() -> None:
    """The equivalence test above is only meaningful if the fast paths run: they do, on most decodes."""
    config = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=16)
    kv = make_kv(CountingKV, 64, 9, True)
    scheduler = Scheduler(config, make_policy("fcfs"))
    specs_ = [Spec(6, 12, 0, None, i, 0) for i in range(4)]
    fast_decodes = 0
    original = scheduler._scheduled_decode

    def counted(*args: object) -> ScheduledSequence:
        nonlocal fast_decodes
        fast_decodes += 1
        return original(*args)  # type: ignore[arg-type]

    scheduler._scheduled_decode = counted  # type: ignore[method-assign]
    run_loop(scheduler, kv, [(s, build_request(i, s)) for i, s in enumerate(specs_)], True,
             lambda: scheduler.check_integrity(kv))
    assert isinstance(kv, CountingKV)
    assert kv.fast_hits > 20 and fast_decodes > 30


@settings(max_examples=200, deadline=None)
@given(prompt_len=st.integers(1, 12), num_outputs=st.integers(0, 6), in_flight=st.integers(0, 2),
       offset=st.integers(0, 20), policy=st.sampled_from(["fcfs", "fair"]))
def test_scheduled_decode_is_scheduled_general_of_one(prompt_len: int, num_outputs: int, in_flight: int,
                                                       offset: int, policy: str) -> None:
    """Any one-token chunk past the prompt of a running request: a decode, or a recompute's chunk cut to one
    token by the budget (then the step samples nothing)."""
    def state() -> Request:
        request = build_request(1, Spec(prompt_len, 20, 0, None, 0, 0))
        request.output_ids.extend(range(50, 50 + num_outputs))
        request.num_in_flight = in_flight
        request.num_computed = min(prompt_len + offset, request.num_tokens - 1)
        request.needs_reset = False
        return request

    fast_request, general_request = state(), state()
    if fast_request.num_computed < prompt_len:
        return  # the chunk is a prompt token: not the fast path's case
    fast, general = Scheduler(SchedulerConfig(), make_policy(policy)), Scheduler(SchedulerConfig(), make_policy(policy))
    tables = ((1, 2, 3), (0, 2, 3))
    fast_sequence = fast._scheduled(fast_request, 1, tables)
    assert fast_sequence == general._scheduled_general(general_request, 1, tables)
    fields = ("num_computed", "num_in_flight", "needs_reset", "output_ids", "status", "started")
    assert [getattr(fast_request, f) for f in fields] == [getattr(general_request, f) for f in fields]
    assert fast.policy.victim_key(fast_request) == general.policy.victim_key(general_request)
