"""CPU per token of the engine process alone (``ENGINE_PROCESS=separate``'s child), under a front that does nothing
else: a steadier instrument than ``http_overhead.py --split`` for changes to the engine process.

The child is the real one (``python -m inference_server.engine_process``, the settings as JSON, the socket end
inherited) building ``http_overhead.split_fake_parts`` (its zero-cost fake step, the embedded tokenizer's
vocabulary). This process is a raw-channel front: it submits ``--concurrency`` token-id requests of
``--max-tokens`` (``ignore_eos``), reads each ``StepOutput`` and submits a new request for each that ended. After
``--warmup`` seconds it measures the child's CPU time (user + system, from /proc) over ``--seconds`` and the
tokens it sent: µs of engine CPU per token, tokens/s, and tokens per message. No HTTP, no detokenisation, no
``RemoteEngine``: on the shared 2-core VM the figure moves ±5 % from run to run, against ±15 % for the engine
column of ``http_overhead.py --split`` (whose front competes with it for the cores).

    uv run python bench/engine_process_overhead.py                      # 64 and 256 streams, one run each
    uv run python bench/engine_process_overhead.py --concurrency 256 --runs 3

This is a benchmark, not a test; docs/ipc.md records its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import attrs
import trio

from inference_server.config import Settings
from inference_server.ipc.channel import open_socket_channel
from inference_server.ipc.messages import ENGINE_TO_FRONT, Drain, Hello, StepOutput, Stopped, Submit, ToEngine
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams

HERE = Path(__file__).resolve().parent
PROMPT_IDS = (2, 818, 5279, 529, 7001, 563)  # "<bos>The capital of France is" in Gemma 3's vocabulary


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(settings: Settings) -> tuple[subprocess.Popen[bytes], socket.socket]:
    ours, theirs = socket.socketpair()
    env = dict(os.environ, HTTP_OVERHEAD_STEP_MS="0",
               PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "inference_server.engine_process", "--channel-fd", str(theirs.fileno()),
         "--settings", json.dumps(attrs.asdict(settings)), "--engine-factory", "http_overhead:split_fake_parts"],
        pass_fds=(theirs.fileno(),), env=env)
    theirs.close()  # only the child holds its end: its death is our EOF
    return process, ours


async def measure(concurrency: int, max_tokens: int, seconds: float, warmup: float) -> dict[str, float]:
    settings = Settings(log_level="warning", max_batch_size=concurrency, max_queue_size=4 * concurrency)
    process, sock = spawn(settings)
    next_id = 0

    def submit() -> Submit:
        nonlocal next_id
        next_id += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return Submit(next_id, GenerationRequest(params, prompt_ids=PROMPT_IDS), time.monotonic())

    result: dict[str, float] = {}
    async with open_socket_channel(sock, 16, receive_type=ENGINE_TO_FRONT) as channel:
        assert isinstance(await channel.receive(), Hello)
        await channel.send(ToEngine([submit() for _ in range(concurrency)]))
        tokens = messages = 0
        began = time.monotonic()
        mark: tuple[float, int, int, float] | None = None
        async for message in channel:
            if isinstance(message, Stopped):
                break
            if not isinstance(message, StepOutput):
                continue
            messages += 1
            ended = 0
            for update in message.updates:
                tokens += len(update.token_ids)
                ended += update.finish_reason is not None
            if ended and not result:
                await channel.send(ToEngine([submit() for _ in range(ended)]))
            now = time.monotonic()
            if mark is None and now - began >= warmup:
                mark = (now, tokens, messages, cpu_seconds(process.pid))
            elif mark is not None and not result and now - mark[0] >= seconds:
                elapsed, counted = now - mark[0], tokens - mark[1]
                cpu = cpu_seconds(process.pid) - mark[3]
                result = {"tok/s": counted / elapsed, "cores": cpu / elapsed, "us/token": 1e6 * cpu / counted,
                          "tok/message": counted / max(1, messages - mark[2])}
                await channel.send(Drain(0))
    process.wait()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=1, help="runs per concurrency (the median is reported too)")
    args = parser.parse_args()
    print(f"{'streams':>8} {'tok/s':>9} {'engine CPU':>10} {'µs/token':>9} {'tok/message':>11}")
    for concurrency in args.concurrency:
        runs = [trio.run(measure, concurrency, args.max_tokens, args.seconds, args.warmup) for _ in range(args.runs)]
        for run in runs:
            print(f"{concurrency:>8} {run['tok/s']:>9.0f} {run['cores']:>10.2f} {run['us/token']:>9.2f} "
                  f"{run['tok/message']:>11.0f}", flush=True)
        if len(runs) > 1:
            print(f"{'median':>8} {statistics.median(r['tok/s'] for r in runs):>9.0f} "
                  f"{statistics.median(r['cores'] for r in runs):>10.2f} "
                  f"{statistics.median(r['us/token'] for r in runs):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
