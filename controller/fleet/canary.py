"""A canary in progress: the candidate profile on one replica, the current one on the rest.

Owns the trial's bookkeeping: which replica is the canary, the warmup windows skipped after it
rejoined the router, the replica-windows collected tick by tick (canary arm and control arm,
aligned by the tick's time), and the verdict from policies.canary.assess after every tick.
Must not act: promoting (a rolling switch) or rolling back is controller.fleet.controller's job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.fleet.observe import ReplicaObservation, arm_window
from controller.fleet.settings import CanarySettings
from policies.canary import ARM_CANARY, ARM_CONTROL, ArmWindow, CanaryVerdict, assess
from policies.types import Observation


@dataclass
class CanaryTrial:
    candidate: str
    current: str  # what the other replicas run (the deployment's profile)
    replica: str  # the canary replica's name
    started_s: float
    settings: CanarySettings
    windows: list[ArmWindow] = field(default_factory=list)
    skip: int = 0
    verdict: CanaryVerdict | None = None
    ticks: int = 0

    def __post_init__(self) -> None:
        self.skip = self.settings.warmup_windows

    def candidate_window(self, tick: Mapping[str, ReplicaObservation]) -> Observation | None:
        """The canary replica's window of this tick, when it serves the candidate (None on its
        first scrape after the start, a failed scrape, or another profile)."""
        mine = tick.get(self.replica)
        if mine is None or mine.obs is None or mine.profile != self.candidate:
            return None
        return mine.obs

    def add(self, tick: Mapping[str, ReplicaObservation]) -> CanaryVerdict | None:
        """Fold one tick in; the verdict so far (None while warming up or without a window)."""
        self.ticks += 1
        mine = self.candidate_window(tick)
        if mine is None:
            return self.verdict
        if self.skip > 0:
            self.skip -= 1
            return self.verdict
        canary = arm_window(self.replica, ARM_CANARY, mine)
        if canary is None:
            return self.verdict
        control = [
            w
            for name, r in tick.items()
            if name != self.replica
            and r.obs is not None
            and r.profile == self.current
            and (w := arm_window(name, ARM_CONTROL, r.obs)) is not None
        ]
        if not control:
            return self.verdict  # nothing to compare with in this tick
        self.windows.append(canary)
        self.windows.extend(control)
        self.verdict = assess(self.windows, self.settings.test())
        return self.verdict

    def view(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "current": self.current,
            "replica": self.replica,
            "started_s": self.started_s,
            "windows": sum(1 for w in self.windows if w.arm == ARM_CANARY),
            "verdict": self.verdict.to_dict() if self.verdict else None,
        }
