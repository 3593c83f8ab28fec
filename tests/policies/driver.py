"""A minimal virtual-time driver for decide(): synthetic windows while a profile serves, None
while a restart is in flight, on_switch_done when it ends (tests only; the real benchmark lives
in controller/bench)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from policies.decide import PolicyState, decide, initial_state, on_switch_done
from policies.settings import PolicySettings
from policies.types import Action, Decision, Overrides
from tests.policies.synth import PROFILES, Synth

SPECS = {p.name: p for p in PROFILES}


@dataclass
class Driver:
    start: str
    settings: PolicySettings = field(default_factory=PolicySettings)
    seed: int = 0
    restart_s: float = 150.0
    window_s: float = 10.0
    t: float = 0.0
    fail_next_start: bool = False
    # The boot every server reports (Observation.startup_s), None: not reported.
    startup_s: float | None = None

    def __post_init__(self) -> None:
        self.syn = Synth(seed=self.seed)
        self.state: PolicyState = initial_state(PROFILES, self.start, self.t, self.settings)
        self.running = self.start
        self.down_until: float | None = None
        self.target: str | None = None
        self.decisions: list[Decision] = []
        self.last_switch_before: list[float] = []
        self.served = 0.0  # tokens actually produced (true rate x window)

    def step(
        self,
        batch: float,
        alphas: Mapping[str, float],
        mix: Mapping[str, float],
        overrides: Overrides | None = None,
    ) -> Decision:
        self.t += self.window_s
        if self.down_until is not None and self.t >= self.down_until:
            assert self.target is not None
            ok = not self.fail_next_start
            self.fail_next_start = False
            self.state = on_switch_done(self.state, self.target, ok, self.restart_s, self.t)
            self.running = self.target if ok else "down"
            self.down_until = None
        obs = None
        if self.down_until is None and self.running != "down":
            obs = self.syn.window(SPECS[self.running], self.t, batch, alphas, mix, self.window_s)
            obs = replace(obs, startup_s=self.startup_s)
            self.served += (
                self.syn.true_tok_s(SPECS[self.running], batch, alphas, mix) * self.window_s
            )
        self.last_switch_before.append(self.state.last_switch_s)
        self.state, d = decide(self.state, obs, self.t, self.settings, overrides or Overrides())
        if d.action is Action.SWITCH:
            self.target = d.profile
            self.down_until = self.t + self.restart_s
        self.decisions.append(d)
        return d

    def run(
        self,
        n: int,
        batch: float,
        alphas: Mapping[str, float],
        mix: Mapping[str, float],
        overrides: Overrides | None = None,
    ) -> list[Decision]:
        return [self.step(batch, alphas, mix, overrides) for _ in range(n)]

    def switches(self) -> list[Decision]:
        return [d for d in self.decisions if d.action is Action.SWITCH]
