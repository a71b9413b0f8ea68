"""Typed settings, read once at start-up from defaults < ``.env`` < environment < command line.

Every knob is one field of ``Settings`` with its environment name (the field name upper-cased), a type,
accepted values and a help line; ``.env.example`` documents the same list (a test keeps the two in sync).
An invalid value stops start-up with a ``SettingsError`` naming the setting and the accepted values.
Runtime facts (the device actually chosen, the model's context length) travel separately, not here.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from inference_server.core.faults import parse_faults


class SettingsError(ValueError):
    """A setting with an invalid value; the message names the setting and what it accepts."""


def _field(default: Any, help: str, choices: tuple[str, ...] | None = None, minimum: float | None = None,
           check: Callable[[str], object] | None = None) -> Any:
    """``check``: for a text setting with its own grammar, a parser whose ``ValueError`` names what is wrong."""
    return attrs.field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum,
                                                  "check": check})


def parse_allowed_origins(value: str) -> frozenset[str]:
    """``ALLOWED_ORIGINS``: ``*``, or comma-separated origins ``scheme://host[:port]`` (no path, no trailing
    slash: a browser's ``Origin`` has neither, so such an entry could never match). Raises ``ValueError``
    naming a malformed entry."""
    origins = frozenset(part.strip() for part in value.split(",") if part.strip())
    if "*" in origins and len(origins) > 1:
        raise ValueError("* allows every origin: send it alone")
    for origin in origins - {"*"}:
        scheme, separator, rest = origin.partition("://")
        if not separator or scheme not in ("http", "https") or not rest or "/" in rest:
            raise ValueError(f"{origin!r} is not an origin such as https://app.example.com or http://localhost:3000")
    return origins


@attrs.frozen
class Settings:
    model: str = _field("", "Model to serve: a Hugging Face checkpoint folder, a .gguf file or a preset name "
                            "(with DUMMY_WEIGHTS). Empty: the embedded Gemma 3 270M GGUF.")
    dummy_weights: bool = _field(False, "Random weights at the model's real size, made on the device "
                                        "(benchmarks; needs a preset or a folder with config.json).")
    device: str = _field("auto", "Where the model runs; auto picks CUDA, then MPS, then CPU.",
                         ("auto", "cuda", "mps", "cpu"))
    dtype: str = _field("auto", "Weight and activation dtype; auto is bfloat16 on CUDA, float32 elsewhere.",
                        ("auto", "bfloat16", "float16", "float32"))
    backend: str = _field("auto", "Step runner backend: custom-cuda (Triton kernels, CUDA graphs), "
                                  "reference (pure PyTorch) or hf (a stock transformers model: the baseline, "
                                  "with KV eviction); auto picks custom-cuda when CUDA is present.",
                          ("auto", "custom-cuda", "reference", "hf"))
    kv_eviction: str = _field("none", "KV eviction of the hf backend when a sequence's cache reaches "
                                      "KV_BUDGET_TOKENS: sink (first KV_SINK_TOKENS + recent, StreamingLLM), h2o "
                                      "(heavy hitters + recent), lru (least recently used by top attention); "
                                      "none: caches grow with the sequence (docs/baseline.md).",
                              ("none", "lru", "sink", "h2o"))
    kv_budget_tokens: int = _field(0, "Most KV tokens a layer of one sequence holds with KV_EVICTION (at least "
                                      "16); 0 with KV_EVICTION=none.", minimum=0)
    kv_sink_tokens: int = _field(4, "Sink tokens KV_EVICTION=sink always keeps (at most a quarter of "
                                    "KV_BUDGET_TOKENS).", minimum=1)
    quantization: str = _field("auto", "Weight quantization applied at load: int8 stores every linear layer "
                                       "(attention, MLP, MoE experts, PLE projections; routers stay float) as "
                                       "symmetric per-output-channel int8 with scales in the model dtype, "
                                       "quantized as each weight is loaded; on the CPU the embedding and lm_head "
                                       "too. auto: int8 on the CPU (faster decode there at a small perplexity cost), "
                                       "none on GPUs and with BACKEND=hf (figures: docs/quantization.md).",
                                ("auto", "none", "int8"))
    int8_embeddings: str = _field("auto", "With QUANTIZATION=int8, whether the token embeddings and lm_head (tied "
                                          "or not; Gemma 4's per-layer embeddings too) are int8 as well: auto "
                                          "quantizes them on the CPU and keeps them in the model dtype on GPUs; on "
                                          "and off force it (docs/quantization.md).", ("auto", "on", "off"))
    cuda_graphs: bool = _field(True, "Capture decode steps in CUDA graphs (custom-cuda backend).")
    overlap: bool = _field(True, "Launch step N+1 on the device before step N's tokens are read back, so host "
                                 "work (planning, staging, streaming) runs while the device computes; off: "
                                 "one step at a time.")
    deterministic: bool = _field(False, "Batch-invariant kernels: a request's tokens and logprobs are bitwise the "
                                        "same whatever else is batched with it, however its prompt was chunked, "
                                        "whether its prefix came from the cache or it was preempted and recomputed "
                                        "(greedy, or seeded sampling); costs speed (docs/architecture.md, "
                                        "Deterministic inference).")
    engine_process: str = _field("auto", "Where `serve` runs the engine (scheduler, KV cache, model): in-process "
                                         "(one process with HTTP) or separate (a child process on a Unix socket, "
                                         "so HTTP and the engine loop do not share one GIL; docs/ipc.md). auto is "
                                         "separate when the model runs on CUDA, in-process elsewhere.",
                                 ("auto", "in-process", "separate"))
    host: str = _field("127.0.0.1", "Address the HTTP server listens on.")
    port: int = _field(8000, "Port the HTTP server listens on.", minimum=0)
    chat_template: str = _field("", "A Jinja chat template file that replaces the model's own (or supplies one "
                                    "when it has none); empty: the model's template (the embedded base model "
                                    "uses Gemma's turn format).")
    tool_call_parser: str = _field("auto", "How chat replies are parsed into tool_calls when a request sends tools: "
                                           "hermes (<tool_call>{json}</tool_call>: Qwen2.5/Qwen3 and the embedded "
                                           "model's template), gemma4 (<|tool_call>call:name{...}<tool_call|>), none "
                                           "(tool calls stay text); auto picks by the served chat template.",
                                   ("auto", "none", "hermes", "gemma4"))
    reasoning_parser: str = _field("auto", "How a chat reply's reasoning section is split into reasoning_content: "
                                           "qwen3 (<think>...</think>), gemma4 (<|channel>thought...<channel|>), "
                                           "none (left in content); auto picks by the served chat template (none "
                                           "for the embedded Gemma 3, which has no thinking).",
                                   ("auto", "none", "qwen3", "gemma4"))
    served_model_name: str = _field("", "Model name(s) the OpenAI routes accept, separated by commas or spaces "
                                        "(aliases, as vLLM's --served-model-name); the first is the one "
                                        "responses and metrics report. Empty: derived from MODEL.")
    max_model_len: int = _field(0, "Longest context (prompt + output) in tokens; 0: the model's own limit, "
                                   "capped at 8192 on CPU.", minimum=0)
    default_max_tokens: int = _field(1024, "Output cap (tokens) of a request that sets no max_tokens (a chat "
                                           "request, or the offline LLM's max_tokens=None): the reply stops at "
                                           "min(this, the rest of the context) with finish_reason length. "
                                           "/v1/completions and /generate keep OpenAI's 16. 0: the rest of the "
                                           "context.", minimum=0)
    max_batch_size: int = _field(256, "Most sequences in one step.", minimum=1)
    max_num_batched_tokens: int = _field(0, "Token budget of one step (prefill chunks plus decodes); 0: 2048 "
                                            "on CUDA, 256 elsewhere (a CPU step stays about a second long, "
                                            "so aborts and deadlines are honoured promptly).", minimum=0)
    max_prefill_tokens: int = _field(0, "Token budget of a step that carries no decodes (prompts only: a long "
                                        "prompt alone, the first step of a burst), and of one with decodes once "
                                        "more requests wait for their first token than decode (a burst), until "
                                        "each of those has its first token (later arrivals do not extend it); 0: "
                                        "4 x MAX_NUM_BATCHED_TOKENS on CUDA (8192), MAX_NUM_BATCHED_TOKENS "
                                        "elsewhere. "
                                        "Other steps with decodes keep MAX_NUM_BATCHED_TOKENS, so a stream's "
                                        "inter-token latency does not grow while a prompt or two arrive.",
                                     minimum=0)
    max_active_kv_tokens: int = _field(0, "Cap on KV tokens held by running requests; 0: the KV pool size.",
                                       minimum=0)
    max_queued_tokens: int = _field(1_000_000, "Cap on prompt tokens waiting for admission; more is rejected "
                                               "as overloaded.", minimum=1)
    max_queue_size: int = _field(1024, "Capacity of the admission inbox; a full inbox rejects at once.",
                                 minimum=1)
    kv_block_size: int = _field(16, "Tokens per KV-cache block.", minimum=1)
    kv_cache_memory_fraction: float = _field(0.9, "Fraction of free device memory (after the weights and what "
                                                  "the largest step needs, measured at start) given to the KV "
                                                  "cache.", minimum=0.0)
    kv_cache_tokens: int = _field(0, "KV pool size in tokens; 0: sized from KV_CACHE_MEMORY_FRACTION "
                                     "(CPU: 16384).", minimum=0)
    kv_expected_sequence_tokens: int = _field(2048, "Sequence length the KV pools are split for on models "
                                                     "with sliding windows (full vs sliding blocks).", minimum=1)
    prefill_mode: str = _field("chunked", "How prompts are prefilled: one whole prompt a step (monolithic), "
                                          "in token-budget chunks beside running decodes (chunked), or "
                                          "several prompts in one forward (batched).",
                               ("monolithic", "chunked", "batched"))
    scheduling_policy: str = _field("fcfs", "Order of admission: first come first served, or fair share "
                                            "per session_id (virtual token counter).", ("fcfs", "fair"))
    enable_prefix_caching: bool = _field(True, "Reuse KV blocks of identical prompt prefixes (radix cache).")
    admission_timeout: float = _field(60.0, "Seconds a request may wait to start before it ends with "
                                            "a timeout.", minimum=0.0)
    shutdown_timeout: float = _field(30.0, "Seconds in-flight requests get to finish after SIGTERM/SIGINT.",
                                     minimum=0.0)
    stall_timeout: float = _field(30.0, "Readiness turns 503 when work is pending and no step completed "
                                        "for this many seconds.", minimum=0.0)
    stream_interval: int = _field(4, "Tokens per streamed update after the first (as SGLang's --stream-interval): "
                                     "a request's first token and its last update go out at once, the tokens "
                                     "between are sent in groups of this many (1: every token on its own).",
                                  minimum=1)
    stream_interval_ms: float = _field(100.0, "The longest the stream interval holds a token back (ms): fewer "
                                              "tokens go in one update when waiting for more would hold one "
                                              "longer, and tokens this far apart are sent at once.", minimum=1.0)
    max_body_bytes: int = _field(4 * 1024 * 1024, "Largest accepted HTTP request body.", minimum=1)
    seed: int = _field(0, "Seed for dummy weights and for requests without their own seed.", minimum=0)
    cache_dir: str = _field("", "Where converted tokenizers and other caches live; empty: "
                                "$XDG_CACHE_HOME/inference_server or ~/.cache/inference_server.")
    telemetry_dir: str = _field("", "Folder for the per-run SQLite file (requests keyed by X-Trace-Id, steps, "
                                    "meta); empty: off.")
    timeline_dir: str = _field("", "Folder for the per-run JSONL step timeline (one line per scheduler "
                                   "decision) and profiler ranges per step phase; empty: off.")
    allowed_origins: str = _field("", "Browser origins allowed to call the API cross-origin (CORS): comma-separated "
                                      "origins such as https://app.example.com,http://localhost:3000, or * for "
                                      "any. Empty: none (no CORS headers; browsers block cross-origin calls).",
                                  check=parse_allowed_origins)
    access_log: bool = _field(True, "One log line per HTTP request (method, path, status, trace id, tokens in / "
                                    "out, TTFT, total time) on the inference_server.access logger.")
    log_level: str = _field("info", "Logging level.", ("debug", "info", "warning", "error"))
    faults: str = _field("", "Fault injection for reliability runs (docs/reliability.md): comma-separated "
                             "step_error=P, step_delay=P:SECONDS, alloc_refuse=P, tokenizer_error=P, seed=N, "
                             "e.g. step_error=0.01,seed=7. Empty: off (costs nothing).", check=parse_faults)

    def served_model_names(self) -> tuple[str, ...]:
        """``SERVED_MODEL_NAME`` split into its names (first: the reported one); empty when unset."""
        return tuple(dict.fromkeys(name for name in re.split(r"[,\s]+", self.served_model_name) if name))

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir)
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "inference_server"


def env_name(field: attrs.Attribute) -> str:
    return field.name.upper()


def _convert(field: attrs.Attribute, raw: str) -> Any:
    name, meta = env_name(field), field.metadata
    text = raw.strip()
    try:
        if field.type in (bool, "bool"):
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off", ""):
                return False
            raise ValueError
        if field.type in (int, "int"):
            value: Any = int(text)
        elif field.type in (float, "float"):
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
        else:
            value = text
    except ValueError:
        kind = {"bool": "true or false", "int": "an integer", "float": "a finite number"}.get(
            str(field.type), str(field.type))
        raise SettingsError(f"{name}={raw!r} is invalid: expected {kind}") from None
    if meta["choices"] is not None and value not in meta["choices"]:
        raise SettingsError(f"{name}={raw!r} is invalid: accepted values are {', '.join(meta['choices'])}")
    if meta["minimum"] is not None and value < meta["minimum"]:
        raise SettingsError(f"{name}={raw!r} is invalid: must be >= {meta['minimum']}")
    if meta["check"] is not None:
        try:
            meta["check"](value)
        except ValueError as error:
            raise SettingsError(f"{name}={raw!r} is invalid: {error}") from None
    return value


def load_settings(
    overrides: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    dotenv_path: str | Path | None = ".env",
) -> Settings:
    """Settings from defaults, then ``dotenv_path`` (if it exists), then ``environ``, then ``overrides``.

    Keys are environment names (``MAX_BATCH_SIZE``); unknown keys in ``overrides`` are an error, unknown
    environment variables are ignored, and so are unknown ``.env`` keys except a setting's name in another case
    (``max_batch_size``), an error.
    """
    from dotenv import dotenv_values

    fields = {env_name(f): f for f in attrs.fields(Settings)}
    layers: list[Mapping[str, str | None]] = []
    if dotenv_path is not None and Path(dotenv_path).is_file():
        dotenv = dotenv_values(dotenv_path)
        # .env may hold other programs' variables, but a setting's name in another case is a mistake that
        # would otherwise be ignored silently (environment names are case-sensitive)
        miscased = sorted(key for key in dotenv if key not in fields and key.upper() in fields)
        if miscased:
            raise SettingsError(f"{dotenv_path}: {', '.join(miscased)} would be ignored: settings are upper case "
                                f"({', '.join(key.upper() for key in miscased)})")
        layers.append(dotenv)
    layers.append(os.environ if environ is None else environ)
    unknown = sorted(set(overrides or {}) - set(fields))
    if unknown:
        raise SettingsError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    layers.append(overrides or {})
    values: dict[str, Any] = {}
    for layer in layers:
        for key, raw in layer.items():
            if key in fields and raw is not None:
                values[fields[key].name] = _convert(fields[key], raw)
    return Settings(**values)
