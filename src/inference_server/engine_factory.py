"""From settings to ``EngineParts``: load the model, size the KV cache, build the step runner."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import llguidance
import torch

from inference_server.actors.executor import RunnerPipeline
from inference_server.backends.factory import (
    EngineLimits,
    build_kv,
    build_kv_manager,
    build_runner,
    engine_limits,
    prepare_weights,
    step_memory_reserve,
)
from inference_server.backends.model_runner import ModelRunner
from inference_server.config import Settings
from inference_server.core.faults import parse_faults
from inference_server.core.grammar_compiler import GrammarCompiler
from inference_server.core.kv_manager import KVManager
from inference_server.core.scheduler import SchedulerConfig
from inference_server.fault_injection import with_faults
from inference_server.models.grammar_tokenizer import build_grammar_tokenizer
from inference_server.models.loading.source import LoadedModel, load_model
from inference_server.models.tokenizer import Tokenizer, TokenizerError
from inference_server.models.tokenizer_export import served_tokenizer_folder
from inference_server.runtime import resolve_backend, resolve_device, resolve_dtype, resolve_quantization
from inference_server.startup import phase, summary
from inference_server.supervisor import EngineParts

if TYPE_CHECKING:
    from inference_server.backends.hf.loading import HFLoadedModel

log = logging.getLogger(__name__)


@attrs.frozen
class BuiltEngine:
    parts: EngineParts
    loaded: LoadedModel | HFLoadedModel
    runner: ModelRunner
    device: torch.device
    dtype: torch.dtype
    backend: str


def build_engine_parts(settings: Settings) -> BuiltEngine:
    """Load the model named by ``settings`` and assemble everything the actors own."""
    device = resolve_device(settings)
    dtype = resolve_dtype(settings, device)
    backend = resolve_backend(settings, device)
    settings = attrs.evolve(settings, quantization=resolve_quantization(settings, device, backend))
    loaded: LoadedModel | HFLoadedModel
    runner: ModelRunner
    if backend == "hf":
        loaded, kv, limits, runner = _build_hf(settings, device, dtype)
    else:
        loaded = load_model(settings, device, dtype)
        _log_loaded(loaded, device, dtype)
        prepare_weights(loaded, device, backend)  # before the KV pool takes its share of the free memory
        step_bytes = step_memory_reserve(settings, loaded, device, dtype, backend)  # and what its largest step needs
        with phase("allocating the KV cache"):
            kv, storage = build_kv(settings, loaded, device, dtype, step_bytes)
        limits = engine_limits(settings, loaded.spec, device, kv)
        with phase(f"building the {backend} step runner"):
            runner = build_runner(settings, loaded, storage, device, backend, limits)
    tokenizer = loaded.tokenizer
    tokenizer_folder = _export_tokenizer(settings, loaded, limits.max_model_len)
    eos = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset(loaded.spec.eos_token_ids)
    torch.manual_seed(settings.seed)
    grammar = (_grammar_compiler(tokenizer, limits.vocab_size, eos, settings.resolved_cache_dir())
               if tokenizer is not None else None)
    runner.grammar = grammar
    if grammar is not None:
        # llguidance holds the GIL for the seconds it builds its tokenizer (core/grammar_compiler.py): here, before
        # /ready, rather than at the first constrained request, where it froze every stream of this process
        with phase("building the grammar engine's tokenizer"):
            grammar.ensure_tokenizer()
    parts = EngineParts(
        grammar=grammar,
        step=RunnerPipeline(runner),
        overlap=settings.overlap,
        kv=kv,
        tokenizer=tokenizer,
        max_model_len=limits.max_model_len,
        vocab_size=limits.vocab_size,
        eos_token_ids=eos,
        scheduler_config=SchedulerConfig(
            max_batch_size=settings.max_batch_size,
            max_num_batched_tokens=limits.step_token_budget,
            max_prefill_tokens=limits.prefill_token_budget,
            prefill_mode=settings.prefill_mode,
            max_active_kv_tokens=settings.max_active_kv_tokens,
        ),
        scheduling_policy=settings.scheduling_policy,
        max_queue_size=settings.max_queue_size,
        max_queued_tokens=settings.max_queued_tokens,
        admission_timeout=settings.admission_timeout,
        model_name=loaded.name,
        default_max_tokens=settings.default_max_tokens or None,
        model_root=loaded.root,
        tokenizer_folder=str(tokenizer_folder or ""),
        stream_interval=settings.stream_interval,
        stream_interval_ms=settings.stream_interval_ms,
    )
    parts = with_faults(parts, parse_faults(settings.faults))  # the same parts when FAULTS is empty
    log.info("KV cache: %d full blocks, %d sliding blocks of %d tokens; max model len %d; backend %s",
             kv.full_pool.num_blocks, kv.sliding_pool.num_blocks if kv.sliding_pool else 0, kv.block_size,
             limits.max_model_len, backend)
    log.info("start-up phases: %s", summary())
    return BuiltEngine(parts=parts, loaded=loaded, runner=runner, device=device, dtype=dtype, backend=backend)


def _grammar_compiler(tokenizer: Tokenizer, vocab_size: int, eos: frozenset[int],
                      cache_dir: Path) -> GrammarCompiler:
    """The structured-output compiler of the served tokenizer: llguidance's tokenizer from the token table an
    earlier start cached, else from its ``tokenizer.json`` text (``models/grammar_tokenizer.py``); the
    special-token table from ``tokenizers``' added vocabulary (what that text's ``added_tokens`` hold)."""
    backend = tokenizer.backend

    def special_tokens() -> dict[str, int]:
        return {added.content: token_id for token_id, added in backend.get_added_tokens_decoder().items()
                if added.special}

    def build(slices: list[str]) -> llguidance.LLTokenizer:
        return build_grammar_tokenizer(tokenizer, vocab_size, eos, slices, cache_dir)

    return GrammarCompiler(backend.to_str, vocab_size, eos, special_tokens=special_tokens, build_tokenizer=build)


def engine_parts(settings: Settings) -> EngineParts:
    """``build_engine_parts(settings).parts``: what the engine process serves (``engine_process.py``)."""
    return build_engine_parts(settings).parts


def _log_loaded(loaded: LoadedModel | HFLoadedModel, device: torch.device, dtype: torch.dtype) -> None:
    log.info("loaded %s (%s) on %s as %s in %.1f s", loaded.name, loaded.spec.architecture, device, dtype,
             loaded.load_seconds)


def _build_hf(settings: Settings, device: torch.device,
              dtype: torch.dtype) -> tuple[HFLoadedModel, KVManager, EngineLimits, ModelRunner]:
    """The Hugging Face backend: a transformers model, and a KV manager for the scheduler's accounting only (the
    runner keeps its own caches; the radix prefix cache is off, since the runner cannot reuse blocks)."""
    from inference_server.backends.hf.loading import load_hf_model
    from inference_server.backends.hf.runner import build_hf_runner

    loaded = load_hf_model(settings, device, dtype)
    _log_loaded(loaded, device, dtype)
    kv = build_kv_manager(settings, loaded.spec, device, dtype, prefix_cache=False)
    limits = engine_limits(settings, loaded.spec, device, kv)
    with phase("building the hf step runner"):
        runner = build_hf_runner(settings, loaded.model, loaded.spec, device)
    return loaded, kv, limits, runner


def _export_tokenizer(settings: Settings, loaded: LoadedModel | HFLoadedModel, max_model_len: int) -> Path | None:
    """The served tokenizer as a Hugging Face folder for clients (written once, then reused); None without
    a tokenizer, or when the cache cannot be written (a warning: serving does not need it)."""
    if loaded.tokenizer is None:
        return None
    try:
        folder = served_tokenizer_folder(loaded.tokenizer, settings.resolved_cache_dir(), loaded.name, max_model_len)
    except TokenizerError as error:
        log.warning("the tokenizer was not exported for clients: %s", error)
        return None
    log.info("tokenizer for clients (transformers.AutoTokenizer.from_pretrained, aiperf --tokenizer, lm-eval "
             "tokenizer=): %s", folder)
    return folder
