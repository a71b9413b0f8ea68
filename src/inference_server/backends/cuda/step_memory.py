"""How much device memory the custom-cuda runner's largest step needs beside the weights and the KV pool, measured
before the pool is sized (what vLLM's profile run does).

The pool takes ``KV_CACHE_MEMORY_FRACTION`` of the memory free after the weights; what the fraction leaves must hold
the activations of the largest eager step (``MAX_PREFILL_TOKENS``: the gate/up output of a dense MLP alone is
``tokens x 2 x intermediate`` elements), the RoPE tables, the graphs' pools and the allocator's fragmentation. On an
80 GB H100 Gemma-4-31B leaves ~16 GB after its weights, and 10 % of that did not hold its 8,192-token warm-up step.
So the engine factory runs that step first, on a runner without graphs over a KV storage of one block a group (the
warm-up writes its KV through block 0, ``CudaModelRunner.warm_up_eager``), reads torch's peak counter, and sizes the
pool from the free memory less that peak. The step's Triton compiles are not lost: the serving runner's warm-up meets
the same variants in the process's cache.
"""

from __future__ import annotations

import logging

import torch

from inference_server.backends.cuda.options import CudaRunnerOptions
from inference_server.backends.cuda.runner import CudaModelRunner, largest_warmup_step
from inference_server.backends.paged_kv import PagedKVStorage, group_of
from inference_server.config import Settings
from inference_server.models.loading.source import LoadedModel

log = logging.getLogger(__name__)


def largest_step_bytes(settings: Settings, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, *,
                       max_model_len: int, largest_step_tokens: int) -> int:
    """Peak device bytes allocated, beyond what is allocated now, while a runner is built and runs one eager step
    of the largest size the serving runner warms up (``largest_warmup_step``): the step's activations and
    workspaces, and what the runner keeps on the model (RoPE tables placed on the device), which stays allocated.
    Everything else it allocated is freed and handed back to the device before it returns. 0 off CUDA."""
    if device.type != "cuda" or largest_step_tokens <= 0:
        return 0
    step = largest_warmup_step(largest_step_tokens, max_model_len, settings.max_batch_size)
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner = run_largest_step(settings, loaded, device, dtype, max_model_len=max_model_len, step_tokens=step)
    torch.cuda.synchronize(device)
    peak = max(0, torch.cuda.max_memory_allocated(device) - held)
    del runner
    torch.cuda.empty_cache()
    log.info("the largest step (%d tokens) measured at %.2f GiB beside the weights; the KV pool leaves it free",
             step, peak / 2**30)
    return peak


def run_largest_step(settings: Settings, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, *,
                     max_model_len: int, step_tokens: int) -> CudaModelRunner:
    """The measured work: a runner without graphs over a KV storage of one block a group, built (its start-up
    warm-up runs the one step of ``step_tokens``, as several sequences past ``max_model_len``, their KV written
    through block 0) and returned for the caller to drop."""
    blocks = {group_of(layer): 1 for layer in loaded.spec.cache_layers}
    storage = PagedKVStorage(loaded.spec.cache_layers, blocks, settings.kv_block_size, dtype, device)
    options = CudaRunnerOptions(max_model_len=max_model_len, max_batch_size=settings.max_batch_size,
                                eager_warmup_tokens=(step_tokens,), cuda_graphs=False,
                                reference_ops=settings.deterministic, deterministic=settings.deterministic)
    return CudaModelRunner(loaded.model, loaded.spec, storage, device, options)
