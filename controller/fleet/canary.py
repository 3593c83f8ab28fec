"""A canary in progress: the candidate profile on one replica, the current one on the rest.

Owns the trial's bookkeeping: which replica is the canary, the warmup windows skipped after it
rejoined the router, the replica-windows collected tick by tick (canary arm and control arm,
aligned by the tick's time), the verdict from policies.canary.assess after every tick, and the
trial's time limit: `max_windows` ticks after its first scrape and warmup, usable or not
(policies.canary.out_of_time). `could_judge` says whether a canary started now could be judged
at all (traffic on its replica and on another).
Must not act: promoting (a rolling switch) or rolling back is controller.fleet.controller's job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.fleet.observe import ReplicaObservation, arm_window
from controller.fleet.settings import CanarySettings
from policies.canary import (
    ARM_CANARY,
    ARM_CONTROL,
    ArmWindow,
    CanaryVerdict,
    assess,
    judgeable,
    out_of_time,
)
from policies.types import Observation


def arms(
    tick: Mapping[str, ReplicaObservation], replica: str, profile: str, current: str
) -> tuple[ArmWindow | None, list[ArmWindow]]:
    """One tick's canary-test windows: `replica`'s (when it serves `profile`) and those of the
    other replicas serving `current` (the control arm)."""
    mine = tick.get(replica)
    canary = (
        arm_window(replica, ARM_CANARY, mine.obs)
        if mine is not None and mine.obs is not None and mine.profile == profile
        else None
    )
    control = [
        w
        for name, r in tick.items()
        if name != replica
        and r.obs is not None
        and r.profile == current
        and (w := arm_window(name, ARM_CONTROL, r.obs)) is not None
    ]
    return canary, control


def could_judge(
    tick: Mapping[str, ReplicaObservation], replica: str, current: str, settings: CanarySettings
) -> bool:
    """Whether a canary started on `replica` now could be judged on traffic like this tick's:
    it and another replica on `current` served usable traffic. A replica the router sends
    (almost) nothing, as when the fleet has fewer streams than replicas, never can."""
    canary, control = arms(tick, replica, current, current)
    return judgeable(canary, control, settings.test())


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
        """Fold one tick in; the verdict so far (None while warming up or without a window).
        Once the trial has run its ticks (`limit_ticks`) an undecided verdict is a rollback."""
        self.ticks += 1
        self._fold(tick)
        if self.ticks < self.limit_ticks:
            return self.verdict
        self.verdict = out_of_time(self.verdict or assess(self.windows, self.settings.test()))
        return self.verdict

    @property
    def limit_ticks(self) -> int:
        """Ticks the trial may take: the canary's first scrape after its start (no window yet),
        its warmup windows, then `max_windows`. With traffic in every window, assess reaches
        `max_windows` paired windows on the same tick."""
        return 1 + self.settings.warmup_windows + self.settings.max_windows

    def _fold(self, tick: Mapping[str, ReplicaObservation]) -> None:
        if self.candidate_window(tick) is None:
            return
        if self.skip > 0:
            self.skip -= 1
            return
        canary, control = arms(tick, self.replica, self.candidate, self.current)
        if canary is None or not control:
            return  # nothing to compare with in this tick
        self.windows.append(canary)
        self.windows.extend(control)
        self.verdict = assess(self.windows, self.settings.test())

    def view(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "current": self.current,
            "replica": self.replica,
            "started_s": self.started_s,
            "windows": sum(1 for w in self.windows if w.arm == ARM_CANARY),
            "verdict": self.verdict.to_dict() if self.verdict else None,
        }
