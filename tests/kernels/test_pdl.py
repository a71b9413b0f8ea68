"""The PDL mode (``kernels.pdl``): on only when the mode in effect asks for it, on a compiled sm_90+ device with a
Triton that has it; a mode holds inside its ``pdl_mode`` block only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from inference_server.kernels import pdl
from inference_server.kernels.rmsnorm import fused_add_rmsnorm

ON = pdl.PdlMode(requested=True)


@pytest.fixture(autouse=True)
def forget_the_fake_devices() -> Iterator[None]:
    yield
    pdl._device_supports.cache_clear()


def fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    """A compiled-kernel process on a CUDA device of ``capability`` (no interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    pdl._device_supports.cache_clear()


def test_a_mode_holds_inside_its_block_and_the_previous_one_after() -> None:
    assert not pdl.pdl_requested() and pdl.early_release_classes() == frozenset()  # the default: off
    with pdl.pdl_mode(pdl.PdlMode(requested=True, early_release=frozenset({"gemv"}))):
        assert pdl.pdl_requested() and pdl.early_release_classes() == {"gemv"}
        with pdl.pdl_mode(pdl.PDL_OFF):
            assert not pdl.pdl_requested()
        assert pdl.pdl_requested()
    assert not pdl.pdl_requested() and pdl.early_release_classes() == frozenset()


def test_off_under_the_interpreter_even_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pdl.pdl_mode(ON):
        assert not pdl.pdl_supported() and not pdl.pdl_enabled()
        assert pdl.pdl_launch() == {"USE_PDL": False}  # no launch option at all: the launch of before


def test_off_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pdl.pdl_mode(ON):
        assert not pdl.pdl_enabled()
        assert pdl.pdl_launch() == {"USE_PDL": False}


def test_off_before_hopper_and_on_from_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    with pdl.pdl_mode(ON):
        fake_gpu(monkeypatch, (8, 0))
        assert not pdl.pdl_enabled()
        fake_gpu(monkeypatch, (9, 0))
        assert pdl.pdl_supported() == pdl._triton_has_pdl()
        if pdl._triton_has_pdl():  # Triton 3.6 and 3.9 have it
            assert pdl.pdl_launch() == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.pdl_launch() == {"USE_PDL": False}  # supported but not asked for


def test_the_early_release_mode_reaches_the_launch_only_with_pdl_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mode's ``early_release`` turns ``USE_PDL`` into ``PDL_RELEASE_AFTER_WAIT`` (2) where PDL is on, for the
    launches of the classes it names; True (1) is the release after the loop; without PDL the launch stays the one
    of before."""
    assert pdl.PDL_RELEASE_AFTER_LOOP == True  # noqa: E712 -- the kernels' USE_PDL=True is this mode
    every = pdl.PdlMode(requested=True, early_release=pdl.loop_classes(True))
    assert every.early_release == frozenset(pdl.PDL_LOOP_CLASSES)
    with pdl.pdl_mode(every):
        fake_gpu(monkeypatch, (8, 0))
        assert pdl.pdl_launch(loop="gemv") == {"USE_PDL": False}
        fake_gpu(monkeypatch, (9, 0))
        if pdl._triton_has_pdl():
            for loop in pdl.PDL_LOOP_CLASSES:
                assert pdl.pdl_launch(loop=loop) == {"USE_PDL": pdl.PDL_RELEASE_AFTER_WAIT, "launch_pdl": True}
            assert pdl.pdl_launch() == {"USE_PDL": True, "launch_pdl": True}  # no loop: nothing to release early
    if pdl._triton_has_pdl():
        with pdl.pdl_mode(ON):  # no early release
            assert pdl.pdl_launch(loop="attention") == {"USE_PDL": True, "launch_pdl": True}


def test_the_release_place_is_chosen_per_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the named classes release after their wait; the others still release after their loop."""
    fake_gpu(monkeypatch, (9, 0))
    if not pdl._triton_has_pdl():
        pytest.skip("this Triton has no launch_pdl")
    with pdl.pdl_mode(pdl.PdlMode(requested=True, early_release=frozenset({"attention", "router"}))):
        assert pdl.early_release_classes() == {"attention", "router"}
        modes = {loop: pdl.pdl_launch(loop=loop)["USE_PDL"] for loop in pdl.PDL_LOOP_CLASSES}
    assert modes == {"attention": pdl.PDL_RELEASE_AFTER_WAIT, "router": pdl.PDL_RELEASE_AFTER_WAIT,
                     "gemv": pdl.PDL_RELEASE_AFTER_LOOP, "head": pdl.PDL_RELEASE_AFTER_LOOP,
                     "moe": pdl.PDL_RELEASE_AFTER_LOOP}


def test_an_unknown_loop_class_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown PDL loop classes"):
        pdl.PdlMode(requested=True, early_release=frozenset({"attention", "mlp"}))
    with pytest.raises(ValueError, match="unknown PDL loop classes"):
        pdl.loop_classes(("attention", "mlp"))
    with pytest.raises(ValueError, match="unknown PDL loop class"):
        pdl.pdl_launch(loop="mlp")
    assert pdl.loop_classes(True) == frozenset(pdl.PDL_LOOP_CLASSES) and pdl.loop_classes(False) == frozenset()


def test_this_triton_has_the_names_the_kernels_use() -> None:
    """``launch_pdl``, ``gdc_wait`` and ``gdc_launch_dependents``: in the local Triton (3.9) as in the device's (3.6,
    checked from its wheel); a Triton without them keeps PDL off."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")
    assert pdl._triton_has_pdl()


def test_a_kernel_gives_the_same_bits_with_pdl_asked_for() -> None:
    """Under the interpreter (unsupported) the launch is the one of before (``USE_PDL`` False); on an sm_90 GPU it
    runs with PDL, eagerly: the same bits either way."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(3, 64, generator=gen).to(device), torch.randn(3, 64, generator=gen).to(device)
    weight = torch.randn(64, generator=gen).to(device)
    off = fused_add_rmsnorm(x, residual, weight, 1e-6, "qwen")
    with pdl.pdl_mode(ON):
        on = fused_add_rmsnorm(x, residual, weight, 1e-6, "qwen")
    assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1])
