"""Host <-> device copies that never make the host wait for the device (overlap depends on it).

A copy from pageable host memory may synchronise with the stream (the driver stages it through pinned memory
and is allowed to wait for earlier work); a blocking copy always does. So each step's small inputs go
through pinned memory with ``non_blocking=True``, and its sampled tokens come back the same way, into
pinned buffers that the host reads only after the step's event has completed (``HostCopy``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``, copied without waiting for the device (pinned first when it is a GPU)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def staged(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A Python list as a host tensor ready for a ``non_blocking`` copy to ``device`` (pinned for a GPU)."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def padded_rows(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """``rows`` of different lengths as one ``int32 [len(rows), longest (at least 1)]`` array, zero past each row's
    end. Built by numpy from one flat pass over the values: a decode step stages every sequence's block table this
    way, a list of lists through ``torch.tensor`` cost several times more."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = max(1, int(lengths.max(initial=0)))
    dense = np.zeros((len(rows), width), dtype=np.int32)
    dense[np.arange(width) < lengths[:, None]] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32,
                                                              count=int(lengths.sum()))
    return dense


def staged_array(values: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A numpy array as a host tensor ready for a ``non_blocking`` copy to ``device`` (pinned for a GPU)."""
    host = torch.from_numpy(values)
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def tensor_to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A Python list as a tensor on ``device`` (see ``to_device``)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


class HostCopy:
    """Device tensors copied to the host behind an event: ``ready()`` returns the host tensors, waiting (with
    the GIL released) for the copy when it is still running. On a CPU device the tensors are the host's."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, device in zip(self.host, tensors, strict=True):
                host.copy_(device, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self.host = list(tensors)

    def ready(self) -> list[torch.Tensor]:
        """The host tensors, once the copy has landed. Safe from two threads at once (a constrained step's
        sampling thread reads the previous step's tokens while the executor collects them)."""
        event = self._event
        if event is not None:
            event.synchronize()
            self._event = None
        return self.host
