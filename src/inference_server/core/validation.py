"""Admission checks: everything that can never run is refused before anything is queued.

``prepare`` validates a ``GenerationRequest`` against the engine's limits, applies the chat template,
tokenises, resolves ``max_tokens=None`` to ``min(default_max_tokens, the rest of the context)`` (the rest of
the context when there is no default), and returns the prompt token ids with
the final sampling parameters, or raises ``RequestError`` carrying a code and the offending field.

Whatever a single request's input makes the tokenizer or the chat template raise becomes that request's
``RequestError``: no input can crash the admission actor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from inference_server.core.bad_words import bad_words_token_ids
from inference_server.records.errors import RequestError
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams


class PromptTokenizer(Protocol):
    """What admission needs of a tokenizer: ``models.tokenizer.Tokenizer`` satisfies it."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, **template_kwargs: Any) -> list[int]: ...


@attrs.frozen
class KVLimits:
    """What the KV cache can hold for one request alone (from the pools' sizes, fixed at start-up).

    ``max_step_tokens`` is the most tokens one step may compute for a sequence when its prompt is cut into
    chunks (``None`` when prompts are prefilled whole, as in the ``monolithic`` and ``batched`` modes).
    """

    block_size: int
    full_blocks: int
    sliding_blocks: int = 0
    sliding_window: int | None = None
    max_step_tokens: int | None = None

    def sliding_blocks_needed(self, total_tokens: int) -> int:
        """Sliding blocks the request needs at its most demanding step: a chunk of ``n`` new tokens reads
        ``window - 1`` earlier positions, so it holds ``ceil((window - 1 + n) / block) + 1`` blocks (never more
        than the sequence's own blocks). A whole-prompt mode may recompute the whole sequence after a
        preemption, so there ``n`` is the request's full length."""
        if self.sliding_window is None:
            return 0
        step = total_tokens if self.max_step_tokens is None else min(total_tokens, self.max_step_tokens)
        spanned = -(-(self.sliding_window - 1 + step) // self.block_size) + 1
        return min(spanned, -(-total_tokens // self.block_size))


def tokenize(request: GenerationRequest, tokenizer: PromptTokenizer | None) -> tuple[int, ...]:
    """The prompt's token ids (text, ids or chat messages); raises ``RequestError`` for anything the
    tokenizer or template cannot handle."""
    given = [x for x in (request.prompt, request.prompt_ids, request.messages) if x is not None]
    if len(given) != 1:
        raise RequestError("invalid_request", "exactly one of prompt, prompt token ids or messages is required",
                           "prompt")
    if request.prompt_ids is not None:
        return tuple(request.prompt_ids)
    if tokenizer is None:
        raise RequestError("invalid_request", "this model has no tokenizer: send the prompt as token ids",
                           "prompt")
    if request.messages is not None:
        messages = [m.template_dict() for m in request.messages]
        template_kwargs = dict(request.chat_template_kwargs or {})
        if request.tools is not None:
            template_kwargs["tools"] = [dict(tool) for tool in request.tools]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                                continue_final_message=request.continue_final_message,
                                                **template_kwargs)
        except Exception as error:  # a template error is the request's problem, reported as such
            raise RequestError("invalid_request", f"cannot apply the chat template: {error}", "messages") from None
        return tuple(ids)
    assert request.prompt is not None
    try:
        return tuple(tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
    except Exception as error:  # e.g. text the tokenizer cannot encode (lone surrogates): this request's fault
        raise RequestError("invalid_request", f"cannot tokenize the prompt: {error}", "prompt") from None


def truncate(prompt_ids: tuple[int, ...], keep: int | None, max_model_len: int,
             side: str = "left") -> tuple[int, ...]:
    """``keep`` prompt tokens (vLLM's ``truncate_prompt_tokens``; -1 = the model's context length, None = all
    of them): the last ones when ``side`` is ``left`` (the left end is cut), the first ones when ``right``."""
    if keep is None:
        return prompt_ids
    if isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or keep < -1:
        raise RequestError("invalid_request", f"truncate_prompt_tokens must be -1 or an integer >= 1, got {keep!r}",
                           "truncate_prompt_tokens")
    if side not in ("left", "right"):
        raise RequestError("invalid_request", f"truncation_side must be 'left' or 'right', got {side!r}",
                           "truncation_side")
    keep = max_model_len if keep == -1 else keep
    if len(prompt_ids) <= keep:
        return prompt_ids
    return prompt_ids[-keep:] if side == "left" else prompt_ids[:keep]


def _first_out_of_vocabulary(prompt_ids: tuple[int, ...], vocab_size: int) -> object | None:
    """The first id that is not an int in ``[0, vocab_size)``, or None. A burst of long prompts is checked
    in C (types, min, max) rather than one Python test per id; the scan runs only to name a bad id."""
    if set(map(type, prompt_ids)) <= {int} and min(prompt_ids) >= 0 and max(prompt_ids) < vocab_size:
        return None
    return next((t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)


def prepare(request: GenerationRequest, tokenizer: PromptTokenizer | None, *, max_model_len: int,
            vocab_size: int, kv: KVLimits | None = None,
            default_max_tokens: int | None = None) -> tuple[tuple[int, ...], SamplingParams]:
    """Validated prompt token ids and final sampling parameters for ``request`` (raises ``RequestError``).

    ``default_max_tokens``: the output cap of a request that sets none (``DEFAULT_MAX_TOKENS``), never more
    than the rest of the context; ``None``: the rest of the context."""
    request.params.validate()
    if request.params.n != 1:
        raise RequestError("invalid_request", f"n={request.params.n}: an engine request is one sequence; its "
                           "caller submits one request per sample (SamplingParams.sample)", "n")
    if request.params.bad_words and not request.params.bad_words_token_ids:
        request = attrs.evolve(request, params=attrs.evolve(
            request.params, bad_words_token_ids=bad_words_token_ids(request.params.bad_words, tokenizer)))
    request.params.validate_vocabulary(vocab_size)
    prompt_ids = truncate(tokenize(request, tokenizer), request.truncate_prompt_tokens, max_model_len,
                          request.truncation_side)
    if not prompt_ids:
        raise RequestError("invalid_request", "the prompt is empty", "prompt")
    bad = _first_out_of_vocabulary(prompt_ids, vocab_size)
    if bad is not None:
        raise RequestError("invalid_request", f"prompt token id {bad} is out of vocabulary (outside [0, {vocab_size}))",
                           "prompt")
    prompt_field = request.tokenized_from or ("messages" if request.messages is not None else "prompt")
    params = request.params
    if params.max_tokens is None:
        rest = max(1, max_model_len - len(prompt_ids))
        params = attrs.evolve(params, max_tokens=rest if default_max_tokens is None else min(default_max_tokens, rest))
    max_tokens = params.max_tokens
    assert max_tokens is not None
    if max_tokens > max_model_len - 1:
        raise RequestError("invalid_request", f"max_tokens={max_tokens} is too large: this model's context is "
                           f"{max_model_len} tokens", "max_tokens")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise RequestError(
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens.", prompt_field)
    if kv is not None:
        check_fits_kv(len(prompt_ids) + max_tokens, kv, prompt_field)
    return prompt_ids, params


def check_fits_kv(total_tokens: int, kv: KVLimits, param: str) -> None:
    """Refuse a request that could not run even alone in an empty cache (it would wait forever)."""
    full_needed = -(-total_tokens // kv.block_size)
    if full_needed > kv.full_blocks:
        raise RequestError(
            "kv_capacity_exceeded", f"the request needs {total_tokens} tokens of KV cache but the cache holds "
            f"{kv.full_blocks * kv.block_size}; reduce the prompt or max_tokens", param)
    sliding_needed = kv.sliding_blocks_needed(total_tokens)
    if sliding_needed > kv.sliding_blocks:
        raise RequestError(
            "kv_capacity_exceeded", f"the request needs {sliding_needed} sliding-window KV blocks at its largest "
            f"step but the sliding pool holds {kv.sliding_blocks} (window {kv.sliding_window}, block "
            f"{kv.block_size} tokens); reduce the prompt or max_tokens, or raise KV_CACHE_TOKENS", param)
