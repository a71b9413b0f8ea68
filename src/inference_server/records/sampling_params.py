"""Per-request sampling parameters: how a request samples and when it stops (validated, engine-wide)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from inference_server.records.constraints import Constraint
from inference_server.records.errors import RequestError
from inference_server.records.stop_patterns import STOP_REGEX_MAX_SIZE, compile_stop_regex, total_size

GREEDY_EPSILON = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing by them would overflow."""

MAX_LOGPROBS = 20
"""Largest accepted ``SamplingParams.logprobs`` (the OpenAI API's limit)."""

MAX_LOGIT_BIAS = 100.0
"""``logit_bias`` values lie in [-100, 100] (the OpenAI API's range)."""

_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
_SAMPLE_SEED_MODULUS = 2**63
"""Derived sample seeds (``SamplingParams.sample``) wrap below this, so they stay in ``_SEED_RANGE``."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return (isinstance(value, float) or _is_int(value)) and math.isfinite(value)  # type: ignore[arg-type]


def _as_tuple(value: Any) -> Any:
    """``stop`` / ``stop_token_ids`` as vLLM's users write them: one string is a stop of its own, a list a tuple;
    anything else is kept for ``validate`` to name."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def _as_id_sequences(value: Any) -> Any:
    """``bad_words_token_ids`` as a tuple of id tuples (lists accepted); anything else is kept as it is."""
    if isinstance(value, (list, tuple)) and all(isinstance(ids, (list, tuple)) for ids in value):
        return tuple(tuple(ids) for ids in value)
    return value


def _as_pairs(value: Any) -> Any:
    """``logit_bias`` as vLLM's users write it: a dict of token id to bias, or a list of pairs, as a tuple of
    ``(id, bias)`` tuples; anything else is kept for ``validate`` to name."""
    if isinstance(value, dict):
        return tuple(value.items())
    if isinstance(value, list):
        return tuple(tuple(pair) if isinstance(pair, list) else pair for pair in value)
    return value


def _require(ok: bool, field: str, accepted: str, value: object) -> None:
    if not ok:
        raise RequestError("invalid_request", f"{field} must be {accepted}, got {value!r}", field)


@attrs.frozen
class SamplingParams:
    """How one request samples and when it stops. Defaults match vLLM / the OpenAI API."""

    temperature: float = 1.0
    """Softmax temperature, >= 0. Values below `GREEDY_EPSILON` (0 in particular) mean greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 = off."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of best tokens with total probability >= top_p; 1.0 = off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the best token's; 0 = off."""
    repetition_penalty: float = 1.0
    """Over prompt + output tokens (HF/vLLM): positive logits divided, negative multiplied; 1.0 = off."""
    presence_penalty: float = 0.0
    """OpenAI semantics over output tokens: subtracted once from the logit of every token already output."""
    frequency_penalty: float = 0.0
    """OpenAI semantics over output tokens: subtracted from a token's logit once per time it was output."""
    seed: int | None = None
    """Per-request seed: the same seed, prompt and params give the same tokens. None = unseeded."""
    n: int = 1
    """Samples per prompt (vLLM's ``n``), expanded by the caller before the engine: the offline ``LLM`` and the
    HTTP routes submit one engine request per sample (``sample``), and admission refuses any other ``n``."""
    max_tokens: int | None = 16
    """Most output tokens to generate (finish reason ``"length"`` when reached). ``None``: admission resolves
    it before the request is queued to ``DEFAULT_MAX_TOKENS`` (1024 by default), never more than the rest of
    the context (``max_model_len`` minus the prompt); with ``DEFAULT_MAX_TOKENS=0``, the rest of the context.
    ``0`` (only with ``prompt_logprobs``): only the prompt is computed (scoring); the request ends
    ``"length"`` with no output token."""
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    """Stop strings: output ends before the first one that appears (or after it, see below)."""
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)
    """Token ids that end the output (in addition to EOS, and even with ``ignore_eos``)."""
    stop_regex: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    """SGLang's regex stops: output ends before the first match of one in the text so far, as with ``stop``
    (``core/stop_regex.py``: each is matched as if the output ended where it is; not with ``min_tokens``)."""
    ignore_eos: bool = False
    """Keep generating after the model's EOS tokens (benchmarks)."""
    logprobs: int | None = None
    """Top logprobs to return per token: None = none, 0 = only the sampled token's, n = it plus the top n."""
    prompt_logprobs: int | None = None
    """Logprobs of the prompt's tokens (vLLM's semantics): None = off, 0 = each prompt token's own logprob
    (the first token has none), k = it plus the top k at that position. A request with it set does not use
    the prefix cache until its prompt logprobs are computed."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or stop token's text) at the end of the output."""
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_pairs)
    """(token id, bias) pairs added to the raw logits before penalties and sampling (OpenAI's ``logit_bias``:
    -100 bans a token in practice, 100 all but forces it). Returned logprobs stay those of the raw model."""
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_as_tuple)
    """vLLM's ``allowed_token_ids``: only these ids may be sampled (None = any)."""
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    """vLLM's ``bad_words``: words never generated. Admission tokenises each (``core/bad_words.py``) into
    ``bad_words_token_ids``; the sampler then bans a sequence's last token wherever the output ends with the
    rest of it (a one-token word: everywhere)."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_as_id_sequences)
    """The token sequences of ``bad_words`` (vLLM's ``_bad_words_token_ids``), filled by admission."""
    min_tokens: int = 0
    """vLLM's ``min_tokens``: nothing ends the output before this many tokens: EOS and ``stop_token_ids``
    are masked out by the sampler and stop strings are not matched until then (``max_tokens`` still caps)."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's EOS ids, filled by admission when ``min_tokens`` is set (the sampler masks them)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text (vLLM's default). Off where a tool-call or reasoning parser
    needs the markers that are special tokens (Gemma 4's ``<|tool_call>``, ``<|channel>``); stop tokens stay
    out of the text either way unless ``include_stop_str_in_output``."""
    constraint: Constraint | None = None
    """Structured output: every sampled token is masked to those the constraint allows (greedy, sampled and
    seeded alike; returned logprobs and top logprobs are those of the masked distribution). Once the
    constraint is complete only EOS is allowed, and the request ends ``"stop"``."""

    def sample(self, index: int) -> SamplingParams:
        """The engine request of sample ``index`` (0-based) of these params' ``n``: one sequence (``n=1``) and,
        when seeded, the seed ``seed + index`` (vLLM's derivation for ``n`` > 1, wrapped below 2**63), so the
        samples differ and each stays reproducible; sample 0 keeps the seed itself."""
        seed = self.seed if self.seed is None or index == 0 else (self.seed + index) % _SAMPLE_SEED_MODULUS
        if self.n == 1 and seed == self.seed:
            return self
        return attrs.evolve(self, n=1, seed=seed)

    def samples(self) -> tuple[SamplingParams, ...]:
        """Each sample's engine params (``sample(0)`` ... ``sample(n - 1)``); an ``n`` that is not an integer >= 1:
        these params alone, unchanged, so that admission refuses them naming ``n``."""
        n = self.n
        if not _is_int(n) or n < 1:
            return (self,)
        return tuple(self.sample(index) for index in range(n))

    def resolved_max_tokens(self) -> int:
        """``max_tokens`` once admission has resolved ``None`` (the rest of the context) to a number."""
        if self.max_tokens is None:
            raise ValueError("max_tokens is unresolved: admission sets it before the request is queued")
        return self.max_tokens

    @property
    def is_greedy(self) -> bool:
        """Whether this request takes the argmax instead of sampling."""
        return self.temperature < GREEDY_EPSILON

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler needs this request's token history."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def needs_token_history(self) -> bool:
        """Whether the runner must see the request's earlier tokens after a reset (penalties count them; a
        constraint's matcher is replayed over them)."""
        return self.uses_penalties or self.constraint is not None or self.bans_after_prefixes

    @property
    def bans_after_prefixes(self) -> bool:
        """Whether a bad word of several tokens makes this request's bans depend on its output so far. (Read for
        every row of every sampled step: the common case, no bad words, returns before building a generator.)"""
        return bool(self.bad_words_token_ids) and any(len(ids) > 1 for ids in self.bad_words_token_ids)

    @property
    def uses_logit_mask(self) -> bool:
        """Whether the sampler must bias or restrict this request's logits (before any output length check)."""
        return (bool(self.logit_bias) or self.allowed_token_ids is not None or self.min_tokens > 0
                or bool(self.bad_words_token_ids))

    def bad_word_bans(self, output_ids: Sequence[int]) -> tuple[int, ...]:
        """The token ids ``bad_words_token_ids`` ban after ``output_ids`` (vLLM's rule: a sequence's last token,
        where the output ends with the rest of it; only output tokens count, not the prompt)."""
        bans = set()
        for ids in self.bad_words_token_ids:
            prefix = ids[:-1]
            if not prefix or (len(output_ids) >= len(prefix) and tuple(output_ids[-len(prefix):]) == prefix):
                bans.add(ids[-1])
        return tuple(sorted(bans))

    def min_tokens_stop_ids(self) -> tuple[int, ...]:
        """Ids that may not be sampled while fewer than ``min_tokens`` tokens are output (vLLM: EOS, unless
        ``ignore_eos``, and ``stop_token_ids``)."""
        eos = () if self.ignore_eos else self.eos_token_ids
        return tuple(sorted({*eos, *self.stop_token_ids}))

    def validate_vocabulary(self, vocab_size: int) -> None:
        """Raise ``RequestError`` naming the token ids of the first field (``stop_token_ids``, ``logit_bias``
        keys or ``allowed_token_ids``) that holds ids outside ``[0, vocab_size)``: every such id of that field
        (up to 20 by name), so a client fixes them in one round trip."""
        groups = (("stop_token_ids", self.stop_token_ids), ("logit_bias", [i for i, _ in self.logit_bias]),
                  ("allowed_token_ids", self.allowed_token_ids or ()),
                  ("bad_words", [i for ids in self.bad_words_token_ids for i in ids]))
        for field, ids in groups:
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                named = ", ".join(map(str, bad[:20])) + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
                plural = "s" if len(bad) > 1 else ""
                raise RequestError("invalid_request", f"{field}: token id{plural} {named} "
                                   f"{'are' if plural else 'is'} outside the vocabulary [0, {vocab_size}) "
                                   f"(vocabulary size {vocab_size})", field)

    def _validate_stop_regex(self) -> None:
        patterns = self.stop_regex
        ok = isinstance(patterns, tuple) and all(isinstance(x, str) and x for x in patterns)
        _require(ok, "stop_regex", "a tuple of non-empty strings", patterns)
        if total_size(patterns) > STOP_REGEX_MAX_SIZE:  # before any is compiled (stop_patterns.STOP_REGEX_MAX_SIZE)
            raise RequestError("invalid_request", "stop_regex: the patterns are too large: their text, counted "
                               f"repetitions and literals come to more than {STOP_REGEX_MAX_SIZE} elements",
                               "stop_regex")
        for pattern in patterns:
            try:
                compile_stop_regex(pattern)
            except ValueError as error:
                raise RequestError("invalid_request", f"stop_regex: {error}", "stop_regex") from None
        if patterns and self.min_tokens:  # a match completed before min_tokens would have to be forgotten
            raise RequestError("invalid_request", "stop_regex cannot be combined with min_tokens", "stop_regex")

    def validate(self) -> None:
        """Raise ``RequestError`` naming the first field out of its accepted range (vLLM's ranges)."""
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        _require(_is_real(t) and t >= 0, "temperature", "a finite number >= 0", t)
        _require(_is_int(k) and k >= -1, "top_k", "-1 or 0 (off) or an integer >= 1", k)
        _require(_is_real(p) and 0 < p <= 1, "top_p", "a number in (0, 1]", p)
        _require(_is_real(m) and 0 <= m <= 1, "min_p", "a number in [0, 1]", m)
        rep, pres, freq = self.repetition_penalty, self.presence_penalty, self.frequency_penalty
        _require(_is_real(rep) and rep > 0, "repetition_penalty", "a finite number > 0", rep)
        _require(_is_real(pres) and -2 <= pres <= 2, "presence_penalty", "a number in [-2, 2]", pres)
        _require(_is_real(freq) and -2 <= freq <= 2, "frequency_penalty", "a number in [-2, 2]", freq)
        seed, (lo, hi) = self.seed, _SEED_RANGE
        ok_seed = seed is None or (_is_int(seed) and lo <= seed <= hi)
        _require(ok_seed, "seed", f"None or an integer in [{lo}, {hi}]", seed)
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        max_tokens, logprobs = self.max_tokens, self.logprobs
        scoring = self.prompt_logprobs is not None
        ok_max = max_tokens is None or (_is_int(max_tokens) and max_tokens >= (0 if scoring else 1))
        _require(ok_max, "max_tokens", "an integer >= 1 (0 only with prompt_logprobs, or echo on /v1/completions)",
                 max_tokens)
        ok_logprobs = logprobs is None or (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS)
        _require(ok_logprobs, "logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", logprobs)
        prompt_logprobs = self.prompt_logprobs
        ok_prompt = prompt_logprobs is None or (_is_int(prompt_logprobs) and 0 <= prompt_logprobs <= MAX_LOGPROBS)
        _require(ok_prompt, "prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", prompt_logprobs)
        ok_stop = isinstance(self.stop, tuple) and all(isinstance(x, str) and x for x in self.stop)
        _require(ok_stop, "stop", "a tuple of non-empty strings", self.stop)
        self._validate_stop_regex()
        words = self.bad_words
        _require(isinstance(words, tuple) and all(isinstance(x, str) and x.strip() for x in words), "bad_words",
                 "a tuple of strings that are not blank", words)
        # filled by admission, or given directly (offline): the sampler bans each one's last id, so an empty one
        # failed the step of every request in its batch
        spelled = self.bad_words_token_ids
        ok_spelled = isinstance(spelled, tuple) and all(
            isinstance(seq, tuple) and seq and all(_is_int(x) and x >= 0 for x in seq) for seq in spelled)
        _require(ok_spelled, "bad_words_token_ids", "a tuple of non-empty tuples of integers >= 0", spelled)
        ids = self.stop_token_ids
        ok_ids = isinstance(ids, tuple) and all(_is_int(x) and x >= 0 for x in ids)
        _require(ok_ids, "stop_token_ids", "a tuple of integers >= 0", ids)
        bias = self.logit_bias
        ok_bias = isinstance(bias, tuple) and all(
            isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and _is_real(pair[1])
            and -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS for pair in bias)
        _require(ok_bias, "logit_bias", f"(token id, bias) pairs with biases in [-{MAX_LOGIT_BIAS:g}, "
                 f"{MAX_LOGIT_BIAS:g}]", bias)  # ids are checked against the vocabulary by validate_vocabulary
        allowed = self.allowed_token_ids
        ok_allowed = allowed is None or (isinstance(allowed, tuple) and len(allowed) > 0
                                         and all(_is_int(x) for x in allowed))
        _require(ok_allowed, "allowed_token_ids", "None or a non-empty tuple of token ids", allowed)
        min_tokens = self.min_tokens
        ok_min = _is_int(min_tokens) and min_tokens >= 0 and (max_tokens is None or min_tokens <= max_tokens)
        _require(ok_min, "min_tokens", "an integer >= 0 and <= max_tokens", min_tokens)
        if self.constraint is not None and min_tokens > 0:  # a complete output allows only EOS, which it holds back
            raise RequestError("invalid_request", "min_tokens cannot be combined with a structured-output "
                               f"constraint ({self.constraint.field})", "min_tokens")
