"""The batched token sampler: one step's logits to one token per row (``SamplingParams`` in ``records``).

The sampler turns one step's logits ``[B, V]`` into one token per row, on the logits' device, in fp32.
Per row, in this order (vLLM v1's order):

0. logit edits (only if some row uses them): ``logit_bias`` added, ids outside ``allowed_token_ids``
   masked, while a row has output fewer than ``min_tokens`` tokens its EOS and stop ids masked, and the
   tokens its ``bad_words`` ban after its output so far masked (``SamplingParams.bad_word_bans``);
1. repetition / presence / frequency penalties (only if some row uses them);
2. greedy rows (``temperature < GREEDY_EPSILON``) take the argmax here and skip the rest;
3. temperature, then min-p, then top-k and top-p (one descending sort shared by both);
4. an exact draw from the remaining distribution: on a GPU by the exponential race ``argmax(probs / q)``,
   ``q ~ Exp(1)`` (one parallel kernel); on the CPU by inverting the row's cumulative distribution in float64 with
   one uniform draw, since drawing a vocabulary's worth of exponentials there costs a decode step's tenth
   (docs/quantization.md). Rows with a ``torch.Generator`` draw from it alone,
   and the runner re-seeds it from (seed, output position) before each draw (``seed_for_position``), so a
   seeded request gets the same tokens whatever else shares its batch and however it was scheduled; other
   rows share one draw from the device's default generator.

Before all of these, a constrained row (structured output) has every token its grammar does not allow set
to ``-inf`` (``apply_token_bitmask``; the bitmask comes from ``grammar_masks``).

Returned logprobs are those of the *raw* model distribution (``log_softmax(logits)`` before penalties,
temperature and truncation), as vLLM returns by default, except on constrained rows: there they are those of
the *masked* distribution (the raw logits with disallowed tokens removed, renormalised), so the sampled token
and every top logprob are tokens the constraint allows.

Host syncs: nothing here reads device memory back. Per-row parameters go to the device in one copy per
batch (`SamplingBatch.from_params`); which stages run is decided from Python-side flags, never from tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from inference_server.backends.transfer import to_device
from inference_server.kernels.token_bitmask_reference import token_bitmask_reference
from inference_server.records.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request; the caller keeps it for the request's whole life and re-seeds it
    with ``seed_for_position`` before each draw."""
    return torch.Generator(device=device).manual_seed(seed)


_MASK64 = (1 << 64) - 1


def seed_for_position(seed: int, output_index: int) -> int:
    """The generator seed of a seeded request's ``output_index``-th token: a splitmix64 mix of both, so each
    token's noise is a function of (seed, position) alone. A request's tokens then do not depend on how it was
    scheduled: not on its batch, nor on a preemption that recomputes it, nor on a draw made for a token that
    overlap computed and discarded."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def argmax_suffices(params: Sequence[SamplingParams], output_lens: Sequence[int]) -> bool:
    """Whether ``sample`` would return, for every row, the argmax of the raw logits and its raw logprob with
    nothing else (no ``TopLogprobs``): then the logits themselves are not needed (the runner's fused greedy
    head). ``output_lens``: tokens each row has output so far (``min_tokens`` counts them). True exactly when
    every row

    * is greedy (``temperature < GREEDY_EPSILON``: stage 2 takes the argmax; top-k/top-p/min-p and seeds are
      then unused),
    * asks for no top logprobs (``logprobs`` None or 0: the sampled token's own logprob is always returned),
    * uses no penalty (repetition, presence, frequency: they change the logits the argmax reads),
    * edits no logit: no ``logit_bias``, no ``allowed_token_ids``, no ``bad_words``, and no ``min_tokens``
      still holding back its stop ids (a row past its ``min_tokens`` has no edit left),
    * has no constraint (its grammar's mask must apply before the argmax: the fused head computes the argmax of
      the unmasked logits, so a step with a constrained row takes the logits and the sampler instead).
    """
    return all(
        p.is_greedy and not p.logprobs and not p.uses_penalties and not p.logit_bias and p.constraint is None
        and p.allowed_token_ids is None and not p.bad_words_token_ids and (p.min_tokens == 0 or n >= p.min_tokens)
        for p, n in zip(params, output_lens, strict=True)
    )


@attrs.frozen(eq=False)
class SamplingBatch:
    """One step's per-row sampling parameters as device tensors, built once per batch by `from_params`.

    The ``bool``/``int`` fields are host-side summaries so that stages no row needs are skipped without
    reading device memory.
    """

    temperature: torch.Tensor  # [B] f32; 1.0 on greedy rows (they never divide)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64; <= 0 = off
    top_p: torch.Tensor  # [B] f32; 1.0 = off
    min_p: torch.Tensor  # [B] f32; 0.0 = off
    repetition_penalty: torch.Tensor  # [B] f32
    presence_penalty: torch.Tensor  # [B] f32
    frequency_penalty: torch.Tensor  # [B] f32
    generators: tuple[torch.Generator | None, ...]  # B entries; a row's own noise source, or None
    all_greedy: bool
    any_greedy: bool
    use_min_p: bool
    use_top_k_top_p: bool
    use_penalties: bool
    num_top_logprobs: int  # columns of `SamplerOutput.top_logprobs` (max over rows); 0 = none
    logit_edits: LogitEdits | None = None  # None when no row biases, restricts or holds back stop ids

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device | str,
        generators: Sequence[torch.Generator | None] | None = None,
        output_lens: Sequence[int] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """Pack B requests' params (one host-to-device copy, two more when a row edits its logits). A row
        with a seed must have a generator; ``output_lens`` (tokens each row has output so far) is needed when
        a row sets ``min_tokens``, ``output_ids`` (each row's output tokens so far) when a row's bad words are
        several tokens long (``SamplingParams.bans_after_prefixes``)."""
        gens = tuple(generators) if generators is not None else (None,) * len(params)
        if len(gens) != len(params):
            raise ValueError(f"{len(gens)} generators for {len(params)} rows")
        for row, (p, g) in enumerate(zip(params, gens, strict=True)):
            if p.seed is not None and g is None:
                raise ValueError(f"row {row} has seed {p.seed} but no generator (see make_generator)")
        columns = [
            [1.0 if p.is_greedy else p.temperature for p in params],
            [float(p.is_greedy) for p in params],
            [float(p.top_k) for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            [p.repetition_penalty for p in params],
            [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params],
        ]
        packed = to_device(torch.tensor(columns, dtype=torch.float32), device)  # [8, B]
        temperature, greedy, top_k, top_p, min_p, rep, pres, freq = packed.unbind(0)
        return cls(
            temperature=temperature,
            greedy=greedy.bool(),
            top_k=top_k.long(),
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
            generators=gens,
            all_greedy=all(p.is_greedy for p in params),
            any_greedy=any(p.is_greedy for p in params),
            use_min_p=any(p.min_p > 0 for p in params),
            use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            use_penalties=any(p.uses_penalties for p in params),
            num_top_logprobs=max((p.logprobs or 0 for p in params), default=0),
            logit_edits=LogitEdits.from_params(params, output_lens, device, output_ids),
        )


@attrs.frozen(eq=False)
class LogitEdits:
    """Sparse per-row logit edits: additive ``(row, id, value)`` entries (``logit_bias``, and ``-inf`` for
    stop ids held back by ``min_tokens`` and for tokens ``bad_words`` ban) and ``(row, id)`` entries of the rows
    restricted to ``allowed_token_ids``. Built on the host from Python-side lengths and output ids: applying
    them never syncs (the runner reads a row's last token back before building them when its bad words need
    it, as for penalties).

    A row's bans can leave it no token at all: ``bad_words`` banning every id its ``allowed_token_ids`` or its
    grammar allow (a grammar that allows only EOS, and EOS banned), or ``min_tokens`` holding back the only
    allowed id. Such a row is sampled without its edits at that step (its grammar's mask still applies): sampling
    from nothing drew an id past the vocabulary on the CPU, which failed the step of every request in the batch.
    Only a batch where some row has both bans and a restriction or a grammar (``may_empty``) pays for the check.
    """

    add_rows: torch.Tensor  # [N] int64
    add_ids: torch.Tensor  # [N] int64
    add_values: torch.Tensor  # [N] f32
    allowed_rows: torch.Tensor  # [M] int64
    allowed_ids: torch.Tensor  # [M] int64
    restricted: torch.Tensor  # [B] bool: the row samples only from its allowed ids
    any_restricted: bool
    may_empty: bool = False  # some row has -inf entries and allowed ids or a grammar: its edits may leave it nothing

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], output_lens: Sequence[int] | None,
                    device: torch.device | str, output_ids: Sequence[Sequence[int]] | None = None,
                    ) -> LogitEdits | None:
        if not any(p.uses_logit_mask for p in params):
            return None
        add_rows: list[int] = []
        add_ids: list[int] = []
        add_values: list[float] = []
        allowed_rows: list[int] = []
        allowed_ids: list[int] = []
        may_empty = False
        for row, p in enumerate(params):
            bans_before = len(add_rows)
            for token_id, bias in p.logit_bias:
                add_rows.append(row)
                add_ids.append(token_id)
                add_values.append(bias)
            if p.min_tokens > 0:
                if output_lens is None:
                    raise ValueError(f"row {row} sets min_tokens but no output_lens were given")
                if output_lens[row] < p.min_tokens:
                    held = p.min_tokens_stop_ids()
                    add_rows += [row] * len(held)
                    add_ids += held
                    add_values += [-math.inf] * len(held)
            if p.bad_words_token_ids:
                if p.bans_after_prefixes and output_ids is None:
                    raise ValueError(f"row {row} bans bad words of several tokens but no output_ids were given")
                banned = p.bad_word_bans(output_ids[row] if output_ids is not None else ())
                add_rows += [row] * len(banned)
                add_ids += banned
                add_values += [-math.inf] * len(banned)
            if p.allowed_token_ids is not None:
                allowed_rows += [row] * len(p.allowed_token_ids)
                allowed_ids += p.allowed_token_ids
            if (p.allowed_token_ids is not None or p.constraint is not None) and -math.inf in add_values[bans_before:]:
                may_empty = True
        restricted = [p.allowed_token_ids is not None for p in params]
        ints = torch.tensor([*add_rows, *add_ids, *allowed_rows, *allowed_ids, *restricted], dtype=torch.int64)
        ints = ints.to(device, non_blocking=True)
        n, m = len(add_rows), len(allowed_rows)
        return cls(
            add_rows=ints[:n], add_ids=ints[n:2 * n],
            add_values=torch.tensor(add_values, dtype=torch.float32).to(device, non_blocking=True),
            allowed_rows=ints[2 * n:2 * n + m], allowed_ids=ints[2 * n + m:2 * n + 2 * m],
            restricted=ints[2 * n + 2 * m:].bool(), any_restricted=any(restricted), may_empty=may_empty)

    def apply(self, work: torch.Tensor) -> None:
        """Edit ``work`` ``[B, V]`` in place."""
        if self.add_rows.numel():
            work.index_put_((self.add_rows, self.add_ids), self.add_values, accumulate=True)
        if self.any_restricted:
            keep = torch.zeros_like(work, dtype=torch.bool)  # [B, V]
            keep[self.allowed_rows, self.allowed_ids] = True
            keep |= ~self.restricted[:, None]
            work.masked_fill_(~keep, -math.inf)


@attrs.frozen(eq=False)
class PenaltyHistory:
    """Token ids the penalties look at, right-padded with -1 (rows without penalties may be empty)."""

    prompt_ids: torch.Tensor  # [B, Lp] int64
    output_ids: torch.Tensor  # [B, Lo] int64

    @classmethod
    def from_lists(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> PenaltyHistory:
        """Pad per-row id lists into two device tensors."""
        return cls(_pad(prompt_ids, device), _pad(output_ids, device))


def _pad(rows: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [[*r, *([-1] * (width - len(r)))] for r in rows]
    return torch.tensor(padded, dtype=torch.int64).reshape(len(rows), width).to(device, non_blocking=True)


@attrs.frozen(eq=False)
class TopLogprobs:
    """The n most likely tokens of each row's raw distribution, best first.

    n is the batch's largest ``params.logprobs``; a row uses its first ``params.logprobs`` columns.
    """

    token_ids: torch.Tensor  # [B, n] int64
    logprobs: torch.Tensor  # [B, n] f32


@attrs.frozen(eq=False)
class SamplerOutput:
    """One step's sampled tokens; all tensors stay on the logits' device."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] f32, log-prob of token_ids under the raw (unprocessed) distribution
    top_logprobs: TopLogprobs | None  # None when no row asked for logprobs >= 1


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    history: PenaltyHistory | None = None,
    token_bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
    row_invariant: bool = False,
) -> SamplerOutput:
    """Sample one token per row of ``logits`` ``[B, V]`` (any float dtype; read, never modified).

    ``history`` is required when ``batch.use_penalties``. ``token_bitmask`` ``[K, ceil(V / 32)]`` int32 (on
    the logits' device): the tokens each of ``bitmask_rows`` ``[K]`` may take (without ``bitmask_rows``: one
    mask per row, ``K = B``; the other rows are unconstrained). Greedy rows give exactly the argmax of the
    (masked, penalised) logits. ``row_invariant`` (``DETERMINISTIC``): each row's log-normaliser is reduced on its
    own, since torch's reduction over ``[B, V]`` picks its split by ``B`` (a row's logprobs then move by an ulp with
    the batch); the mask is applied per row either way.
    """
    writes = token_bitmask is not None or batch.logit_edits is not None or batch.use_penalties or not batch.all_greedy
    # [B, V] scratch, processed in place; an all-greedy batch without edits only reads it: no copy
    work = logits.to(torch.float32, copy=True) if writes else logits.float()
    if token_bitmask is not None:
        apply_token_bitmask(work, token_bitmask, bitmask_rows)
    lse = _log_normalizer(work, row_invariant)  # [B]
    top = _top_logprobs(work, lse, batch.num_top_logprobs)
    if batch.logit_edits is not None:
        unedited = work.clone() if batch.logit_edits.may_empty else None
        batch.logit_edits.apply(work)
        if unedited is not None:  # a row its edits left no token takes its unedited logits (LogitEdits)
            emptied = torch.isneginf(work).all(dim=-1, keepdim=True)  # [B, 1]
            torch.where(emptied, unedited, work, out=work)
    if batch.use_penalties:
        if history is None:
            raise ValueError("a row uses penalties but no PenaltyHistory was given")
        _apply_penalties(work, history, batch)
    token_ids = _choose_tokens(work, batch)  # [B]
    logprobs = logits.gather(1, token_ids[:, None]).squeeze(1).float() - lse  # [B]
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)


def greedy_sample(logits: torch.Tensor, row_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample(logits, batch)``'s ``(token_ids, logprobs)`` ``[B]`` for a batch where ``argmax_suffices`` holds
    (every row greedy, asking for nothing else): the ops ``sample`` runs for it, without building the batch's
    parameters (``SamplingBatch.from_params``: a host-to-device copy and a dozen small ops a step)."""
    work = logits.float()  # what sample reads when nothing writes: no copy of fp32 logits
    lse = _log_normalizer(work, row_invariant)
    token_ids = argmax_rows(work)
    return token_ids, logits.gather(1, token_ids[:, None]).squeeze(1).float() - lse


def _log_normalizer(work: torch.Tensor, row_invariant: bool) -> torch.Tensor:
    """``logsumexp`` of each row of ``work`` ``[B, V]`` (fp32) -> ``[B]``; ``row_invariant``: row by row (see
    ``sample``)."""
    if row_invariant and work.is_cuda and work.stride(-1) == 1:
        # imported here: a CPU server never loads Triton (see apply_token_bitmask)
        from inference_server.kernels.row_logsumexp import row_logsumexp

        return row_logsumexp(work)  # one program a row, one fixed order: one launch for the batch
    if row_invariant:
        return torch.stack([torch.logsumexp(row, dim=-1) for row in work])  # one reduction shape per row
    return torch.logsumexp(work, dim=-1)


MIN_LOGPROB = -9999.0
"""Floor of returned top logprobs (vLLM's): a token a constraint masks out has logprob ``-inf``, which JSON
cannot carry; it is listed at this value when a row asks for more top logprobs than its grammar allows."""


def apply_token_bitmask(work: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set ``work[rows[k]]`` (``work`` ``[B, V]``) to ``-inf`` wherever bit ``i % 32`` of word ``i // 32`` of
    ``bitmask[k]`` (``[K, ceil(V / 32)]`` int32) is clear, token ``i`` disallowed; ``rows`` None: ``K = B``,
    row by row. Other rows are untouched. On the device, no host sync: one Triton launch on a GPU
    (``kernels.token_bitmask``), its torch reference elsewhere."""
    if rows is None:
        rows = torch.arange(bitmask.shape[0], device=work.device)
    if work.is_cuda:
        # imported here: the kernel's module imports Triton, which no CPU server loads (0.2 s, at start-up or in
        # the first constrained request's step, where it stalled every stream)
        from inference_server.kernels.token_bitmask import apply_token_bitmask_

        apply_token_bitmask_(work, bitmask, rows)
    else:
        token_bitmask_reference(work, bitmask, rows)


def _top_logprobs(logits: torch.Tensor, lse: torch.Tensor, n: int) -> TopLogprobs | None:
    if n == 0:
        return None
    values, ids = logits.topk(min(n, logits.shape[-1]), dim=-1)  # [B, n], sorted descending
    return TopLogprobs(token_ids=ids, logprobs=(values - lse[:, None]).clamp_(min=MIN_LOGPROB))


def _choose_tokens(work: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    greedy_ids = argmax_rows(work) if batch.any_greedy else None  # [B]
    if greedy_ids is not None and batch.all_greedy:
        return greedy_ids
    work.div_(batch.temperature[:, None])
    if batch.use_min_p:
        _apply_min_p(work, batch.min_p)
    if batch.use_top_k_top_p:
        _apply_top_k_top_p(work, batch.top_k, batch.top_p)
    probs = work.softmax(dim=-1)  # [B, V]
    draw = _inverse_cdf if probs.device.type == "cpu" else _exponential_race
    sampled = draw(probs, batch.generators)  # [B]
    return sampled if greedy_ids is None else torch.where(batch.greedy, greedy_ids, sampled)


ARGMAX_BLOCK = 1024
"""Columns per block of ``argmax_rows``' first pass."""


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of ``x`` ``[B, V]``: the first maximum of each row (a NaN counts as the maximum, as there). On
    the CPU, where torch's ``argmax`` is a scalar loop and ``amax`` a vector one, in two passes when the blocks
    divide V: the maxima of blocks of ``ARGMAX_BLOCK`` columns, then the argmax inside the first block holding the
    row's maximum (the first maximum of the row, so the same index)."""
    rows, vocab = x.shape
    if x.device.type != "cpu" or vocab % ARGMAX_BLOCK or vocab <= ARGMAX_BLOCK:
        return x.argmax(dim=-1)
    blocks = x.view(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [B]: each row's first block holding its maximum
    within = blocks[torch.arange(rows), best].argmax(dim=-1)  # [B]
    return best * ARGMAX_BLOCK + within


def _bin_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, L]`` ids (-1 = padding) -> ``[B, V]`` f32 occurrence counts."""
    index = torch.where(ids < 0, vocab_size, ids)  # [B, L]; padding lands in a spare column
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))  # [B, V + 1]
    return counts[:, :vocab_size]


def _apply_penalties(work: torch.Tensor, history: PenaltyHistory, batch: SamplingBatch) -> None:
    rows, vocab_size = work.shape
    if history.prompt_ids.shape[0] != rows or history.output_ids.shape[0] != rows:
        raise ValueError(f"PenaltyHistory has {history.prompt_ids.shape[0]} rows, logits have {rows}")
    output_counts = _bin_counts(history.output_ids, vocab_size)  # [B, V]
    seen = (output_counts > 0) | (_bin_counts(history.prompt_ids, vocab_size) > 0)  # [B, V]
    rep = torch.where(seen, batch.repetition_penalty[:, None], 1.0)  # [B, V]
    work.copy_(torch.where(work > 0, work / rep, work * rep))
    work.sub_(batch.frequency_penalty[:, None] * output_counts)
    work.sub_(batch.presence_penalty[:, None] * (output_counts > 0))


def _apply_min_p(work: torch.Tensor, min_p: torch.Tensor) -> None:
    probs = work.softmax(dim=-1)  # [B, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    work.masked_fill_(probs < threshold, -math.inf)


def _apply_top_k_top_p(work: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask (to -inf) everything outside each row's top-k, then outside its top-p of what is left."""
    vocab_size = work.shape[-1]
    sorted_logits, order = work.sort(dim=-1, descending=True)  # [B, V] each
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)  # [B]
    ranks = torch.arange(vocab_size, device=work.device)  # [V]
    sorted_logits.masked_fill_(ranks[None, :] >= k[:, None], -math.inf)
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V] mass of strictly better-ranked tokens
    outside_p = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # the best token always stays
    sorted_logits.masked_fill_(outside_p, -math.inf)
    work.scatter_(1, order, sorted_logits)


def _inverse_cdf(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One exact sample per row of ``probs`` ``[B, V]``: the first token whose float64 cumulative probability
    exceeds ``u * total``, ``u ~ U[0, 1)``: a token of probability 0 adds nothing to the sum and is never chosen, and
    float64 resolves shares of the sum down to ~1e-16, the uniform draw's own resolution. Each row's cumulative sum
    runs along its own row, so a row's draw does not depend on the batch."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    u = torch.empty_like(total)
    seeded = [row for row, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        u.uniform_()
    for row in seeded:
        u[row].uniform_(generator=generators[row])
    # u * total can round up to total, past which lies only the plateau of trailing zeros: kept below it
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # [B]


def _exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One exact sample per row of ``probs`` ``[B, V]`` (consumed): ``argmax(probs / q)``, ``q ~ Exp(1)``."""
    q = torch.empty_like(probs)  # [B, V]
    seeded = [row for row, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        q.exponential_()
    for row in seeded:
        q[row].exponential_(generator=generators[row])
    q.clamp_(min=torch.finfo(q.dtype).tiny)  # a zero draw would turn 0/0 into a NaN "winner"
    return probs.div_(q).argmax(dim=-1)
