"""The ``custom-cuda`` step runner: Triton kernels for attention, KV store, MoE and RMSNorm, decode in CUDA graphs.

What it changes against the reference ``ModelRunner`` (same ``execute(plan) -> StepResult`` contract):

* Ops: installs the Triton fused MoE, the Triton RMSNorm and the Triton q/k RoPE through
  ``architectures.ops.use_ops`` (process-wide; it re-installs them at every step so a reference runner in the same
  process, run under ``ops.reference_ops()``, cannot leave the wrong ones behind). Attention goes through
  ``PagedAttentionContext`` with the Triton store, prefill and decode kernels. The decode kernel gets a fixed
  ``max_context_len`` (the engine's model length), so its split count depends on the batch size only: eager
  and graphed steps of the same batch run identical kernels.
* Weights and KV stay in the dtype they were built with (bf16 on CUDA); rope tables move to the device once.
* Steps of 1-2 tokens run the routed experts as the MoE decode GEMVs (``kernels.moe_decode``, two launches), larger
  ones as the grouped GEMMs. A Gemma 4 MoE layer's dense MLP runs beside them at those sizes: its gate/up GEMV in the
  router's launch, its down GEMV in the experts' gate/up launch (``kernels.mlp_beside_experts``). Float projections
  of small steps take the Triton GEMV where this GPU's tuning sweep timed it faster than cuBLAS (tuned files in
  ``kernels/configs/dense_linear``), cuBLAS elsewhere.
* Greedy sampling: when every sampled row takes the argmax and asks for nothing else, the lm_head and the
  greedy choice run as one fused GEMV (``kernels.greedy_head``) instead of the full
  logits and the sampler; prompt logprobs and every other sampling request keep the full logits.
* Decode-only steps of at most ``max_batch_size`` sequences replay a CUDA graph of the smallest bucket that
  holds them (``cuda_graphs.DecodeGraphs``); steps with prefill chunks run eagerly. The graph ends at the
  final hidden states: logits and sampling run outside it, on the sampled rows only.
* No host syncs inside the forward (every kernel wrapper sizes its grid from shapes; the reference paths
  with ``.tolist()`` are not used). The sampled tokens come back through pinned memory behind an event,
  so ``launch`` returns while the step runs (``model_runner``'s overlap contract).
* ``compile=True`` wraps the model in ``torch.compile`` (default mode): Inductor fuses the elementwise ops
  (norms, RoPE, routing, residuals) between the Triton kernels, which stay opaque to the compiler (a graph
  break at each attention call and each MoE call; traced through Inductor, the decode kernel's float scale
  became an fp64 constant that its loop rejects, seen with torch 2.11 / Triton 3.6). The decode
  graphs then capture the compiled code after a warm-up per bucket.

Overlap needs no second set of static buffers: ``DecodeGraphs.stage`` for step N+1 enqueues its copies on
the same stream as step N's replay, so they land after step N has read the buffers.
"""

from __future__ import annotations

import functools
import time

import torch

from inference_server.backends import deterministic
from inference_server.backends.cuda.attention_ops import (
    OpaqueAttentionContext,
    TritonNormRopeDecode,
    triton_qk_norm_rope,
    triton_qk_norm_rope_store,
)
from inference_server.backends.cuda.moe_ops import (
    triton_add_norm_linear_route,
    triton_fused_moe,
    triton_linear_route,
    triton_mlp_beside_experts,
)
from inference_server.backends.cuda.norm_ops import (
    triton_add_rms_norm,
    triton_norm_add,
    triton_rms_norm,
    triton_rope_cos_sin,
)
from inference_server.backends.cuda.options import (
    DENSE_GEMV_MAX_TOKENS,
    MOE_DECODE_MAX_TOKENS,
    CudaRunnerOptions,
    early_release_classes_for,
)
from inference_server.backends.cuda.projection_ops import (
    dense_linear_takes,
    triton_add_norm_projection,
    triton_dense_linear,
    triton_gated_activation,
    triton_gated_projection,
    triton_norm_add_gated_projection,
)
from inference_server.backends.cuda_graphs import DecodeGraphs
from inference_server.backends.model_runner import LaunchedStep, ModelRunner
from inference_server.backends.paged_kv import PagedAttentionContext, PagedKVStorage, StepTensors
from inference_server.config import Settings
from inference_server.kernels.decode_attention import paged_decode_attention
from inference_server.kernels.dense_linear import dense_linear
from inference_server.kernels.greedy_head import ROW_BLOCKS, greedy_head, greedy_head_of_logits, greedy_head_supports
from inference_server.kernels.int8_linear import int8_linear as triton_int8_linear
from inference_server.kernels.kv_store import store_kv
from inference_server.kernels.pdl import use_early_release, use_pdl
from inference_server.kernels.prefill_attention import paged_prefill_attention
from inference_server.kernels.rope import rope_qk_
from inference_server.kernels.router import triton_route
from inference_server.kernels.streamed_linear import GEMV_MAX_TOKENS
from inference_server.models.architectures import layers, ops
from inference_server.models.architectures.blocks import GatedMLP, SelfAttention
from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.architectures.gemma4 import Gemma4Router
from inference_server.models.loading.source import LoadedModel
from inference_server.models.spec import ModelSpec
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan
from inference_server.startup import phase
from inference_server.telemetry import profiler_ranges


class CudaModelRunner(ModelRunner):
    """``ModelRunner`` with Triton kernels and bucketed decode graphs (see the module docstring)."""

    def __init__(self, model: CausalLM, spec: ModelSpec, storage: PagedKVStorage, device: torch.device,
                 options: CudaRunnerOptions) -> None:
        kernels = options.kernels
        decode = functools.partial(paged_decode_attention, max_context_len=options.max_model_len)
        super().__init__(model, spec, storage, device, attention_kwargs=dict(
            store=store_kv, prefill_attention=paged_prefill_attention, decode_attention=decode,
            norm_rope_store=triton_qk_norm_rope_store if kernels else None,
            norm_rope_decode=TritonNormRopeDecode(options.max_model_len) if kernels else None))
        self.options = options
        self.early_release = early_release_classes_for(spec.hidden_size)
        """The loop classes whose kernels release their PDL dependent right after their wait in this runner's steps."""
        # Under torch.compile the Triton kernels are called eagerly (graph breaks) and the norm is left to
        # Inductor, which fuses the reference ops into their neighbours.
        self._context_cls = OpaqueAttentionContext if options.compile else PagedAttentionContext
        self.moe_decode_max_tokens = 0 if options.reference_ops else MOE_DECODE_MAX_TOKENS
        moe = functools.partial(triton_fused_moe, decode_max_tokens=self.moe_decode_max_tokens)
        self._moe = torch.compiler.disable(moe) if options.compile else moe
        # int8 weight-only layers (QUANTIZATION=int8): the Triton GEMV/GEMM, opaque to torch.compile like the MoE
        self._int8_linear = torch.compiler.disable(triton_int8_linear) if options.compile else triton_int8_linear
        self._norm: layers.NormFn = layers.rms_norm if options.compile else triton_rms_norm
        # One Triton launch rotates q and k in place (ten elementwise kernels per layer in the reference).
        self._rope = layers.reference_rope_qk if options.compile else rope_qk_
        self._add_norm = triton_add_rms_norm if kernels else ops.torch_add_rms_norm
        # One launch for softmax, top-k, renormalisation, per-expert scale and cast (five to seven kernels).
        self._route = triton_route if kernels else ops.torch_route
        # The router GEMV in the same launch at decode sizes (the GEMV is all launch cost there), and the residual
        # add + norm before it (Qwen3-MoE's post-attention norm) too.
        self._linear_route = triton_linear_route if kernels else ops.torch_linear_route
        self._add_norm_route = triton_add_norm_linear_route if kernels else ops.torch_add_norm_linear_route
        # q/k norms + RoPE (+ value norm): one launch instead of three (four on Gemma 4) per attention layer.
        self._qk_norm = triton_qk_norm_rope if kernels else ops.torch_qk_norm_rope
        # RoPE tables: one launch a layer type instead of seven.
        self._rope_tables = triton_rope_cos_sin if kernels else layers.rope_cos_sin
        # Gemma 4's sandwich norms: one launch instead of two to four per use.
        self._norm_add = triton_norm_add if kernels else ops.torch_norm_add
        # act(gate) * up: one launch instead of two per dense MLP.
        self._gated = triton_gated_activation if kernels else ops.torch_gated_activation
        # Small-M float projections on the Triton GEMV where this GPU's sweep timed it faster than cuBLAS; cuBLAS
        # elsewhere. The same bound for the GEMVs fused with the gated activation, the norms and the router.
        dense_max = DENSE_GEMV_MAX_TOKENS if kernels else None
        self._dense_gemv = kernels  # also the greedy head's 1-2 row GEMV path (_head_gemv_logits)
        # The gate/up GEMV with the gated activation in its epilogue (same bits as the two launches it replaces).
        self._gated_projection = functools.partial(triton_gated_projection, dense_max_tokens=dense_max) \
            if kernels else ops.torch_gated_projection
        # Gemma 4's dense MLP and routed experts: two launches of paired work instead of four in a chain.
        self._mlp_beside_experts = functools.partial(
            triton_mlp_beside_experts, decode_max_tokens=self.moe_decode_max_tokens, dense_max_tokens=dense_max) \
            if kernels else ops.torch_mlp_beside_experts
        # Gemma 4 PLE layers' post-FFN add feeding the per-layer-input gate: one launch instead of two at decode.
        self._norm_add_gated_projection = functools.partial(triton_norm_add_gated_projection,
                                                            dense_max_tokens=dense_max) \
            if kernels else ops.torch_norm_add_gated_projection
        # Qwen3-MoE's input add + norm feeding the fused q/k/v GEMV: one launch instead of two at decode.
        self._add_norm_projection = functools.partial(triton_add_norm_projection, dense_max_tokens=dense_max) \
            if kernels else ops.torch_add_norm_projection
        self._linear: ops.LinearFn = functools.partial(triton_dense_linear, max_tokens=DENSE_GEMV_MAX_TOKENS) \
            if kernels else torch.nn.functional.linear
        if not options.reference_ops:
            for module in model.modules():
                if isinstance(module, SelfAttention):
                    module.fuse_qkv()
                elif isinstance(module, GatedMLP):
                    module.fuse_gate_up()
                elif isinstance(module, Gemma4Router):
                    module.fold_scale()
        if options.deterministic:
            self.use_table(deterministic.cuda_table())
        self._install_ops()
        model.model.place_rope_tables(device)
        self._model_fn = torch.compile(model) if options.compile else model
        self.graph_steps = 0  # decode steps that ran as a graph (tests and telemetry)
        self.eager_steps = 0
        self.capture_seconds = 0.0
        self.graphs: DecodeGraphs | None = None
        if options.cuda_graphs:
            max_blocks = -(-options.max_model_len // storage.block_size) + 1  # one block of slack
            self.graphs = DecodeGraphs(self._graph_forward, max_batch=options.max_batch_size,
                                       num_groups=self.num_groups, max_blocks=max_blocks,
                                       block_size=storage.block_size, device=device, capture=options.capture)
            started = time.perf_counter()
            self.graphs.capture()
            self.capture_seconds = time.perf_counter() - started
        started = time.perf_counter()
        self.warm_up_eager(options.eager_warmup_tokens)
        if device.type == "cuda":
            self.warm_up_greedy_head()
        self.eager_warmup_seconds = time.perf_counter() - started

    def use_table(self, table: deterministic.KernelTable) -> None:
        """Run ``table``'s ops instead of this runner's (``DETERMINISTIC``), with the sampler's per-row reductions."""
        self._linear = table.linear or self._linear
        self._norm = table.norm or self._norm
        self._moe = table.fused_moe or self._moe
        self._int8_linear = table.int8_linear or self._int8_linear
        self.attention_kwargs.update(table.attention_kwargs())
        self.deterministic = True

    def warm_up_eager(self, token_counts: tuple[int, ...]) -> None:
        """Run one eager step of each size in ``token_counts`` (one greedy sequence, prefilled from 0).

        Triton compiles a kernel the first time it meets a new variant (block sizes chosen from the step's
        token count, e.g. the fused MoE's BLOCK_M); a variant first met while serving stalls the device for
        seconds (steps of seconds at a wave of new prompts). Run at start-up only: the
        steps write their KV through block 0 of each group, which no sequence holds yet."""
        if not token_counts:
            return
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        with phase("compiling eager step kernels", total=len(token_counts), unit="step sizes") as progress:
            for count in progress.wrap(token_counts):
                tables = tuple((0,) * -(-count // self.block_size) for _ in range(self.num_groups))
                sequence = ScheduledSequence(request_id=-1, token_ids=(0,) * count, cached_len=0,
                                             block_tables=tables, sample=True, sampling=greedy, reset=True,
                                             prompt_len=count)
                self.collect(self.launch(StepPlan(step_id=-1, sequences=(sequence,))))
                self.forget((-1,))
        # The counters describe serving: a 1-token warm-up step fits a decode graph and would count as one.
        self.eager_steps = self.graph_steps = 0
        self.tokens_computed = 0

    def _head_operands(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(weight [V, H], scale [V] or None)`` of the head for the fused greedy head: the float weight, or an
        int8 head's (``CausalLM.int8_head``); None under ``reference_ops``."""
        if self.options.reference_ops:
            return None
        weight = self.model.head_weight()
        return (weight, None) if weight is not None else self.model.int8_head()

    def _greedy_head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused greedy head where it takes the head: a float weight of the hidden
        rows' dtype or an int8 one with its scales, and at most ``MAX_ROWS`` rows; at 1-2 rows
        the head's CUDA-core GEMV and ``greedy_head_of_logits`` instead. None (the unfused path) otherwise."""
        head = self._head_operands()
        if head is None or not greedy_head_supports(hidden, *head):
            return None
        weight, scale = head
        softcap = self.model.spec.final_logit_softcapping
        if hidden.shape[0] <= GEMV_MAX_TOKENS:
            # 1-2 rows: the head's CUDA-core GEMV streams the weight faster than the fused head's tensor-core tiles
            # (int8 always; bf16 where this GPU's sweep tuned the logits GEMV: bench/greedy_head.py,
            # docs/benchmarks.md), so the GEMV writes the logits and two short launches reduce them as the fused
            # head would.
            logits = self._head_gemv_logits(hidden, weight, scale)
            if logits is not None:
                return greedy_head_of_logits(logits, softcap)
            if scale is not None:
                return None  # the unfused path's int8 GEMV and the sampler
        return greedy_head(hidden, weight, softcap, scale=scale)

    def _head_gemv_logits(self, hidden: torch.Tensor, weight: torch.Tensor,
                          scale: torch.Tensor | None) -> torch.Tensor | None:
        """The raw logits ``[N, V]`` of 1-2 hidden rows through the head's CUDA-core GEMV:
        ``ops.int8_linear``'s kernel for an int8 head, the Triton GEMV for a float head where this GPU's sweep
        timed it faster than cuBLAS (``dense_linear_takes``, tuned shapes only); None where neither applies."""
        if scale is not None:
            return triton_int8_linear(hidden, weight, scale)
        if self._dense_gemv and dense_linear_takes(hidden, weight, None, max_tokens=GEMV_MAX_TOKENS):
            return dense_linear(hidden, weight)
        return None

    def warm_up_greedy_head(self) -> None:
        """Compile the greedy head's variants that decode batches up to ``max_batch_size`` meet (the fused head's, one
        per ``greedy_head.ROW_BLOCKS`` entry, and the 1-2 row GEMV path's), so that none compiles mid-serving (a
        stall of a second or more)."""
        head = self._head_operands()
        if head is None:
            return
        weight, scale = head
        dtype = scale.dtype if scale is not None else weight.dtype  # the activations' (an int8 head's scale has it)
        # through the serving path: 1 and 2 rows (the GEMV path where it applies, each its own GEMV config), then the
        # fewest rows of each fused block (3 rows: the first block's, which 1-2 rows no longer reach)
        for rows in sorted({1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1, *(block + 1 for block in ROW_BLOCKS[:-1])}):
            hidden = torch.zeros(rows, weight.shape[1], dtype=dtype, device=weight.device)
            if rows <= self.options.max_batch_size:
                self._greedy_head(hidden)

    def _install_ops(self) -> None:
        use_pdl(self.options.pdl and not self.options.reference_ops)  # process-wide, like the ops
        use_early_release(self.early_release)
        ops.use_ops(moe=self._moe, norm=self._norm, rope=self._rope, router=self._route,
                    weights_fused=not self.options.reference_ops, gated=self._gated, add_norm=self._add_norm,
                    qk_norm=self._qk_norm, sandwich=self._norm_add, int8_linear=self._int8_linear,
                    linear_router=self._linear_route, linear=self._linear, add_norm_router=self._add_norm_route,
                    gated_proj=self._gated_projection, rope_tables=self._rope_tables,
                    mlp_experts=self._mlp_beside_experts, norm_add_gated=self._norm_add_gated_projection,
                    add_norm_proj=self._add_norm_projection)

    def _graph_forward(self, ids: torch.Tensor, step: StepTensors) -> torch.Tensor:
        self._install_ops()
        return self._model_fn(ids, self._context_cls(self.storage, step, **self.attention_kwargs))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        self._install_ops()
        return super().launch(plan)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Graph replay for decode-only steps that fit a bucket, eager otherwise."""
        step_id = plan.step_id
        if self.graphs is not None and self.graphs.fits(plan.sequences):
            with profiler_ranges.phase("stage", step_id):
                bucket = self.graphs.stage(plan.sequences)
                self._resolve_pending(self.graphs.step_view(bucket)[0], plan)
            with profiler_ranges.phase("forward", step_id):
                hidden = self.graphs.run(bucket)  # [bucket, H], padded rows unread
            self.graph_steps += 1
            return hidden
        self.eager_steps += 1
        return super()._forward(plan)  # eager, through this runner's model function and context class


def eager_warmup_sizes(step_token_budget: int) -> tuple[int, ...]:
    """Step sizes to compile at start-up: the budget, then halving down to 1 (each MoE BLOCK_M class and
    alignment chunking a prefill-carrying step can meet lies on this ladder), largest first."""
    sizes, size = [], max(1, step_token_budget)
    while size >= 1:
        sizes.append(size)
        size //= 2
    return tuple(sizes)


def build_cuda_runner(settings: Settings, loaded: LoadedModel, storage: PagedKVStorage, device: torch.device, *,
                      max_model_len: int, step_token_budget: int = 0) -> CudaModelRunner:
    """The ``custom-cuda`` runner for the engine: graphs for batches up to ``MAX_BATCH_SIZE`` (``CUDA_GRAPHS``),
    ``torch.compile`` with ``CUSTOM_BACKEND_COMPILE``. Block tables are sized for the engine's
    ``max_model_len`` (``factory.engine_limits``: already capped by the full-attention pool)."""
    warmup = eager_warmup_sizes(min(step_token_budget, max_model_len)) if step_token_budget and device.type == "cuda" \
        else ()
    options = CudaRunnerOptions(max_model_len=max_model_len, max_batch_size=settings.max_batch_size,
                                eager_warmup_tokens=warmup,
                                cuda_graphs=settings.cuda_graphs, capture=device.type == "cuda",
                                compile=settings.custom_backend_compile,
                                reference_ops=settings.deterministic, deterministic=settings.deterministic)
    return CudaModelRunner(loaded.model, loaded.spec, storage, device, options)
