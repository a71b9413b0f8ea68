"""The step runner: one forward over a mixed batch of prefill chunks and decodes, then batched sampling.

It owns the model, the paged KV storage and the per-request sampling state (seeded generators and the token
history penalties read). It is synchronous and trio-free: the executor actor calls it in its worker thread.
Attention and KV-store implementations and the model's ops table (``architectures.ops``, bound to the model here)
are injected, so the Triton kernels and CUDA graphs of the CUDA backend plug in behind the same contract.

A step is ``launch`` then ``collect`` (``execute`` does both). ``launch`` queues the whole step on the device
(inputs, forward, sampling, and the copy of the sampled tokens to pinned host memory) and returns without
waiting for it; ``collect`` waits for that copy (an event wait, GIL released) and builds the ``StepResult``.
Between the two the host is free, so the executor launches step N+1 before it collects step N (overlap):
a plan's ``PENDING_TOKEN`` is then replaced on the device by the token the previous launched step sampled for
that request (``_resolve_pending``). The only host syncs inside ``launch`` are prompt logprobs, and penalties
or bad words of several tokens on a row whose previous token is still in flight (its history is read on the
host: ``_fill_awaiting``).

A step with constrained rows (structured output) queues its forward and head, then hands the rest of its
sampling to the runner's sampling thread (``_masked_sample``) and returns: that thread waits for the previous
step's tokens (those still pending on the device), advances the rows' grammars, fills their masks
(``grammar_masks``), copies them to the device and queues the masked sampling, while the device runs the
forward and the executor collects the previous step and the scheduler plans the next one. The next ``launch``
(and this step's ``collect``) waits for that job first (``_join_sampling``), so nothing of the next step is
queued before this step's sampling, and the job shares no state with the launch thread but the grammar states
it owns until then. Unconstrained rows are never masked; a step without constrained rows has no job.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import attrs
import numpy as np
import torch

from inference_server.backends.cpu_threads import CpuThreads
from inference_server.backends.grammar_masks import BitmaskFiller, GrammarState
from inference_server.backends.paged_kv import PagedAttentionContext, PagedKVStorage, StepTensors
from inference_server.backends.sampler import (
    PenaltyHistory,
    SamplingBatch,
    argmax_suffices,
    greedy_sample,
    make_generator,
    sample,
    seed_for_position,
)
from inference_server.backends.step_layout import step_layout
from inference_server.backends.transfer import HostCopy, tensor_to_device, to_device
from inference_server.core.grammar_compiler import GrammarCompiler
from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.architectures.ops import REFERENCE_OPS, Ops, bind_ops
from inference_server.models.spec import ModelSpec
from inference_server.records.steps import (
    PromptLogprobsChunk,
    SampledToken,
    ScheduledSequence,
    StepPlan,
    StepResult,
)
from inference_server.telemetry import profiler_ranges

PROMPT_LOGPROB_ROWS = 64
"""Prompt positions whose full-vocabulary log-softmax is held at once: a [rows, vocab] fp32 block, 67 MB at
Gemma's 262k vocabulary (a 2048-token lm-eval prompt takes 32 blocks)."""


@attrs.define
class _RequestState:
    """What the runner remembers of a request between steps: every token fed to the model so far (the
    prompt's first ``prompt_len``, then outputs, since each sampled token is fed back) and its generator."""

    prompt_len: int
    token_ids: list[int]
    generator: torch.Generator | None
    awaiting: bool = False  # the last token fed was PENDING_TOKEN: appended when its step is collected
    grammar: GrammarState | None = None  # a constrained request's matcher (``grammar_masks``)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


class ModelRunner:
    """Runs ``StepPlan``s on one model. Not thread-safe: one caller at a time (the executor's thread). Steps
    are collected in launch order, at most one launched ahead."""

    def __init__(self, model: CausalLM, spec: ModelSpec, storage: PagedKVStorage, device: torch.device,
                 *, ops: Ops = REFERENCE_OPS, attention_kwargs: dict | None = None,
                 deterministic: bool = False) -> None:
        self.model = model
        self.ops = ops
        """The table the model computes through, bound to it once here (the CPU engine's: the reference with its int8
        matmul; the CUDA runner's: ``op_table.cuda_ops``)."""
        bind_ops(model, ops)
        self.spec = spec
        self.storage = storage
        self.device = device
        self.block_size = storage.block_size
        self.num_groups = max(storage.num_blocks) + 1
        self.attention_kwargs = attention_kwargs or {}
        self._init_step_state(device, deterministic=deterministic)

    def _init_step_state(self, device: torch.device, *, deterministic: bool = False) -> None:
        """What every runner keeps between steps, whatever runs its forward (the Hugging Face runner calls this
        instead of ``__init__``: it has no paged storage)."""
        self.device = device
        self.deterministic = deterministic
        """``DETERMINISTIC``: per-row sampling reductions (``sample(row_invariant=True)``), one CPU thread a step."""
        self._requests: dict[int, _RequestState] = {}
        self.tokens_computed = 0  # all tokens run through the model (tests count prefix-cache savings)
        # The last launched step's samples (device) and each sampling request's row in them: the source of
        # the next step's PENDING_TOKENs.
        self._previous_tokens = torch.empty(0, dtype=torch.int64, device=device)
        self._previous_rows: dict[int, int] = {}
        self._last_launched: LaunchedStep | None = None
        self.grammar: GrammarCompiler | None = None
        """Compiles constrained requests' grammars (set by the engine factory; None: no request is constrained)."""
        self._bitmasks: BitmaskFiller | None = None
        self._sampling_thread: ThreadPoolExecutor | None = None  # constrained steps' sampling (``_masked_sample``)
        self._pending_sample: Future[tuple[torch.Tensor, HostCopy]] | None = None  # the last one, until joined
        # per-step intra-op thread count, measured; DETERMINISTIC runs every step on one thread: torch's CPU
        # reductions split a long row across threads, so the thread count is part of a row's summation order
        self._cpu_threads = CpuThreads(default=1 if deterministic else None) if device.type == "cpu" else None

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of final hidden states [N, H] (the Hugging Face runner applies its model's head)."""
        return self.model.compute_logits(hidden)

    def _greedy_head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hook for a fused greedy head: ``(token_ids [N] int64, logprobs [N] f32)`` of final hidden states
        [N, H], equal to ``sample(compute_logits(hidden), all-greedy batch)``'s, or None to take that path.
        Called only when ``sampler.argmax_suffices`` holds for every row. The reference runner's is the logits and
        ``sampler.greedy_sample`` (the sampler's ops, without the batch's parameters); the CUDA runner's one kernel
        pass over the head."""
        return greedy_sample(self._compute_logits(hidden), row_invariant=self.deterministic)

    # -- state ---------------------------------------------------------------------------------------
    def _state_for(self, seq: ScheduledSequence) -> _RequestState:
        state = self._requests.get(seq.request_id)
        if state is None or seq.reset:
            generator = state.generator if state is not None else None  # re-seeded per token (seed_for_position)
            if generator is None and seq.sampling.seed is not None:
                generator = make_generator(seq.sampling.seed, self.device)
            state = _RequestState(prompt_len=seq.prompt_len, token_ids=list(seq.history), generator=generator,
                                  grammar=self._grammar_state(seq))
            self._requests[seq.request_id] = state
        if seq.pending:
            state.token_ids.extend(seq.token_ids[:-1])
            state.awaiting = True
        else:
            state.token_ids.extend(seq.token_ids)
        return state

    def _grammar_state(self, seq: ScheduledSequence) -> GrammarState | None:
        """A constrained request's matcher in its start state (compiled at admission: a cache hit, or a
        recompile of an evicted entry that compiled before)."""
        constraint = seq.sampling.constraint
        if constraint is None:
            return None
        if self.grammar is None:
            raise ValueError(f"request {seq.request_id} is constrained but the runner has no GrammarCompiler")
        return GrammarState.start(self.grammar.compile(constraint))

    def _grammar_updates(self, states: Sequence[_RequestState], seqs: Sequence[ScheduledSequence],
                         previous_rows: dict[int, int]) -> list[_GrammarUpdate]:
        """What ``_masked_sample`` feeds each constrained row's grammar before its mask: the output tokens the
        host holds past ``consumed``, and the row of the previous launched step's samples holding the token still
        pending (None when none is). Read here, in the launch thread, so the job never reads ``token_ids``."""
        updates = []
        for j, (state, seq) in enumerate(zip(states, seqs, strict=True)):
            if state.grammar is not None:
                known = state.output_ids[state.grammar.consumed:]
                pending = previous_rows.get(seq.request_id) if state.awaiting else None
                updates.append(_GrammarUpdate(state.grammar, j, known, pending))
        return updates

    def _masked_sample(self, logits: torch.Tensor, batch: SamplingBatch, history: PenaltyHistory | None,
                       updates: list[_GrammarUpdate], previous: LaunchedSamples | None,
                       ) -> tuple[torch.Tensor, HostCopy]:
        """The sampling thread's job for one step with constrained rows (see the module docstring): the sampled
        token ids (device) and their copy to the host."""
        with torch.inference_mode(), _on_device(self.device):
            pending = previous.token_ids() if previous is not None and any(
                u.pending is not None for u in updates) else []  # waits for the previous step's tokens
            assert self._bitmasks is not None
            self._bitmasks.advance([(u.state, u.known if u.pending is None else [*u.known, pending[u.pending]])
                                    for u in updates])
            bits, rows = self._bitmasks.fill([(u.state, u.row) for u in updates])
            out = sample(logits, batch, history, bits, rows, row_invariant=self.deterministic)
            tensors = [out.token_ids, out.logprobs]
            if out.top_logprobs is not None:
                tensors += [out.top_logprobs.token_ids, out.top_logprobs.logprobs]
            return out.token_ids, HostCopy(tensors)

    def _join_sampling(self) -> None:
        """Wait for the last constrained step's sampling job (its sampling is queued once it returns)."""
        job, self._pending_sample = self._pending_sample, None
        if job is not None:
            self._previous_tokens = job.result()[0]

    def forget(self, request_ids: tuple[int, ...]) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    # -- tensors -------------------------------------------------------------------------------------
    def _step_tensors(self, plan: StepPlan) -> StepTensors:
        """The step's positions, query offsets, context lengths, padded block tables and slot mappings.

        Vectorised (numpy over every token at once, ``step_layout``): a 2048-token prefill step costs a few
        Python operations per sequence, not a Python loop over every token of every group."""
        layout = step_layout(plan.sequences, self.num_groups, self.block_size)

        def device_copy(array: np.ndarray) -> torch.Tensor:
            return to_device(torch.from_numpy(array), self.device)

        return StepTensors(
            positions=device_copy(layout.positions),
            cu_seqlens_q=device_copy(layout.cu_seqlens_q),
            context_lens=device_copy(layout.context_lens),
            block_tables={g: device_copy(t) for g, t in enumerate(layout.block_tables)},
            slot_mappings={g: device_copy(s) for g, s in enumerate(layout.slot_mappings)},
            is_decode_only=all(len(seq.token_ids) == 1 for seq in plan.sequences),
        )

    def _input_ids(self, plan: StepPlan) -> torch.Tensor:
        """The step's token ids [T] on the device, pending tokens substituted."""
        flat = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in plan.sequences), np.int64,
                           plan.num_tokens)
        ids = to_device(torch.from_numpy(flat), self.device)
        self._resolve_pending(ids, plan)
        return ids

    def _resolve_pending(self, ids: torch.Tensor, plan: StepPlan) -> None:
        """Replace each sequence's ``PENDING_TOKEN`` (always its last token) in ``ids`` [T] with the token the
        previous launched step sampled for the request, on the device (no host sync)."""
        rows, sources, end = [], [], 0
        for seq in plan.sequences:
            end += len(seq.token_ids)
            if seq.pending:
                rows.append(end - 1)
                sources.append(self._previous_rows[seq.request_id])
        if rows:
            index = tensor_to_device([rows, sources], torch.int64, self.device)  # [2, n]
            ids.index_copy_(0, index[0], self._previous_tokens.index_select(0, index[1]))

    # -- the step ------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; returns a sampled token for every sequence with ``sample`` set."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue one step on the device (see the module docstring); ``collect`` returns its result."""
        started = time.perf_counter()
        self._join_sampling()
        self.forget(plan.finished_request_ids)
        states = [self._state_for(seq) for seq in plan.sequences]
        samples: LaunchedSamples | None = None
        prompt_logprobs: tuple[PromptLogprobsChunk, ...] = ()
        if plan.sequences:
            if self._cpu_threads is not None:
                self._cpu_threads.apply(plan.num_tokens)
            hidden = self._forward(plan)  # [T or bucket, H]
            with profiler_ranges.phase("sample", plan.step_id):
                samples = self._sample(plan, states, hidden)
                prompt_logprobs = self._prompt_logprobs(plan, hidden)  # rows in plan order either way
            self.tokens_computed += plan.num_tokens
            if self._cpu_threads is not None:  # a CPU step has run to its end here (but a constrained step's
                # sampling, on the sampling thread): its time picks the count
                self._cpu_threads.record(plan.num_tokens, time.perf_counter() - started)
        launched = LaunchedStep(plan, started, samples, prompt_logprobs)
        self._last_launched = launched
        return launched

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens and return its result."""
        plan = launched.plan
        tokens: tuple[SampledToken, ...] = ()
        if launched.samples is not None:
            tokens = launched.samples.tokens()
            for token in tokens:
                state = self._requests.get(token.request_id)
                if state is not None and state.awaiting:
                    state.token_ids.append(token.token_id)
                    state.awaiting = False
        return StepResult(step_id=plan.step_id, tokens=tokens, num_computed_tokens=plan.num_tokens,
                          seconds=time.perf_counter() - launched.started, prompt_logprobs=launched.prompt_logprobs)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Stage the step's inputs and run the model; hidden states [T, H] (the CUDA runner may return more
        rows: the sampled rows are always found at the same offsets)."""
        with profiler_ranges.phase("stage", plan.step_id):
            step = self._step_tensors(plan)
            ids = self._input_ids(plan)
            ctx = PagedAttentionContext(self.storage, step, **self.attention_kwargs)
        with profiler_ranges.phase("forward", plan.step_id):
            return self.model(ids, ctx)  # [T, H]

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> tuple[PromptLogprobsChunk, ...]:
        """Log-softmax (fp32, raw logits: no temperature or penalties, as vLLM) at the prompt positions the
        plan asks for, and only those; each sequence's rows start at its chunk's first row."""
        chunks = []
        offset = 0
        for seq in plan.sequences:
            targets = seq.prompt_logprob_targets
            if targets:
                logprobs: list[float] = []
                tops: list[tuple[tuple[int, float], ...]] = []
                for begin in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                    rows = hidden[offset + begin:offset + min(begin + PROMPT_LOGPROB_ROWS, len(targets))]
                    block = torch.log_softmax(self._compute_logits(rows).float(), dim=-1)
                    ids = torch.tensor(targets[begin:begin + len(rows)], dtype=torch.int64, device=block.device)
                    logprobs.extend(block.gather(1, ids[:, None])[:, 0].tolist())
                    if seq.prompt_logprobs_top:
                        values, indices = block.topk(seq.prompt_logprobs_top, dim=-1)
                        tops.extend(tuple(zip(i, v, strict=True))
                                    for i, v in zip(indices.tolist(), values.tolist(), strict=True))
                chunks.append(PromptLogprobsChunk(seq.request_id, seq.cached_len + 1, tuple(logprobs), tuple(tops)))
            offset += len(seq.token_ids)
        return tuple(chunks)

    def _sample(self, plan: StepPlan, states: list[_RequestState], hidden: torch.Tensor) -> LaunchedSamples | None:
        rows, ends, total = [], [], 0
        for i, seq in enumerate(plan.sequences):
            total += len(seq.token_ids)
            if seq.sample:
                rows.append(i)
                ends.append(total - 1)
        previous_rows, self._previous_rows = self._previous_rows, {}
        if not rows:
            return None
        if ends[-1] == len(ends) - 1:  # every row samples its only token (a decode step): no gather
            last_hidden = hidden[: len(ends)]
        else:
            last_hidden = hidden[tensor_to_device(ends, torch.int64, hidden.device)]
        seqs = [plan.sequences[i] for i in rows]
        lens = output_lens(seqs)
        fused = self._greedy_head(last_hidden) if argmax_suffices([s.sampling for s in seqs], lens) else None
        if fused is not None:  # every row greedy and asking for nothing else: no [N, V] logits
            self._previous_tokens = fused[0]
            self._previous_rows = {seq.request_id: j for j, seq in enumerate(seqs)}
            return LaunchedSamples(tuple(seqs), HostCopy(list(fused)))
        logits = self._compute_logits(last_hidden)  # [N, V]
        generators = [states[i].generator for i in rows]
        for generator, seq, index in zip(generators, seqs, lens, strict=True):
            if generator is not None and seq.sampling.seed is not None:
                generator.manual_seed(seed_for_position(seq.sampling.seed, index))
        outputs = None
        # bad words of several tokens: bans follow the output (the empty-tuple test first: this runs every step)
        if any(s.sampling.bad_words_token_ids and s.sampling.bans_after_prefixes for s in seqs):
            if any(states[i].awaiting for i in rows):
                self._fill_awaiting()
            outputs = [states[i].output_ids for i in rows]
        batch = SamplingBatch.from_params([s.sampling for s in seqs], self.device, generators, lens, outputs)
        history = None
        if batch.use_penalties:
            if any(states[i].awaiting for i in rows):
                self._fill_awaiting()
            history = PenaltyHistory.from_lists([states[i].prompt_ids for i in rows],
                                                [states[i].output_ids for i in rows], self.device)
        self._previous_rows = {seq.request_id: j for j, seq in enumerate(seqs)}
        updates = self._grammar_updates([states[i] for i in rows], seqs, previous_rows)
        if updates:
            if self._bitmasks is None:
                assert self.grammar is not None
                self._bitmasks = BitmaskFiller(self.grammar.vocab_size, self.grammar.eos_token_ids, self.device)
            if self._sampling_thread is None:
                self._sampling_thread = ThreadPoolExecutor(  # DETERMINISTIC: one CPU thread there too
                    1, thread_name_prefix="constrained-sampling",
                    initializer=_one_thread if self.deterministic else None)
            previous = self._last_launched.samples if self._last_launched is not None else None
            job = self._sampling_thread.submit(self._masked_sample, logits, batch, history, updates, previous)
            self._pending_sample = job
            return LaunchedSamples(tuple(seqs), _JobCopy(job))
        out = sample(logits, batch, history, row_invariant=self.deterministic)
        self._previous_tokens = out.token_ids
        tensors = [out.token_ids, out.logprobs]
        if out.top_logprobs is not None:
            tensors += [out.top_logprobs.token_ids, out.top_logprobs.logprobs]
        return LaunchedSamples(tuple(seqs), HostCopy(tensors))

    def _fill_awaiting(self) -> None:
        """Append the previous launched step's tokens to the histories still awaiting them (waits for it)."""
        previous = self._last_launched
        if previous is None or previous.samples is None:
            return
        for token in previous.samples.tokens():
            state = self._requests.get(token.request_id)
            if state is not None and state.awaiting:
                state.token_ids.append(token.token_id)
                state.awaiting = False


@attrs.frozen(eq=False)
class _GrammarUpdate:
    """One constrained row of a step, for ``_masked_sample``: its grammar, its row in the step's samples, the
    output tokens past ``state.consumed`` the host already holds, and the row of the previous step's samples
    holding its pending token (None: no token pending)."""

    state: GrammarState
    row: int
    known: list[int]
    pending: int | None


class _JobCopy:
    """A constrained step's ``HostCopy``, from its sampling job (``ready`` waits for the job, then the copy)."""

    def __init__(self, job: Future[tuple[torch.Tensor, HostCopy]]) -> None:
        self.job = job

    def ready(self) -> list[torch.Tensor]:
        return self.job.result()[1].ready()


def _one_thread() -> None:
    """Run the calling thread's torch CPU ops on one thread (the count is per thread under OpenMP)."""
    torch.set_num_threads(1)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.device(device)`` on a CUDA device, else nothing (a thread's current device is its own)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@attrs.frozen(eq=False)
class LaunchedSamples:
    """One launched step's sampled rows: their sequences, and the tokens on their way to the host."""

    sequences: tuple[ScheduledSequence, ...]
    copy: HostCopy | _JobCopy  # token ids [N], logprobs [N], then top ids and logprobs [N, k] when asked for

    def token_ids(self) -> list[int]:
        """The sampled token ids, row by row (waits for the copy)."""
        return self.copy.ready()[0].tolist()

    def tokens(self) -> tuple[SampledToken, ...]:
        """The sampled tokens (waits for the copy)."""
        host = self.copy.ready()
        token_ids, logprobs = host[0].tolist(), host[1].tolist()
        top = (host[2].tolist(), host[3].tolist()) if len(host) > 2 else None
        result = []
        for j, seq in enumerate(self.sequences):
            n_top = seq.sampling.logprobs or 0
            pairs = tuple(zip(top[0][j][:n_top], top[1][j][:n_top], strict=True)) if top and n_top else ()
            result.append(SampledToken(seq.request_id, token_ids[j], logprobs[j], pairs))
        return tuple(result)


@attrs.frozen(eq=False)
class LaunchedStep:
    """A step queued on the device: what ``ModelRunner.collect`` needs to finish it."""

    plan: StepPlan
    started: float  # perf_counter at launch (the result's ``seconds`` run from here to collection)
    samples: LaunchedSamples | None
    prompt_logprobs: tuple[PromptLogprobsChunk, ...]


def output_lens(seqs: Sequence[ScheduledSequence]) -> list[int]:
    """Tokens each sampled sequence has output before this step's token (what ``min_tokens`` counts)."""
    return [max(0, s.cached_len + len(s.token_ids) - s.prompt_len) for s in seqs]
