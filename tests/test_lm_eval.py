"""lm-eval's ``local-completions`` against a live server on the embedded model (heavy): a multiple-choice
task, a ``loglikelihood_rolling`` task and a ``generate_until`` task on small jsonl files shipped in
``tests/lm_eval_tasks`` (no downloads), and every score lm-eval reports equals the one computed directly
from our own contiguous forward over the exact token ids lm-eval sent (rebuilt with lm-eval's own
encoding helpers).

lm-eval sends token-id prompts (``tokenized_requests``) with ``echo``, ``logprobs: 1`` and ``max_tokens: 1``,
batched (``batch_size`` 4), and reads the prompt tokens' ``token_logprobs`` and ``top_logprobs``; it needs the
model's tokenizer as a Hugging Face folder, which the test copies out of the converted-tokenizer cache.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.gguf_tokenizer import cache_folder
from inference_server.models.loading.embedded import embedded_gguf_path
from inference_server.models.loading.gguf_loader import open_gguf
from inference_server.models.loading.loader import build_model, load_weights
from inference_server.models.spec import parse_model_spec
from inference_server.models.tokenizer import Tokenizer, default_cache_dir

sys.path.insert(0, str(Path(__file__).parent / "telemetry"))
from served import fake_server

pytestmark = pytest.mark.heavy
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the json builder reads local files; nothing is fetched
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (uv sync installs it with the dev group)")

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "lm_eval_tasks"
MAX_LENGTH = 64  # small, so the longest rolling document spans several windows
LOGPROB_TOLERANCE = 2e-3  # paged fp32 server vs contiguous fp32 forward, summed over a window


def task_configs(folder: Path) -> list[str]:
    """The shipped task YAMLs, copied into ``folder`` with their data files made absolute (they name them
    relative to the repository root, for the command line in docs/api.md)."""
    names = []
    for source in sorted(TASKS.glob("*.yaml")):
        config = yaml.safe_load(source.read_text())
        files = config["dataset_kwargs"]["data_files"]
        files["test"] = str(REPO / files["test"])
        (folder / source.name).write_text(yaml.safe_dump(config))
        names.append(config["task"])
    return names


def export_tokenizer(folder: Path) -> Path:
    """The embedded model's tokenizer as a Hugging Face folder (converted once, then cached)."""
    path = embedded_gguf_path()
    Tokenizer.from_gguf(path)
    shutil.copytree(cache_folder(path, default_cache_dir()), folder)
    return folder


class DirectModel:
    """The embedded model in this process: full contiguous forwards, no server, no paging."""

    def __init__(self) -> None:
        checkpoint = open_gguf(embedded_gguf_path())
        self.spec = parse_model_spec(checkpoint.config)
        self.model: CausalLM = build_model(self.spec, torch.float32, "cpu")
        load_weights(self.model, self.spec, checkpoint.iter_tensors(torch.float32), "embedded")

    @torch.no_grad()
    def log_softmax(self, ids: list[int]) -> torch.Tensor:
        batch = ForwardBatch(seq_ids=(0,), cached_lens=(0,), query_lens=(len(ids),))
        hidden = self.model(torch.tensor(ids), ContiguousKVCache(self.spec).context(batch, "cpu"))
        return torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)

    def loglikelihood(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """lm-eval's (sum of the continuation's logprobs, whether each was the argmax)."""
        ids = context + continuation
        assert len(ids) <= MAX_LENGTH  # lm-eval truncates longer inputs; the shipped tasks never need it
        rows = self.log_softmax(ids)[len(ids) - len(continuation) - 1:-1]
        target = torch.tensor(continuation)
        return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())

    @torch.no_grad()
    def greedy(self, ids: list[int], max_tokens: int, eos: set[int]) -> list[int]:
        cache = ContiguousKVCache(self.spec)
        batch = ForwardBatch(seq_ids=(0,), cached_lens=(0,), query_lens=(len(ids),))
        hidden = self.model(torch.tensor(ids), cache.context(batch, "cpu"))
        out: list[int] = []
        for step in range(max_tokens):
            token = int(self.model.compute_logits(hidden[-1:]).argmax(-1))
            if token in eos:
                break
            out.append(token)
            batch = ForwardBatch(seq_ids=(0,), cached_lens=(len(ids) + step,), query_lens=(1,))
            hidden = self.model(torch.tensor([token]), cache.context(batch, "cpu"))
        return out


def cut_at_stops(text: str, until: list[str]) -> str:
    for stop in until:
        if stop and stop in text:
            text = text.split(stop, 1)[0]
    return text


def test_lm_eval_scores_equal_our_forward(tmp_path: Path) -> None:
    from lm_eval import simple_evaluate, utils
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(2)
    tasks = task_configs(tmp_path)
    tokenizer_folder = export_tokenizer(tmp_path / "tokenizer")
    env = {"MODEL": "", "DEVICE": "cpu"}
    command = [sys.executable, "-m", "inference_server", "serve"]
    with fake_server(env, tmp_path / "server.log", command=command) as (process, url):
        model_name = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        model_args = {"model": model_name, "base_url": f"{url}/v1/completions", "tokenizer": str(tokenizer_folder),
                      "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": MAX_LENGTH,
                      "max_retries": 1}
        out = simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks,
                              task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
                              batch_size=4, cache_requests=False, bootstrap_iters=0)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    assert out is not None
    lm = lm_eval.api.registry.get_model("local-completions")(**{**model_args, "base_url": "http://unused"})
    direct = DirectModel()
    samples, results = out["samples"], out["results"]
    assert {name: len(samples[name]) for name in tasks} == {"tiny_gen": 3, "tiny_mc": 5, "tiny_ppl": 3}
    print({name: results[name] for name in tasks})  # the scores, for the record (pytest -s)

    # multiple choice: every choice's loglikelihood and greediness, and the accuracy they give
    correct = []
    for sample in samples["tiny_mc"]:
        ours = []
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            expected = direct.loglikelihood(*lm._encode_pair(context, continuation))
            (got_ll, got_greedy), = response
            assert got_ll == pytest.approx(expected[0], abs=LOGPROB_TOLERANCE), (context, continuation)
            assert got_greedy == expected[1]
            ours.append(expected[0])
        correct.append(max(range(len(ours)), key=ours.__getitem__) == sample["doc"]["answer"])
    assert results["tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))

    # rolling: each document's total over lm-eval's disjoint windows
    total_ll, total_words = 0.0, 0
    for sample in samples["tiny_ppl"]:
        ((text,),) = sample["arguments"]
        windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
            token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id, max_seq_len=MAX_LENGTH - 1,
            context_len=1))
        expected = sum(direct.loglikelihood(list(c), list(t))[0] for c, t in windows)
        ((got,),) = sample["resps"]
        assert got == pytest.approx(expected, abs=LOGPROB_TOLERANCE * 4), text
        total_ll += expected
        total_words += len(text.split())
    assert results["tiny_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / total_words), rel=1e-3)

    # generate_until: the greedy text of our forward from the same ids, cut at the stop strings
    matches = []
    eos = {lm.tokenizer.eos_token_id}
    for sample in samples["tiny_gen"]:
        ((context, gen_kwargs),) = sample["arguments"]
        ids = lm.tok_encode(context)
        greedy = direct.greedy(ids, gen_kwargs["max_gen_toks"], eos)
        expected = cut_at_stops(lm.tokenizer.decode(greedy), gen_kwargs["until"])
        ((got,),) = sample["resps"]
        print(repr(context), "->", repr(got))
        assert got == expected, context
        matches.append(expected == sample["target"])
    assert results["tiny_gen"]["exact_match,none"] == pytest.approx(sum(matches) / len(matches))
