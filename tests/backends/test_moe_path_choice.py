"""Which kernel path ``cuda_backend.triton_fused_moe`` takes for a step's routed experts: the decode GEMVs (two
launches) for steps of at most ``decode_max_tokens`` tokens, the one launch instead where ``one_launch`` is asked
for and the shapes fit it (float experts only), and the grouped GEMMs otherwise. The three kernels are replaced by
spies, so this checks the choice alone (each kernel's numbers have tests of their own)."""

from __future__ import annotations

import pytest
import torch

import inference_server.backends.cuda_backend as backend
from inference_server.kernels.moe_decode_one_launch import fits_one_launch

E, H, INTER, K = 8, 64, 48, 2


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ("moe_decode_one_launch", "fused_moe_decode", "fused_moe"):
        def spy(hidden: torch.Tensor, *args: object, name: str = name, **kwargs: object) -> torch.Tensor:
            calls.append(name)
            return torch.zeros_like(hidden)
        monkeypatch.setattr(backend, name, spy)
    return calls


def step(tokens: int, int8: bool = False) -> dict:
    w_gate_up = torch.zeros(E, 2 * INTER, H, dtype=torch.int8 if int8 else torch.float32)
    w_down = torch.zeros(E, H, INTER, dtype=torch.int8 if int8 else torch.float32)
    scales = dict(w_gate_up_scale=torch.ones(E, 2 * INTER), w_down_scale=torch.ones(E, H)) if int8 else {}
    return dict(hidden=torch.zeros(tokens, H), w_gate_up=w_gate_up, w_down=w_down,
                topk_weights=torch.ones(tokens, K), topk_ids=torch.zeros(tokens, K, dtype=torch.int64), act="silu",
                **scales)


@pytest.mark.parametrize(("tokens", "one_launch", "int8", "expected"), [
    (1, False, False, "fused_moe_decode"),
    (1, True, False, "moe_decode_one_launch"),
    (2, True, False, "moe_decode_one_launch"),
    (1, True, True, "fused_moe_decode"),  # int8 experts: the one launch takes float experts only
    (4, False, False, "fused_moe_decode"),
    (5, False, False, "fused_moe"),  # past decode_max_tokens
    (5, True, False, "fused_moe"),
])
def test_path(tokens: int, one_launch: bool, int8: bool, expected: str, taken: list[str]) -> None:
    assert fits_one_launch(min(tokens, 2), K, H, INTER, int8=False)  # the shapes fit, so the choice is the flag's
    backend.triton_fused_moe(**step(tokens, int8), decode_max_tokens=4, one_launch=one_launch)
    assert taken == [expected]


def test_no_decode_path_when_off(taken: list[str]) -> None:
    backend.triton_fused_moe(**step(1), decode_max_tokens=0, one_launch=True)
    assert taken == ["fused_moe"]


@pytest.mark.parametrize("one_launch", [False, True])
def test_runner_option_reaches_the_moe_op(one_launch: bool) -> None:
    """``CudaRunnerOptions.moe_one_launch`` (off by default) is what the runner's MoE op hands
    ``triton_fused_moe``."""
    from tests.backends.test_cuda_backend import BLOCK, build, storage_for

    from inference_server.models.architectures import ops

    assert backend.CudaRunnerOptions(max_model_len=64, max_batch_size=1).moe_one_launch is False
    spec, model = build("qwen3-30b-a3b-tiny", torch.float32, "cpu")
    with ops.reference_ops():
        runner = backend.CudaModelRunner(
            model, spec, storage_for(spec, 1, 2, torch.float32, "cpu"), torch.device("cpu"),
            backend.CudaRunnerOptions(max_model_len=2 * BLOCK, max_batch_size=1, capture=False, cuda_graphs=False,
                                      moe_one_launch=one_launch))
    assert runner._moe.func is backend.triton_fused_moe
    assert runner._moe.keywords["one_launch"] is one_launch
