"""Static proof (mypy) that the engine's parts implement the protocols of ``core/interfaces.py``: each function
returns its argument as the protocol, so a part that drifts from its seam fails type-checking. Nothing here
runs; the imports are for the type checker only."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference_server.backends.cuda.runner import CudaModelRunner
    from inference_server.backends.hf.runner import HFModelRunner
    from inference_server.backends.model_runner import LaunchedStep, ModelRunner
    from inference_server.core.interfaces import CacheManager, InferenceBackend, SchedulerInterface
    from inference_server.core.kv_manager import KVManager
    from inference_server.core.scheduler import Scheduler


def reference_runner(runner: ModelRunner) -> InferenceBackend[LaunchedStep]:
    return runner


def cuda_runner(runner: CudaModelRunner) -> InferenceBackend[LaunchedStep]:
    return runner


def hf_runner(runner: HFModelRunner) -> InferenceBackend[LaunchedStep]:
    return runner


def scheduler(core: Scheduler) -> SchedulerInterface:
    return core


def kv_manager(kv: KVManager) -> CacheManager:
    return kv
