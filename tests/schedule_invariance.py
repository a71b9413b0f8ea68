"""Schedule invariance: a greedy request's tokens must not depend on how the engine scheduled it.

One engine (built from ``Settings`` overrides, so any backend, dtype, model, block size, step budget or a
future ``OVERLAP`` can be checked) runs the same fixed greedy token-id prompts three ways:

* **solo**: each prompt alone on an idle engine, with a cache salt of its own, so nothing is shared: its
  ``cached_prompt_tokens`` must be 0 (the empty-prefix-cache case).
* **loaded**: every prompt inside a mixed batch. Filler requests (other prompts, some longer than a step's
  budget) start first; the test prompts then arrive one by one, each after the engine has streamed a further
  ``stagger_tokens`` tokens, so the chunked prefill of one prompt shares steps with the decodes of the
  fillers and of the prompts before it, and chunk boundaries fall elsewhere than in the solo run.
* **cache hit**: per prompt, a warm-up request of the prompt's first ``shared_len`` tokens plus a tail of
  other tokens fills the prefix cache (same salt); the prompt then runs alone and must reuse it
  (``cached_prompt_tokens > 0``: checked, and reported). ``shared_len`` alternates between the whole
  prompt and 70 % of it, so hits longer than the sliding window, hits that end at the prompt's last whole
  block and hits that end mid-prompt are all exercised.
* **preempted** (only with ``preempt_kv_tokens``): the loaded run again on a second engine whose KV pool holds
  only that many tokens, so running requests are preempted and recomputed (their restarts are counted from the
  plans' ``reset`` chunks).

Every run asks for the top-2 logprobs, so a divergence is reported with the top-2 margin (nats) at the
first position where the tokens differ, as the solo run saw it and as the other run saw it: a divergence
at a margin of ~1e-6 is a floating-point near-tie, one at a margin of whole nats is a scheduling defect.

Time plays no part: arrivals are driven by streamed-token counts, never by sleeps, so the harness runs the
same on a busy 2-core machine as on a GPU. ``tests/test_schedule_invariance.py`` asserts invariance on CPU (fp32,
embedded model) and on CUDA.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import trio

from inference_server.actors.executor import StepFunction, StepPipeline, as_pipeline
from inference_server.actors.request_handle import RequestHandle
from inference_server.config import load_settings
from inference_server.engine_factory import BuiltEngine, build_engine_parts
from inference_server.models.loading.presets import preset_config
from inference_server.records.requests import GenerationRequest, RequestUpdate, TokenOutput
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import StepPlan, StepResult
from inference_server.supervisor import Engine, EngineParts

WAYS = ("loaded", "cache_hit")
"""The runs compared against each prompt's solo run (and ``preempted`` when the config asks for it)."""


@attrs.frozen
class InvarianceConfig:
    """What to run (the engine itself comes from ``settings``: environment-style names, as ``.env``)."""

    settings: Mapping[str, str]
    """Settings overrides (``MODEL``, ``DUMMY_WEIGHTS``, ``BACKEND``, ``DTYPE``, ``DEVICE``,
    ``MAX_NUM_BATCHED_TOKENS``, ``KV_BLOCK_SIZE``, ``OVERLAP``, ...); everything else keeps its default
    (the process environment and ``.env`` are not read, so a run is reproducible)."""
    prompt_lengths: tuple[int, ...]
    max_tokens: int = 16
    num_fillers: int = 3
    filler_prompt_lengths: tuple[int, ...] = (40, 300, 9)
    """Filler prompt lengths, cycled (a filler longer than the step budget is prefilled in chunks too)."""
    filler_max_tokens: int = 64
    """Fillers decode this many tokens: enough to stay running while the test prompts arrive."""
    stagger_tokens: int = 6
    """A test prompt of the loaded run arrives after this many more streamed tokens (all requests)."""
    hit_tail_tokens: int = 5
    """Tokens after the shared prefix in a cache-hit warm-up request (so it differs from the prompt)."""
    seed: int = 0
    repetition_penalty: float = 1.0
    """Applied to the test prompts (fillers stay plain greedy): penalties read the request's whole history
    (prompt and output), which a chunked, batched or cache-hit run must hand the sampler just the same."""
    preempt_kv_tokens: int | None = None
    """With a value, a fourth way: the loaded run on an engine whose KV pool holds this many tokens (preemptions)."""
    token_range: tuple[int, int] = (1000, 100_000)
    """Prompt token ids are drawn from ``[low, high)`` (cut to the vocabulary): ordinary sub-words of
    Gemma's vocabulary, clear of its special and unused ids."""


@attrs.frozen
class Divergence:
    """Where a run first left the solo run's tokens."""

    position: int
    """Index into the output (0: the very first generated token)."""
    solo_token: int
    other_token: int
    solo_margin: float
    """Top-2 logprob gap (nats) of the solo run at ``position``."""
    other_margin: float
    """The same gap as the other run saw it at ``position`` (its context is identical up to there)."""


@attrs.frozen
class RunTokens:
    """One request's generated tokens with their top-2 margins, and its prefix-cache hit."""

    token_ids: tuple[int, ...]
    margins: tuple[float, ...]
    cached_prompt_tokens: int
    request_id: int
    logprobs: tuple[float, ...] = ()
    """The sampled tokens' logprobs (bitwise comparisons: ``bitwise_equal``)."""

    @staticmethod
    def of(update: RequestUpdate) -> RunTokens:
        if update.error is not None or update.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"request ended {update.finish_reason}: {update.error}")
        return RunTokens(tuple(t.token_id for t in update.tokens), tuple(top2_margin(t) for t in update.tokens),
                         update.cached_prompt_tokens, update.request_id, tuple(t.logprob for t in update.tokens))


@attrs.frozen
class PromptOutcome:
    prompt_len: int
    shared_len: int
    """Prompt tokens shared with the cache-hit warm-up request."""
    solo_chunks: int
    loaded_chunks: int
    """Steps that computed part of the prompt, solo and in the loaded run."""
    solo: RunTokens
    runs: Mapping[str, RunTokens]
    """The other ways (``WAYS``, and ``preempted`` when run) by name."""
    preempted_restarts: int = 0
    """Times the prompt was restarted (preempted and recomputed) in the preempted run."""

    def divergence(self, way: str) -> Divergence | None:
        return first_divergence(self.solo, self.runs[way])

    @property
    def min_solo_margin(self) -> float:
        return min(self.solo.margins, default=math.inf)


@attrs.frozen
class InvarianceReport:
    outcomes: tuple[PromptOutcome, ...]
    block_size: int
    sliding_window: int | None
    step_token_budget: int
    loaded_mixed_steps: int
    """Steps of the loaded run that computed a prefill chunk and a decode together."""
    loaded_max_batch: int
    """Most sequences in one step of the loaded run."""

    @property
    def ways(self) -> tuple[str, ...]:
        return tuple(self.outcomes[0].runs) if self.outcomes else WAYS

    def bitwise_equal(self, way: str) -> int:
        """Prompts whose ``way`` run has the solo run's tokens and bitwise the same logprobs."""
        return sum(1 for o in self.outcomes if o.solo.token_ids == o.runs[way].token_ids
                   and o.solo.logprobs == o.runs[way].logprobs)

    def identical(self, way: str) -> int:
        return sum(1 for o in self.outcomes if o.divergence(way) is None)

    def defects(self, tie_margin: float = 0.0) -> list[str]:
        """Every divergence whose solo margin is at least ``tie_margin`` nats (0: every divergence), every
        solo run that hit the cache, and every cache-hit run that missed it; empty when invariant."""
        problems = []
        for index, outcome in enumerate(self.outcomes):
            if outcome.solo.cached_prompt_tokens:
                problems.append(f"prompt {index}: the solo run hit the prefix cache "
                                f"({outcome.solo.cached_prompt_tokens} tokens)")
            if outcome.shared_len > self.block_size and not outcome.runs["cache_hit"].cached_prompt_tokens:
                problems.append(f"prompt {index}: the cache-hit run did not hit the prefix cache")
            for way in outcome.runs:
                d = outcome.divergence(way)
                if d is not None and d.solo_margin >= tie_margin:
                    problems.append(f"prompt {index} ({outcome.prompt_len} tokens) {way}: {describe(d)}")
        return problems

    def table(self) -> str:
        """One line per prompt and a summary line (what the bench prints)."""
        lines = [f"block {self.block_size}, sliding window {self.sliding_window}, step budget "
                 f"{self.step_token_budget}; loaded run: {self.loaded_mixed_steps} steps mixing prefill and "
                 f"decode, up to {self.loaded_max_batch} sequences a step",
                 f"{'#':>2} {'prompt':>6} {'chunks':>7} {'shared':>6} {'hit':>5} {'min margin':>10}  "
                 f"{'solo vs loaded':<44} solo vs cache hit"]
        for i, o in enumerate(self.outcomes):
            cells = [describe(o.divergence(way)) for way in WAYS]
            chunks = f"{o.solo_chunks}/{o.loaded_chunks}"
            lines.append(f"{i:>2} {o.prompt_len:>6} {chunks:>7} {o.shared_len:>6} "
                         f"{o.runs['cache_hit'].cached_prompt_tokens:>5} {o.min_solo_margin:>10.4g}  "
                         f"{cells[0]:<44} {cells[1]}")
        n = len(self.outcomes)
        lines.append(f"identical: solo vs loaded {self.identical('loaded')}/{n}, "
                     f"solo vs cache hit {self.identical('cache_hit')}/{n}")
        if "preempted" in self.ways:
            restarted = sum(1 for o in self.outcomes if o.preempted_restarts)
            lines.append(f"solo vs preempted {self.identical('preempted')}/{n} ({restarted} prompts restarted)")
        lines.append("bitwise (tokens and logprobs): " + ", ".join(
            f"{way} {self.bitwise_equal(way)}/{n}" for way in self.ways))
        return "\n".join(lines)


def describe(divergence: Divergence | None) -> str:
    if divergence is None:
        return "identical"
    d = divergence
    return (f"differs at {d.position} ({d.solo_token} vs {d.other_token}), margin {d.solo_margin:.3g} / "
            f"{d.other_margin:.3g}")


def top2_margin(token: TokenOutput) -> float:
    """The gap (nats) between the best and second-best logprob of one step (inf without two)."""
    if len(token.top_logprobs) < 2:
        return math.inf
    return token.top_logprobs[0][1] - token.top_logprobs[1][1]


def first_divergence(solo: RunTokens, other: RunTokens) -> Divergence | None:
    for position, (a, b) in enumerate(zip(solo.token_ids, other.token_ids, strict=False)):
        if a != b:
            return Divergence(position, a, b, solo.margins[position], other.margins[position])
    if len(solo.token_ids) != len(other.token_ids):
        position = min(len(solo.token_ids), len(other.token_ids))
        return Divergence(position, -1, -1, math.nan, math.nan)  # one run stopped early (EOS is ignored)
    return None


# ---------------------------------------------------------------------------------------------- prompts


def make_prompts(lengths: Sequence[int], rng: random.Random, low: int, high: int,
                 bos: int | None) -> list[tuple[int, ...]]:
    """Random token-id prompts of the given lengths, each starting with ``bos`` when there is one."""
    prompts = []
    for length in lengths:
        body = [rng.randrange(low, high) for _ in range(length - (1 if bos is not None else 0))]
        prompts.append(tuple(([bos] if bos is not None else []) + body))
    return prompts


def shared_length(index: int, prompt_len: int) -> int:
    """Prompt tokens a cache-hit warm-up shares: the whole prompt for even indices, 70 % for odd ones."""
    return prompt_len if index % 2 == 0 else max(1, math.ceil(0.7 * prompt_len))


# ------------------------------------------------------------------------------------------------- runs


class _TokenClock:
    """Counts tokens streamed by every request of a run; ``wait_for(n)`` returns once ``n`` were seen, or
    once ``close`` says no more will come (so a run can never hang on fillers that ended early)."""

    def __init__(self) -> None:
        self.count = 0
        self._waiters: list[tuple[int, trio.Event]] = []
        self._closed = False

    def add(self, n: int) -> None:
        self.count += n
        for threshold, event in self._waiters:
            if self.count >= threshold:
                event.set()

    def close(self) -> None:
        self._closed = True
        for _, event in self._waiters:
            event.set()

    async def wait_for(self, threshold: int) -> None:
        if self.count >= threshold or self._closed:
            return
        event = trio.Event()
        self._waiters.append((threshold, event))
        await event.wait()


async def _read(handle: RequestHandle, clock: _TokenClock | None = None) -> RequestUpdate:
    """Every update of a request merged into one, feeding ``clock`` as tokens arrive."""
    async with handle:
        await handle.admission()
        merged: list[TokenOutput] = []
        last: RequestUpdate | None = None
        async for update in handle:
            merged.extend(update.tokens)
            if clock is not None:
                clock.add(len(update.tokens))
            last = update
    assert last is not None
    return attrs.evolve(last, tokens=tuple(merged))


def _greedy(max_tokens: int, top: int | None = 2, repetition_penalty: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=top,
                          repetition_penalty=repetition_penalty)


class _Runner:
    def __init__(self, engine: Engine, config: InvarianceConfig, nonce: str) -> None:
        self.engine = engine
        self.config = config
        self.nonce = nonce  # in every cache salt: runs on one engine never share its prefix cache

    async def one(self, prompt: Sequence[int], salt: str, max_tokens: int | None = None) -> RunTokens:
        params = _greedy(max_tokens or self.config.max_tokens, repetition_penalty=self.config.repetition_penalty)
        request = GenerationRequest(params=params, prompt_ids=tuple(prompt),
                                    cache_salt=f"{self.nonce}-{salt}")
        return RunTokens.of(await _read(self.engine.submit(request)))

    async def loaded(self, prompts: Sequence[tuple[int, ...]], fillers: Sequence[tuple[int, ...]]) -> list[RunTokens]:
        config = self.config
        clock = _TokenClock()
        results: list[RunTokens | None] = [None] * len(prompts)

        fillers_left = len(fillers)
        if not fillers_left:
            clock.close()

        async def filler(prompt: tuple[int, ...], index: int) -> None:
            nonlocal fillers_left
            request = GenerationRequest(params=_greedy(config.filler_max_tokens, None), prompt_ids=prompt,
                                        cache_salt=f"{self.nonce}-filler-{index}")
            try:
                RunTokens.of(await _read(self.engine.submit(request), clock))
            finally:
                fillers_left -= 1
                if not fillers_left:  # nothing may stream any more: let the remaining prompts in at once
                    clock.close()

        async def test_prompt(index: int) -> None:
            params = _greedy(config.max_tokens, repetition_penalty=config.repetition_penalty)
            request = GenerationRequest(params=params, prompt_ids=prompts[index],
                                        cache_salt=f"{self.nonce}-loaded")
            results[index] = RunTokens.of(await _read(self.engine.submit(request), clock))

        async with trio.open_nursery() as fillers_nursery:
            for index, prompt in enumerate(fillers):
                fillers_nursery.start_soon(filler, prompt, index)
            async with trio.open_nursery() as tests:
                for index in range(len(prompts)):
                    await clock.wait_for((index + 1) * config.stagger_tokens)
                    tests.start_soon(test_prompt, index)
        return [r for r in results if r is not None]


class _RecordingPipeline(StepPipeline):
    """A step pipeline that appends every plan it launches to ``plans``."""

    def __init__(self, inner: StepPipeline, plans: list[StepPlan]) -> None:
        self.inner = inner
        self.plans = plans

    async def advance(self, plan: StepPlan | None, collect: bool) -> StepResult | None:
        if plan is not None:
            self.plans.append(plan)
        return await self.inner.advance(plan, collect)


class _PlanLog:
    """Every plan the engine ran, so a report can show that the loaded run really mixed prefill chunks with
    decodes and cut the prompts into chunks (the scheduler decides; the harness only arranges arrivals)."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def wrap(self, step: StepFunction | StepPipeline) -> StepPipeline:
        return _RecordingPipeline(as_pipeline(step), self.plans)

    def prefill_chunks(self, request_id: int) -> int:
        return sum(1 for plan in self.plans for seq in plan.sequences
                   if seq.request_id == request_id and seq.cached_len < seq.prompt_len)

    def restarts(self, request_id: int) -> int:
        """``reset`` chunks of the request after its first one: its preemptions."""
        return max(0, sum(1 for plan in self.plans for seq in plan.sequences
                          if seq.request_id == request_id and seq.reset) - 1)

    def mixed_steps(self, first: int, last: int) -> int:
        """Plans ``first .. last - 1`` (list indices) with a prefill chunk and a decode side by side."""
        return sum(1 for plan in self.plans[first:last]
                   if any(s.cached_len < s.prompt_len for s in plan.sequences)
                   and any(s.cached_len >= s.prompt_len for s in plan.sequences))


async def _run_all(parts: EngineParts, log: _PlanLog, config: InvarianceConfig, prompts: list[tuple[int, ...]],
                   fillers: list[tuple[int, ...]], tails: list[tuple[int, ...]],
                   nonce: str) -> tuple[list[PromptOutcome], int, int]:
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        runner = _Runner(engine, config, nonce)
        solo = [await runner.one(p, salt=f"solo-{i}") for i, p in enumerate(prompts)]
        loaded_from = len(log.plans)
        loaded = await runner.loaded(prompts, fillers)
        loaded_to = len(log.plans)
        hits = []
        for i, prompt in enumerate(prompts):
            shared = shared_length(i, len(prompt))
            await runner.one(prompt[:shared] + tails[i], salt=f"hit-{i}", max_tokens=1)
            hits.append(await runner.one(prompt, salt=f"hit-{i}"))
        engine.close()
    outcomes = [PromptOutcome(len(p), shared_length(i, len(p)), log.prefill_chunks(solo[i].request_id),
                              log.prefill_chunks(loaded[i].request_id), solo[i],
                              {"loaded": loaded[i], "cache_hit": hits[i]})
                for i, p in enumerate(prompts)]
    max_batch = max((len(plan.sequences) for plan in log.plans[loaded_from:loaded_to]), default=0)
    return outcomes, log.mixed_steps(loaded_from, loaded_to), max_batch


def build_engine(config: InvarianceConfig) -> BuiltEngine:
    return build_engine_parts(load_settings(dict(config.settings), environ={}, dotenv_path=None))


def run_invariance(config: InvarianceConfig, built: BuiltEngine | None = None) -> InvarianceReport:
    """Run ``config``'s prompts solo, loaded and after a cache hit on ``built`` (or an engine built from
    ``config.settings``); the engine's prefix cache keeps what the runs left (salted apart from later runs)."""
    built = built or build_engine(config)
    preempting = None
    if config.preempt_kv_tokens is not None:
        preempting = build_engine(attrs.evolve(config, settings={
            **config.settings, "KV_CACHE_TOKENS": str(config.preempt_kv_tokens)}))
    spec = built.loaded.spec
    rng = random.Random(config.seed)
    low, high = config.token_range
    high = min(high, spec.vocab_size)
    low = min(low, max(3, high // 2))
    bos = spec.bos_token_id
    prompts = make_prompts(config.prompt_lengths, rng, low, high, bos)
    lengths = config.filler_prompt_lengths
    fillers = make_prompts([lengths[i % len(lengths)] for i in range(config.num_fillers)], rng, low, high, bos)
    tails = [tuple(rng.randrange(low, high) for _ in range(config.hit_tail_tokens)) for _ in prompts]
    log = _PlanLog()
    parts = attrs.evolve(built.parts, step=log.wrap(built.parts.step))
    outcomes, mixed, max_batch = trio.run(_run_all, parts, log, config, prompts, fillers, tails, uuid.uuid4().hex)
    if preempting is not None:
        outcomes = _add_preempted(preempting, config, prompts, fillers, outcomes)
    kv = built.parts.kv
    return InvarianceReport(tuple(outcomes), kv.block_size, kv.sliding_window,
                            built.parts.scheduler_config.max_num_batched_tokens, mixed, max_batch)


def _add_preempted(built: BuiltEngine, config: InvarianceConfig, prompts: list[tuple[int, ...]],
                   fillers: list[tuple[int, ...]], outcomes: list[PromptOutcome]) -> list[PromptOutcome]:
    """The loaded run on ``built`` (a small KV pool), added to each outcome as ``preempted``."""
    log = _PlanLog()
    parts = attrs.evolve(built.parts, step=log.wrap(built.parts.step))

    async def run() -> list[RunTokens]:
        async with trio.open_nursery() as nursery:
            engine: Engine = await nursery.start(Engine(parts).run)
            runs = await _Runner(engine, config, uuid.uuid4().hex).loaded(prompts, fillers)
            engine.close()
        return runs

    runs = trio.run(run)
    return [attrs.evolve(o, runs={**o.runs, "preempted": r}, preempted_restarts=log.restarts(r.request_id))
            for o, r in zip(outcomes, runs, strict=True)]


def cut_model_folder(preset: str, num_layers: int, folder: Path) -> Path:
    """A checkpoint folder (config.json only: run it with ``DUMMY_WEIGHTS``) of ``preset`` at its real widths,
    window and expert shapes, cut to its first ``num_layers`` layers (Gemma's last one made full attention,
    as Gemma 4 always has it)."""
    config = preset_config(preset)
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        types = list(config["layer_types"][:num_layers])
        types[-1] = "full_attention"
        config["layer_types"] = types
    if config.get("num_kv_shared_layers", 0) >= num_layers:
        config["num_kv_shared_layers"] = 0
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


# ------------------------------------------------------------------------------ the configurations we run

CPU_SETTINGS = {"DEVICE": "cpu", "DTYPE": "float32", "BACKEND": "reference", "MAX_NUM_BATCHED_TOKENS": "128",
                "KV_BLOCK_SIZE": "16", "QUANTIZATION": "none"}
"""fp32 weights, not the CPU's int8 default: its int8pack head returns bf16 logits, whose one-step near-ties (1/32 nat)
flip with the batch's summation order; DETERMINISTIC=true is what makes the int8 default invariant
(tests/test_deterministic_cpu.py)."""


def cpu_config(**settings: str) -> InvarianceConfig:
    """The embedded Gemma 3 270M (real weights, sliding window 512) in fp32 on the CPU: a 128-token step budget
    chunks the two prompts longer than the window, whose cache hits (528 and 560 tokens) exceed it too. The
    17- and 529-token prompts hit all but their last token, so their first step computes one token at a
    cached position (on the custom-cuda backend: a decode-graph step)."""
    return InvarianceConfig(settings={**CPU_SETTINGS, **settings}, prompt_lengths=(17, 90, 529, 800),
                            max_tokens=6, filler_max_tokens=24)


GPU_PRESET = "gemma-4-26b-a4b"
GPU_PROMPT_LENGTHS = (5, 40, 289, 600, 1025, 1500, 2100, 129)
"""Eight prompts, four of them longer than Gemma 4's 1024-token window (the 26B-A4B's); after their cache
hits the 289- and 1025-token prompts compute only their last token (1025: the hit is exactly the window)."""


def gpu_config(model: str, dtype: str, **settings: str) -> InvarianceConfig:
    """A Gemma 4 model (dummy weights) on the custom-cuda backend with its kernels and decode graphs; a 256-token
    step budget chunks every prompt longer than it, and 12 fillers make the loaded run's steps 20 sequences.
    ``MAX_BATCH_SIZE`` 32 holds those 20 with the fewest decode graphs to capture (the suite's start-up time)."""
    base = {"MODEL": model, "DUMMY_WEIGHTS": "true", "DEVICE": "cuda", "BACKEND": "custom-cuda", "DTYPE": dtype,
            "MAX_NUM_BATCHED_TOKENS": "256", "KV_BLOCK_SIZE": "16", "KV_CACHE_TOKENS": "65536",
            "MAX_BATCH_SIZE": "32"}
    return InvarianceConfig(settings={**base, **settings}, prompt_lengths=GPU_PROMPT_LENGTHS, max_tokens=16,
                            num_fillers=12, filler_prompt_lengths=(40, 300, 9, 700), filler_max_tokens=96,
                            stagger_tokens=24)
