"""``DETERMINISTIC=true`` on the CPU runner: a greedy request's tokens *and logprobs* are bitwise the same alone, inside
a loaded mixed batch with chunked prefill, after a prefix-cache hit of part of its prompt, and after being preempted
and recomputed (``tests/schedule_invariance.py`` drives the real engine all four ways).

Dtype: float32 activations, what the CPU runner serves in (``DTYPE=auto``; bf16 GEMMs on CPUs without AVX-512 BF16
are emulated and several times slower, so nobody serves them there). Weights: the embedded Gemma 3 270M with its
real weights in the CPU default ``QUANTIZATION=auto`` (int8 layers and head), and a Gemma-4-26B-A4B tiny preset
(MoE, sliding and full layers) widened to the real head sizes (256 sliding, 512 full) with float dummy weights.

The default mode is checked on the same runs: its *tokens* are the same every way on these models (the fp32
logits move by ~1e-6 relative, far below these top-2 margins; ``test_schedule_invariance.py`` asserts that), but
its logprobs are not bitwise the same: the fp32 GEMMs change summation order with the row count and the reference
attention with the chunk boundaries (``kernels/batch_invariant_cpu.py``). So on the CPU the default mode's
divergence shows in the logprobs, not (on these prompts) in the greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.schedule_invariance import InvarianceConfig, InvarianceReport, run_invariance

from inference_server.backends.cuda.options import CudaRunnerOptions
from inference_server.config import SettingsError, load_settings
from inference_server.models.loading.presets import preset_config
from inference_server.runtime import resolve_backend

WAYS = ("loaded", "cache_hit", "preempted")


def wide_moe_folder(folder: Path) -> Path:
    """The Gemma-4-26B-A4B tiny preset at the real model's head sizes and a 128-token sliding window."""
    config = preset_config("gemma-4-26b-a4b-tiny")
    config.update(head_dim=256, global_head_dim=512, sliding_window=128)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def embedded_config(deterministic: bool) -> InvarianceConfig:
    """The embedded model (window 512): a 64-token step budget chunks every prompt but the first; the 600-token
    prompt's cache hit (420 tokens) and prefill cross the window; a 1,024-token KV pool preempts."""
    return InvarianceConfig(
        settings={"DEVICE": "cpu", "BACKEND": "reference", "MAX_NUM_BATCHED_TOKENS": "64", "KV_BLOCK_SIZE": "16",
                  "KV_CACHE_TOKENS": "8192", "DETERMINISTIC": str(deterministic).lower()},
        prompt_lengths=(17, 90, 600), max_tokens=6, num_fillers=3, filler_prompt_lengths=(40, 300, 9),
        filler_max_tokens=24, stagger_tokens=4, preempt_kv_tokens=1024)


def moe_config(folder: Path, deterministic: bool) -> InvarianceConfig:
    return InvarianceConfig(
        settings={"MODEL": str(folder), "DUMMY_WEIGHTS": "true", "DEVICE": "cpu", "BACKEND": "reference",
                  "DTYPE": "float32", "QUANTIZATION": "none", "MAX_NUM_BATCHED_TOKENS": "48", "KV_BLOCK_SIZE": "16",
                  "KV_CACHE_TOKENS": "4096", "DETERMINISTIC": str(deterministic).lower()},
        prompt_lengths=(5, 70, 200, 33), max_tokens=8, num_fillers=3, filler_prompt_lengths=(40, 150, 9),
        filler_max_tokens=24, stagger_tokens=4, preempt_kv_tokens=640)


def check_deterministic(report: InvarianceReport) -> None:
    print(report.table())
    assert report.loaded_mixed_steps > 0, "the loaded run never mixed a prefill chunk with decodes"
    assert any(o.loaded_chunks > 1 for o in report.outcomes), "no prompt was prefilled in chunks"
    assert any(o.runs["cache_hit"].cached_prompt_tokens for o in report.outcomes), "no cache hit"
    assert any(o.preempted_restarts for o in report.outcomes), "no test prompt was preempted"
    assert report.defects() == [], report.table()
    n = len(report.outcomes)
    assert [report.bitwise_equal(way) for way in WAYS] == [n] * len(WAYS), report.table()


def check_default_differs(report: InvarianceReport) -> None:
    """The default mode on the same runs: same greedy tokens here, logprobs not bitwise the same somewhere."""
    print(report.table())
    assert sum(report.bitwise_equal(way) for way in WAYS) < len(WAYS) * len(report.outcomes), report.table()


def test_embedded_model_is_bitwise_deterministic_on_cpu() -> None:
    check_deterministic(run_invariance(embedded_config(deterministic=True)))


def test_embedded_model_default_mode_is_not_bitwise_batch_invariant() -> None:
    check_default_differs(run_invariance(embedded_config(deterministic=False)))


def test_moe_at_real_head_sizes_is_bitwise_deterministic_on_cpu(tmp_path: Path) -> None:
    check_deterministic(run_invariance(moe_config(wide_moe_folder(tmp_path / "moe"), deterministic=True)))


def test_moe_default_mode_is_not_bitwise_batch_invariant(tmp_path: Path) -> None:
    check_default_differs(run_invariance(moe_config(wide_moe_folder(tmp_path / "moe"), deterministic=False)))


@pytest.mark.parametrize(("environ", "device", "message"), [
    ({"BACKEND": "hf"}, "cpu", "DETERMINISTIC=true is invalid with BACKEND='hf' on cpu"),
    ({"BACKEND": "reference"}, "cuda", "DETERMINISTIC=true is invalid with BACKEND='reference' on cuda"),
])
def test_deterministic_is_refused_where_the_runner_has_no_batch_invariant_kernels(
        environ: dict[str, str], device: str, message: str) -> None:
    settings = load_settings(environ={"DETERMINISTIC": "true", "QUANTIZATION": "none", **environ}, dotenv_path=None)
    with pytest.raises(SettingsError, match=message):
        resolve_backend(settings, torch.device(device))
    plain = load_settings(environ={"QUANTIZATION": "none", **environ}, dotenv_path=None)
    resolve_backend(plain, torch.device(device))  # the same settings without it are fine
    on = load_settings(environ={"DETERMINISTIC": "true"}, dotenv_path=None)
    assert resolve_backend(on, torch.device("cpu")) == "reference"
    assert resolve_backend(on, torch.device("cuda")) == "custom-cuda"


def test_deterministic_cuda_options_need_the_reference_set() -> None:
    assert CudaRunnerOptions(max_model_len=64, reference_ops=True, deterministic=True).deterministic
    with pytest.raises(ValueError, match="deterministic=True"):
        CudaRunnerOptions(max_model_len=64, deterministic=True)
