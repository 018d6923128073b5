"""The in-process executor: one worker in the engine's own process (tensor-parallel size 1)."""

from __future__ import annotations

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor:
    """Hands each ``SchedulerOutput`` to a single local worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        pass
