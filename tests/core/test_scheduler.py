"""Scheduler behaviour with the fake engine (``tests/fake_engine.py``, which checks that chunks arrive
contiguously): refills, prefill modes, fairness, priority,
preemption, deadlines, and KV released exactly once."""

from __future__ import annotations

import pytest
from tests.fake_engine import FakeEngine
from tests.fake_engine import next_token as fake_token

from inference_server.core.kv_grants import allocate_step
from inference_server.core.kv_manager import KVManager
from inference_server.core.policies import make_policy
from inference_server.core.request import Request
from inference_server.core.scheduler import Scheduler, SchedulerConfig
from inference_server.core.stop_checker import StopChecker
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import StepPlan

BLOCK = 4


class Harness:
    """Scheduler and KV allocator composed as the actors compose them, one demand and grant per step."""

    def __init__(self, num_blocks: int = 64, policy: str = "fcfs", **config) -> None:
        self.kv = KVManager(block_size=BLOCK, num_full_blocks=num_blocks)
        self.scheduler = Scheduler(SchedulerConfig(**config), make_policy(policy))

    def schedule(self) -> StepPlan | None:
        return self.scheduler.apply_grant(allocate_step(self.kv, self.scheduler.demand()))

    def __getattr__(self, name: str):
        return getattr(self.scheduler, name)


def make_scheduler(num_blocks: int = 64, policy: str = "fcfs", **config) -> Harness:
    return Harness(num_blocks, policy, **config)


_next_index = iter(range(10**6))


def request(rid: int, prompt_len: int = 6, max_tokens: int = 5, session: str | None = None, priority: int = 0,
            deadline: float | None = None, first_token: int = 10) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(request_id=rid, prompt_ids=tuple(range(first_token, first_token + prompt_len)), params=params,
                   arrival_time=0.0, arrival_index=next(_next_index), deadline=deadline, session_id=session,
                   priority=priority, stop_checker=StopChecker.from_params(params, eos_token_ids=()))


class Outcomes:
    """Each request's tokens and its one terminal finish, as a run's updates arrive."""

    def __init__(self) -> None:
        self.outputs: dict[int, list] = {}
        self.finished: dict[int, str] = {}

    def record(self, updates: list) -> None:
        for update in updates:
            self.outputs.setdefault(update.request_id, []).extend(t.token_id for t in update.tokens)
            if update.finished:
                assert update.request_id not in self.finished, "two terminal events"
                self.finished[update.request_id] = update.finish_reason

    def settle(self, scheduler: Harness) -> dict[int, tuple[list, str]]:
        """Check the finished run left no work and no KV behind; ``{request id: (tokens, finish reason)}``."""
        assert not scheduler.has_work
        scheduler.schedule()  # delivers the last releases to the allocator
        scheduler.check_integrity(scheduler.kv)
        assert scheduler.kv.full_pool.num_referenced == 0
        return {rid: (self.outputs.get(rid, []), reason) for rid, reason in self.finished.items()}


def run_to_completion(scheduler: Harness, runner: FakeEngine, max_steps: int = 1000) -> dict[int, tuple[list, str]]:
    outcomes = Outcomes()
    for _ in range(max_steps):
        plan = scheduler.schedule()
        if plan is None:
            break
        outcomes.record(scheduler.on_step_result(runner.execute(plan)))
        scheduler.check_integrity()
    return outcomes.settle(scheduler)


def test_freed_slot_is_refilled_in_the_next_step() -> None:
    scheduler = make_scheduler(max_batch_size=2)
    runner = FakeEngine()
    scheduler.add(request(1, max_tokens=1))
    scheduler.add(request(2, max_tokens=4))
    scheduler.add(request(3, max_tokens=4))
    first = scheduler.schedule()
    assert [s.request_id for s in first.sequences] == [1, 2]
    updates = scheduler.on_step_result(runner.execute(first))
    assert [u.request_id for u in updates if u.finished] == [1]
    second = scheduler.schedule()
    assert {s.request_id for s in second.sequences} == {2, 3}  # request 3 took request 1's slot at once
    assert second.finished_request_ids == (1,)


@pytest.mark.parametrize("mode", ["monolithic", "chunked", "batched"])
def test_prefill_modes_produce_identical_outputs(mode: str) -> None:
    reference = None
    scheduler = make_scheduler(prefill_mode=mode, max_num_batched_tokens=8)
    for rid, length in [(1, 3), (2, 13), (3, 7)]:
        scheduler.add(request(rid, prompt_len=length, first_token=rid * 20))
    results = run_to_completion(scheduler, FakeEngine())
    reference = {rid: run_alone(rid * 20, length) for rid, length in [(1, 3), (2, 13), (3, 7)]}
    assert {rid: out for rid, (out, _) in results.items()} == reference


def run_alone(first_token: int, length: int) -> list[int]:
    tokens = list(range(first_token, first_token + length))
    out = []
    for _ in range(5):
        t = fake_token(len(tokens), tokens[-1])
        out.append(t)
        tokens.append(t)
    return out


def test_prefill_mode_batch_shapes() -> None:
    def first_plan(mode: str) -> list[int]:
        scheduler = make_scheduler(prefill_mode=mode, max_num_batched_tokens=10)
        for rid in (1, 2, 3):
            scheduler.add(request(rid, prompt_len=4))
        return [len(s.token_ids) for s in scheduler.schedule().sequences]

    assert first_plan("monolithic") == [4]
    assert first_plan("batched") == [4, 4]
    assert first_plan("chunked") == [4, 4, 2]


def test_chunked_prefill_never_stalls_running_decodes() -> None:
    scheduler = make_scheduler(prefill_mode="chunked", max_num_batched_tokens=8)
    runner = FakeEngine()
    scheduler.add(request(1, prompt_len=4, max_tokens=20))
    scheduler.on_step_result(runner.execute(scheduler.schedule()))
    scheduler.add(request(2, prompt_len=40))
    for _ in range(5):  # while the long prompt is prefilled in chunks, request 1 decodes every step
        plan = scheduler.schedule()
        assert plan.sequences[0].request_id == 1 and len(plan.sequences[0].token_ids) == 1
        assert plan.num_tokens <= 8
        scheduler.on_step_result(runner.execute(plan))


def test_a_step_without_decodes_takes_the_prefill_budget() -> None:
    """``max_prefill_tokens``: a prompt alone is prefilled in chunks of the larger budget; once a request decodes,
    every step (the rest of a prompt, a newcomer's chunks) keeps ``max_num_batched_tokens``."""
    scheduler = make_scheduler(prefill_mode="chunked", max_num_batched_tokens=8, max_prefill_tokens=32)
    runner = FakeEngine()
    scheduler.add(request(1, prompt_len=40, max_tokens=20))
    sizes = []
    for _ in range(2):  # 32 tokens, then the last 8 (nothing decodes yet)
        plan = scheduler.schedule()
        sizes.append(plan.num_tokens)
        scheduler.on_step_result(runner.execute(plan))
    assert sizes == [32, 8]
    scheduler.add(request(2, prompt_len=40, first_token=100))
    for _ in range(4):  # request 1 decodes: request 2's prompt comes 7 tokens a step beside its decode
        plan = scheduler.schedule()
        assert [len(s.token_ids) for s in plan.sequences] == [1, 7]
        scheduler.on_step_result(runner.execute(plan))
    assert make_scheduler(max_num_batched_tokens=8).config.prefill_step_tokens == 8  # 0: the step budget
    assert make_scheduler(max_num_batched_tokens=8, max_prefill_tokens=4).config.prefill_step_tokens == 8


@pytest.mark.parametrize("mode", ["monolithic", "chunked", "batched"])
def test_the_prefill_budget_keeps_outputs(mode: str) -> None:
    scheduler = make_scheduler(prefill_mode=mode, max_num_batched_tokens=4, max_prefill_tokens=16)
    lengths = [(1, 3), (2, 23), (3, 9), (4, 17)]
    for rid, length in lengths:
        scheduler.add(request(rid, prompt_len=length, first_token=rid * 20))
    results = run_to_completion(scheduler, FakeEngine())
    assert {rid: out for rid, (out, _) in results.items()} == {rid: run_alone(rid * 20, n) for rid, n in lengths}


def test_preemption_under_a_tiny_pool_loses_nothing_and_keeps_outputs() -> None:
    prompts = [(rid, 5 + rid) for rid in range(1, 7)]
    roomy = make_scheduler(num_blocks=256)
    tight = make_scheduler(num_blocks=12)
    for scheduler in (roomy, tight):
        for rid, length in prompts:
            scheduler.add(request(rid, prompt_len=length, max_tokens=12, first_token=rid * 7))
    expected = run_to_completion(roomy, FakeEngine())
    got = run_to_completion(tight, FakeEngine())
    assert tight.num_preemptions > 0
    assert got == expected
    assert all(reason == "length" for _, reason in got.values())


def test_priority_orders_admission_and_picks_victims() -> None:
    scheduler = make_scheduler(max_batch_size=1)
    scheduler.add(request(1, priority=5))
    scheduler.add(request(2, priority=0))
    assert [s.request_id for s in scheduler.schedule().sequences] == [2]
    assert max(scheduler.running + scheduler.waiting, key=scheduler.policy.victim_key).request_id == 1


def test_fair_share_bounds_a_light_session_while_a_heavy_one_floods() -> None:
    """Ten heavy requests arrive before one light request; under fair share the light one is admitted
    immediately after the heavy session has received service, under FCFS it waits for all of them."""

    def light_finish_step(policy: str) -> int:
        scheduler = make_scheduler(policy=policy, max_batch_size=2)
        runner = FakeEngine()
        for rid in range(10):
            scheduler.add(request(100 + rid, session="heavy", max_tokens=8))
        step = 0
        while True:
            if step == 2:
                scheduler.add(request(1, session="light", max_tokens=8))
            plan = scheduler.schedule()
            updates = scheduler.on_step_result(runner.execute(plan))
            step += 1
            if any(u.request_id == 1 and u.finished for u in updates):
                return step

    assert light_finish_step("fair") <= 18
    assert light_finish_step("fcfs") > 30


def test_admission_deadline_times_out_only_unstarted_requests() -> None:
    scheduler = make_scheduler(max_batch_size=1)
    scheduler.add(request(1, deadline=5.0))
    scheduler.add(request(2, deadline=5.0))
    scheduler.schedule()
    updates = scheduler.expire(now=6.0)
    assert [(u.request_id, u.finish_reason) for u in updates] == [(2, "timeout")]
    assert scheduler.expire(now=100.0) == []  # request 1 started: no timeout


def test_abort_frees_kv_exactly_once() -> None:
    scheduler = make_scheduler()
    runner = FakeEngine()
    scheduler.add(request(1, max_tokens=50))
    scheduler.on_step_result(runner.execute(scheduler.schedule()))
    update = scheduler.abort(1)
    assert update.finish_reason == "abort"
    assert scheduler.abort(1) is None
    assert scheduler.schedule().finished_request_ids == (1,)
    assert scheduler.kv.full_pool.num_referenced == 0
    scheduler.check_integrity(scheduler.kv)


def test_prefix_hit_computes_only_the_suffix() -> None:
    scheduler = make_scheduler()
    runner = FakeEngine()
    scheduler.add(request(1, prompt_len=16, max_tokens=1))
    run_to_completion(scheduler, runner)
    before = runner.tokens_computed
    scheduler.add(request(2, prompt_len=18, max_tokens=1))  # same first 16 tokens, 2 more
    run_to_completion(scheduler, runner)
    assert runner.tokens_computed - before == 18 - 16


def test_a_backlog_of_prompts_takes_the_prefill_budget_beside_decodes() -> None:
    """While more requests wait for their first token than are decoding (a burst), a step with decodes takes the
    prefill budget too, and keeps it until the burst's last request has its first token, also once the decodes are
    as many as the prompts left; the next step with decodes takes the step budget. Outputs are those of each request
    alone."""
    scheduler = make_scheduler(prefill_mode="chunked", max_num_batched_tokens=8, max_prefill_tokens=32,
                               num_blocks=256)
    runner = FakeEngine()
    for rid in range(1, 13):
        scheduler.add(request(rid, prompt_len=10, max_tokens=40, first_token=rid * 20))
    steps = []  # (decodes, requests waiting for their first token, budget, tokens) per step
    while scheduler.waiting or any(r.num_uncomputed > 1 for r in scheduler.running):
        decoding = sum(r.num_computed >= len(r.prompt_ids) for r in scheduler.running)
        demand = scheduler.scheduler.demand()
        plan = scheduler.scheduler.apply_grant(allocate_step(scheduler.kv, demand))
        assert plan is not None
        steps.append((decoding, len(scheduler.requests) - decoding, demand.token_budget, plan.num_tokens))
        scheduler.on_step_result(runner.execute(plan))
        scheduler.check_integrity()
    # 3 prompts and a part, twice; then 6 decode beside 6 left (the backlog rule alone would take 8 tokens there)
    assert steps[:3] == [(0, 12, 32, 32), (3, 9, 32, 32), (6, 6, 32, 32)]
    assert all(budget == 32 for _, _, budget, _ in steps)
    assert scheduler.scheduler.demand().token_budget == 8  # every request decodes: the burst is over
    fresh = make_scheduler(prefill_mode="chunked", max_num_batched_tokens=8, max_prefill_tokens=32, num_blocks=256)
    for rid in range(1, 13):
        fresh.add(request(rid, prompt_len=10, first_token=rid * 20))  # 5 tokens out, as run_alone's
    results = run_to_completion(fresh, FakeEngine())
    assert {rid: out for rid, (out, _) in results.items()} == {rid: run_alone(rid * 20, 10) for rid in range(1, 13)}


STEP_BUDGET, PREFILL_BUDGET = 64, 256
"""The burst tests' budgets: a step with decodes, and one without (``max_prefill_tokens``)."""


def decodes_and_backlog(harness: Harness) -> tuple[int, int]:
    """What ``demand`` counts before the next step: the running requests that decode one token, and those that wait
    for their first token (waiting, or still prefilling). The backlog rule alone takes the prefill budget beside
    decodes only while the backlog outnumbers them. (No request here finishes with a token in flight, the one
    decode ``demand`` leaves out.)"""
    scheduler = harness.scheduler
    decodes = sum(r.num_uncomputed == 1 for r in scheduler.running)
    prefilling = sum(r.num_uncomputed > 1 for r in scheduler.running)
    return decodes, prefilling + len(scheduler.waiting)


def budgets_of_a_burst(*, num_requests: int = 20, prompt_len: int = 48, later: int = 0, steps_after: int = 0,
                       harness: Harness | None = None) -> list[tuple[int, int, int]]:
    """(token budget, decodes, backlog) of each step while a burst is served, the counts taken as ``demand`` takes
    them (``decodes_and_backlog``): ``num_requests`` prompts of ``prompt_len`` tokens arrive at once on an idle
    scheduler (``STEP_BUDGET`` / ``PREFILL_BUDGET``), and ``later`` more right after the second step, the first that
    had decodes (when the burst began); the steps up to the one that samples the last burst request's first token,
    then ``steps_after`` more. Every request decodes well past the burst, so the decodes soon outnumber the prompts
    left. ``harness`` (made here when None) is left as the run leaves it."""
    scheduler = harness or make_scheduler(prefill_mode="chunked", max_num_batched_tokens=STEP_BUDGET,
                                          max_prefill_tokens=PREFILL_BUDGET, num_blocks=2048)
    runner = FakeEngine()
    burst = [request(rid, prompt_len=prompt_len, max_tokens=200, first_token=rid) for rid in range(1, num_requests + 1)]
    for r in burst:
        scheduler.add(r)
    steps: list[tuple[int, int, int]] = []
    remaining_after = steps_after
    while remaining_after > 0 or not all(r.output_ids for r in burst):
        if all(r.output_ids for r in burst):
            remaining_after -= 1
        decodes, backlog = decodes_and_backlog(scheduler)
        demand = scheduler.scheduler.demand()
        assert decodes == sum(not item.new and item.num_tokens == 1 for item in demand.items)
        steps.append((demand.token_budget, decodes, backlog))
        plan = scheduler.scheduler.apply_grant(allocate_step(scheduler.kv, demand))
        assert plan is not None and plan.num_tokens <= demand.token_budget
        scheduler.on_step_result(runner.execute(plan))
        scheduler.check_integrity()
        if later and len(steps) == 2:  # the second step was the first with decodes: it began the burst
            for rid in range(1000, 1000 + later):
                scheduler.add(request(rid, prompt_len=prompt_len, max_tokens=200, first_token=rid % 50))
            later = 0
        assert len(steps) < 200, "the burst never got its first tokens"
    return steps


def test_a_held_burst_keeps_the_prefill_budget_until_its_last_first_token() -> None:
    """Every step until the burst's last request has its first token takes the prefill budget, and at some of those
    steps the decodes already outnumber the prompts left: the backlog rule alone would have dropped them to the step
    budget (and the burst would have taken more steps)."""
    steps = budgets_of_a_burst()
    assert [budget for budget, _, _ in steps] == [PREFILL_BUDGET] * len(steps)
    assert steps[0][1] == 0  # no decodes yet; then 5 decode while 15 wait, and so on
    assert any(backlog < decodes for _, decodes, backlog in steps), "the decodes never outnumbered the backlog"


def test_requests_arriving_after_a_burst_began_do_not_extend_it() -> None:
    """Ten requests arrive once the burst's first step with decodes has begun it: the hold ends with the burst's own
    last first token, and the next step takes the step budget while the late ones still wait for theirs (a backlog
    that does not outnumber the decodes)."""
    harness = make_scheduler(prefill_mode="chunked", max_num_batched_tokens=STEP_BUDGET,
                             max_prefill_tokens=PREFILL_BUDGET, num_blocks=2048)
    budgets = [budget for budget, _, _ in budgets_of_a_burst(later=10, steps_after=1, harness=harness)]
    assert budgets[:-1] == [budget for budget, _, _ in budgets_of_a_burst()]  # the late ones came after (FCFS)
    assert budgets[-1] == STEP_BUDGET
    late_waiting = [r for r in harness.requests.values() if r.request_id >= 1000 and not r.output_ids]
    assert late_waiting, "the test needs late requests still without a first token after the burst"


def test_a_backlog_of_recomputes_is_scanned_for_a_burst_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """KV thrash: requests preempted after their first token wait to be recomputed and outnumber the decodes. The
    backlog takes the prefill budget, but none of them lacks a first token, so there is no burst to hold: the held
    requests are scanned for one once, and later steps skip the scan until a request that may lack one appears
    (``check_integrity`` asserts after every step that a skipped scan would have found nobody). Outputs are those of
    a roomy pool."""
    entered = scanned = looked_at = 0
    begin, lacks = Scheduler._begin_burst, Scheduler._lacks_first_token

    def counting_lacks(request: Request) -> bool:
        nonlocal looked_at
        looked_at += 1
        return lacks(request)

    def counting_begin(self: Scheduler) -> None:
        nonlocal entered, scanned
        before = looked_at
        begin(self)
        entered += 1
        scanned += looked_at > before

    monkeypatch.setattr(Scheduler, "_lacks_first_token", staticmethod(counting_lacks))
    monkeypatch.setattr(Scheduler, "_begin_burst", counting_begin)
    budgets = {"prefill_mode": "chunked", "max_num_batched_tokens": 8, "max_prefill_tokens": 48}
    roomy, tight = make_scheduler(num_blocks=256, **budgets), make_scheduler(num_blocks=20, **budgets)
    for scheduler in (roomy, tight):
        for rid in range(1, 17):
            scheduler.add(request(rid, prompt_len=9 + rid % 5, max_tokens=40, first_token=rid * 20))
    expected = run_to_completion(roomy, FakeEngine())
    entered = scanned = 0
    assert run_to_completion(tight, FakeEngine()) == expected
    assert tight.num_preemptions > 16
    assert 1 <= scanned < entered, (entered, scanned)


def test_one_long_prompt_beside_decoding_streams_keeps_the_step_budget() -> None:
    """One prompt arriving while streams decode is no burst (a backlog of one does not outnumber them): every step
    of its prefill keeps the step budget."""
    scheduler = make_scheduler(prefill_mode="chunked", max_num_batched_tokens=STEP_BUDGET,
                               max_prefill_tokens=PREFILL_BUDGET, num_blocks=2048)
    runner = FakeEngine()
    for rid in range(1, 9):
        scheduler.add(request(rid, prompt_len=8, max_tokens=200, first_token=rid))
    scheduler.on_step_result(runner.execute(scheduler.schedule()))  # 8 prompts in one step: then 8 decode
    long = request(100, prompt_len=1000, max_tokens=4, first_token=50)
    scheduler.add(long)
    budgets = []
    while not long.output_ids:
        demand = scheduler.scheduler.demand()
        budgets.append(demand.token_budget)
        scheduler.on_step_result(runner.execute(scheduler.scheduler.apply_grant(allocate_step(scheduler.kv, demand))))
        scheduler.check_integrity()
    assert budgets == [STEP_BUDGET] * len(budgets) and len(budgets) >= 1000 // STEP_BUDGET


def test_a_held_burst_under_preemption_keeps_outputs_and_its_members() -> None:
    """A burst in a pool too small for it: requests are preempted and recomputed (at these sizes, six after their
    first token, which then no longer hold the burst, and two before, which do); ``check_integrity`` checks the
    burst's members against the requests held after every step, and outputs are those of a roomy pool."""
    prompts = [(rid, 9 + rid % 5) for rid in range(1, 17)]
    budgets = {"prefill_mode": "chunked", "max_num_batched_tokens": 8, "max_prefill_tokens": 48}
    roomy, tight = make_scheduler(num_blocks=256, **budgets), make_scheduler(num_blocks=30, **budgets)
    for scheduler in (roomy, tight):
        for rid, length in prompts:
            scheduler.add(request(rid, prompt_len=length, max_tokens=12, first_token=rid * 20))
    expected = run_to_completion(roomy, FakeEngine())
    assert run_to_completion(tight, FakeEngine()) == expected
    assert tight.num_preemptions > 0
