"""Programmatic dependent launch (``CudaRunnerOptions.pdl``) changes when kernels start, never what they compute.

Two CUDA runners on one model, graphs captured, one with ``pdl=True``, run the same teacher-forced plans (three
prompts prefilled together, a fourth joining at decode step 5 in an eager mixed step, then graphed decode steps of
bucket 4): every step's tokens and final hidden states must be bitwise equal. Real configs cut to 2 layers
(``test_cuda_backend.model_config``), bf16: Qwen3-MoE and every Gemma 4 kind (MoE, PLE with shared KV, dense). On
the CPU: the option sets the process-wide switch at every step, and PDL stays off under the interpreter.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from inference_server.backends.cuda.options import (
    EARLY_RELEASE_NARROW_CLASSES,
    CudaRunnerOptions,
    early_release_classes_for,
)
from inference_server.backends.cuda.runner import CudaModelRunner
from inference_server.kernels import pdl
from inference_server.models.architectures import ops

from .test_cuda_backend import BLOCK, Script, build, num_groups, storage_for, tokens_of


@pytest.fixture(autouse=True)
def restore_reference_ops_and_pdl() -> Iterator[None]:
    """A CUDA runner installs the Triton ops and the PDL switch process-wide; put both back for later tests."""
    with ops.reference_ops():
        yield
    pdl.use_pdl(False)


def hidden_tap(runner: CudaModelRunner) -> list[torch.Tensor]:
    """Keeps a copy of every step's final hidden states (the graph's output buffer, or the eager forward's)."""
    seen: list[torch.Tensor] = []
    forward = runner._forward

    def tapped(plan):  # type: ignore[no-untyped-def]
        hidden = forward(plan)
        seen.append(hidden.detach().clone())
        return hidden

    runner._forward = tapped  # type: ignore[method-assign]
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gemma-4-26b-a4b", "gemma-4-e4b", "gemma-4-31b", "gemma-4-e2b"])
def test_pdl_decode_is_bitwise_equal_to_no_pdl(name: str) -> None:
    """Either place of the loop kernels' release (every class but the router after its wait at hidden sizes up to
    2,048: Qwen3-30B-A3B, Gemma-4-E2B; after the loop above) gives the bits of a runner without PDL."""
    if not pdl.pdl_supported():
        pytest.skip("PDL needs an sm_90+ GPU and a Triton with launch_pdl")
    dtype, device, steps = torch.bfloat16, "cuda", 12
    spec, model = build(name, dtype, device)
    script = Script(spec, num_groups(spec), steps, seed=3, num_seqs=4, join=5, prompt_lens=(20, 60))
    n, m = len(script.seqs), script.blocks_per_seq
    runners, hidden = {}, {}
    for use_pdl in (False, True):
        options = CudaRunnerOptions(max_model_len=m * BLOCK, max_batch_size=4, pdl=use_pdl)
        runners[use_pdl] = CudaModelRunner(model, spec, storage_for(spec, n, m, dtype, device), torch.device(device),
                                           options)
        hidden[use_pdl] = hidden_tap(runners[use_pdl])
    for _ in range(steps + 1):
        plan = script.plan()
        off = tokens_of(runners[False])(plan)
        assert not pdl.pdl_enabled()
        on = tokens_of(runners[True])(plan)
        assert pdl.pdl_enabled() and pdl.early_release_classes() == early_release_classes_for(spec.hidden_size)
        assert on == off, f"step {script.step}: tokens differ"
        # only the plan's rows: a decode graph's padding rows are garbage nobody reads (backends/cuda_graphs.py)
        rows = plan.num_tokens
        assert torch.equal(hidden[True][-1][:rows], hidden[False][-1][:rows]), f"step {script.step}: hidden differ"
        script.advance(plan, off)
    assert runners[True].graph_steps == runners[False].graph_steps >= steps - 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels in the CPU interpreter; with CUDA "
                    "present the gpu test covers the option")
def test_the_option_sets_the_switch_at_every_step_cpu() -> None:
    """Each runner sets ``kernels.pdl``'s switch to its option when it installs its ops (construction and every
    step), so two runners in one process each run with their own; under the interpreter it is never enabled."""
    spec, model = build("qwen3-30b-a3b-tiny", torch.float32, "cpu")
    script = Script(spec, num_groups(spec), 1, seed=4, num_seqs=2, join=None, prompt_lens=(3, 6))
    n, m = len(script.seqs), script.blocks_per_seq

    def runner(use_pdl: bool) -> CudaModelRunner:
        options = CudaRunnerOptions(max_model_len=m * BLOCK, max_batch_size=2, cuda_graphs=False, pdl=use_pdl)
        return CudaModelRunner(model, spec, storage_for(spec, n, m, torch.float32, "cpu"), torch.device("cpu"),
                               options)

    with_pdl = runner(True)
    assert pdl.pdl_requested()
    # the loop kernels' release place by hidden size (a tiny model: the narrow classes after the wait)
    assert with_pdl.early_release == frozenset(EARLY_RELEASE_NARROW_CLASSES) == pdl.early_release_classes()
    assert early_release_classes_for(2048) == with_pdl.early_release and not early_release_classes_for(2049)
    without = runner(False)
    assert not pdl.pdl_requested()
    plan = script.plan()
    on = tokens_of(with_pdl)(plan)
    assert pdl.pdl_requested() and not pdl.pdl_enabled()  # asked for; off under the interpreter
    assert tokens_of(without)(plan) == on
    assert not pdl.pdl_requested()
