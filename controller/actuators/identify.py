"""Which configured profile a running server is in, read from its /server_info.

Owns the comparison of SGLang's resolved server args (`speculative_algorithm`,
`speculative_num_steps`, `speculative_eagle_topk`, `speculative_num_draft_tokens`,
`speculative_adaptive`) with the profiles' resolved shapes (`controller.settings.profile_spec`);
for an adaptive profile the steps and draft tokens are left out (its tier moves).
Pure functions; no HTTP. Profiles that differ only in environment (NCCL settings) or in flags
/server_info does not show cannot be told apart here: the caller breaks such ties with what it
knows (the profile it started).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from controller.actuators.base import SwitchOutcome, SwitchResult
from policies.types import ProfileSpec

# SGLang resolves NEXTN to EAGLE (srt/arg_groups/speculative_hook.py); settings.profile_spec too.
_ALGORITHM_ALIASES = {"NEXTN": "EAGLE"}


def _algorithm(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip().upper()
    if text in ("", "NONE", "NULL"):
        return None
    return _ALGORITHM_ALIASES.get(text, text)


def _int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def server_shape(server_args: Mapping[str, Any]) -> dict[str, Any]:
    """The speculation shape /server_info reports, normalised for comparison."""
    algo = _algorithm(server_args.get("speculative_algorithm"))
    if algo is None:
        return {"algorithm": None}
    return _shape(
        algo,
        _int(server_args.get("speculative_num_steps")),
        _int(server_args.get("speculative_eagle_topk")),
        _int(server_args.get("speculative_num_draft_tokens")),
        _bool(server_args.get("speculative_adaptive", False)),
    )


def _shape(
    algo: str, steps: int | None, topk: int | None, tokens: int | None, adaptive: bool
) -> dict[str, Any]:
    if adaptive:
        # The tier moves at run time, and the initial steps SGLang resolves depend on the
        # adaptive config's candidates: compare what does not move.
        return {"algorithm": algo, "topk": topk, "adaptive": True}
    return {
        "algorithm": algo,
        "num_steps": steps,
        "topk": topk,
        "draft_tokens": tokens,
        "adaptive": False,
    }


def spec_shape(spec: ProfileSpec) -> dict[str, Any]:
    """The same shape for a configured profile."""
    algo = _algorithm(spec.algorithm)
    if algo is None:
        return {"algorithm": None}
    return _shape(algo, spec.num_steps, spec.topk, spec.draft_tokens, spec.adaptive)


def matching_profiles(server_args: Mapping[str, Any], specs: Sequence[ProfileSpec]) -> list[str]:
    """Every configured profile whose speculation shape equals the server's, in config order."""
    shape = server_shape(server_args)
    return [spec.name for spec in specs if spec_shape(spec) == shape]


def identify_profile(server_args: Mapping[str, Any], specs: Sequence[ProfileSpec]) -> str | None:
    """The one profile the server runs; None when no profile matches, or several do (they differ
    only in what /server_info does not show)."""
    names = matching_profiles(server_args, specs)
    return names[0] if len(names) == 1 else None


def describe_shape(server_args: Mapping[str, Any]) -> str:
    """One line for error messages: what the server runs."""
    shape = server_shape(server_args)
    if shape["algorithm"] is None:
        return "no speculation"
    if shape["adaptive"]:
        return f"{shape['algorithm']} adaptive topk={shape['topk']}"
    return (
        f"{shape['algorithm']} steps={shape['num_steps']} topk={shape['topk']} "
        f"draft_tokens={shape['draft_tokens']}"
    )


def verify_started(
    server_args: Mapping[str, Any],
    specs: Sequence[ProfileSpec],
    *,
    profile: str,
    from_profile: str | None,
    downtime_s: float,
    subject: str,
) -> SwitchResult:
    """The end of a start that reached /ready: OK when the new server's /server_info matches
    `profile`; UNKNOWN when `subject` came up in another shape (a person must look)."""
    names = matching_profiles(server_args, specs)
    if profile not in names:
        return SwitchResult(
            SwitchOutcome.UNKNOWN,
            from_profile,
            profile,
            downtime_s,
            error=f"{subject} is up but /server_info shows {describe_shape(server_args)}, which "
            f"matches {names or 'no profile'}, not {profile!r}",
            server_args=server_args,
        )
    return SwitchResult(
        SwitchOutcome.OK, from_profile, profile, downtime_s, server_args=server_args
    )
