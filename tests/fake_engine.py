"""The fake engine: a deterministic stand-in for the model step, shared by the core, actor, HTTP, control-plane
and telemetry tests and by the bench's zero-cost servers.

A step answers every sampled sequence of the plan at once with ``token(length, last_token)``, where ``length`` is
the sequence's length after the step's tokens (``cached_len + len(token_ids)``). The same step runs two ways:

* ``execute(plan)``, synchronous: what a core-scheduler harness calls in place of the runner;
* ``await engine(plan)``, in the trio loop: an executor step function for ``EngineParts.step`` (it may wait on
  ``gate``, sleep ``step_seconds``, or raise from its ``fail_at``-th call on, counted from 0).

What the routes need on top (the HTTP kit's word engine, ``http_testkit.word_engine``, sets it): a sequence of
length ``eos_at_length`` gets ``eos_token_id`` and one of a length in ``token_at_length`` that token; a request
asking for ``logprobs`` gets that many alternatives (``token(length + k, last)``, logprob ``-0.5 (k + 1)``);
``prompt_logprobs`` answers the chunks that ask for prompt logprobs; ``use_sampler`` has the real sampler
(``backends.sampler``, CPU) pick the tokens over logits that favour the same tokens (the fake token 5.0, EOS 10.0
where due, the rest 0), so logit-editing fields change the output. A constrained request (structured output) gets
EOS as its first token: this engine cannot follow a grammar, so it ends the request the way a complete grammar
does; the embedded model's tests check constrained output.

``check_contiguous`` asserts that each request's chunks arrive in order without a gap (a new or reset request
may start anywhere), which is how the scheduler tests catch a plan that skips or repeats tokens. Servers that
run long (the HTTP kit, ``bench/http_overhead.py``) turn it and ``keep_plans`` off, so that
the step costs (next to) nothing and keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from inference_server.records.steps import PromptLogprobsChunk, SampledToken, ScheduledSequence, StepPlan, StepResult


def next_token(length: int, last_token: int) -> int:
    """The fake model: the next token depends on the sequence's length and its last token (ids 3..99)."""
    return (last_token * 31 + length * 7) % 97 + 3


@attrs.define(eq=False, slots=False)
class FakeEngine:
    """A deterministic step function (see the module docstring).

    ``plans`` records every plan stepped (``keep_plans``); ``steps`` counts the in-loop steps that got past
    ``gate`` and ``step_seconds``; ``tokens_computed`` counts the tokens stepped over (prompt chunks included) and
    ``tokens_emitted`` the sampled ones; ``progress`` is each running request's length so far
    (``check_contiguous``).
    """

    step_seconds: float = 0.0
    fail_at: int | None = None
    token: Callable[[int, int], int] = next_token
    logprob: float = -1.0
    check_contiguous: bool = True
    keep_plans: bool = True
    gate: trio.Event | None = None  # when set, in-loop steps wait for it (a stalled executor)
    eos_token_id: int = 1
    eos_at_length: int | None = None
    token_at_length: dict[int, int] = attrs.Factory(dict)
    prompt_logprobs: Callable[[StepPlan], tuple[PromptLogprobsChunk, ...]] | None = None
    use_sampler: bool = False
    vocab_size: int = 512  # the sampler's logits (use_sampler)
    plans: list[StepPlan] = attrs.Factory(list)
    progress: dict[int, int] = attrs.Factory(dict)
    steps: int = 0
    tokens_computed: int = 0
    tokens_emitted: int = 0

    def execute(self, plan: StepPlan) -> StepResult:
        """One step, synchronously: the sampled tokens of ``plan`` (the step takes ``step_seconds``)."""
        sampled: list[tuple[ScheduledSequence, int]] = []
        for seq in plan.sequences:
            length = seq.cached_len + len(seq.token_ids)
            if self.check_contiguous:
                assert seq.reset or self.progress[seq.request_id] == seq.cached_len, (seq.request_id, seq.cached_len)
                self.progress[seq.request_id] = length
            self.tokens_computed += len(seq.token_ids)
            if seq.sample:
                sampled.append((seq, length))
        if self.check_contiguous:
            for request_id in plan.finished_request_ids:
                self.progress.pop(request_id, None)
        tokens = self._sampled(sampled) if self.use_sampler else tuple(self._answer(seq, length)
                                                                       for seq, length in sampled)
        self.tokens_emitted += len(tokens)
        prompt_logprobs = self.prompt_logprobs(plan) if self.prompt_logprobs is not None else ()
        return StepResult(plan.step_id, tokens, plan.num_tokens, self.step_seconds, prompt_logprobs)

    async def __call__(self, plan: StepPlan) -> StepResult:
        """One step in the trio loop: record the plan, wait for ``gate``, sleep ``step_seconds``, fail from call
        ``fail_at`` on (an executor crash), else ``execute``."""
        if self.keep_plans:
            self.plans.append(plan)
        if self.gate is not None:
            await self.gate.wait()
        await trio.sleep(self.step_seconds)  # a checkpoint even at 0, as an executor step is
        self.steps += 1
        if self.fail_at is not None and self.steps > self.fail_at:
            raise RuntimeError("injected step failure")
        return self.execute(plan)

    def _next(self, seq: ScheduledSequence, length: int) -> int:
        """The token the model favours for ``seq`` at ``length`` (EOS where due, a scripted token, else
        ``token``)."""
        if length == self.eos_at_length:
            return self.eos_token_id
        return self.token_at_length.get(length, self.token(length, seq.token_ids[-1]))

    def _answer(self, seq: ScheduledSequence, length: int) -> SampledToken:
        token = self.eos_token_id if seq.sampling.constraint is not None else self._next(seq, length)
        last = seq.token_ids[-1]
        top = tuple((self.token(length + k, last), -0.5 * (k + 1)) for k in range(seq.sampling.logprobs or 0))
        return SampledToken(seq.request_id, token, self.logprob, top)

    def _sampled(self, sampled: list[tuple[ScheduledSequence, int]]) -> tuple[SampledToken, ...]:
        import torch

        from inference_server.backends.model_runner import output_lens
        from inference_server.backends.sampler import SamplingBatch, sample

        seqs = [seq for seq, _ in sampled]
        logits = torch.zeros(len(seqs), self.vocab_size)
        for row, (seq, length) in enumerate(sampled):
            logits[row, self.token(length, seq.token_ids[-1])] = 5.0
            if length == self.eos_at_length:
                logits[row, self.eos_token_id] = 10.0
        batch = SamplingBatch.from_params([seq.sampling for seq in seqs], "cpu", output_lens=output_lens(seqs))
        out = sample(logits, batch)
        return tuple(SampledToken(seq.request_id, int(token), float(logprob))
                     for seq, token, logprob in zip(seqs, out.token_ids, out.logprobs, strict=True))
