"""Quality of QUANTIZATION=int8 on the embedded Gemma 3 270M (real weights, CPU, fp32 activations).

Loads the model through the engine's loader (``QUANTIZATION=none``; ``int8`` with ``INT8_EMBEDDINGS=on``: every
linear layer and the tied embedding / lm_head int8; ``int8`` with ``INT8_EMBEDDINGS=off``: the body int8, the
embedding / lm_head left fp32, so the head's own share of the error shows) and prints, for each int8 model
(``--heads``) with each CPU matmul asked for (``--impls``):

* greedy agreement over 20 fixed prompts x 64 new tokens, all prompts decoded as one batch through the reference
  contiguous KV cache: the mean fraction of tokens identical to fp32's until the first divergence, and the
  fraction of prompts whose 64 tokens are all identical;
* perplexity of ``bench/data/quantization_text.txt`` (BOS + the text, scored in 256-token prefill chunks),
  int8 vs fp32, and the mean / max absolute difference of the log-probabilities of the text's tokens.

``--impls cpu reference``: ``cpu`` is the engine's CPU matmul (``kernels.cpu_int8``: fbgemm, activations also
quantized per token to 7 bits), ``reference`` the weight-only reference (``int8_linear_reference``: float
activations; slow, a quality yardstick; the GPU's int8 matmul is weight-only too, so this is the row that
predicts an int8 head on the GPU). ``--heads int8 float``: the head int8 (what the CPU engine runs) and/or float.
Takes ~5-8 minutes on 2 cores with both heads (``--tokens`` / ``--prompts`` / ``--heads`` cut it).

    uv run python bench/int8_quality.py
    uv run python bench/int8_quality.py --heads float --impls reference   # the body-only yardstick alone
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import torch
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

from inference_server.config import Settings
from inference_server.kernels.cpu_int8 import cpu_int8_linear
from inference_server.models.architectures import ops
from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.loading.source import load_model
from inference_server.models.spec import ModelSpec

TEXT = Path(__file__).resolve().parent / "data" / "quantization_text.txt"
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "def fibonacci(n):",
    "The theory of relativity, proposed by Albert Einstein,",
    "My favourite season of the year is",
    "In 1969, the first humans to walk on the Moon",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "import numpy as np\nimport matplotlib.pyplot as plt\n",
    "The largest ocean on Earth is the",
    "Photosynthesis is the process by which plants",
    "Here is a short poem about the autumn rain:\n",
    "The main causes of the First World War were",
    "SELECT name, age FROM users WHERE",
    "A healthy breakfast usually includes",
    "The planets of the solar system, in order from the Sun, are",
    "Dear Sir or Madam,\n\nI am writing to",
    "The difference between a virus and a bacterium is that",
)


def greedy(model: CausalLM, spec: ModelSpec, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt, decoded together (one batch per step)."""
    cache = ContiguousKVCache(spec)
    seq_ids = tuple(range(len(prompts)))
    outputs: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        ids = torch.tensor([t for p in prompts for t in p])
        batch = ForwardBatch(seq_ids, (0,) * len(prompts), tuple(len(p) for p in prompts))
        hidden = model(ids, cache.context(batch, "cpu"))
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        tokens = model.compute_logits(hidden[last]).argmax(-1)
        for step in range(new_tokens):
            for i, token in enumerate(tokens.tolist()):
                outputs[i].append(token)
            if step == new_tokens - 1:
                break
            batch = ForwardBatch(seq_ids, tuple(len(p) + step for p in prompts), (1,) * len(prompts))
            tokens = model.compute_logits(model(tokens, cache.context(batch, "cpu"))).argmax(-1)
    return outputs


def token_logprobs(model: CausalLM, spec: ModelSpec, tokens: list[int], chunk: int = 256) -> torch.Tensor:
    """log p(token[i] | tokens[:i]) for i >= 1, scored in prefill chunks of ``chunk`` tokens."""
    cache = ContiguousKVCache(spec)
    scores = []
    with torch.inference_mode():
        for start in range(0, len(tokens) - 1, chunk):
            piece = tokens[start:start + chunk]
            batch = ForwardBatch(("text",), (start,), (len(piece),))
            logits = model.compute_logits(model(torch.tensor(piece), cache.context(batch, "cpu"))).float()
            targets = torch.tensor(tokens[start + 1:start + 1 + len(piece)])
            logprobs = torch.log_softmax(logits[:len(targets)], dim=-1)
            scores.append(logprobs.gather(1, targets[:, None]).squeeze(1))
    return torch.cat(scores)


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(mean fraction of tokens identical until the first divergence, fraction of identical sequences)."""
    prefix = []
    for a, b in zip(reference, other, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix.append(same / len(a))
    return sum(prefix) / len(prefix), sum(p == 1.0 for p in prefix) / len(prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", nargs="+", default=["cpu", "reference"], choices=["cpu", "reference"])
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--heads", nargs="+", default=["int8", "float"], choices=["int8", "float"],
                        help="int8: the embedding / lm_head int8 too (INT8_EMBEDDINGS=on); float: left fp32 (off)")
    args = parser.parse_args()
    device = torch.device("cpu")
    base = load_model(Settings(device="cpu", quantization="none"), device, torch.float32)
    models = {head: load_model(Settings(device="cpu", quantization="int8",
                                        int8_embeddings="on" if head == "int8" else "off"), device, torch.float32)
              for head in args.heads}
    tokenizer = base.tokenizer
    assert tokenizer is not None
    prompts = [tokenizer.encode(p) for p in PROMPTS[:args.prompts]]
    text = tokenizer.encode(TEXT.read_text())
    print(f"model {base.name}; {len(prompts)} prompts x {args.tokens} greedy tokens; perplexity text "
          f"{TEXT.name}: {len(text)} tokens; torch {torch.__version__}, {torch.get_num_threads()} threads")
    reference_tokens = greedy(base.model, base.spec, prompts, args.tokens)
    reference_logprobs = token_logprobs(base.model, base.spec, text)
    print(f"{'fp32':<33} perplexity {math.exp(-reference_logprobs.mean().item()):8.3f}")
    impls = {"cpu": cpu_int8_linear, "reference": ops.REFERENCE_OPS.int8_linear}
    for head, int8 in models.items():
        for name in args.impls:
            ops.bind_ops(int8.model, dataclasses.replace(ops.REFERENCE_OPS, int8_linear=impls[name]))
            tokens = greedy(int8.model, int8.spec, prompts, args.tokens)
            logprobs = token_logprobs(int8.model, int8.spec, text)
            prefix, exact = agreement(reference_tokens, tokens)
            delta = (logprobs - reference_logprobs).abs()
            label = f"int8 ({name} matmul)" if head == "int8" else f"int8 body, fp32 head ({name})"
            print(f"{label:<33} perplexity {math.exp(-logprobs.mean().item()):8.3f}   "
                  f"greedy: identical prefix {prefix:6.1%}, identical sequences {exact:6.1%}   "
                  f"|delta logprob| mean {delta.mean().item():.4f} max {delta.max().item():.3f}", flush=True)


if __name__ == "__main__":
    main()
