"""Bucketed CUDA graphs of decode steps over static input buffers.

A decode step (every sequence feeds exactly one token) has the same kernel sequence for every batch of the
same size, so it is captured once per *bucket* (``decode_buckets``: 1, 2, 4, 8, 16, 24, ... up to the
largest batch) and replayed: one graph launch instead of thousands of kernel launches and their Python
overhead.

Invariants:

* The graphs read their inputs only from the static buffers below, whose addresses never change: token ids,
  positions, context lengths, per-group block tables ``[max_batch, max_blocks]`` and slot mappings. A step
  with ``B`` sequences runs the smallest bucket ``>= B``; rows ``B..bucket-1`` are *padding*: context length
  0 (attention reads nothing and returns zeros), slot -1 (the KV store writes nothing), token 0, position 0.
  Their hidden rows are garbage that nobody reads.
* Only the first ``width`` columns of a block-table row are refreshed each step; the decode kernel reads
  entries below ``ceil(context_len / block_size)`` only, so stale columns past them are never read.
* Graphs are captured largest first into one shared memory pool: each smaller graph reuses the larger one's
  intermediate memory, and replays never overlap (one step at a time), so sharing is safe. Outputs (the
  hidden states ``[bucket, H]``) live in that pool too: read them before the next replay.
* Capture happens with every row padded, so warm-up and capture write nothing into the KV cache.

Off CUDA nothing is captured: the same static-buffer path calls the forward eagerly, so a machine without CUDA
checks the staging and padding logic with the Triton interpreter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from inference_server.backends.paged_kv import StepTensors
from inference_server.backends.transfer import padded_rows, staged, staged_array
from inference_server.records.steps import ScheduledSequence
from inference_server.startup import Progress, phase

DecodeForward = Callable[[torch.Tensor, StepTensors], torch.Tensor]  # (ids [B], step) -> hidden [B, H]


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to capture (ascending): 1, 2, 4, 8, then every 8 up to 64, then every 16, then
    ``max_batch`` itself. A batch runs in the smallest bucket that holds it, so the padding rows a step
    computes for nothing stay under 8 up to 64 sequences and under 16 beyond (100 sequences run as 112, not
    128); each bucket costs one capture at start-up, and all share one memory pool."""
    buckets = [size for size in (1, 2, 4) if size < max_batch]
    size = 8
    while size < max_batch:
        buckets.append(size)
        size += 8 if size < 64 else 16
    buckets.append(max_batch)
    return tuple(buckets)


class DecodeGraphs:
    """Static decode inputs plus one captured graph per bucket; see the module docstring."""

    def __init__(self, forward: DecodeForward, *, max_batch: int, num_groups: int, max_blocks: int,
                 block_size: int, device: torch.device) -> None:
        self.forward = forward
        self.buckets = decode_buckets(max_batch)
        self.max_batch = max_batch
        self.num_groups = num_groups
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = device
        self.capture_enabled = device.type == "cuda"
        # int64 rows: 0 token ids, 1 positions, 2+g slot mapping of group g. One buffer, so staging is one copy.
        self._i64 = torch.zeros((2 + num_groups, max_batch), dtype=torch.int64, device=device)
        self._i64[2:] = -1
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)  # 0 = padding row
        self.block_tables = [torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
                             for _ in range(num_groups)]
        self._cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)  # one token a row
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    # -- eligibility and buckets -----------------------------------------------------------------------
    def fits(self, sequences: Sequence[ScheduledSequence]) -> bool:
        """True when a step can run as a graph: decode-only, at most ``max_batch`` rows, tables that fit."""
        return (0 < len(sequences) <= self.max_batch
                and all(len(s.token_ids) == 1 for s in sequences)
                and all(len(table) <= self.max_blocks for s in sequences for table in s.block_tables))

    def bucket_for(self, batch: int) -> int:
        for bucket in self.buckets:
            if bucket >= batch:
                return bucket
        raise ValueError(f"batch {batch} exceeds the largest decode bucket {self.buckets[-1]}")

    def step_view(self, bucket: int) -> tuple[torch.Tensor, StepTensors]:
        """Token ids [bucket] and the step tensors a bucket's forward reads (views of the static buffers)."""
        step = StepTensors(
            positions=self._i64[1, :bucket],
            cu_seqlens_q=self._cu_seqlens[: bucket + 1],
            context_lens=self.context_lens[:bucket],
            block_tables={g: self.block_tables[g][:bucket] for g in range(self.num_groups)},
            slot_mappings={g: self._i64[2 + g, :bucket] for g in range(self.num_groups)},
            is_decode_only=True,
        )
        return self._i64[0, :bucket], step

    # -- capture ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one pool (no-op when capture is off)."""
        if not self.capture_enabled:
            return
        self._reset_padding(self.max_batch)
        buckets = sorted(self.buckets, reverse=True)
        with phase("capturing CUDA graphs", total=len(buckets), unit="batch sizes") as progress:
            self._capture(buckets, progress)

    def _capture(self, buckets: list[int], progress: Progress) -> None:
        pool = None
        for bucket in progress.wrap(buckets):
            ids, step = self.step_view(bucket)
            self.forward(ids, step)  # compiles the Triton kernels for these shapes and settles the allocator
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bucket] = self.forward(ids, step)
            if pool is None:
                pool = graph.pool()
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    def _reset_padding(self, rows: int) -> None:
        self._i64[:2, :rows] = 0
        self._i64[2:, :rows] = -1
        self.context_lens[:rows] = 0

    # -- one step --------------------------------------------------------------------------------------
    def stage(self, sequences: Sequence[ScheduledSequence]) -> int:
        """Copy one decode step's inputs into the static buffers; returns the bucket to run.

        Host work is a few Python lists and 2 + num_groups host-to-device copies from pinned memory, queued
        behind whatever step is still running (the token ids of a ``PENDING_TOKEN`` row are then written by
        the runner, on the device).
        """
        batch = len(sequences)
        bucket = self.bucket_for(batch)
        pad = bucket - batch
        bs = self.block_size
        rows64 = [[s.token_ids[0] for s in sequences] + [0] * pad,
                  [s.cached_len for s in sequences] + [0] * pad]
        for g in range(self.num_groups):
            slots = []
            for s in sequences:
                table, p = s.block_tables[g], s.cached_len
                index = p // bs
                slots.append(table[index] * bs + p % bs if index < len(table) else -1)
            rows64.append(slots + [-1] * pad)
        self._i64[:, :bucket].copy_(staged(rows64, torch.int64, self.device), non_blocking=True)
        ctx = [s.cached_len + 1 for s in sequences] + [0] * pad
        self.context_lens[:bucket].copy_(staged(ctx, torch.int32, self.device), non_blocking=True)
        for g in range(self.num_groups):
            rows = padded_rows([s.block_tables[g] for s in sequences])  # [batch, width]
            self.block_tables[g][:batch, : rows.shape[1]].copy_(staged_array(rows, self.device), non_blocking=True)
        return bucket

    def run(self, bucket: int) -> torch.Tensor:
        """Replay (or, without capture, run eagerly) the bucket's forward; hidden states [bucket, H]."""
        graph = self._graphs.get(bucket)
        if graph is None:
            ids, step = self.step_view(bucket)
            return self.forward(ids, step)
        graph.replay()
        return self._outputs[bucket]

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))
