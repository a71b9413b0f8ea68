"""The Hugging Face baseline step runner (``BACKEND=hf``): the scheduler's plans run on a stock transformers
model, with per-sequence caches and optional KV eviction under a budget.

It is a ``ModelRunner`` for everything around the forward: per-request sampling state, the engine's batched
sampler, prompt logprobs, pending tokens under overlap and ``launch``/``collect``. Only the forward differs:

* Each sequence has its own ``SequenceKV`` (keyed by request id), dropped when the request ends, is preempted
  (its next chunk has ``reset``) or aborted (``finished_request_ids``). The scheduler's block tables are
  accounting only: this runner stores no paged KV, and the radix prefix cache is off with it.
* A step runs as few forwards as transformers allows: all its decodes in one (rows left-padded to a common
  past length per layer, ``StepCache``), then each prefill chunk on its own (a chunk is split into pieces of at
  most half the budget when evicting, so a piece never crowds its own context out of the cache).
* Attention is transformers' SDPA, or the model's eager attention when the policy needs the weights, behind a
  registered attention function that builds the mask from each key's position (``attention.py``).
* With a policy (``KV_EVICTION``), every layer is cut to ``budget - incoming`` tokens before a forward, so no
  layer ever holds more than ``KV_BUDGET_TOKENS``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from inference_server.backends.hf.attention import register_attention
from inference_server.backends.hf.eviction_config import EvictionConfig
from inference_server.backends.hf.rope import KeyRotation
from inference_server.backends.hf.sequence_kv import SequenceKV
from inference_server.backends.hf.step_cache import CURRENT_STEP, StepCache, StepRow
from inference_server.backends.hf_eviction import EvictionPolicy, make_policy
from inference_server.backends.model_runner import ModelRunner
from inference_server.config import Settings
from inference_server.models.spec import ModelSpec
from inference_server.records.steps import ScheduledSequence, StepPlan
from inference_server.telemetry import profiler_ranges


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Per layer: the sliding window (``layer_types`` of the config), None for full attention."""
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    window = getattr(config, "sliding_window", None)
    return tuple(window if kind == "sliding_attention" and window else None for kind in types)


class HFModelRunner(ModelRunner):
    """See the module docstring. ``forwards`` counts model calls (tests check that decodes are batched)."""

    def __init__(self, model: Any, spec: ModelSpec, device: torch.device,
                 eviction: EvictionConfig | None = None) -> None:
        self._init_step_state(device)
        self.spec = spec
        model.set_attn_implementation(register_attention())
        self.hf_model: Any = model.eval()
        self.eviction = eviction or EvictionConfig()
        self.policy: EvictionPolicy | None = make_policy(self.eviction.policy, sink_tokens=self.eviction.sink_tokens)
        self.pinned = self.eviction.sink_tokens if self.eviction.policy == "sink" else 0
        self.windows = layer_windows(model.config)
        self.rotation = KeyRotation(model)
        self.caches: dict[int, SequenceKV] = {}
        self.forwards = 0
        self.batch_decodes = True  # False: one forward per decoding sequence (the baseline of the batching)
        self._head: Any = model.get_output_embeddings()
        self._softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        self._hidden_size = int(model.config.hidden_size)
        self._base: Any = model.base_model
        takes_cache = "cache" in inspect.signature(self._base.forward).parameters
        self._cache_kwarg = "cache" if takes_cache else "past_key_values"  # transformers < 5.24: past_key_values

    # -- per-request state ---------------------------------------------------------------------------
    def forget(self, request_ids: tuple[int, ...]) -> None:
        super().forget(request_ids)
        for request_id in request_ids:
            self.caches.pop(request_id, None)

    def _cache_for(self, seq: ScheduledSequence) -> SequenceKV:
        kv = self.caches.get(seq.request_id)
        if kv is None or seq.reset:
            kv = SequenceKV(self.windows)
            self.caches[seq.request_id] = kv
        if kv.seen != seq.cached_len:
            raise RuntimeError(f"request {seq.request_id}: the plan starts at position {seq.cached_len} but its "
                               f"cache holds {kv.seen} tokens (the hf backend needs the prefix cache off)")
        return kv

    # -- the forward -------------------------------------------------------------------------------
    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._head(hidden)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Hidden states [T, H] of every token of the plan, in plan order."""
        with profiler_ranges.phase("stage", plan.step_id):
            ids = self._input_ids(plan)
            decodes: list[tuple[SequenceKV, int, int, int]] = []
            chunks: list[tuple[SequenceKV, int, int, int]] = []
            offset = 0
            for seq in plan.sequences:
                count = len(seq.token_ids)
                (decodes if count == 1 else chunks).append((self._cache_for(seq), seq.cached_len, offset, count))
                offset += count
        hidden = torch.empty(plan.num_tokens, self._hidden_size, dtype=self.hf_model.dtype, device=self.device)
        with profiler_ranges.phase("forward", plan.step_id):
            for group in ([decodes] if self.batch_decodes else [[row] for row in decodes]) if decodes else []:
                self._run_rows(ids, hidden, group)
            piece = self.eviction.piece_tokens if self.policy is not None else None
            for kv, start, first, count in chunks:
                step = piece or count
                for done in range(0, count, step):
                    self._run_rows(ids, hidden, [(kv, start + done, first + done, min(step, count - done))])
        return hidden

    def _run_rows(self, ids: torch.Tensor, hidden: torch.Tensor,
                  rows: Sequence[tuple[SequenceKV, int, int, int]]) -> None:
        """One forward over ``rows`` (cache, first position, first row in ``ids``, token count); writes their
        hidden states into ``hidden`` at the same rows as ``ids``."""
        if self.policy is not None:
            for kv, _, _, count in rows:
                kv.make_room(self.policy, self.eviction.budget, count, self.rotation.shift, self.pinned)
        width = max(count for *_, count in rows)
        step = StepCache([StepRow(kv, start, count) for kv, start, _, count in rows], width, self.policy,
                         self.device)
        offsets = torch.tensor([first for _, _, first, _ in rows], device=self.device)
        counts = torch.tensor([count for *_, count in rows], device=self.device)
        columns = torch.arange(width, device=self.device)
        source = offsets[:, None] + torch.minimum(columns[None, :], counts[:, None] - 1)  # [B, N]
        shifts = torch.tensor([kv.rope_shift for kv, *_ in rows], device=self.device)
        positions = step.query_positions
        rope_positions = torch.where(positions >= self.pinned, positions - shifts[:, None], positions)
        token = CURRENT_STEP.set(step)
        try:
            out = self._base(input_ids=ids[source], position_ids=rope_positions, use_cache=True,
                             **{self._cache_kwarg: step}).last_hidden_state  # [B, N, H]
        finally:
            CURRENT_STEP.reset(token)
        step.commit()
        self.forwards += 1
        valid = step.query_valid
        hidden[source[valid]] = out[valid].to(hidden.dtype)


def build_hf_runner(settings: Settings, model: Any, spec: ModelSpec,
                    device: torch.device) -> HFModelRunner:
    return HFModelRunner(model, spec, device,
                         EvictionConfig(settings.kv_eviction, settings.kv_budget_tokens, settings.kv_sink_tokens))
