"""Programmatic dependent launch (``CudaRunnerOptions.pdl``) changes when kernels start, never what they compute.

Two CUDA runners on one model, graphs captured, one with ``pdl=True``, run the same teacher-forced plans (three
prompts prefilled together, a fourth joining at decode step 5 in an eager mixed step, then graphed decode steps of
bucket 4): every step's tokens and final hidden states must be bitwise equal. Real configs cut to 2 layers
(``test_cuda_backend.model_config``), bf16: Qwen3-MoE and every Gemma 4 kind (MoE, PLE with shared KV, dense). On
the CPU: each runner's PDL mode holds inside its own steps only, and PDL stays off under the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from inference_server.backends.cuda.options import (
    EARLY_RELEASE_NARROW_CLASSES,
    CudaRunnerOptions,
    early_release_classes_for,
)
from inference_server.backends.cuda.runner import CudaModelRunner
from inference_server.kernels import pdl

from .test_cuda_backend import BLOCK, Script, build, num_groups, storage_for, tokens_of


def hidden_tap(runner: CudaModelRunner, modes: list[tuple[bool, bool, frozenset[str]]] | None = None,
               ) -> list[torch.Tensor]:
    """Keeps a copy of every step's final hidden states (the graph's output buffer, or the eager forward's); with
    ``modes``, also the PDL mode in effect during the step's forward: ``(requested, enabled, early release)``."""
    seen: list[torch.Tensor] = []
    forward = runner._forward

    def tapped(plan):  # type: ignore[no-untyped-def]
        if modes is not None:
            modes.append((pdl.pdl_requested(), pdl.pdl_enabled(), pdl.early_release_classes()))
        hidden = forward(plan)
        seen.append(hidden.detach().clone())
        return hidden

    runner._forward = tapped  # type: ignore[method-assign]
    return seen


@pytest.mark.gpu
# Gemma-4-E2B's layers are E4B's kind, and its hidden size (1,536) takes Qwen3-30B-A3B's branch (up to 2,048)
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gemma-4-26b-a4b", "gemma-4-e4b", "gemma-4-31b"])
def test_pdl_decode_is_bitwise_equal_to_no_pdl(name: str) -> None:
    """Either place of the loop kernels' release (every class but the router after its wait at hidden sizes up to
    2,048: Qwen3-30B-A3B and Gemma-4-E2B; after the loop above) gives the bits of a runner without PDL."""
    if not pdl.pdl_supported():
        pytest.skip("PDL needs an sm_90+ GPU and a Triton with launch_pdl")
    dtype, device, steps = torch.bfloat16, "cuda", 12
    spec, model = build(name, dtype, device)
    script = Script(spec, num_groups(spec), steps, seed=3, num_seqs=4, join=5, prompt_lens=(20, 60))
    n, m = len(script.seqs), script.blocks_per_seq
    runners, hidden, modes = {}, {}, {False: [], True: []}  # type: ignore[var-annotated]
    for use_pdl in (False, True):  # one model: the two runners' ops tables differ in nothing (PDL is not an op)
        options = CudaRunnerOptions(max_model_len=m * BLOCK, max_batch_size=4, pdl=use_pdl)
        runners[use_pdl] = CudaModelRunner(model, spec, storage_for(spec, n, m, dtype, device), torch.device(device),
                                           options)
        hidden[use_pdl] = hidden_tap(runners[use_pdl], modes[use_pdl])
    for _ in range(steps + 1):
        plan = script.plan()
        off = tokens_of(runners[False])(plan)
        assert modes[False][-1][1] is False
        on = tokens_of(runners[True])(plan)
        assert modes[True][-1][1:] == (True, early_release_classes_for(spec.hidden_size))
        assert on == off, f"step {script.step}: tokens differ"
        # only the plan's rows: a decode graph's padding rows are garbage nobody reads (backends/cuda_graphs.py)
        rows = plan.num_tokens
        assert torch.equal(hidden[True][-1][:rows], hidden[False][-1][:rows]), f"step {script.step}: hidden differ"
        script.advance(plan, off)
    assert runners[True].graph_steps == runners[False].graph_steps >= steps - 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels in the CPU interpreter; with CUDA "
                    "present the gpu test covers the option")
def test_each_runner_launches_with_its_own_pdl_mode_cpu() -> None:
    """A runner's PDL mode (its option, and the loop kernels' release place by hidden size) holds during its own
    steps and nowhere else, so two runners in one process each run with their own; under the interpreter PDL is
    never enabled."""
    spec, model = build("qwen3-30b-a3b-tiny", torch.float32, "cpu")
    script = Script(spec, num_groups(spec), 1, seed=4, num_seqs=2, join=None, prompt_lens=(3, 6))
    n, m = len(script.seqs), script.blocks_per_seq
    modes: dict[bool, list[tuple[bool, bool, frozenset[str]]]] = {False: [], True: []}

    def runner(use_pdl: bool) -> CudaModelRunner:
        options = CudaRunnerOptions(max_model_len=m * BLOCK, max_batch_size=2, cuda_graphs=False, pdl=use_pdl)
        built = CudaModelRunner(model, spec, storage_for(spec, n, m, torch.float32, "cpu"), torch.device("cpu"),
                                options)
        hidden_tap(built, modes[use_pdl])
        return built

    with_pdl, without = runner(True), runner(False)
    # the loop kernels' release place by hidden size (a tiny model: the narrow classes after the wait)
    narrow = frozenset(EARLY_RELEASE_NARROW_CLASSES)
    assert with_pdl.pdl == pdl.PdlMode(requested=True, early_release=narrow)
    assert without.pdl == pdl.PdlMode(requested=False, early_release=narrow)
    assert early_release_classes_for(2048) == narrow and not early_release_classes_for(2049)
    assert not pdl.pdl_requested()  # outside any runner's step: the default mode
    plan = script.plan()
    on = tokens_of(with_pdl)(plan)
    assert tokens_of(without)(plan) == on
    assert modes == {True: [(True, False, narrow)], False: [(False, False, narrow)]}  # asked for; off interpreted
    assert not pdl.pdl_requested() and pdl.early_release_classes() == frozenset()
