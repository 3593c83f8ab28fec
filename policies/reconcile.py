"""A restored policy state against the profiles configured now.

Owns `reconcile_profiles`: a state saved by an earlier run describes the profiles of the config
that run had. Between runs the operator may have removed a profile, added one, or changed one
under the same name (another draft model, another depth: its flags or environment). A removed
profile is forgotten (and any pending switch, trial or rollback naming it cleared), a new one
joins untried, a changed one (its definition digest moved) loses its estimates and is untried
again, so that exploration measures it anew; an unchanged one keeps everything.
`drop_unknown_pin` is the same rule for the operator's pin.

Must not: read clocks, read the config (the shell passes the specs and their digests), or do I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from policies import hybrid_decide
from policies.state import PolicyState
from policies.types import Overrides, ProfileSpec


@dataclass(frozen=True)
class ProfileChanges:
    """What `reconcile_profiles` found and did: the profiles added to the state, removed from
    it and reset (changed definition), and the references to them it cleared ("pending",
    "trial", "rollback_to", "running": the state's running profile was removed)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    cleared: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def describe(self) -> str:
        """One log line's worth: the non-empty lists, e.g. "added=x removed=y,z changed=w"."""
        parts = [
            f"{what}={','.join(names)}"
            for what, names in (
                ("added", self.added),
                ("removed", self.removed),
                ("changed", self.changed),
                ("cleared", self.cleared),
            )
            if names
        ]
        return " ".join(parts)


def _profile_key(key: str, names: Collection[str]) -> bool:
    """Whether a change-detector or stream key is one of `names`' own ("accept:<p>",
    "cycle:<p>", "accept:<p>:<workload>")."""
    kind, _, rest = key.partition(":")
    if kind == "cycle":
        return rest in names
    if kind == "accept":
        return rest in names or rest.split(":", 1)[0] in names
    return False


def reconcile_profiles(
    state: PolicyState,
    specs: Sequence[ProfileSpec],
    digests: Mapping[str, str],
    *,
    running: str | None = None,
    adaptive_tables: Mapping[str, Mapping[str, Any]] | None = None,
    now_s: float | None = None,
) -> ProfileChanges:
    """Make `state` describe the profiles `specs` (the config now, in its order), whose
    definitions hash to `digests` (one per profile: Settings.profile_digests). Updates `state`
    in place and returns what changed.

    - A profile of the state not in `specs` is removed: its estimates, restart time,
      quarantine, exploration record and change detectors go, and a pending switch, a trial or
      a rollback that names it is cleared. Were it the state's running profile, `running` (the
      caller's profile serving now, default the first of `specs`) takes its place.
    - A profile of `specs` not in the state is added, untried, with no estimates.
    - A profile in both is changed when the state kept a digest for it that differs from
      `digests`: it is reset as if new (a pending switch or trial to or from it, priced with
      the old estimates, is cleared). A state saved without digests (an older version) changes
      no profile; it records them from now on.
    - Any other profile keeps everything it learned, under its spec as `specs` gives it now
      (the spec is derived from the definition the digest covers; where it moved without the
      digest, e.g. a field a newer version derives, the definition is the same one).

    Adaptive profiles added or changed get their table as initial_state gives it
    (`adaptive_tables`: {"table", "managed"}; for a changed profile only an unmanaged one, the
    user's own file: a managed table generated for the old definition is reseeded), stamped
    `now_s` (default the state's last window, else its start)."""
    new = {p.name: p for p in specs}
    if not new or len(new) != len(specs):
        raise ValueError(f"specs must be a non-empty list of unique names, got {list(new)}")
    missing = [n for n in new if n not in digests]
    if missing:
        raise ValueError(f"no digest for profile(s) {missing}")
    if running is not None and running not in new:
        raise ValueError(f"running profile {running!r} is not one of {list(new)}")
    old = state.specs
    removed = tuple(n for n in old if n not in new)
    added = tuple(n for n in new if n not in old)
    changed = tuple(
        n for n in new if n in old and n in state.digests and state.digests[n] != digests[n]
    )
    gone = set(removed) | set(changed)  # what the state knew of them no longer holds
    cleared: list[str] = []
    if removed or added or changed or tuple(old.values()) != tuple(specs):
        state.profiles = tuple(specs)
        state.model.reprofile(specs, changed)
    if removed or changed:
        _forget(state, gone, cleared)
    if state.running not in new:
        state.running = running if running is not None else specs[0].name
        cleared.append("running")
    if removed or added or changed:
        state.eval_cache = None
        state.long_run.cache = None
        _reconcile_tables(state, specs, added, changed, adaptive_tables, now_s)
    state.digests = {n: str(digests[n]) for n in new}
    return ProfileChanges(added, removed, changed, tuple(cleared))


def _forget(state: PolicyState, gone: set[str], cleared: list[str]) -> None:
    """Everything the state holds of the profiles in `gone` beside the model's estimates (which
    ThroughputModel.reprofile dropped), and the pending switch, trial and rollback naming
    them (their predictions were of a definition that is gone)."""
    for per in (
        state.restart_s,
        state.startup_s,
        state.failed,
        state.explore_declined,
        state.served_top,
        state.served_low,
    ):
        for n in gone & set(per):
            del per[n]
    state.tried -= gone
    for k in [k for k in state.stream_acc if _profile_key(k, gone)]:
        del state.stream_acc[k]
    for per_key in (state.monitor.detectors, state.monitor.history):
        for k in [k for k in per_key if _profile_key(k, gone)]:
            del per_key[k]
    if state.boot_ref is not None and state.boot_ref.get("profile") in gone:
        state.boot_ref = None
    pending = state.pending
    if pending is not None and (pending.get("target") in gone or pending.get("from") in gone):
        state.pending = None
        cleared.append("pending")
    trial = state.trial
    if trial is not None and (trial.get("profile") in gone or trial.get("from") in gone):
        state.trial = None
        cleared.append("trial")
    if state.rollback_to in gone:
        state.rollback_to = None
        cleared.append("rollback_to")


def _reconcile_tables(
    state: PolicyState,
    specs: Sequence[ProfileSpec],
    added: Collection[str],
    changed: Collection[str],
    given: Mapping[str, Mapping[str, Any]] | None,
    now_s: float | None,
) -> None:
    """The adaptive profiles' tables follow the profile set: one per adaptive profile of
    `specs` (kept, or new for one added or changed), none for any other, and no HybridState
    without adaptive profiles (as initial_state makes it)."""
    adaptive = tuple(p for p in specs if p.adaptive)
    if not adaptive:
        state.hybrid = None
        return
    hs = state.hybrid
    have = set() if hs is None else set(hs.tables)
    make = tuple(p for p in adaptive if p.name in added or p.name in changed or p.name not in have)
    tables = {
        n: g for n, g in (given or {}).items() if n not in changed or not g.get("managed", True)
    }
    t = now_s if now_s is not None else (state.last_window_t_s or state.start_s)
    made = hybrid_decide.new_state(make, tables, t)
    if hs is None:
        state.hybrid = made
        return
    new_tables = {} if made is None else made.tables
    hs.tables = {p.name: new_tables.get(p.name) or hs.tables[p.name] for p in adaptive}
    hs.corr = {n: v for n, v in hs.corr.items() if n in hs.tables and n not in new_tables}


def drop_unknown_pin(overrides: Overrides, profiles: Collection[str]) -> Overrides:
    """`overrides` without a pin naming a profile not in `profiles` (removed from the config
    while the pin was saved): the pin and its expiry go, nothing else changes."""
    if overrides.pin_profile is None or overrides.pin_profile in profiles:
        return overrides
    return replace(overrides, pin_profile=None, pin_until_s=None)
