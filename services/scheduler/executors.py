"""ExecutorState: what a scheduler knows of one executor. Its own module, below service.py, so that
placement, disaggregation and recovery can name it without importing the service."""
from __future__ import annotations

from dataclasses import dataclass

from radixflow.shared.messages import ExecutorInfo


@dataclass
class ExecutorState:
    instance: str
    last_seen: float           # its latest beat (monotonic)
    info: ExecutorInfo         # what that beat said
    inflight: int = 0          # what this scheduler sent there and has not seen end
