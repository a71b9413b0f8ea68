"""The Triton kernels added or changed for issues 12 and 13 compile for the H200 (sm_90) without a GPU.

The CPU tests run kernels in the Triton interpreter, which accepts things the compiler rejects (a kernel reading
a plain Python global compiled nowhere: the GPU run failed where every interpreter test passed). Triton compiles
to PTX without a device, so a child process without ``TRITON_INTERPRET`` compiles each variant the runner
launches. The int8 kernels (issue 13) and the float-weight ``dense_linear`` (the same kernel) are compiled with
the alignment facts the launcher passes at run time (16-byte aligned pointers, sizes and strides divisible by 16,
unit strides), so the software pipeliner builds the multi-stage variant that runs, and its shared memory must fit
the H200's 227 KB per block.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent('''
    from triton.compiler import ASTSource


    def source(fn, signature, constexprs, attrs=None, use_pdl=False):
        """``ASTSource`` of ``fn`` with its ``USE_PDL`` constexpr (kernels.pdl) set when it has one: off, the kernel
        is the code it was before PDL (a signature without it fails to compile; typed i32 it is a runtime flag)."""
        if "USE_PDL" in fn.arg_names:
            signature = {**signature, "USE_PDL": "constexpr"}
            constexprs = {**constexprs, "USE_PDL": use_pdl}
        return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
''')

COMPILE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget

    from inference_server.kernels.fused_moe import _moe_align_scatter_kernel
    from inference_server.kernels.gated_activation import _gated_activation_kernel
    from inference_server.kernels.norm_add import _norm_add_kernel
    from inference_server.kernels.qk_norm_rope import _qk_norm_rope_kernel
    from inference_server.kernels.router import _linear_route_kernel, _route_kernel
    from inference_server.kernels.token_bitmask import BLOCK as BITMASK_BLOCK
    from inference_server.kernels.token_bitmask import _apply_token_bitmask_kernel

    target = GPUTarget("cuda", 90, 64)
    scalars = dict.fromkeys(("n_rows", "width", "stride_gate", "stride_up", "stride_out"), "i32")
    for gelu in (True, False):
        signature = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", **scalars,
                     "GELU_TANH": "constexpr", "BLOCK": "constexpr", "LIBDEVICE_TANH": "constexpr"}
        triton.compile(source(fn=_gated_activation_kernel, signature=signature,
                                 constexprs={"GELU_TANH": gelu, "BLOCK": 1024, "LIBDEVICE_TANH": True}),
                       target=target)
    names = ("a_ptr", "b_ptr", "res_ptr", "wa_ptr", "wb_ptr", "ws_ptr", "scale_ptr", "y_ptr", "wz0_ptr", "wz1_ptr",
             "z0_ptr", "z1_ptr", "z2_ptr")
    flag_names = ("HAS_B", "HAS_SUM_NORM", "HAS_RES", "HAS_SCALE", "NUM_Z")
    # a MoE layer after attention (three out norms, the router's fp32), the MoE tail, the dense tail, PLE's first add
    for flags in ((False, False, True, False, 3), (True, True, True, True, 1), (False, False, True, True, 1),
                  (False, False, True, False, 0)):
        signature = {**dict.fromkeys(names, "*bf16"), "wz2_ptr": "*fp32",
                     **dict.fromkeys(("n_cols", "sa", "sb", "sr", "sy", "sz0", "sz1", "sz2"), "i32"),
                     **dict.fromkeys(("eps_a", "eps_b", "eps_s", "eps_z0", "eps_z1", "eps_z2"), "fp32"),
                     **dict.fromkeys((*flag_names, "BLOCK"), "constexpr")}
        constexprs = dict(zip(flag_names, flags, strict=True)) | {"BLOCK": 8192}
        triton.compile(source(fn=_norm_add_kernel, signature=signature, constexprs=constexprs),
                       target=target, options={"num_warps": 16})
    pointers = ("q_ptr", "k_ptr", "v_ptr", "qo_ptr", "ko_ptr", "vo_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr",
                "kc_ptr", "vc_ptr")
    strides = ("q_st", "q_sh", "k_st", "k_sh", "v_st", "v_sh", "qo_st", "ko_st", "vo_st", "cs_st",
               "kc_sb", "kc_st", "kc_sh", "vc_sb", "vc_st", "vc_sh")
    # (gemma, norm_v, store, heads): Gemma 4 sliding without and with the KV store, Qwen3 with the store (raw v
    # copied), Gemma 4 full (K = V, D = 512) with the store
    for gemma, norm_v, store, (nq, nk, half) in ((True, True, False, (16, 8, 128)), (True, True, True, (16, 8, 128)),
                                                (False, False, True, (32, 4, 64)), (True, True, True, (16, 2, 256))):
        signature = {**dict.fromkeys(pointers, "*bf16"), "slot_ptr": "*i64", **dict.fromkeys(strides, "i32"),
                     "eps": "fp32", "num_tokens": "i32",
                     **dict.fromkeys(("NUM_Q", "NUM_K", "HALF", "BLOCK_HALF", "BLOCK_T", "GEMMA", "NORM_V",
                                      "NUM_OUT", "STORE", "PAGE"), "constexpr")}
        constexprs = {"NUM_Q": nq, "NUM_K": nk, "HALF": half, "BLOCK_HALF": half, "BLOCK_T": 1024 // half,
                      "GEMMA": gemma, "NORM_V": norm_v,
                      "NUM_OUT": nq + nk + (nk if norm_v else 0), "STORE": store, "PAGE": 16}
        triton.compile(source(fn=_qk_norm_rope_kernel, signature=signature, constexprs=constexprs), target=target)
    for weights, has_scale in (("*bf16", False), ("*fp32", True)):
        signature = {"logits_ptr": "*bf16", "scale_ptr": "*bf16", "weights_ptr": weights, "ids_ptr": "*i64",
                     "n_rows": "i32", "E": "i32", "stride_row": "i32", "K": "constexpr", "RENORMALIZE": "constexpr",
                     "HAS_SCALE": "constexpr", "BLOCK_E": "constexpr", "BLOCK_K": "constexpr"}
        constexprs = {"K": 8, "RENORMALIZE": True, "HAS_SCALE": has_scale, "BLOCK_E": 128, "BLOCK_K": 8}
        triton.compile(source(fn=_route_kernel, signature=signature, constexprs=constexprs), target=target)
        # the router GEMV + routing: Qwen3-30B-A3B (bf16 weights out) and Gemma-4-26B-A4B (scale, fp32 out) at
        # T = 1 and 16
        # (and Qwen's with the residual add + norm before it, ADD_NORM)
        for rows, add_norm in ((1, False), (16, False), (1, not has_scale)):
            signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "logits_ptr": "*bf16", "counter_ptr": "*i32",
                         "scale_ptr": "*bf16", "weights_ptr": weights, "ids_ptr": "*i64",
                         **dict.fromkeys(("res_ptr", "norm_w_ptr", "res_out_ptr", "normed_ptr"), "*bf16"),
                         **dict.fromkeys(("n_rows", "E", "H", "stride_x", "stride_w", "stride_r", "stride_ro",
                                          "stride_n"), "i32"), "eps": "fp32",
                         **dict.fromkeys(("K", "RENORMALIZE", "HAS_SCALE", "ROWS", "BLOCK_E", "BLOCK_K",
                                          "EXPERTS_PER_PROGRAM", "BLOCK_H", "ADD_NORM", "GEMMA_NORM"), "constexpr")}
            constexprs = {"K": 8, "RENORMALIZE": True, "HAS_SCALE": has_scale, "ROWS": rows, "BLOCK_E": 128,
                          "BLOCK_K": 8, "EXPERTS_PER_PROGRAM": 2, "BLOCK_H": 4096 if has_scale else 2048,
                          "ADD_NORM": add_norm, "GEMMA_NORM": False}
            kernel = triton.compile(source(fn=_linear_route_kernel, signature=signature, constexprs=constexprs),
                                    target=target)
            ptx = kernel.asm["ptx"]
            assert "atom.global" in ptx and "acq_rel" in ptx and "ld.global.cg" in ptx, "arrival ordering lost"
    for single in (True, False):  # decode (one program, padding then a barrier) and prefill (chunks)
        signature = {"ids_ptr": "*i64", "chunk_counts_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                     "num_padded_ptr": "*i32", "num_pairs": "i32", "max_blocks": "i32", "num_chunks": "i32",
                     "BLOCK_M": "constexpr", "E_PAD": "constexpr", "CHUNK": "constexpr", "NC_PAD": "constexpr",
                     "SINGLE": "constexpr", "FILL": "constexpr"}
        constexprs = {"BLOCK_M": 16, "E_PAD": 128, "CHUNK": 16 if single else 128, "NC_PAD": 1 if single else 128,
                      "SINGLE": single, "FILL": 1024}
        triton.compile(source(fn=_moe_align_scatter_kernel, signature=signature, constexprs=constexprs),
                       target=target)
    # structured output's mask on the sampler's fp32 logits (issue 39)
    signature = {"logits_ptr": "*fp32", "bits_ptr": "*i32", "rows_ptr": "*i64", "vocab_size": "i32",
                 "logits_stride": "i32", "bits_stride": "i32", "BLOCK": "constexpr"}
    triton.compile(source(fn=_apply_token_bitmask_kernel, signature=signature, constexprs={"BLOCK": BITMASK_BLOCK}),
                   target=target)
    print("compiled")
''')


INT8_COMPILE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget

    from inference_server.kernels import dense_linear, fused_moe, int8_gemv, int8_linear, streamed_linear
    from inference_server.kernels.fused_moe import moe_kernel_config

    target = GPUTarget("cuda", 90, 64)
    H200_SHARED = 232448  # bytes of shared memory one block may use (227 KB)
    UNIT = ("stride_xk", "stride_ak", "stride_wk", "stride_sn", "stride_scale")  # 1 at run time: specialised

    def compile_fn(fn, types, constexprs, aligned, num_warps, num_stages, pipelined=True):
        constexprs = dict(constexprs, **{n: 1 for n in UNIT if n in fn.arg_names})
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
                 if n.endswith("_ptr") or n in aligned}
        kernel = triton.compile(source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=target, options=dict(num_warps=num_warps, num_stages=num_stages))
        assert kernel.metadata.shared <= H200_SHARED, (fn.__name__, constexprs, kernel.metadata.shared)
        # The GEMV's loads feed no dot, so Triton does not pipeline them: each iteration's tile is its loads in
        # flight (pipelined=False), and several programs per SM keep HBM busy.
        assert not pipelined or "cp.async" in kernel.asm["ptx"], (fn.__name__, constexprs, "loads not pipelined")
        return kernel

    # int8_linear and dense_linear (one streamed_linear kernel): the heuristic config of every token bucket at
    # Gemma-4-31B's down_proj (split-K at decode) and gate_up and Qwen3-30B-A3B's o_proj and router (narrow rows,
    # deep K tiles), bf16 activations; as many int8 programs as the bucket counts on must fit one SM's 228 KB.
    compiled = set()
    for module, heuristic, weight_type in ((int8_linear, int8_linear.int8_linear_config, "*i8"),
                                           (dense_linear, dense_linear.dense_linear_config, "*bf16")):
        for bucket in module.BUCKETS:
            for n, k in ((5376, 21504), (43008, 5376), (2048, 4096), (128, 2048)):
                cfg = heuristic(min(bucket.max_tokens, 2048), n, k)
                if (weight_type, cfg) in compiled:
                    continue
                compiled.add((weight_type, cfg))
                types = {"x_ptr": "*bf16", "w_ptr": weight_type, "scale_ptr": "*bf16",
                         "out_ptr": "*fp32" if cfg.split_k > 1 else "*bf16"}
                constexprs = {"BLOCK_N": cfg.block_n, "BLOCK_T": cfg.block_t, "BLOCK_K": cfg.block_k,
                              "SPLIT_K": cfg.split_k, "EVEN_K": True, "HAS_SCALE": module is int8_linear,
                              "IEEE": False, "UPCAST": False}
                # int8: the conversion instruction and the exponent trick; float weights: no conversion
                for magic in (False, True) if module is int8_linear else (False,):
                    kernel = compile_fn(streamed_linear._streamed_linear_kernel, types, dict(constexprs, MAGIC=magic),
                                        ("N", "K", "k_per_split", "stride_xt", "stride_wn", "stride_os", "stride_ot"),
                                        cfg.num_warps, cfg.num_stages)
                    if module is int8_linear:  # the wave model counts on the bucket's programs per SM
                        per_sm = bucket.programs_per_sm * (kernel.metadata.shared + 1024)  # 1 KB reserved a block
                        assert per_sm <= 233472, (cfg, kernel.metadata.shared, bucket.programs_per_sm)
                    else:  # dense_linear's model counts the stages' weight and x tiles
                        modelled = cfg.num_stages * (cfg.block_n + cfg.block_t) * cfg.block_k * 2
                        assert kernel.metadata.shared <= modelled, (cfg, kernel.metadata.shared, modelled)
    # the CUDA-core GEMV (block_t < 16): int8 as words with the PTX byte permute, int8 as single bytes, bf16 and
    # fp32 weights; one, two and four tokens per program, with and without split-K, ragged K.
    for weight, act, block_n, block_t, block_k, split, even_k in (
            ("words", "*bf16", 8, 1, 1024, 1, True), ("words", "*bf16", 16, 2, 1024, 2, True),
            ("words", "*bf16", 4, 4, 2048, 1, False), ("words", "*bf16", 16, 1, 256, 1, True),
            ("words", "*fp32", 8, 1, 512, 1, True), ("*i8", "*bf16", 16, 1, 512, 1, False),
            ("*bf16", "*bf16", 8, 1, 1024, 1, True), ("*bf16", "*bf16", 4, 4, 1024, 2, False),
            ("*fp32", "*fp32", 8, 2, 512, 1, True)):
        num_warps = max(1, min(4, block_k // 256))
        types = {"x_ptr": act, "w_ptr": "*i32" if weight == "words" else weight, "scale_ptr": "*bf16",
                 "out_ptr": "*fp32" if split > 1 else act}
        int8 = weight in ("words", "*i8")
        constexprs = {"BLOCK_N": block_n, "BLOCK_T": block_t, "BLOCK_K": block_k, "SPLIT_K": split,
                      "EVEN_K": even_k, "HAS_SCALE": int8, "W_WORDS": weight == "words", "PRMT": weight == "words",
                      "GATED": 0, "UP_IN_MEMORY": False, "LIBDEVICE_TANH": True, "DEEP": False,
                      "INT_DOT": weight == "words" and act == "*bf16"}
        kernel = compile_fn(int8_gemv.int8_gemv_kernel, types, constexprs,
                            ("N", "K", "k_per_split", "stride_xt", "stride_wn", "stride_os", "stride_ot"), num_warps,
                            1, pipelined=False)
        assert weight != "words" or "prmt.b32" in kernel.asm["ptx"], (weight, "no byte permute")
        # int8 words with bf16 activations: integer dot products (kernels.int8_fixed_dot), fp32 ones: float FMAs
        assert ("dp2a.lo.s32.s32" in kernel.asm["ptx"]) == constexprs["INT_DOT"], (weight, act, "integer dot")
    # the gated epilogue (kernels.gated_gemv): int8 words with gelu_tanh (libdevice tanh), bf16 weights with silu
    # and with the up factor read from memory (Gemma 4's per-layer-input gate)
    for weight, gated, up_in_memory, block_n, block_t, block_k in (
            ("words", 1, False, 8, 1, 256), ("*bf16", 2, False, 16, 2, 1024), ("*bf16", 1, True, 8, 1, 1024)):
        deep = weight == "words"  # and weight tiles two iterations ahead (a num_stages 2 config)
        int8 = weight == "words"
        types = {"x_ptr": "*bf16", "w_ptr": "*i32" if int8 else weight, "scale_ptr": "*bf16", "out_ptr": "*bf16",
                 "up_ptr": "*bf16"}
        constexprs = {"BLOCK_N": block_n, "BLOCK_T": block_t, "BLOCK_K": block_k, "SPLIT_K": 1, "EVEN_K": True,
                      "HAS_SCALE": int8, "W_WORDS": int8, "PRMT": int8, "GATED": gated,
                      "UP_IN_MEMORY": up_in_memory, "LIBDEVICE_TANH": True, "DEEP": deep, "INT_DOT": int8}
        compile_fn(int8_gemv.int8_gemv_kernel, types, constexprs,
                   ("N", "K", "k_per_split", "stride_xt", "stride_wn", "stride_os", "stride_ot"),
                   max(1, min(4, block_k // 256)), 1, pipelined=False)
    for has_scale in (True, False):
        signature = {"part_ptr": "*fp32", "scale_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32", "N": "i32",
                     "stride_ps": "i32", "stride_pt": "i32", "stride_scale": "i32", "stride_ot": "i32",
                     "SPLIT_K": "constexpr", "HAS_SCALE": "constexpr", "BLOCK": "constexpr"}
        triton.compile(source(fn=streamed_linear._split_k_reduce_kernel, signature=signature,
                                 constexprs={"SPLIT_K": 4, "HAS_SCALE": has_scale, "BLOCK": 1024}), target=target)

    # int8 fused MoE: decode and prefill heuristic configs at Gemma-4-26B-A4B's expert shape.
    for tokens in (1, 2048):
        cfg = moe_kernel_config(tokens, 2816, 704, 128, 8)
        common = {"BLOCK_M": cfg.block_m, "EVEN_K": True, "IEEE": False, "UPCAST": False, "W_INT8": True}
        types = {"x_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": "*i8", "out_ptr": "*bf16", "topk_w_ptr": "*fp32",
                 "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "scale_ptr": "*bf16"}
        aligned = ("H", "inter_size", "stride_xt", "stride_at", "stride_we", "stride_wn", "stride_ot", "stride_se")
        for fn, gemm, extra in ((fused_moe._moe_gate_up_kernel, cfg.gate_up, {"TOP_K": 8, "ACT": 1}),
                                (fused_moe._moe_down_kernel, cfg.down, {})):
            constexprs = dict(common, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k, GROUP_M=gemm.group_m, **extra)
            for magic in (False, True):
                compile_fn(fn, types, dict(constexprs, MAGIC=magic), aligned, gemm.num_warps, gemm.num_stages)
    print("compiled")
''')


GREEDY_HEAD_COMPILE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget

    from inference_server.kernels import greedy_head as gh

    target = GPUTarget("cuda", 90, 64)
    fn = gh._greedy_head_slices_kernel
    aligned = ("vocab", "hidden_size", "stride_hn", "stride_wv")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if n.endswith("_ptr") or n in aligned}
    # (activation dtype, weight dtype, rows, soft-cap, EVEN_K); EVEN_K False: a hidden size like 96
    variants = (("bf16", "bf16", 1, False, True), ("bf16", "bf16", 16, True, True), ("bf16", "bf16", 64, True, True),
                ("fp32", "fp32", 16, True, True), ("bf16", "bf16", 4, True, False),
                ("bf16", "i8", 1, True, True), ("bf16", "i8", 32, True, True), ("bf16", "i8", 64, True, True),
                ("bf16", "i8", 4, False, False), ("fp32", "i8", 64, True, True))  # int8 heads
    for dtype, weight, rows, softcap, even_k in variants:
        sizes = {"bf16": 2, "fp32": 4, "i8": 1}
        cfg = gh.greedy_head_config(rows, sizes[weight], sizes[dtype])
        int8 = weight == "i8"
        constexprs = {"BLOCK_V": cfg.block_v, "BLOCK_N": max(16, triton.next_power_of_2(rows)),
                      "BLOCK_K": cfg.block_k, "EVEN_K": even_k, "ROUND_BF16": dtype == "bf16", "SOFTCAP": softcap,
                      "RECIPROCAL": True, "IEEE": dtype == "fp32", "UPCAST": False, "LIBDEVICE_TANH": True,
                      "HAS_SCALE": int8, "MAGIC": int8 and cfg.magic_dequant}
        types = {"hidden_ptr": f"*{dtype}", "weight_ptr": f"*{weight}", "scale_ptr": f"*{dtype}", "max_ptr": "*fp32",
                 "index_ptr": "*i32", "sum_ptr": "*fp32", "inv_cap": "fp32", "cap": "fp32"}
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        kernel = triton.compile(source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=target, options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        assert kernel.metadata.shared <= 232448, (dtype, rows, kernel.metadata.shared)
        assert "cp.async" in kernel.asm["ptx"], (dtype, rows, "loads not pipelined")
        assert dtype == "fp32" or "wgmma" in kernel.asm["ptx"], (dtype, rows, "no tensor-core dot")
    signature = {"max_ptr": "*fp32", "index_ptr": "*i32", "sum_ptr": "*fp32", "ids_ptr": "*i64",
                 "logprobs_ptr": "*fp32", "n_rows": "i32", "n_slices": "i32", "BLOCK_S": "constexpr"}
    triton.compile(source(fn=gh._greedy_head_combine_kernel, signature=signature, constexprs={"BLOCK_S": 4096}),
                   target=target)
    print("compiled")
''')


PDL_COMPILE = textwrap.dedent('''
    import importlib
    import pkgutil

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    import inference_server.kernels as package
    from inference_server.kernels import (decode_attention, fused_moe, gated_activation, greedy_head, int8_gemv,
                                          kv_store, mlp_beside_experts, moe_decode, norm_add, norm_add_gemv,
                                          qk_norm_rope, rmsnorm, rope, rope_tables, router, streamed_linear)

    target = GPUTarget("cuda", 90, 64)
    BF16 = "*bf16"
    GEMV_1024 = dict(BLOCK_N=8, BLOCK_T=1, BLOCK_K=1024, SPLIT_K=1, EVEN_K=False, HAS_SCALE=False, W_WORDS=False,
                     PRMT=False, UP_IN_MEMORY=False, LIBDEVICE_TANH=True, DEEP=False, INT_DOT=False)
    # (kernel, pointer and float argument types (others: i32), constexprs): one decode-shaped variant of each
    cases = [
        (rmsnorm._rmsnorm_kernel, {"eps": "fp32"},
         dict(HAS_RES=True, HAS_W=True, GEMMA=False, BLOCK_R=1, BLOCK_D=2048)),
        (norm_add._norm_add_kernel,
         {**dict.fromkeys(("eps_a", "eps_b", "eps_s", "eps_z0", "eps_z1", "eps_z2"), "fp32"), "wz2_ptr": "*fp32"},
         dict(HAS_B=False, HAS_SUM_NORM=False, HAS_RES=True, HAS_SCALE=False, NUM_Z=3, BLOCK=4096)),
        (qk_norm_rope._qk_norm_rope_kernel, {"slot_ptr": "*i64", "eps": "fp32"},
         dict(NUM_Q=32, NUM_K=4, HALF=64, BLOCK_HALF=64, BLOCK_T=16, GEMMA=False, NORM_V=False, NUM_OUT=36,
              STORE=True, PAGE=16)),
        (kv_store._store_kv_kernel, {"slot_mapping_ptr": "*i64"}, dict(PAGE=16, H=4, D=128, BLOCK_H=4, BLOCK_D=128)),
        (rope._rope_kernel, {}, dict(NUM_Q_HEADS=32, HALF=64, BLOCK_HALF=64)),
        (rope_tables._rope_tables_kernel, {"pos_ptr": "*i64", "inv_ptr": "*fp32"}, dict(BLOCK=128, LIBDEVICE=True)),
        (decode_attention._paged_decode_kernel,
         {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
          "part_acc_ptr": "*fp32", "counter_ptr": "*i32", "qk_scale": "fp32", "q_eps": "fp32"},
         dict(PAGE=16, G=8, BLOCK_G=16, D=128, BLOCK_D=128, BLOCK_N=64, SPLIT=True, DOT_PRECISION="tf32",
              UPCAST=False, FUSED_REDUCE=True, BLOCK_S=16, SPLIT_CHUNK=16, BLOCK_R=8, KV_BEFORE_WAIT=True,
              TABLE_AHEAD=False)),
        # Gemma-4-E4B's KV-shared sliding layer: the raw q normed and rotated in the launch
        (decode_attention._paged_decode_kernel,
         {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
          "part_acc_ptr": "*fp32", "counter_ptr": "*i32", "qk_scale": "fp32", "q_eps": "fp32"},
         dict(PAGE=16, G=4, BLOCK_G=16, D=256, BLOCK_D=256, BLOCK_N=32, SPLIT=True, DOT_PRECISION="tf32",
              UPCAST=False, FUSED_REDUCE=True, BLOCK_S=16, SPLIT_CHUNK=16, BLOCK_R=4, Q_NORM_ROPE=1,
              KV_BEFORE_WAIT=True, TABLE_AHEAD=False)),
        (decode_attention._decode_reduce_kernel,
         {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "context_lens_ptr": "*i32"},
         dict(D=128, BLOCK_D=128, BLOCK_S=64, BLOCK_N=64)),
        (router._route_kernel, {"ids_ptr": "*i64"},
         dict(K=8, RENORMALIZE=True, HAS_SCALE=False, BLOCK_E=128, BLOCK_K=8)),
        (router._linear_route_kernel, {"counter_ptr": "*i32", "ids_ptr": "*i64", "eps": "fp32"},
         dict(K=8, RENORMALIZE=True, HAS_SCALE=False, ROWS=1, BLOCK_E=128, BLOCK_K=8, EXPERTS_PER_PROGRAM=1,
              BLOCK_H=2048, ADD_NORM=True, GEMMA_NORM=False)),
        (fused_moe._moe_align_count_kernel, {"ids_ptr": "*i64", "chunk_counts_ptr": "*i32"},
         dict(E_PAD=128, CHUNK=128)),
        (fused_moe._moe_align_scatter_kernel,
         {"ids_ptr": "*i64", **dict.fromkeys(("chunk_counts_ptr", "sorted_ptr", "block_expert_ptr", "num_padded_ptr"),
                                             "*i32")},
         dict(BLOCK_M=16, E_PAD=128, CHUNK=16, NC_PAD=1, SINGLE=True, FILL=1024)),
        (fused_moe._moe_gate_up_kernel, {"sorted_ptr": "*i32", "block_expert_ptr": "*i32"},
         dict(TOP_K=8, ACT=0, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, EVEN_K=True, IEEE=False, UPCAST=False,
              W_INT8=False, MAGIC=False)),
        (fused_moe._moe_down_kernel, {"sorted_ptr": "*i32", "block_expert_ptr": "*i32"},
         dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, EVEN_K=True, IEEE=False, UPCAST=False, W_INT8=False,
              MAGIC=False)),
        (fused_moe._moe_sum_kernel, {"topk_w_ptr": "*fp32"}, dict(TOP_K=8, BLOCK_H=1024, WEIGHTED_DTYPE=tl.float32)),
        (moe_decode._gate_up_kernel, {"ids_ptr": "*i64"},
         dict(TOP_K=8, ACT=0, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, W_INT8=False, W_WORDS=False, PRMT=False,
              INT_DOT=False)),
        (moe_decode._down_kernel, {"w_ptr": "*i32", "ids_ptr": "*i64", "pair_ptr": "*bf16", "counter_ptr": "*i32"},
         dict(TOP_K=8, ROW_TILES_STRIDE=2048, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, W_INT8=True, W_WORDS=True,
              PRMT=True, INT_DOT=True, W_BEFORE_WAIT=False)),  # int8 experts as words, bf16 activations as fixed point
        # bf16 experts, the expert id and the first weight tile before the wait
        (moe_decode._down_kernel, {"ids_ptr": "*i64", "pair_ptr": "*bf16", "counter_ptr": "*i32"},
         dict(TOP_K=8, ROW_TILES_STRIDE=2048, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, W_INT8=False, W_WORDS=False,
              PRMT=False, INT_DOT=False, W_BEFORE_WAIT=True)),
        (gated_activation._gated_activation_kernel, {}, dict(GELU_TANH=True, BLOCK=1024, LIBDEVICE_TANH=True)),
        (greedy_head._greedy_head_slices_kernel,
         {"max_ptr": "*fp32", "index_ptr": "*i32", "sum_ptr": "*fp32", "inv_cap": "fp32", "cap": "fp32"},
         dict(BLOCK_V=64, BLOCK_N=16, BLOCK_K=128, EVEN_K=True, ROUND_BF16=True, SOFTCAP=False, RECIPROCAL=True,
              IEEE=False, UPCAST=False, LIBDEVICE_TANH=True, HAS_SCALE=False, MAGIC=False)),
        # 1-2 rows: the logits of the head's CUDA-core GEMV reduced as the fused head would (greedy_head_of_logits)
        (greedy_head._logit_slices_kernel,
         {"max_ptr": "*fp32", "index_ptr": "*i32", "sum_ptr": "*fp32", "inv_cap": "fp32", "cap": "fp32"},
         dict(BLOCK_V=1024, BLOCK_N=1, ROUND_BF16=True, SOFTCAP=True, RECIPROCAL=True, LIBDEVICE_TANH=True)),
        (greedy_head._greedy_head_combine_kernel,
         {"max_ptr": "*fp32", "index_ptr": "*i32", "sum_ptr": "*fp32", "ids_ptr": "*i64", "logprobs_ptr": "*fp32"},
         dict(BLOCK_S=4096)),
        (streamed_linear._streamed_linear_kernel, {"out_ptr": "*fp32"},
         dict(BLOCK_N=64, BLOCK_T=16, BLOCK_K=128, SPLIT_K=2, EVEN_K=True, HAS_SCALE=False, IEEE=False, UPCAST=False,
              MAGIC=False)),
        (int8_gemv.int8_gemv_kernel, {"w_ptr": "*i32"},
         dict(BLOCK_N=16, BLOCK_T=1, BLOCK_K=1024, SPLIT_K=1, EVEN_K=True, HAS_SCALE=True, W_WORDS=True, PRMT=True,
              GATED=1, UP_IN_MEMORY=False, LIBDEVICE_TANH=True, DEEP=True, INT_DOT=True)),
        (streamed_linear._split_k_reduce_kernel, {"part_ptr": "*fp32"}, dict(SPLIT_K=4, HAS_SCALE=False, BLOCK=1024)),
        # Gemma-4-26B-A4B bf16 at one token: the gated gate/up GEMV beside the router, the down GEMV beside the
        # experts' gate/up (kernels.mlp_beside_experts)
        (mlp_beside_experts._gated_gemv_and_route_kernel,
         {"r_counter_ptr": "*i32", "r_ids_ptr": "*i64", "r_weights_ptr": "*fp32", "r_scale_ptr": "*fp32",
          "r_eps": "fp32"},
         dict(**GEMV_1024, GATED=1, R_K=8, R_RENORMALIZE=True, R_HAS_SCALE=True, R_ROWS=1, R_BLOCK_E=128, R_BLOCK_K=8,
              R_EXPERTS_PER_PROGRAM=1, R_BLOCK_H=4096, R_ADD_NORM=False, R_GEMMA_NORM=True)),
        (mlp_beside_experts._expert_gate_up_and_gemv_kernel, {"e_ids_ptr": "*i64"},
         dict(**GEMV_1024, GATED=0, E_TOP_K=8, E_ACT=1, E_BLOCK_N=16, E_BLOCK_K=256, E_EVEN_K=True, E_W_INT8=False,
              E_W_WORDS=False, E_PRMT=False, E_INT_DOT=False)),
        # Gemma-4-E4B's post-FFN add inside the per-layer-input gate's GEMV (kernels.norm_add_gemv)
        (norm_add_gemv._norm_add_gemv_kernel, {"eps_a": "fp32"},
         {**GEMV_1024, "GATED": 1, "UP_IN_MEMORY": True, "NORM_IN": 1, "HAS_S": False, "NORM_BLOCK": 4096}),
        # Qwen3-MoE's input add + norm inside the q/k/v GEMV (kernels.norm_add_gemv.add_norm_gemv)
        (norm_add_gemv._norm_add_gemv_kernel, {"eps_a": "fp32"},
         {**GEMV_1024, "GATED": 0, "UP_IN_MEMORY": False, "NORM_IN": 2, "HAS_S": False, "NORM_BLOCK": 2048}),
    ]
    # kernels.pdl's invariant: only these read (weights) before the wait
    EARLY_LOADS = {"int8_gemv_kernel", "_norm_add_kernel", "_qk_norm_rope_kernel", "_norm_add_gemv_kernel"}
    # and the cases that ask for early loads: the decode attention's earlier keys, the MoE down launch's weights
    EARLY_SWITCHES = ("KV_BEFORE_WAIT", "W_BEFORE_WAIT")
    # kernels whose programs run one of two kernels' programs (kernels.mlp_beside_experts): each branch is the code
    # of a kernel checked here (the GEMV's loads early, the other's not), so the PTX's first load says nothing
    BRANCHED = {"_gated_gemv_and_route_kernel", "_expert_gate_up_and_gemv_kernel"}
    # every kernel of the package that takes part in PDL is compiled here (the jit programs that kernels call,
    # e.g. int8_gemv.gemv_program, are compiled inside them)
    with_pdl = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        with_pdl |= {f"{v.__module__}.{v.__name__}" for v in vars(module).values()  # pdl's own helpers aside
                     if isinstance(v, triton.runtime.JITFunction) and "USE_PDL" in v.arg_names
                     and v.__module__ != "inference_server.kernels.pdl" and v.__name__.endswith("_kernel")}
    covered = {f"{fn.__module__}.{fn.__name__}" for fn, _, _ in cases}
    assert with_pdl == covered, (sorted(with_pdl - covered), sorted(covered - with_pdl))
    # the kernels with a main loop between their wait and their release (kernels.pdl's PDL_RELEASE_AFTER_LOOP, i.e.
    # USE_PDL=True); with USE_PDL=2 (PDL_RELEASE_AFTER_WAIT) every kernel releases before its first load after the wait
    LOOPS = {"int8_gemv_kernel", "_norm_add_gemv_kernel", "_paged_decode_kernel", "_moe_gate_up_kernel",
             "_moe_down_kernel", "_gate_up_kernel", "_down_kernel", "_linear_route_kernel",
             "_greedy_head_slices_kernel", "_streamed_linear_kernel"}

    def loads_between_wait_and_release(ptx):
        wait, release = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
        between = ptx[wait:release] if release > wait else ""
        return "ld.global" in between or "cp.async" in between

    for fn, types, constexprs in cases:
        signature = {n: "constexpr" if n in constexprs else types.get(n, BF16 if n.endswith("_ptr") else "i32")
                     for n in fn.arg_names}
        for use_pdl in (True, 2, False):
            kernel = triton.compile(source(fn, signature, constexprs, use_pdl=use_pdl), target=target,
                                    options={"launch_pdl": bool(use_pdl)})
            ptx = kernel.asm["ptx"]
            # the RoPE tables take CUDA's cosf / sinf (as PyTorch's kernels), not the approximate instructions
            assert fn is not rope_tables._rope_tables_kernel or not ("cos.approx" in ptx or "sin.approx" in ptx)
            if use_pdl:
                assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, fn.__name__
                assert kernel.metadata.launch_pdl, fn.__name__
                # the kernels that read weights before the wait still do, and no other kernel reads anything there
                loads_early = fn.__name__ in EARLY_LOADS or any(constexprs.get(k) for k in EARLY_SWITCHES)
                assert fn.__name__ in BRANCHED or (
                    ptx.index("ld.global") < ptx.index("griddepcontrol.wait")) == loads_early, fn.__name__
                # where the release sits: after the main loop, or right after the wait
                assert fn.__name__ in BRANCHED or loads_between_wait_and_release(ptx) == (
                    use_pdl is True and fn.__name__ in LOOPS), (fn.__name__, use_pdl)
            else:  # off: no trace of PDL in the code
                assert "griddepcontrol" not in ptx and not kernel.metadata.launch_pdl, fn.__name__
    print("compiled", len(cases))
''')


INVARIANT_MATMUL_COMPILE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget

    from inference_server.kernels.batch_invariant_matmul import CONFIG, _invariant_matmul_kernel

    target = GPUTarget("cuda", 90, 64)
    fn, c = _invariant_matmul_kernel, CONFIG
    for dtype in ("bf16", "fp32"):
        for all_splits in (True, False):  # every split in one program; a program a split, the last folding
            constexprs = dict(HAS_BIAS=True, FP32_DOT=dtype == "fp32", UPCAST=False, ALL_SPLITS=all_splits,
                              BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k)
            types = dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "y_ptr"), f"*{dtype}")
            if not all_splits:
                types |= {"part_ptr": "*fp32", "counter_ptr": "*i32"}
            signature = {n: "constexpr" if n in constexprs else types.get(n, f"*{dtype}" if n.endswith("_ptr")
                                                                          else "i32") for n in fn.arg_names}
            kernel = triton.compile(source(fn, signature, constexprs), target=target,
                                    options={"num_warps": c.num_warps, "num_stages": c.num_stages})
            ptx = kernel.asm["ptx"]
            assert kernel.metadata.shared <= 227 * 1024, (dtype, all_splits, kernel.metadata.shared)
            assert ("wgmma" in ptx) == (dtype == "bf16"), dtype  # tensor cores for bf16, IEEE fp32 FMAs for fp32
            if all_splits:
                assert "atom." not in ptx
            else:
                # the partials' stores, a barrier, then the counter's acq_rel add; the fold's loads bypass L1 and
                # the counter is put back to zero after them
                add = ptx.index("atom.global.gpu.acq_rel.add")
                assert "bar.sync" in ptx[ptx.rindex("st.global", 0, add):add], dtype
                assert "ld.global.cg" in ptx[add:] and "atom.global" in ptx[ptx.rindex("ld.global.cg"):], dtype
    print("compiled")
''')


def _compile_in_child(script: str) -> None:
    pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend (and its ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_new_kernels_compile_for_sm90() -> None:
    _compile_in_child(COMPILE)


def test_streamed_linear_and_int8_moe_compile_for_sm90_within_shared_memory() -> None:
    _compile_in_child(INT8_COMPILE)


def test_greedy_head_compiles_for_sm90_pipelined() -> None:
    """The greedy head's variants (bf16 with and without the soft-cap at 1, 16 and 64 rows; fp32 IEEE; int8 heads
    at 1-64 rows) compile with pipelined weight loads, tensor-core dots in bf16, and fit the H200's shared memory."""
    _compile_in_child(GREEDY_HEAD_COMPILE)


def test_pdl_kernels_compile_for_sm90_with_griddepcontrol() -> None:
    """Every kernel that takes ``USE_PDL`` (kernels.pdl) compiles for sm_90 with it on (the PTX has the wait and the
    release, the launch carries the PDL attribute) and off (no ``griddepcontrol`` at all: today's code)."""
    _compile_in_child(PDL_COMPILE)


def test_batch_invariant_matmul_compiles_for_sm90_with_its_fold() -> None:
    """The deterministic GEMM (``kernels.batch_invariant_matmul``) in both modes, bf16 and fp32: the interpreter
    runs code the compiler rejects (a loop's variable read after the loop), and the split launch's fold must keep
    its barrier before the counter's acq_rel add and read the partials past L1."""
    _compile_in_child(INVARIANT_MATMUL_COMPILE)


MOE_SUM_COMPILE = textwrap.dedent('''
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from inference_server.kernels.fused_moe import _moe_sum_kernel as fn

    target = GPUTarget("cuda", 90, 64)
    constexprs = dict(TOP_K=8, BLOCK_H=1024, WEIGHTED_DTYPE=tl.float32)
    types = {"in_ptr": "*bf16", "topk_w_ptr": "*fp32", "out_ptr": "*bf16"}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    ptx = {fusion: triton.compile(source(fn, signature, constexprs), target=target,
                                  options={"num_warps": 4, "enable_fp_fusion": fusion}).asm["ptx"]
           for fusion in (True, False)}
    assert "fma.rn.f32" in ptx[True]  # what the launch's option prevents: the product folded into the add
    assert "fma.rn.f32" not in ptx[False] and "mul.rn.f32" in ptx[False] and "add.rn.f32" in ptx[False]
    print("compiled")
''')


def test_moe_sum_rounds_each_weighted_pair_before_the_add() -> None:
    """``fused_moe`` launches the k-sum with ``enable_fp_fusion=False``: with Gemma 4's fp32 routing weights the
    product ``pair * weight`` is rounded to fp32 before it is added (as when the down kernel stored it weighted);
    with contraction on, the compiler folds them into one FMA (one rounding fewer, other bits)."""
    _compile_in_child(MOE_SUM_COMPILE)


ROW_LOGSUMEXP_COMPILE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget

    from inference_server.kernels.row_logsumexp import BLOCK, NUM_WARPS, _row_logsumexp_kernel as fn

    signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", "vocab": "i32", "stride_xb": "i32", "BLOCK": "constexpr"}
    kernel = triton.compile(source(fn, signature, {"BLOCK": BLOCK}), target=GPUTarget("cuda", 90, 64),
                            options={"num_warps": NUM_WARPS})
    assert "ex2" in kernel.asm["ptx"]
    print("compiled")
''')


def test_row_logsumexp_compiles_for_sm90() -> None:
    """The deterministic sampler's row log-sum-exp (its running max and sum carried through the chunk loop as
    fp32 scalars, which the interpreter never type-checks)."""
    _compile_in_child(ROW_LOGSUMEXP_COMPILE)
