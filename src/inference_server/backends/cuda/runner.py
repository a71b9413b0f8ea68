"""The ``custom-cuda`` step runner: Triton kernels for attention, KV store, MoE and RMSNorm, decode in CUDA graphs.

What it changes against the reference ``ModelRunner`` (same ``execute(plan) -> StepResult`` contract):

* Ops: its model computes through the table ``op_table.cuda_ops`` builds from the options once (the Triton fused
  MoE, RMSNorm, q/k RoPE and the fusions of ``backends/cuda/*_ops.py``), bound to the model at construction; PDL's
  mode (``kernels.pdl``) is scoped to this runner's launches and graph capture. Nothing is process-wide, so a
  reference runner of another model in the same process keeps its own ops. Attention goes through
  ``PagedAttentionContext`` with the Triton store, prefill and decode kernels (``op_table.cuda_attention_kwargs``).
  The decode kernel gets a fixed ``max_context_len`` (the engine's model length), so its split count depends on the
  batch size only: eager and graphed steps of the same batch run identical kernels.
* ``DETERMINISTIC`` (``options.deterministic``): the batch-invariant table and the aligned prefill attention for
  every step (decode graphs included) over the ``reference_ops`` set, and per-row sampling reductions: a row's
  tokens and logprobs do not depend on the batch (docs/architecture.md, Deterministic inference).
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

Overlap needs no second set of static buffers: ``DecodeGraphs.stage`` for step N+1 enqueues its copies on
the same stream as step N's replay, so they land after step N has read the buffers.
"""

from __future__ import annotations

import time

import torch

from inference_server.backends.cuda.op_table import cuda_attention_kwargs, cuda_ops
from inference_server.backends.cuda.options import CudaRunnerOptions, early_release_classes_for
from inference_server.backends.cuda.projection_ops import dense_linear_takes
from inference_server.backends.cuda_graphs import DecodeGraphs
from inference_server.backends.model_runner import LaunchedStep, ModelRunner
from inference_server.backends.paged_kv import PagedAttentionContext, PagedKVStorage, StepTensors
from inference_server.config import Settings, SettingsError
from inference_server.kernels.dense_linear import dense_linear
from inference_server.kernels.greedy_head import ROW_BLOCKS, greedy_head, greedy_head_of_logits, greedy_head_supports
from inference_server.kernels.int8_linear import int8_linear as triton_int8_linear
from inference_server.kernels.pdl import PdlMode, pdl_mode
from inference_server.kernels.streamed_linear import GEMV_MAX_TOKENS
from inference_server.kernels.token_bitmask import warm_up_token_bitmask
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
        super().__init__(model, spec, storage, device, ops=cuda_ops(options),
                         attention_kwargs=cuda_attention_kwargs(options), deterministic=options.deterministic)
        self.options = options
        self.pdl = PdlMode(requested=options.pdl and not options.reference_ops,
                           early_release=early_release_classes_for(spec.hidden_size))
        """PDL of this runner's kernels: set around each launch and graph capture (``pdl_mode``), nowhere else."""
        self._dense_gemv = options.kernels  # the greedy head's 1-2 row GEMV path (_head_gemv_logits)
        if options.fuse_weights:
            fuse_model_weights(model)  # a no-op where the engine factory did it before sizing the KV pool
        model.model.place_rope_tables(device)
        self.graph_steps = 0  # decode steps that ran as a graph (tests and telemetry)
        self.eager_steps = 0
        self.capture_seconds = 0.0
        self.graphs: DecodeGraphs | None = None
        if options.cuda_graphs:
            max_blocks = -(-options.max_model_len // storage.block_size) + 1  # one block of slack
            self.graphs = DecodeGraphs(self._graph_forward, max_batch=options.max_batch_size,
                                       num_groups=self.num_groups, max_blocks=max_blocks,
                                       block_size=storage.block_size, device=device)
            started = time.perf_counter()
            self.graphs.capture()
            self.capture_seconds = time.perf_counter() - started
        self.warm_up_eager(options.eager_warmup_tokens)
        if device.type == "cuda":
            with pdl_mode(self.pdl):  # the head's kernel variants of serving: launched inside launch()
                self.warm_up_greedy_head()
                warm_up_token_bitmask(spec.vocab_size, device)  # structured output's mask (sampler)

    def warm_up_eager(self, token_counts: tuple[int, ...]) -> None:
        """Run one eager step of each size in ``token_counts``: greedy sequences prefilled from 0, one of ``count``
        tokens, or where ``count`` exceeds ``max_model_len`` several of at most ``max_model_len`` tokens summing to it
        (``warmup_sequence_lengths``), as serving would fill such a step.

        Triton compiles a kernel the first time it meets a new variant (block sizes chosen from the step's
        token count, e.g. the fused MoE's BLOCK_M); a variant first met while serving stalls the device for
        seconds (steps of seconds at a wave of new prompts). Run at start-up only: the
        steps write their KV through block 0 of each group, which no sequence holds yet."""
        if not token_counts:
            return
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        with phase("compiling eager step kernels", total=len(token_counts), unit="step sizes") as progress:
            for count in progress.wrap(token_counts):
                sequences = tuple(
                    ScheduledSequence(request_id=-1 - i, token_ids=(0,) * length, cached_len=0,
                                      block_tables=((0,) * -(-length // self.block_size),) * self.num_groups,
                                      sample=True, sampling=greedy, reset=True, prompt_len=length)
                    for i, length in enumerate(warmup_sequence_lengths(count, self.options.max_model_len)))
                try:
                    self.collect(self.launch(StepPlan(step_id=-1, sequences=sequences)))
                except torch.OutOfMemoryError as error:
                    raise SettingsError(
                        f"the device ran out of memory in a {count}-token step at start-up: the KV cache "
                        "(KV_CACHE_MEMORY_FRACTION of the memory free after the weights and the largest step's "
                        "measured need) left too little beside it; lower KV_CACHE_MEMORY_FRACTION (e.g. 0.7), or "
                        "MAX_PREFILL_TOKENS and MAX_NUM_BATCHED_TOKENS") from error
                self.forget(tuple(sequence.request_id for sequence in sequences))
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
            # (int8 always; bf16 where this GPU's sweep tuned the logits GEMV), so the GEMV writes the logits and two
            # short launches reduce them as the fused head would.
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

    def _graph_forward(self, ids: torch.Tensor, step: StepTensors) -> torch.Tensor:
        with pdl_mode(self.pdl):  # captured: the replays launch what the capture launched
            return self.model(ids, PagedAttentionContext(self.storage, step, **self.attention_kwargs))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        with pdl_mode(self.pdl):
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
        return super()._forward(plan)  # eager


def fuse_model_weights(model: CausalLM) -> None:
    """The weights as the runner's fused table reads them (``CudaRunnerOptions.fuse_weights``): every attention
    layer's q/k/v and every dense MLP's gate/up in one matrix each, Gemma 4's router scale folded into its norm.
    Idempotent (a second runner over the same model keeps the tensors its graphs read). Each fusion copies a layer's
    weights into a new tensor before the originals are freed, so it needs free device memory: the engine factory
    runs it before the KV pool takes its share of what is free (``factory.prepare_weights``)."""
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.fuse_qkv()
        elif isinstance(module, GatedMLP):
            module.fuse_gate_up()
        elif isinstance(module, Gemma4Router):
            module.fold_scale()


def eager_warmup_sizes(largest_step_tokens: int) -> tuple[int, ...]:
    """Step sizes to compile at start-up: the largest step, then halving down to 1 (each MoE BLOCK_M class and
    alignment chunking a prefill-carrying step can meet lies on this ladder), largest first."""
    sizes, size = [], max(1, largest_step_tokens)
    while size >= 1:
        sizes.append(size)
        size //= 2
    return tuple(sizes)


def warmup_sequence_lengths(count: int, max_model_len: int) -> tuple[int, ...]:
    """The sequences a warm-up step of ``count`` tokens prefills: one, or where ``count`` is longer than any sequence
    can be, sequences of ``max_model_len`` tokens and one of the rest (a step that size only ever carries several)."""
    full, rest = divmod(count, max_model_len)
    return (max_model_len,) * full + ((rest,) if rest else ())


def largest_warmup_step(largest_step_tokens: int, max_model_len: int, max_batch_size: int) -> int:
    """The largest step the warm-up compiles for: the prefill-only budget, unless ``max_batch_size`` sequences of
    ``max_model_len`` tokens cannot fill it (a step is no longer than its sequences together)."""
    return min(largest_step_tokens, max_model_len * max_batch_size)


def build_cuda_runner(settings: Settings, loaded: LoadedModel, storage: PagedKVStorage, device: torch.device, *,
                      max_model_len: int, largest_step_tokens: int = 0) -> CudaModelRunner:
    """The ``custom-cuda`` runner for the engine: graphs for batches up to ``MAX_BATCH_SIZE`` (``CUDA_GRAPHS``).
    Block tables are sized for the engine's ``max_model_len`` (``factory.engine_limits``: already capped by the
    full-attention pool); the eager step sizes up to ``largest_step_tokens`` (the prefill-only budget) are compiled
    at start, as far as ``MAX_BATCH_SIZE`` sequences can fill a step (``largest_warmup_step``), those longer than
    ``max_model_len`` as several sequences (``warmup_sequence_lengths``)."""
    largest = largest_warmup_step(largest_step_tokens, max_model_len, settings.max_batch_size)
    warmup = eager_warmup_sizes(largest) if largest_step_tokens and device.type == "cuda" else ()
    options = CudaRunnerOptions(max_model_len=max_model_len, max_batch_size=settings.max_batch_size,
                                eager_warmup_tokens=warmup,
                                cuda_graphs=settings.cuda_graphs,
                                reference_ops=settings.deterministic, deterministic=settings.deterministic)
    return CudaModelRunner(loaded.model, loaded.spec, storage, device, options)
