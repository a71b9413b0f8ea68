"""The Triton kernels added or changed for issue 12 compile for the H200 (sm_90) without a GPU.

The CPU tests run kernels in the Triton interpreter, which accepts things the compiler rejects (a kernel reading
a plain Python global compiled nowhere: the GPU run failed where every interpreter test passed). Triton compiles
to PTX without a device, so a child process without ``TRITON_INTERPRET`` compiles each variant the runner
launches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

COMPILE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from inference_server.kernels.fused_moe import _moe_align_scatter_kernel
    from inference_server.kernels.gated_activation import _gated_activation_kernel
    from inference_server.kernels.norm_add import _norm_add_kernel
    from inference_server.kernels.qk_norm_rope import _qk_norm_rope_kernel
    from inference_server.kernels.router import _route_kernel

    target = GPUTarget("cuda", 90, 64)
    scalars = dict.fromkeys(("n_rows", "width", "stride_gate", "stride_up", "stride_out"), "i32")
    for gelu in (True, False):
        signature = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", **scalars,
                     "GELU_TANH": "constexpr", "BLOCK": "constexpr", "LIBDEVICE_TANH": "constexpr"}
        triton.compile(ASTSource(fn=_gated_activation_kernel, signature=signature,
                                 constexprs={"GELU_TANH": gelu, "BLOCK": 1024, "LIBDEVICE_TANH": True}),
                       target=target)
    names = ("a_ptr", "b_ptr", "res_ptr", "wa_ptr", "wb_ptr", "wz_ptr", "scale_ptr", "y_ptr", "z_ptr")
    for flags in ((False, True, False, True), (True, False, False, False), (False, True, True, True)):
        signature = {**dict.fromkeys(names, "*bf16"), **dict.fromkeys(("n_cols", "sa", "sb", "sr", "sy", "sz"), "i32"),
                     **dict.fromkeys(("eps_a", "eps_b", "eps_z"), "fp32"),
                     **dict.fromkeys(("HAS_B", "HAS_RES", "HAS_SCALE", "HAS_Z", "BLOCK"), "constexpr")}
        constexprs = dict(zip(("HAS_B", "HAS_RES", "HAS_SCALE", "HAS_Z"), flags, strict=True)) | {"BLOCK": 8192}
        triton.compile(ASTSource(fn=_norm_add_kernel, signature=signature, constexprs=constexprs),
                       target=target, options={"num_warps": 16})
    pointers = ("q_ptr", "k_ptr", "v_ptr", "qo_ptr", "ko_ptr", "vo_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr")
    strides = ("q_st", "q_sh", "k_st", "k_sh", "v_st", "v_sh", "qo_st", "ko_st", "vo_st", "cs_st")
    for gemma in (True, False):
        signature = {**dict.fromkeys(pointers, "*bf16"), **dict.fromkeys(strides, "i32"), "eps": "fp32",
                     **dict.fromkeys(("NUM_Q", "NUM_K", "HALF", "BLOCK_HALF", "GEMMA"), "constexpr")}
        constexprs = {"NUM_Q": 16, "NUM_K": 8, "HALF": 128, "BLOCK_HALF": 128, "GEMMA": gemma}
        triton.compile(ASTSource(fn=_qk_norm_rope_kernel, signature=signature, constexprs=constexprs), target=target)
    for weights, has_scale in (("*bf16", False), ("*fp32", True)):
        signature = {"logits_ptr": "*bf16", "scale_ptr": "*bf16", "weights_ptr": weights, "ids_ptr": "*i64",
                     "n_rows": "i32", "E": "i32", "stride_row": "i32", "K": "constexpr", "RENORMALIZE": "constexpr",
                     "HAS_SCALE": "constexpr", "BLOCK_E": "constexpr", "BLOCK_K": "constexpr"}
        constexprs = {"K": 8, "RENORMALIZE": True, "HAS_SCALE": has_scale, "BLOCK_E": 128, "BLOCK_K": 8}
        triton.compile(ASTSource(fn=_route_kernel, signature=signature, constexprs=constexprs), target=target)
    for single in (True, False):  # decode (one program, padding then a barrier) and prefill (chunks)
        signature = {"ids_ptr": "*i64", "chunk_counts_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                     "num_padded_ptr": "*i32", "num_pairs": "i32", "max_blocks": "i32", "num_chunks": "i32",
                     "BLOCK_M": "constexpr", "E_PAD": "constexpr", "CHUNK": "constexpr", "NC_PAD": "constexpr",
                     "SINGLE": "constexpr", "FILL": "constexpr"}
        constexprs = {"BLOCK_M": 16, "E_PAD": 128, "CHUNK": 16 if single else 128, "NC_PAD": 1 if single else 128,
                      "SINGLE": single, "FILL": 1024}
        triton.compile(ASTSource(fn=_moe_align_scatter_kernel, signature=signature, constexprs=constexprs),
                       target=target)
    print("compiled")
''')


def test_new_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend (and its ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
