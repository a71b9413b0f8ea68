"""Iteration-level continuous batching: which tokens of which requests the next step computes.

Each call to ``schedule`` builds one ``StepPlan`` under a token budget (``max_num_batched_tokens``) and a
sequence cap (``max_batch_size``): running decodes first, then prefill work in the order the policy gives.
A request that finishes frees its slot and KV at once, so the very next plan refills it.

Prefill modes (``PREFILL_MODE``):

* ``monolithic``: at most one prompt per step, prefilled whole, beside the running decodes.
* ``batched``: as many whole prompts as fit in the budget (one prompt larger than the budget goes alone).
* ``chunked``: prompts are cut into chunks that fill the budget left after the decodes, so a long prompt
  never stalls running decodes for more than one step's budget.

Under KV pressure a running request is preempted by recompute: its blocks are released (its computed
tokens go to the prefix cache, so the recompute is often short) and it goes back to the waiting queue with
its original arrival index, so it keeps its place. The KV manager is the only owner of blocks; every path
that ends a request (finish, abort, timeout, failure) releases its sequence exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from inference_server.core.kv_manager import KVManager
from inference_server.core.policies import SchedulingPolicy, session_of
from inference_server.core.request import Request, RequestStatus, RequestUpdate, TokenOutput
from inference_server.messages import FinishReason, ScheduledSequence, StepPlan, StepResult

PREFILL_MODES = ("monolithic", "chunked", "batched")


@attrs.frozen
class SchedulerConfig:
    max_batch_size: int = 256
    max_num_batched_tokens: int = 2048
    prefill_mode: str = "chunked"
    max_active_kv_tokens: int = 0  # 0 = no cap beyond the pool itself

    def __attrs_post_init__(self) -> None:
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {self.prefill_mode!r}")


class Scheduler:
    """Owns waiting and running requests; trio-free and deterministic (tests drive it step by step)."""

    def __init__(self, config: SchedulerConfig, kv: KVManager, policy: SchedulingPolicy) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._finished_since_last_plan: list[int] = []
        self._step_id = 0
        self._scheduled_now: set[int] = set()
        self.num_preemptions = 0

    # -- queries -------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def active_sessions(self) -> set[str]:
        return {session_of(r) for r in self.requests.values()}

    def active_kv_tokens(self) -> int:
        return sum(self.kv.num_tokens(r.request_id) for r in self.running)

    # -- request lifecycle ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} already added")
        self.policy.on_arrival(request, self.active_sessions())
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: int, reason: FinishReason = "abort", error: str | None = None) -> RequestUpdate | None:
        """End a request now (client gone, deadline, shutdown); None when it already ended."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, reason, error=error)

    def fail_all(self, error: str) -> list[RequestUpdate]:
        """End every request with an error (the engine is going down)."""
        return [self._finish(r, "error", error=error) for r in list(self.requests.values())]

    def expire(self, now: float) -> list[RequestUpdate]:
        """Requests that did not start before their admission deadline end with ``timeout``."""
        late = [r for r in self.waiting if not r.started and r.deadline is not None and now >= r.deadline]
        return [self._finish(r, "timeout", error="the request was not started before its deadline") for r in late]

    def _finish(self, request: Request, reason: FinishReason, *, stop_reason: str | int | None = None,
                error: str | None = None, tokens: tuple[TokenOutput, ...] = ()) -> RequestUpdate:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.release_sequence(request.request_id, request.all_token_ids[: request.num_computed])
            self._finished_since_last_plan.append(request.request_id)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        return RequestUpdate(
            request_id=request.request_id, tokens=tokens, finish_reason=reason, stop_reason=stop_reason,
            error=error, prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.output_ids),
            cached_prompt_tokens=request.num_cached_prompt_tokens,
        )

    # -- planning ------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to run (finished ids are still delivered
        with the next plan)."""
        budget = self.config.max_num_batched_tokens
        work: list[tuple[Request, int]] = []
        self._scheduled_now = set()
        for request in self._decodes():
            if len(work) >= self.config.max_batch_size:
                break
            work.append((request, 1))
            self._scheduled_now.add(request.request_id)
            budget -= 1
        self._plan_prefills(work, budget)
        work = [(r, n) for r, n in work if r.status is RequestStatus.RUNNING]
        if not work:
            return None
        sequences = tuple(self._scheduled(request, n) for request, n in work)
        plan = StepPlan(step_id=self._step_id, sequences=sequences,
                        finished_request_ids=tuple(self._finished_since_last_plan))
        self._step_id += 1
        self._finished_since_last_plan.clear()
        return plan

    def _decodes(self) -> Iterator[Request]:
        """Running requests whose prompt is computed, each with a KV slot for one more token (preempting
        the policy's victims when the pool runs short)."""
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.num_uncomputed != 1:
                continue
            if self._make_room(request, 1):
                yield request

    def _make_room(self, request: Request, num_tokens: int) -> bool:
        """Preempt other running requests until ``request`` can append ``num_tokens``; False if it was
        itself the victim."""
        while not self.kv.can_append(request.request_id, num_tokens):
            candidates = [r for r in self.running if r.request_id not in self._scheduled_now or r is request]
            victim = max(candidates, key=self.policy.victim_key)
            self._preempt(victim)
            if victim is request:
                return False
        self.kv.append_slots(request.request_id, num_tokens)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.release_sequence(request.request_id, request.all_token_ids[: request.num_computed])
        self._finished_since_last_plan.append(request.request_id)  # the runner forgets its state
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.needs_reset = True
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)

    def _plan_prefills(self, work: list[tuple[Request, int]], budget: int) -> None:
        mode = self.config.prefill_mode
        prefills = 0
        in_progress = [r for r in self.running if r.num_uncomputed > 1]
        for request in in_progress:  # prefills already under way (chunked mode) come first
            if budget <= 0 or len(work) >= self.config.max_batch_size:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted while this step was being planned
            chunk = min(request.num_uncomputed, budget)
            if not self._make_room(request, chunk):
                continue
            work.append((request, chunk))
            self._scheduled_now.add(request.request_id)
            budget -= chunk
            prefills += 1
        for request in self.policy.order(self.waiting):
            if len(work) >= self.config.max_batch_size or (mode == "monolithic" and prefills >= 1):
                break
            chunk = self._admit(request, budget, first_in_step=not work)
            if chunk is None:
                break
            work.append((request, chunk))
            self._scheduled_now.add(request.request_id)
            budget -= chunk
            prefills += 1
            if budget <= 0:
                break

    def _admit(self, request: Request, budget: int, first_in_step: bool) -> int | None:
        """Start a waiting request with the chunk it gets this step, or None (it stays waiting)."""
        self.kv.start_sequence(request.request_id, request.all_token_ids, request.extra_key)
        cached = self.kv.num_tokens(request.request_id)
        remaining = request.num_tokens - cached
        whole_prompt = self.config.prefill_mode != "chunked"
        chunk = remaining if whole_prompt else min(remaining, budget)
        fits_budget = chunk <= budget or (whole_prompt and first_in_step)
        cap = self.config.max_active_kv_tokens
        alone = first_in_step and not self.running
        fits_cap = cap == 0 or alone or self.active_kv_tokens() + request.num_tokens <= cap
        if chunk <= 0 or not fits_budget or not fits_cap or not self.kv.can_append(request.request_id, chunk):
            self.kv.release_sequence(request.request_id)
            return None
        self.kv.append_slots(request.request_id, chunk)
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed = cached
        if not request.started:
            request.num_cached_prompt_tokens = min(cached, len(request.prompt_ids))
        request.started = True
        request.needs_reset = True
        return chunk

    def _scheduled(self, request: Request, num_tokens: int) -> ScheduledSequence:
        start = request.num_computed
        tables = self.kv.block_tables(request.request_id)
        groups = (tables.full, tables.sliding) if self.kv.sliding_pool is not None else (tables.full,)
        sequence = ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_tokens],
            cached_len=start,
            block_tables=groups,
            sample=start + num_tokens == request.num_tokens,
            sampling=request.params,
            reset=request.needs_reset,
            prompt_len=len(request.prompt_ids),
        )
        prompt_part = max(0, min(start + num_tokens, len(request.prompt_ids)) - start)
        self.policy.charge(request, prompt_part, num_tokens - prompt_part)
        request.num_computed += num_tokens
        request.needs_reset = False
        return sequence

    # -- results -------------------------------------------------------------------------------------
    def on_step_result(self, result: StepResult) -> list[RequestUpdate]:
        """Append sampled tokens; returns one update per request that got a token or finished."""
        updates = []
        for sampled in result.tokens:
            request = self.requests.get(sampled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.output_ids.append(sampled.token_id)
            text = request.detokenizer.add_token(sampled.token_id) if request.detokenizer else ""
            stop = request.stop_checker.update(sampled.token_id, text) if request.stop_checker else None
            emitted = stop.text if stop is not None else text
            token = TokenOutput(sampled.token_id, emitted, sampled.logprob, sampled.top_logprobs)
            if stop is not None and stop.finished:
                updates.append(self._finish(request, stop.finish_reason, stop_reason=stop.stop_reason,
                                            tokens=(token,)))
            else:
                updates.append(RequestUpdate(request_id=request.request_id, tokens=(token,)))
        return updates

    def check_integrity(self) -> None:
        """Scheduler and KV manager agree: exactly the running requests hold KV sequences."""
        self.kv.check_integrity()
        running_ids = {r.request_id for r in self.running}
        assert self.kv.num_sequences == len(running_ids), (self.kv.num_sequences, running_ids)
        for r in self.running:
            assert r.request_id in self.kv and r.status is RequestStatus.RUNNING
        for r in self.waiting:
            assert r.request_id not in self.kv and r.status is RequestStatus.WAITING
