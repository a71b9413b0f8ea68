"""Iteration-level continuous batching: which tokens of which requests the next step computes.

Each call to ``schedule`` builds one ``StepPlan`` under a token budget (``max_num_batched_tokens``) and a
sequence cap (``max_batch_size``): running decodes first, then prefill work in the order the policy gives. A
step with no decodes takes the larger ``max_prefill_tokens``: no stream's inter-token latency waits on it. So does
a step while more requests wait for their first token than are decoding (a burst of arrivals): then the larger,
more efficient steps shorten more requests' wait than they lengthen streams' inter-token gaps.
A request that finishes frees its slot and KV at once, so the very next plan refills it.

Holding a burst: the backlog rule alone would drop a burst to ``max_num_batched_tokens`` once its first prompts,
now decoding, outnumber the ones still waiting, so the burst's last requests would wait many small steps (its p99
TTFT). So the step at which a backlog first takes the prefill budget beside decodes begins a burst: its members are
the requests held then without a first token (waiting, or running and still prefilling), and ``_burst_through`` is
their largest arrival index. Every step keeps ``prefill_step_tokens`` until each request with an arrival index up to
``_burst_through`` has its first token (the step computing its prompt's last token has been planned) or has ended;
then the burst ends. Later arrivals (larger indexes) do not extend it; a member preempted before its first token
arrived counts again; one preempted after keeps it (its recompute is not a wait for a first token). One prompt
arriving beside decoding streams is no burst (a backlog of one does not outnumber the decodes): it keeps the small
budget. The cost is the streams' inter-token gap for the burst's length.

Prefill modes (``PREFILL_MODE``):

* ``monolithic``: at most one prompt per step, prefilled whole, beside the running decodes.
* ``batched``: as many whole prompts as fit in the budget (one prompt larger than the budget goes alone).
* ``chunked``: prompts are cut into chunks that fill the budget left after the decodes, so a long prompt
  never stalls running decodes for more than one step's budget.

Under KV pressure a running request is preempted by recompute: the KV allocator releases its blocks and it
goes back to the waiting queue with its original arrival index, so it keeps its place.

The scheduler never touches blocks: ``demand`` describes what the next step wants, the KV allocator (the
sole owner of blocks, ``core/kv_grants.py``) answers with a ``StepGrant``, and ``apply_grant`` turns that
into the ``StepPlan``. Every path that ends a running request (finish, abort, timeout, failure) puts its
sequence on the release list of the next demand exactly once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Set as AbstractSet

import attrs

from inference_server.core.kv_grants import Demand, StepDemand, StepGrant
from inference_server.core.kv_manager import KVManager
from inference_server.core.policies import SchedulingPolicy, session_of
from inference_server.core.request import Request, RequestStatus
from inference_server.core.stop_checker import ends_after_last_token
from inference_server.records.requests import FinishReason, PromptTokenLogprob, RequestUpdate, TokenOutput
from inference_server.records.steps import (
    PENDING_TOKEN,
    PromptLogprobsChunk,
    ScheduledSequence,
    StepPlan,
    StepResult,
)

PREFILL_MODES = ("monolithic", "chunked", "batched")


@attrs.frozen
class SchedulerConfig:
    max_batch_size: int = 256
    max_num_batched_tokens: int = 2048
    max_prefill_tokens: int = 0  # budget of a step without decodes; 0 (or less): max_num_batched_tokens
    prefill_mode: str = "chunked"
    max_active_kv_tokens: int = 0  # 0 = no cap beyond the pool itself

    @property
    def prefill_step_tokens(self) -> int:
        """The token budget of a step that carries no decodes: nothing's inter-token latency waits on it, so it
        may be longer, and a long prompt alone is prefilled in fewer, larger (more efficient) chunks."""
        return max(self.max_num_batched_tokens, self.max_prefill_tokens)

    def __attrs_post_init__(self) -> None:
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {self.prefill_mode!r}")


class Scheduler:
    """Owns waiting and running requests; trio-free and deterministic (tests drive it step by step)."""

    def __init__(self, config: SchedulerConfig, policy: SchedulingPolicy) -> None:
        self.config = config
        self.policy = policy
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._releases: list[tuple[int, tuple[int, ...] | None]] = []
        self._forget: list[int] = []
        self._step_id = 0
        self.num_preemptions = 0
        self.last_finished: dict[int, Request] = {}  # requests ended since the last demand (for reporting)
        self.waiting_prompt_tokens = 0  # prompt tokens of the waiting requests (the overload check reads it)
        self.last_started: list[int] = []  # requests the last plan started (or restarted after preemption)
        self._decode_demands: dict[int, Demand] = {}  # a running request's decode demand never changes
        # Requests held per session, kept as they come and go: ``active_sessions`` is asked on every arrival, and
        # collecting it from every request held made each arrival cost as much as the requests held.
        self._session_counts: Counter[str] = Counter()
        # The burst being held (module docstring): its largest arrival index, None when no burst is held, and the
        # ids of its requests still without a first token (planned). Kept as requests are planned, preempted and end,
        # so a step asks only whether the set is empty: ``demand`` runs every step beside hundreds of running requests.
        # Invariant (``check_integrity``): with ``_burst_through`` set, the set is exactly the held requests with an
        # arrival index up to it that have no first token, and it is not empty; else empty.
        self._burst_through: int | None = None
        self._burst_pending: set[int] = set()
        # True once a scan for a burst's members found none, until a request that may lack a first token appears
        # (an arrival, a preemption that drops a first token in flight): a backlog of recomputes after preemptions
        # (KV thrash) then costs no scan of every held request each step. Invariant (``check_integrity``): while
        # True, no held request lacks a first token.
        self._no_burst_members = False

    # -- queries -------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_pending_releases(self) -> bool:
        """Ended requests whose KV release or runner state has not been sent with a step yet."""
        return bool(self._releases or self._forget)

    @property
    def next_step_id(self) -> int:
        """The id the next plan will carry (profiler ranges name the step before it is planned)."""
        return self._step_id

    def active_sessions(self) -> AbstractSet[str]:
        """The sessions of the requests held (waiting or running): a live view, not a copy."""
        return self._session_counts.keys()

    # -- request lifecycle ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} already added")
        self.policy.on_arrival(request, self.active_sessions())
        self.requests[request.request_id] = request
        self._session_counts[session_of(request)] += 1
        self.waiting.append(request)
        self.waiting_prompt_tokens += len(request.prompt_ids)
        self._no_burst_members = False
        if self._burst_through is not None and request.arrival_index <= self._burst_through:
            self._burst_pending.add(request.request_id)  # only out of order (tests): arrivals come after a burst

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
            self._releases.append((request.request_id, request.all_token_ids[: request.num_computed]))
            self._forget.append(request.request_id)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            self.waiting_prompt_tokens -= len(request.prompt_ids)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        if self._burst_pending:
            self._burst_member_served(request.request_id)  # ended: it waits no longer
        session = session_of(request)
        self._session_counts[session] -= 1
        if not self._session_counts[session]:
            del self._session_counts[session]
        self.last_finished[request.request_id] = request
        return RequestUpdate(
            request_id=request.request_id, tokens=tokens, finish_reason=reason, stop_reason=stop_reason,
            error=error, prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.output_ids),
            cached_prompt_tokens=request.num_cached_prompt_tokens,
        )

    # -- planning ------------------------------------------------------------------------------------
    def demand(self) -> StepDemand:
        """What the next step wants from the KV allocator (and the sequences to release first). Its token budget
        may begin holding a burst (``_token_budget``)."""
        whole = self.config.prefill_mode != "chunked"
        decodes: list[Demand] = []
        prefills: list[Demand] = []
        decode_demands = self._decode_demands
        for r in self.running:  # one pass: this runs for every running request every step
            uncomputed = r.num_uncomputed
            if uncomputed == 1:
                if not (r.num_in_flight and self._finishes_in_flight(r)):
                    decode = decode_demands.get(r.request_id)
                    if decode is None:
                        decode = decode_demands[r.request_id] = Demand(r.request_id, new=False, num_tokens=1)
                    decodes.append(decode)
            elif uncomputed > 1:
                prefills.append(Demand(r.request_id, new=False, num_tokens=uncomputed, whole=whole))
        # Only as many candidates as there are free sequence slots (building their token tuples costs
        # time proportional to their length, so a long waiting queue is not copied every step).
        free_slots = max(0, self.config.max_batch_size - len(decodes) - len(prefills))
        admissions = [Demand(r.request_id, new=True, num_tokens=r.num_tokens, tokens=r.all_token_ids,
                             extra_key=r.extra_key, whole=whole, use_prefix_cache=not r.needs_prompt_logprobs)
                      for r in self._admissible()[:free_slots]]
        self.last_finished.clear()
        demand = StepDemand(
            releases=tuple(self._releases), items=tuple(decodes + prefills + admissions),
            victims=self._victims(tuple(self.running)),
            token_budget=self._token_budget(len(decodes), len(prefills) + len(self.waiting)),
            max_sequences=self.config.max_batch_size,
            max_new=1 if self.config.prefill_mode == "monolithic" else None,
        )
        self._releases.clear()
        return demand

    def _token_budget(self, num_decodes: int, num_backlog: int) -> int:
        """The step's token budget: ``prefill_step_tokens`` when nothing decodes, when more requests wait for their
        first token (``num_backlog``: waiting, or prefilling) than are decoding, or while a burst is held; else
        ``max_num_batched_tokens``, so that a stream's inter-token gap stays one small step while a prompt or two
        arrive.

        A step that takes the prefill budget for a backlog beside decodes begins a burst (``_begin_burst``), and
        every step keeps ``prefill_step_tokens`` while one of the burst's requests still has no first token, even
        once the decodes outnumber the backlog: the burst's last requests then wait a few large steps instead of many
        small ones. Costs O(1) a step: the burst's members are counted once, when it begins, and leave the count as
        they are served (module docstring)."""
        if num_decodes == 0:
            return self.config.prefill_step_tokens
        if self._burst_pending:
            return self.config.prefill_step_tokens  # a burst is held
        if num_backlog > num_decodes:
            self._begin_burst()
            return self.config.prefill_step_tokens
        return self.config.max_num_batched_tokens

    def _begin_burst(self) -> None:
        """Hold the burst of the requests held now without a first token (waiting, or prefilling; not one
        recomputing after a preemption that came after its first token): O(requests held), once a burst, and once
        for a backlog without such requests (``_no_burst_members``) until one may have appeared."""
        if self._no_burst_members:
            return
        members = [r for r in self.requests.values() if self._lacks_first_token(r)]
        if members:
            self._burst_through = max(r.arrival_index for r in members)
            self._burst_pending = {r.request_id for r in members}
        else:
            self._no_burst_members = True

    @staticmethod
    def _lacks_first_token(request: Request) -> bool:
        """Whether no step planned so far samples the request's first token, and none was received: a step that
        computes its prompt's last token samples it (in flight until it arrives, then an output)."""
        return not request.output_ids and request.num_in_flight == 0

    def _burst_member_served(self, request_id: int) -> None:
        """``request_id`` has its first token planned, or ended: it no longer holds the burst; the burst ends with
        its last member."""
        self._burst_pending.discard(request_id)
        if not self._burst_pending:
            self._burst_through = None

    def _victims(self, running: tuple[Request, ...]) -> Callable[[], tuple[int, ...]]:
        """The preemption order of ``running`` (largest victim key first), computed only if the allocator
        asks: most steps preempt nothing, and sorting every running request each step costs time."""
        def victims() -> tuple[int, ...]:
            return tuple(r.request_id for r in sorted(running, key=self.policy.victim_key, reverse=True))
        return victims

    @staticmethod
    def _finishes_in_flight(request: Request) -> bool:
        """Whether the token in flight is the request's last by ``max_tokens`` (overlap): then no step is
        planned for it, so a request that ends by length costs no wasted token. (One that ends on a stop
        token or string does: the step planned before its last token arrived computes one more.)"""
        return request.num_in_flight > 0 and request.num_outputs_planned >= request.params.resolved_max_tokens()

    def _admissible(self) -> list[Request]:
        """Waiting requests in policy order, cut where the active-KV-token cap would be exceeded.

        Each request reserves its whole possible length (prompt plus ``max_tokens``), so admitted requests
        can always grow to completion within the cap; the first one that does not fit stops admission
        (head of line), except that a lone request is always admitted.
        """
        ordered = self.policy.order(self.waiting)
        cap = self.config.max_active_kv_tokens
        if cap == 0:
            return ordered
        reserved = sum(r.max_length for r in self.running)
        admissible: list[Request] = []
        for request in ordered:
            if reserved + request.max_length > cap and (self.running or admissible):
                break
            reserved += request.max_length
            admissible.append(request)
        return admissible

    def apply_grant(self, grant: StepGrant) -> StepPlan | None:
        """Turn the allocator's grant into the next ``StepPlan`` (None when nothing was granted)."""
        for request_id in grant.preempted:
            self._preempted(self.requests[request_id])
        sequences = []
        started = self.last_started
        started.clear()
        requests = self.requests
        for g in grant.grants:
            request = requests[g.request_id]
            if request.status is RequestStatus.WAITING:
                self._started(request, g.start)
                started.append(request.request_id)
            sequences.append(self._scheduled(request, g.num_tokens, g.block_tables))
        forget = tuple(self._forget)
        self._forget.clear()
        for request_id in forget:  # ended or preempted: its decode demand is made afresh if it runs again
            self._decode_demands.pop(request_id, None)
        if not sequences and not forget:
            return None
        plan = StepPlan(step_id=self._step_id, sequences=tuple(sequences), finished_request_ids=forget)
        self._step_id += 1
        return plan

    def _preempted(self, request: Request) -> None:
        self.running.remove(request)
        self._forget.append(request.request_id)  # the runner drops its per-request state
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.num_in_flight = 0  # its step's sample is dropped on arrival (the request is not running)
        request.needs_reset = True
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self._lacks_first_token(request):  # its first token was in flight and is dropped: it waits again
            self._no_burst_members = False
            if self._burst_through is not None and request.arrival_index <= self._burst_through:
                self._burst_pending.add(request.request_id)
        self.waiting.append(request)
        self.waiting_prompt_tokens += len(request.prompt_ids)

    def _started(self, request: Request, cached: int) -> None:
        self.waiting.remove(request)
        self.waiting_prompt_tokens -= len(request.prompt_ids)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed = cached
        if not request.started:
            request.num_cached_prompt_tokens = min(cached, len(request.prompt_ids))
        request.started = True
        request.needs_reset = True

    def _scheduled(self, request: Request, num_tokens: int,
                   block_tables: tuple[tuple[int, ...], ...]) -> ScheduledSequence:
        start = request.num_computed
        prompt_len = len(request.prompt_ids)
        if num_tokens == 1 and start >= prompt_len and not request.needs_reset:
            return self._scheduled_decode(request, start, prompt_len, block_tables)
        return self._scheduled_general(request, num_tokens, block_tables)

    def _scheduled_general(self, request: Request, num_tokens: int,
                           block_tables: tuple[tuple[int, ...], ...]) -> ScheduledSequence:
        """Schedule ``num_tokens`` of ``request`` from ``num_computed`` on, whatever the chunk."""
        start = request.num_computed
        targets: tuple[int, ...] = ()
        if request.needs_prompt_logprobs:  # positions start .. score the prompt tokens after them
            targets = request.prompt_ids[start + 1:min(start + num_tokens + 1, len(request.prompt_ids))]
        sample = start + num_tokens == request.num_tokens
        sequence = ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.planned_token_ids(start, num_tokens),
            cached_len=start,
            block_tables=block_tables,
            sample=sample,
            sampling=request.params,
            reset=request.needs_reset,
            prompt_len=len(request.prompt_ids),
            prompt_logprob_targets=targets,
            prompt_logprobs_top=request.params.prompt_logprobs or 0,
            history=(request.token_slice(0, start) if request.needs_reset and request.params.needs_token_history
                     else ()),
        )
        prompt_part = max(0, min(start + num_tokens, len(request.prompt_ids)) - start)
        self.policy.charge(request, prompt_part, num_tokens - prompt_part)
        request.num_computed += num_tokens
        request.num_in_flight += sample
        request.needs_reset = False
        if sample and self._burst_pending:
            self._burst_member_served(request.request_id)  # this step samples its first token (or a later one)
        return sequence

    def _scheduled_decode(self, request: Request, start: int, prompt_len: int,
                          block_tables: tuple[tuple[int, ...], ...]) -> ScheduledSequence:
        """``_scheduled_general`` for one token past the prompt of a request already running (the common
        step), without its general machinery: no prompt logprob targets, no history, no reset, and the token
        is an output or in flight. Must give what ``_scheduled_general`` gives (tests/core/test_fast_paths)."""
        output_ids = request.output_ids
        index = start - prompt_len
        token = output_ids[index] if index < len(output_ids) else PENDING_TOKEN
        sample = start + 1 == prompt_len + len(output_ids) + request.num_in_flight
        params = request.params
        # Positional (a third cheaper than keywords; the fields' order is ScheduledSequence's): request_id,
        # token_ids, cached_len, block_tables, sample, sampling, reset, prompt_len, prompt_logprob_targets,
        # prompt_logprobs_top, history.
        sequence = ScheduledSequence(request.request_id, (token,), start, block_tables, sample, params, False,
                                     prompt_len, (), params.prompt_logprobs or 0, ())
        self.policy.charge(request, 0, 1)
        request.num_computed = start + 1
        request.num_in_flight += sample
        return sequence

    # -- results -------------------------------------------------------------------------------------
    def on_step_result(self, result: StepResult) -> list[RequestUpdate]:
        """Append sampled tokens; returns one update per request that got a token or finished.

        Runs once per token of every running request, on the event loop: the loop body keeps to what each
        token needs (prompt logprobs, scoring-only requests and finishes are the rare branches)."""
        for chunk in result.prompt_logprobs:
            self._add_prompt_logprobs(chunk)
        updates: list[RequestUpdate] = []
        append = updates.append
        requests = self.requests
        running = RequestStatus.RUNNING
        for sampled in result.tokens:
            request = requests.get(sampled.request_id)
            if request is None or request.status is not running:
                continue  # aborted or preempted while the step ran
            request.num_in_flight -= 1
            params = request.params
            prompt_logprobs = self._take_prompt_logprobs(request) if params.prompt_logprobs is not None else None
            if params.resolved_max_tokens() == 0:  # scoring only: the prompt was the work
                append(attrs.evolve(self._finish(request, "length"), prompt_logprobs=prompt_logprobs))
                continue
            token_id = sampled.token_id
            request.output_ids.append(token_id)
            text = request.detokenizer.add_token(token_id) if request.detokenizer is not None else ""
            stop = request.stop_checker.update(token_id, text) if request.stop_checker is not None else None
            if stop is None:
                token = TokenOutput(token_id, text, sampled.logprob, sampled.top_logprobs)
                update = RequestUpdate(request.request_id, (token,))
            elif stop.finish_reason is None:
                update = RequestUpdate(request.request_id,
                                       (TokenOutput(token_id, stop.text, sampled.logprob, sampled.top_logprobs),))
            else:
                text = stop.text
                if request.detokenizer is not None and ends_after_last_token(stop):
                    text += request.detokenizer.flush()  # an incomplete last character is not dropped
                token = TokenOutput(token_id, text, sampled.logprob, sampled.top_logprobs)
                update = self._finish(request, stop.finish_reason, stop_reason=stop.stop_reason, error=stop.error,
                                      tokens=(token,))
            append(attrs.evolve(update, prompt_logprobs=prompt_logprobs) if prompt_logprobs else update)
        return updates

    def _add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """File one step's prompt logprobs by position; positions already held (a request recomputed after
        preemption scores its prompt again) are skipped, so the list stays in prompt order."""
        request = self.requests.get(chunk.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return
        held = request.prompt_logprobs
        if not held:
            held.append(PromptTokenLogprob(request.prompt_ids[0], None))
        tops = chunk.top_logprobs or ((),) * len(chunk.token_logprobs)
        for i, (logprob, top) in enumerate(zip(chunk.token_logprobs, tops, strict=True)):
            position = chunk.first_position + i
            if position == len(held):
                held.append(PromptTokenLogprob(request.prompt_ids[position], logprob, top))

    def _take_prompt_logprobs(self, request: Request) -> tuple[PromptTokenLogprob, ...] | None:
        """The whole prompt's logprobs, once (with the request's first token), when they were asked for."""
        if request.params.prompt_logprobs is None or request.prompt_logprobs_sent:
            return None
        if not request.prompt_logprobs:  # a one-token prompt: nothing to score
            request.prompt_logprobs.append(PromptTokenLogprob(request.prompt_ids[0], None))
        request.prompt_logprobs_sent = True
        return tuple(request.prompt_logprobs)

    def check_integrity(self, kv: KVManager | None = None) -> None:
        """Internal consistency, and (given the allocator's manager after it applied every release)
        exactly the running requests hold KV sequences."""
        for r in self.running:
            assert r.status is RequestStatus.RUNNING and self.requests[r.request_id] is r
        for r in self.waiting:
            assert r.status is RequestStatus.WAITING and self.requests[r.request_id] is r
        assert len(self.running) + len(self.waiting) == len(self.requests)
        assert self.waiting_prompt_tokens == sum(len(r.prompt_ids) for r in self.waiting)
        assert self._session_counts == Counter(session_of(r) for r in self.requests.values())
        through = self._burst_through
        if through is None:
            assert not self._burst_pending
        else:
            assert self._burst_pending == {r.request_id for r in self.requests.values()
                                           if r.arrival_index <= through and self._lacks_first_token(r)}
            assert self._burst_pending, "a burst without members ended"
        if self._no_burst_members:
            assert not any(self._lacks_first_token(r) for r in self.requests.values())
        if kv is not None:
            kv.check_integrity()
            pending = {rid for rid, _ in self._releases}
            held = {r.request_id for r in self.running} | pending
            assert kv.num_sequences == len(held), (kv.num_sequences, held)
            for rid in held:
                assert rid in kv
