"""Which kernel path ``moe_ops.triton_fused_moe`` takes for a step's routed experts: the decode GEMVs (two
launches) for steps of at most ``decode_max_tokens`` tokens, the grouped GEMMs otherwise. The kernels are replaced
by spies, so this checks the choice alone (each kernel's numbers have tests of their own)."""

from __future__ import annotations

import pytest
import torch

from inference_server.backends.cuda import moe_ops

E, H, INTER, K = 8, 64, 48, 2


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ("fused_moe_decode", "fused_moe"):
        def spy(hidden: torch.Tensor, *args: object, name: str = name, **kwargs: object) -> torch.Tensor:
            calls.append(name)
            return torch.zeros_like(hidden)
        monkeypatch.setattr(moe_ops, name, spy)
    return calls


def step(tokens: int, int8: bool = False) -> dict:
    w_gate_up = torch.zeros(E, 2 * INTER, H, dtype=torch.int8 if int8 else torch.float32)
    w_down = torch.zeros(E, H, INTER, dtype=torch.int8 if int8 else torch.float32)
    scales = dict(w_gate_up_scale=torch.ones(E, 2 * INTER), w_down_scale=torch.ones(E, H)) if int8 else {}
    return dict(hidden=torch.zeros(tokens, H), w_gate_up=w_gate_up, w_down=w_down,
                topk_weights=torch.ones(tokens, K), topk_ids=torch.zeros(tokens, K, dtype=torch.int64), act="silu",
                **scales)


@pytest.mark.parametrize(("tokens", "int8", "expected"), [
    (1, False, "fused_moe_decode"),
    (1, True, "fused_moe_decode"),
    (4, False, "fused_moe_decode"),
    (5, False, "fused_moe"),  # past decode_max_tokens
    (5, True, "fused_moe"),
])
def test_path(tokens: int, int8: bool, expected: str, taken: list[str]) -> None:
    moe_ops.triton_fused_moe(**step(tokens, int8), decode_max_tokens=4)
    assert taken == [expected]


def test_no_decode_path_when_off(taken: list[str]) -> None:
    moe_ops.triton_fused_moe(**step(1), decode_max_tokens=0)
    assert taken == ["fused_moe"]
