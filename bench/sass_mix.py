"""The instruction mix of the weight-streaming linear kernels' main loop, per weight byte, from sm_90 SASS.

No GPU needed: each kernel variant is compiled for the H200 (``GPUTarget("cuda", 90, 64)``, the alignment facts the
launcher passes at run time), Triton's own ``nvdisasm`` turns the cubin into SASS and ``cuobjdump -res-usage``
gives registers and local memory (spills). The K loop is the backward branch whose body holds the most global
loads; its instructions are counted by opcode and divided by the weight bytes one iteration of the whole program
streams (``BLOCK_N x BLOCK_K x`` weight bytes per element; the loop body runs once per warp).

From the counts, a throughput bound per SM and clock (cycles an SM needs per weight byte, in issue slots and per
pipe, with sm_90's per-SM rates from the CUDA programming guide: 4 warp instructions issued per clock; 128 fp32
FFMA/FADD/FMUL lanes; 64 lanes of integer ALU work: LOP3, PRMT, SHF, IADD3, IMAD, ISETP...; 16 conversions I2F/F2F;
32 shuffles). ``B/clk`` is the weight bytes per SM clock the tightest of those allows; the H200 streams HBM at
~4.3 TB/s, which is ~16-18 weight bytes per SM clock (132 SMs at 1.75-1.98 GHz): a variant below ~18 B/clk cannot
reach the memory limit whatever its loads do, and one well above it is bound by its loads in flight.

  uv run python bench/sass_mix.py                        # the table: int8 and float configs at 31B and Qwen shapes
  uv run python bench/sass_mix.py --only gemv --dump 0   # one variant's loop SASS (row 0 of the table)
  uv run python bench/sass_mix.py --only moe             # the MoE decode GEMVs (kernels.moe_decode), both models

Triton's version changes the SASS: the H200 runs Triton 3.6 (``triton.__version__`` is printed).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

WARP_ISSUE_PER_CLK = 4  # warp schedulers per SM
HBM_BYTES_PER_SM_CLK = 18.0  # 4.3 TB/s over 132 SMs at ~1.8 GHz
# lanes per SM per clock by pipe (CUDA C programming guide, arithmetic instruction throughput, compute capability 9.0)
PIPES = {
    "fp32": (128, ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP")),
    "alu": (64, ("LOP3", "PRMT", "SHF", "IADD3", "IMAD", "ISETP", "SEL", "LEA", "IABS", "VIADD", "IMNMX", "MOV",
                 "SGXT", "BMSK", "LOP", "SHL", "SHR", "BFE", "BFI", "CS2R", "VIMNMX", "IADD")),
    "fp16x2": (64, ("HFMA2", "HADD2", "HMUL2")),
    "conversion": (16, ("I2F", "F2F", "F2I", "I2I", "F2FP")),
    "shuffle": (32, ("SHFL",)),
}
LOADS = ("LDG", "LDGSTS", "UTMALDG")


@dataclass(frozen=True)
class Variant:
    """One compiled variant: which kernel, weight and activation types, tiles."""

    label: str
    path: str  # "gemv" (CUDA-core), "dot" (tensor-core streamed_linear), "moe_gate_up" or "moe_down" (moe_decode)
    weight: str  # "i8", "bf16", "fp16", "fp32"
    block_n: int
    block_t: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    magic: bool = False
    act: str = "bf16"
    words: bool = True  # CUDA-core int8: read as int32 words (else single bytes)
    prmt: bool = True  # CUDA-core int8 words: bytes placed by the PTX byte permute (else shifts and masks)
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass
class LoopMix:
    variant: Variant
    registers: int
    spill_bytes: int
    shared: int
    counts: Counter[str]
    loop_text: list[str]

    @property
    def weight_bytes(self) -> int:
        per_element = 1 if self.variant.weight == "i8" else (4 if self.variant.weight == "fp32" else 2)
        row_sets = 2 if self.variant.path == "moe_gate_up" else 1  # gate and up rows a program
        return self.variant.block_n * self.variant.block_k * per_element * row_sets

    def per_byte(self, *opcodes: str) -> float:
        """Thread instructions per weight byte of the named opcodes (prefix match), all warps of the program."""
        count = sum(c for op, c in self.counts.items() if any(op.split(".")[0] == o for o in opcodes))
        return count * 32 * self.variant.num_warps / self.weight_bytes

    def total_per_byte(self) -> float:
        return sum(self.counts.values()) * 32 * self.variant.num_warps / self.weight_bytes

    def bytes_per_clk(self) -> tuple[float, str]:
        """Weight bytes per SM clock the tightest of issue and the pipes allows, and which one it is."""
        limits = {"issue": 32 * WARP_ISSUE_PER_CLK / self.total_per_byte()}
        for pipe, (lanes, ops) in PIPES.items():
            used = self.per_byte(*ops)
            if used:
                limits[pipe] = lanes / used
        name = min(limits, key=limits.__getitem__)
        return limits[name], name


def _bin_dir() -> Path:
    import triton

    return Path(triton.__file__).resolve().parent / "backends" / "nvidia" / "bin"


def compile_moe_variant(v: Variant) -> Any:
    """``moe_decode``'s gate/up or down kernel with the alignment facts of its launches (16-byte aligned pointers,
    sizes and strides divisible by 16), top-8, whole K tiles unless ``extra`` says otherwise."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from inference_server.kernels import moe_decode

    int8 = v.weight == "i8"
    words = int8 and v.words
    weight = "*i32" if words else f"*{v.weight}"
    if v.path == "moe_gate_up":
        fn = moe_decode._gate_up_kernel
        types = {"x_ptr": f"*{v.act}", "w_ptr": weight, "ids_ptr": "*i64", "scale_ptr": "*bf16",
                 "out_ptr": f"*{v.act}"}
        constexprs: dict[str, Any] = {"TOP_K": 8, "ACT": 0}
    else:
        fn = moe_decode._down_kernel
        types = {"inter_ptr": f"*{v.act}", "w_ptr": weight, "ids_ptr": "*i64", "topk_w_ptr": "*bf16",
                 "scale_ptr": "*bf16", "pair_ptr": "*bf16", "counter_ptr": "*i32", "out_ptr": f"*{v.act}"}
        constexprs = {"TOP_K": 8, "ROW_TILES_STRIDE": 2048}
    constexprs.update(BLOCK_N=v.block_n, BLOCK_K=v.block_k, EVEN_K=True, W_INT8=int8)
    optional = {"W_WORDS": words, "PRMT": words and v.prmt, "USE_PDL": False, "INT_DOT": words and v.act == "bf16"}
    constexprs.update({name: value for name, value in optional.items() if name in fn.arg_names})
    constexprs.update(v.extra)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if n.endswith("_ptr") or n.startswith("stride") or n in ("H", "inter_size")}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 64),
                          options=dict(num_warps=v.num_warps, num_stages=v.num_stages))


def compile_variant(v: Variant) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from inference_server.kernels import int8_gemv, streamed_linear

    if v.path.startswith("moe_"):
        return compile_moe_variant(v)

    fn = int8_gemv.int8_gemv_kernel if v.path == "gemv" else streamed_linear._streamed_linear_kernel
    constexprs: dict[str, Any] = {"BLOCK_N": v.block_n, "BLOCK_T": v.block_t, "BLOCK_K": v.block_k,
                                  "SPLIT_K": v.split_k, "EVEN_K": True}
    words = v.path == "gemv" and v.weight == "i8" and "W_WORDS" in fn.arg_names and v.words
    optional = {"HAS_SCALE": v.weight == "i8", "IEEE": v.act == "fp32", "UPCAST": False, "MAGIC": v.magic,
                "W_WORDS": words, "PRMT": words and v.prmt, "USE_PDL": False, "GATED": 0,
                "UP_IN_MEMORY": False, "LIBDEVICE_TANH": True,
                "DEEP": v.path == "gemv" and v.num_stages >= 2, "INT_DOT": words and v.act == "bf16"}
    constexprs.update({name: value for name, value in optional.items() if name in fn.arg_names})
    constexprs.update(v.extra)
    constexprs.update({n: 1 for n in ("stride_xk", "stride_wk", "stride_scale") if n in fn.arg_names})
    types = {"x_ptr": f"*{v.act}", "w_ptr": "*i32" if words else f"*{v.weight}", "scale_ptr": "*bf16",
             "out_ptr": "*fp32" if v.split_k > 1 else f"*{v.act}"}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    aligned = ("N", "K", "k_per_split", "stride_xt", "stride_wn", "stride_os", "stride_ot")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if n.endswith("_ptr") or n in aligned}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 64),
                          options=dict(num_warps=v.num_warps, num_stages=v.num_stages))


def sass_and_resources(cubin: bytes) -> tuple[str, int, int]:
    """(SASS text, registers, local-memory bytes per thread) of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        sass = subprocess.run([_bin_dir() / "nvdisasm", "-c", path], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([_bin_dir() / "cuobjdump", "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))  # type: ignore[union-attr]
    return sass, regs, local


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def main_loop(sass: str) -> list[tuple[int, str, str]]:
    """The instructions (address, opcode, line) of the backward-branch loop whose body has the most global loads
    (the K loop); nested and unrolled loops count as one body."""
    instrs: list[tuple[int, str, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTR.search(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for name in pending:
            labels[name] = addr
        pending = []
        instrs.append((addr, m.group(2), line.strip()))
    best: list[tuple[int, str, str]] = []
    best_loads = -1
    for addr, op, line in instrs:
        if not op.startswith("BRA"):
            continue
        target = _BRANCH.search(line)
        if not target or target.group(1) not in labels or labels[target.group(1)] > addr:
            continue
        body = [i for i in instrs if labels[target.group(1)] <= i[0] <= addr]
        loads = sum(1 for _, o, _ in body if o.split(".")[0] in LOADS)
        if loads > best_loads:
            best, best_loads = body, loads
    return best


def _opcode_key(op: str) -> str:
    """Opcode with the modifiers that matter here: load width, I2F/F2F kinds; others by base name."""
    base = op.split(".")[0]
    if base in LOADS or base in ("LDS", "STS", "LDSM"):
        width = next((p for p in op.split(".")[1:] if p in ("64", "128", "U8", "S8", "U16", "S16")), "32")
        return f"{base}.{width}"
    if base in ("I2F", "F2F", "F2FP", "HADD2", "HFMA2"):
        return op
    return base


def analyse(v: Variant) -> LoopMix:
    kernel = compile_variant(v)
    sass, regs, local = sass_and_resources(kernel.asm["cubin"])
    loop = main_loop(sass)
    counts = Counter(_opcode_key(op) for _, op, _ in loop)
    return LoopMix(v, regs, local, kernel.metadata.shared, counts, [line for _, _, line in loop])


SHOWN = ("LDG.128", "LDG.64", "LDG.32", "LDG.U16", "LDG.U8", "LDGSTS.128", "LDS", "STS", "PRMT", "LOP3", "SHF",
         "IMAD", "IADD3", "I2F", "FFMA", "FADD", "FMUL", "HFMA2", "SHFL", "BAR", "HGMMA")


def row(m: LoopMix) -> str:
    def per(op: str) -> str:
        if "." in op and op.split(".")[0] in LOADS:
            count = m.counts.get(op, 0)
            value = count * 32 * m.variant.num_warps / m.weight_bytes
        else:
            value = m.per_byte(op)
        return f"{value:.2f}" if value else "-"

    bound, pipe = m.bytes_per_clk()
    v = m.variant
    tiles = f"n{v.block_n} t{v.block_t} k{v.block_k} s{v.split_k} w{v.num_warps} st{v.num_stages}"
    return (f"| {v.label} | {v.path}{' magic' if v.magic else ''} {v.weight} | {tiles} | {m.registers} | "
            f"{m.spill_bytes} | {sum(m.counts.values())} | {m.total_per_byte():.2f} | "
            + " | ".join(per(op) for op in SHOWN) + f" | {bound:.1f} ({pipe}) |")


HEADER = ("| shape | path | tiles | regs | spill B | loop instrs/warp | instr/byte | "
          + " | ".join(SHOWN) + " | B/clk/SM bound |\n|" + "---|" * (8 + len(SHOWN)))

GEMMA_31B = {"qkv sliding": (16384, 5376), "qk full": (18432, 5376), "o sliding": (5376, 8192),
             "o full": (5376, 16384), "gate_up": (43008, 5376), "down": (5376, 21504)}
QWEN_ATTN = {"qwen qkv": (5120, 2048), "qwen o": (2048, 4096)}


def default_variants() -> list[Variant]:
    """The decode configs in use today (tuned files, else the heuristic) at 31B's int8 shapes and Qwen's float
    attention shapes, and the CUDA-core GEMV's candidates (``int8_kernels.GEMV_SWEEP`` and ``dense_linear``'s)."""
    import torch

    from inference_server.kernels.dense_linear import dense_linear_config
    from inference_server.kernels.int8_linear import int8_linear_config
    from inference_server.kernels.int8_linear_configs import CONFIG_DIR, tuned_int8_linear_config

    out = []
    for name, (n, k) in GEMMA_31B.items():
        for tokens in (1, 4):
            cfg = (tuned_int8_linear_config(tokens, n, k, torch.bfloat16, "NVIDIA H200", CONFIG_DIR)
                   or int8_linear_config(tokens, n, k))
            out.append(Variant(f"31B {name} T={tokens}", "gemv" if cfg.block_t < 16 else "dot", "i8",
                               cfg.block_n, cfg.block_t, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages,
                               bool(cfg.magic_dequant)))
    for name, (n, k) in QWEN_ATTN.items():
        cfg = dense_linear_config(1, n, k)
        out.append(Variant(f"{name} T=1", "dot", "bf16", cfg.block_n, cfg.block_t, cfg.block_k, cfg.split_k,
                           cfg.num_warps, cfg.num_stages))
    return out


def gemv_variants() -> list[Variant]:
    """The CUDA-core GEMV at the tiles its sweeps try (``int8_kernels.GEMV_SWEEP``, ``dense_linear``'s), 1, 2 and 4
    tokens, int8 (words with PRMT; with a masked K tail; single bytes; words with shifts) and bf16 weights."""
    out = []
    for block_t in (1, 2, 4):
        for bn, bk, warps in ((16, 256, 1), (8, 256, 1), (16, 1024, 4), (8, 1024, 4), (8, 2048, 8), (8, 512, 4)):
            out.append(Variant(f"gemv int8 T<={block_t}", "gemv", "i8", bn, block_t, bk, 1, warps, 1))
    out.append(Variant("gemv int8 K tail T<=1", "gemv", "i8", 8, 1, 1024, 1, 4, 1, extra={"EVEN_K": False}))
    out.append(Variant("gemv int8 bytes T<=1", "gemv", "i8", 8, 1, 1024, 1, 4, 1, words=False))
    for block_n, block_k, warps in ((8, 256, 1), (8, 1024, 4)):  # the words' bytes as floats (before the integer dot)
        out.append(Variant("gemv int8 float dequant T<=1", "gemv", "i8", block_n, 1, block_k, 1, warps, 1,
                           extra={"INT_DOT": False}))
    out.append(Variant("gemv int8 shifts T<=1", "gemv", "i8", 8, 1, 1024, 1, 4, 1, prmt=False))
    for block_t in (1, 2, 4):
        for bn, bk, warps in ((8, 1024, 4), (16, 256, 1), (8, 256, 1)):
            out.append(Variant(f"gemv bf16 T<={block_t}", "gemv", "bf16", bn, block_t, bk, 1, warps, 1))
    return out


MOE_MODELS = {"qwen3-30b-a3b": (2048, 768), "gemma-4-26b-a4b": (2816, 704)}  # H, I (E = 128, top-8)


def moe_variants() -> list[Variant]:
    """``moe_decode``'s two kernels for both MoE models at T = 1 (more tokens only add programs): bf16 experts at
    the float tiles; int8 read as single bytes at the float tiles (the path before words; now the fallback); int8
    words at the float tiles and at the int8 tiles (``moe_decode_config(..., int8=True)``: the default)."""
    from inference_server.kernels.moe_decode import moe_decode_config

    out = []
    for model, (hidden, inter) in MOE_MODELS.items():
        float_cfg = moe_decode_config(hidden, inter, 2)
        int8_cfg = moe_decode_config(hidden, inter, 2, int8=True)
        for path, length in (("moe_gate_up", hidden), ("moe_down", inter)):
            for label, cfg, weight, words in (("", float_cfg, "bf16", False), (" bytes", float_cfg, "i8", False),
                                              (" words, float tiles", float_cfg, "i8", True),
                                              (" words", int8_cfg, "i8", True)):
                block_n, block_k, warps = ((cfg.gate_up_block_n, cfg.gate_up_block_k, cfg.gate_up_warps)
                                           if path == "moe_gate_up" else
                                           (cfg.down_block_n, cfg.down_block_k, cfg.down_warps))
                out.append(Variant(f"{model} {path[4:]}{label}", path, weight, block_n, 1, block_k, 1, warps, 1,
                                   words=words, extra={"EVEN_K": length % block_k == 0}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("current", "gemv", "moe"), default=None)
    parser.add_argument("--dump", type=int, default=None, help="print the loop SASS of this table row")
    args = parser.parse_args()
    import triton

    variants = []
    if args.only in (None, "current"):
        variants += default_variants()
    if args.only in (None, "gemv"):
        variants += gemv_variants()
    if args.only in (None, "moe"):
        variants += moe_variants()
    print(f"# sm_90 SASS, Triton {triton.__version__}: K-loop instructions per weight byte (thread instructions, "
          f"all warps), and the weight bytes per SM clock the issue rate or the tightest pipe allows "
          f"(HBM needs ~{HBM_BYTES_PER_SM_CLK:.0f})\n\n{HEADER}")
    for i, v in enumerate(variants):
        if args.dump is not None and i != args.dump:
            continue
        try:
            mix = analyse(v)
        except Exception as err:  # a variant that does not compile (registers, shared memory): say so, go on
            print(f"| {v.label} | {v.path} {v.weight} | failed: {type(err).__name__}: {str(err)[:80]} |")
            continue
        print(row(mix), flush=True)
        if args.dump is not None:
            print("\n".join(mix.loop_text))
            print(sorted(mix.counts.items(), key=lambda kv: -kv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
