"""Configuration: config.toml read once with tomllib into frozen pydantic models.

Owns the schema of config.toml (every field documented here), the validation of profiles the way
SGLang 0.5.23 would validate their flags, and the one error type a bad file raises
(`ConfigError`, which the CLI turns into exit code 78, systemd's "do not restart" status).
Must not start anything or touch the network.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from controller import sglang_names as sg
from controller.fleet.settings import FleetSettings
from policies.settings import PolicySettings
from policies.types import Mode, ProfileSpec

# An environment variable name as a systemd EnvironmentFile= takes it (actuators.envfile too).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
EXIT_CONFIG = 78  # EX_CONFIG; the systemd unit sets RestartPreventExitStatus=78

# SGLang 0.5.23's --speculative-algorithm choices (srt/server_args.py).
SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO")
# Flags the controller owns for every profile: a profile may not set them.
RESERVED_FLAGS = ("--host", "--port")


# The longest pin or pause TTL (API and CLI): a month; longer "temporary" overrides are
# forgotten, not temporary. Like every *_s, in server time (the simulator's under time_scale).
OVERRIDE_TTL_MAX_S = 30 * 86400.0


class ConfigError(Exception):
    """A configuration file that cannot be used: the message names the file, the key and why."""


class _Frozen(BaseModel):
    # Every float setting is a finite number: inf and nan are config errors ("Input should be a
    # finite number"), not a poll that never comes or a deadline that never passes. Strict: a
    # value of the wrong TOML type is an error, not coerced (owns_server = "no" was True, a
    # port = true was 1, poll_interval_s = "10" was 10.0); an integer is still a float.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)


def _host(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty: name an address (127.0.0.1 for loopback)")
    return v


# An address to bind or reach: never empty (an empty [api] host bound every interface).
Host = Annotated[str, AfterValidator(_host)]


def _database(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty: name the SQLite file (e.g. specpilot.db)")
    if v.endswith(("/", os.sep)):
        raise ValueError(f"{v!r} names a directory: name the SQLite file in it")
    return v


class ControllerSettings(_Frozen):
    """[controller]: the control loop."""

    mode: Mode = Field(
        Mode.ACTIVE,
        strict=False,  # the TOML string names the enum member
        description="active: act on decisions; advisory: decide and explain, never restart.",
    )
    poll_interval_s: float = Field(
        10.0,
        gt=0,
        description="Seconds between scrapes (server time); 10 s spans many gauge refreshes.",
    )
    database: Annotated[str, AfterValidator(_database)] = Field(
        "specpilot.db",
        description="SQLite file; relative paths are under $STATE_DIRECTORY when systemd sets it.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    scrape_timeout_s: float = Field(5.0, gt=0, description="HTTP timeout of one scrape.")
    scrape_error_limit: int = Field(
        6,
        ge=1,
        description="Consecutive failed scrapes after which the target counts as down (the "
        "trial's consecutive-error limit): a trial in progress then ends inconclusive and rolls "
        "back, since a profile that cannot be observed cannot be judged; outside a trial the "
        "controller holds (a server whose process lives may still serve, and a restart for a "
        "monitoring fault would cost minutes of output). 6 polls of 10 s: one minute.",
    )
    time_scale: float = Field(
        1.0,
        gt=0,
        description="Simulated seconds per real second. 1 for a real server; for the simulator it "
        "must equal its --sim-speed, so that every *_s setting is in the server's time.",
    )


class ApiSettings(_Frozen):
    """[api]: the REST API and the controller's own /metrics."""

    enabled: bool = True
    host: Host = Field("127.0.0.1", description="Bind address; loopback by default.")
    port: int = Field(8471, ge=0, le=65535, description="0 picks a free port.")
    token: str = Field("", description="Write endpoints' bearer token.")
    token_file: str = Field(
        "", description="File whose first line is the token (not with api.token)."
    )

    @model_validator(mode="after")
    def _one_token_source(self) -> ApiSettings:
        if self.token and self.token_file:
            raise ValueError(
                "api.token and api.token_file are both set: keep one (which should win is "
                "ambiguous)"
            )
        return self


class ServerSettings(_Frozen):
    """[server]: the SGLang server (or the simulator) being controlled."""

    actuator: Literal["process", "systemd", "command"] = Field(
        "process",
        description="process: specpilot runs the server as its child; systemd: a unit of its own; "
        "command: user-given switch/status commands.",
    )
    host: Host = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    launch: list[str] = Field(
        default_factory=lambda: ["{python}", "-m", "simulator"],
        description="Command before the flags. {python} is this interpreter. Real SGLang: "
        '["python", "-m", "sglang.launch_server"].',
    )
    common_flags: list[str] = Field(
        default_factory=list, description="Flags every profile gets (model path, metrics...)."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment for every profile.")
    initial_profile: str = Field("baseline", description="Profile started when none is running.")
    owns_server: bool = Field(
        True, description="Stop the server when the controller stops (process actuator only)."
    )
    start_timeout_s: float = Field(
        900.0, gt=0, description="Deadline for /ready after a start; a 1T model needs minutes."
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="Bounded wait for in-flight requests before SIGTERM."
    )
    stop_timeout_s: float = Field(
        30.0, gt=0, description="SIGTERM -> SIGKILL of the whole process group after this."
    )
    crash_backoff_s: float = Field(
        30.0,
        gt=0,
        description="First wait before restarting a crashed server; doubles per failure.",
    )
    crash_backoff_max_s: float = Field(
        1800.0, gt=0, description="Longest wait between restarts of a server that keeps crashing."
    )
    start_failure_limit: int = Field(
        3,
        ge=1,
        description="Consecutive failed starts (crash restarts and rollbacks that did not come "
        "up) after which automatic actuation stops until a person clears the block through the "
        "API: restarting again cannot fix a broken host. 3: the failed profile, the rollback, "
        "one retry after a backoff.",
    )
    pid_file: str = Field("", description="Where the process actuator records the server's pid.")
    log_file: str = Field("", description="Server stdout/stderr; empty: inherit.")
    systemd_unit: str = Field("sglang@specpilot.service", description="Unit (systemd actuator).")
    systemd_env_file: str = Field(
        "/etc/specpilot/sglang-specpilot.env",
        description="EnvironmentFile of the unit (deploy/sglang@.service: sglang-%i.env).",
    )
    switch_command: list[str] = Field(
        default_factory=list, description="command actuator: run with {profile} and {flags}."
    )
    status_command: list[str] = Field(
        default_factory=list, description="command actuator: prints the running profile."
    )

    @field_validator("launch")
    @classmethod
    def _launch_set(cls, v: list[str], info: ValidationInfo) -> list[str]:
        # The process and systemd actuators run `launch`; the command actuator only hands the
        # flags after it to switch_command, so an empty launch is its business.
        if info.data.get("actuator", "process") != "command" and (not v or not v[0].strip()):
            raise ValueError(
                "must name the command that starts the server "
                '(e.g. ["python", "-m", "sglang.launch_server"])'
            )
        return v

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ProfileSettings(_Frozen):
    """[profiles.NAME]: one speculation profile = flags + environment."""

    flags: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    kind: Literal["fixed", "adaptive"] = "fixed"
    description: str = ""
    candidate_steps: list[int] | None = Field(
        None,
        description="kind = 'adaptive' only: the draft steps specpilot's generated table may use "
        "(0 = no drafting; each step captures its own CUDA graphs at launch). Unset: SGLang's "
        "default table's steps 0, 1, 3, 5, 7. Not with a --speculative-adaptive-config of your "
        "own (then the table is yours and specpilot only predicts it).",
    )

    @field_validator("candidate_steps")
    @classmethod
    def _steps(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v or any(s < 0 or s > 16 for s in v):
            raise ValueError(f"candidate_steps must be a non-empty list of ints 0..16, got {v}")
        return sorted(set(v))

    @field_validator("flags")
    @classmethod
    def _no_reserved(cls, v: list[str]) -> list[str]:
        for flag in v:
            if flag.split("=", 1)[0] in RESERVED_FLAGS:
                raise ValueError(f"{flag} is set by [server], not by a profile")
        return v


class Settings(_Frozen):
    """The whole file."""

    # [policy] values are checked by _check_policy_value (finite, typed, in range), with the key.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=True, strict=True)

    controller: ControllerSettings = ControllerSettings()
    api: ApiSettings = ApiSettings()
    server: ServerSettings = ServerSettings()
    policy: dict[str, float | int | bool | str] = Field(
        default_factory=dict, description="Overrides of policies.settings.PolicySettings fields."
    )
    profiles: dict[str, ProfileSettings]
    fleet: FleetSettings = Field(
        default_factory=FleetSettings,
        description="[fleet]: replicas behind sglang-router (docs/FLEET.md); replicas = 0 is off.",
    )

    @model_validator(mode="after")
    def _check_profiles(self) -> Settings:
        if not self.profiles:
            raise ValueError("[profiles] must define at least one profile")
        if self.server.initial_profile not in self.profiles:
            raise ValueError(
                f"server.initial_profile {self.server.initial_profile!r} is not a profile "
                f"(have: {', '.join(sorted(self.profiles))})"
            )
        if self.fleet.enabled and self.server.actuator != "process":
            raise ValueError(
                "fleet mode runs its replicas with the process actuator: "
                "set server.actuator = 'process'"
            )
        if self._api_takes_server_port():
            raise ValueError(
                f"api.port {self.api.port} is server.port too ({self.server.host}): the API and "
                "the server cannot listen on one port; change one of them"
            )
        if self.server.actuator == "command" and not self.server.switch_command:
            raise ValueError("server.actuator = 'command' needs server.switch_command")
        problem = self._launch_text_problem()
        if problem:
            raise ValueError(problem)
        sim_speed = _flag_values(self.server.common_flags).get("--sim-speed")
        if sim_speed is not None and float(sim_speed) != self.controller.time_scale:
            raise ValueError(
                f"controller.time_scale ({self.controller.time_scale}) must equal the simulator's "
                f"--sim-speed ({sim_speed}) in server.common_flags"
            )
        return self

    def _api_takes_server_port(self) -> bool:
        """The API would bind the port the server listens on, on one machine: the same host, a
        wildcard address, or loopback on both sides."""
        if not self.api.enabled or self.api.port != self.server.port:
            return False
        hosts = {self.api.host, self.server.host}
        loopback = {"127.0.0.1", "localhost", "::1"}
        return len(hosts) == 1 or bool(hosts & {"0.0.0.0", "::"}) or hosts <= loopback

    def _launch_text_problem(self) -> str | None:
        """What no server launch can carry, named by its key: a NUL anywhere in the launch
        command, flags or environment (exec cannot pass one); with the systemd actuator, whose
        environment file holds them one assignment per line, a newline or carriage return too,
        and an environment name that is not one (systemd skips such a line)."""
        systemd = self.server.actuator == "systemd"
        bad = "\0\n\r" if systemd else "\0"
        envs = [("server.env", self.server.env)]
        envs += [(f"profiles.{n}.env", p.env) for n, p in self.profiles.items()]
        texts = [("server.launch", v) for v in self.server.launch]
        texts += [("server.common_flags", v) for v in self.server.common_flags]
        texts += [(f"profiles.{n}.flags", v) for n, p in self.profiles.items() for v in p.flags]
        texts += [(f"{t}.{k}", v) for t, env in envs for k, v in env.items()]
        for key, text in texts:
            if any(c in text for c in bad):
                what = "a NUL" if "\0" in text else "a newline (the systemd environment file)"
                return f"{key}: {text[:40]!r} contains {what}"
        for table, env in envs if systemd else ():
            for k in env:
                if not ENV_NAME.fullmatch(k):
                    return (
                        f"{table}.{k}: not an environment name (letters, digits and _, not "
                        "starting with a digit)"
                    )
        return None

    def profile_specs(self) -> list[ProfileSpec]:
        return [
            profile_spec(name, p, self.server.common_flags) for name, p in self.profiles.items()
        ]

    def profile_digests(self) -> dict[str, str]:
        """Per profile, a stable hash (16 hex digits of SHA-256) of what decides how its server
        runs, so that a profile edited between runs under the same name is told from one left
        alone (policies.reconcile re-measures the first): the launch command, its flags
        ([server] common_flags, then its own, in order), its environment ([server] env under
        its own, as launch_env merges them), its kind and candidate_steps. Not its
        description, nor host and port (every profile's alike, and no part of its speed)."""
        out = {}
        for name, p in self.profiles.items():
            body = {
                "launch": list(self.server.launch),
                "flags": [*self.server.common_flags, *p.flags],
                "env": {**self.server.env, **p.env},
                "kind": p.kind,
                "candidate_steps": p.candidate_steps,
            }
            text = json.dumps(body, sort_keys=True, separators=(",", ":"))
            out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return out

    def api_token(self) -> str:
        """Write token: SPECPILOT_API_TOKEN, else api.token, else token_file's first line.
        Raises ConfigError naming api.token_file, the file and the problem (missing, a
        directory, unreadable, not UTF-8, empty first line)."""
        env = os.environ.get("SPECPILOT_API_TOKEN", "").strip()
        if env:
            return env
        if self.api.token:
            return self.api.token
        if self.api.token_file:
            return read_token_file(self.api.token_file)
        return ""

    def state_dir(self) -> Path:
        """Where the database lives (relative paths under $STATE_DIRECTORY when systemd sets
        it, as controller.daemon.database_path resolves them): generated files go next to it."""
        p = Path(self.controller.database)
        state = os.environ.get("STATE_DIRECTORY")
        if not p.is_absolute() and state:
            p = Path(state.split(":")[0]) / p
        return p.parent

    def managed_adaptive(self, profile: str) -> bool:
        """An adaptive profile whose table specpilot writes (no config file of its own)."""
        prof = self.profiles[profile]
        return prof.kind == "adaptive" and "--speculative-adaptive-config" not in _flag_values(
            prof.flags
        )

    def adaptive_table_path(self, profile: str) -> Path:
        """The --speculative-adaptive-config file specpilot writes for a managed profile."""
        return self.state_dir() / f"adaptive-{profile}.json"

    def adaptive_config_flags(self, profile: str) -> list[str]:
        """`--speculative-adaptive-config FILE` for a managed adaptive profile, else nothing.
        Writes the seed table (SGLang's default restricted to candidate_steps) when no table
        was generated yet, so a launch never names a missing file."""
        if not self.managed_adaptive(profile):
            return []
        path = self.adaptive_table_path(profile)
        if not path.exists():
            from controller.actuators.envfile import write_atomic
            from policies.hybrid import seed_table

            spec = profile_spec(profile, self.profiles[profile])
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(seed_table(spec.candidate_steps)) + "\n", mode=0o644)
        return ["--speculative-adaptive-config", str(path)]

    def launch_argv(self, profile: str, extra_flags: Sequence[str] | None = None) -> list[str]:
        """The full command line that starts the server with `profile`. `extra_flags` default:
        the generated table's flag for a managed adaptive profile (adaptive_config_flags)."""
        launch = [sys.executable if a == "{python}" else a for a in self.server.launch]
        extra = self.adaptive_config_flags(profile) if extra_flags is None else list(extra_flags)
        return [
            *launch,
            *self.server.common_flags,
            *self.profiles[profile].flags,
            *extra,
            "--host",
            self.server.host,
            "--port",
            str(self.server.port),
        ]

    def launch_env(self, profile: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's environment: base + [server].env + the profile's env, never NOTIFY_SOCKET
        (the server must not talk to specpilot's systemd notify socket)."""
        env = dict(os.environ if base is None else base)
        env.update(self.server.env)
        env.update(self.profiles[profile].env)
        env.pop("NOTIFY_SOCKET", None)
        env.pop("WATCHDOG_USEC", None)
        env.pop("WATCHDOG_PID", None)
        return env


def read_token_file(path: str) -> str:
    """The first line of api.token_file, stripped; ConfigError when it cannot be the token."""
    where = f"api.token_file {path}"
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a directory, not a file") from None
    except PermissionError:
        raise ConfigError(f"{where}: cannot read it: permission denied") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({decode_problem(e)})") from None
    lines = text.splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ConfigError(f"{where}: its first line is empty (it must hold the token)")
    return token


def decode_problem(e: UnicodeDecodeError) -> str:
    """Where a file stops being UTF-8, for a one-line error: the byte and its offset."""
    bad = e.object[e.start : e.start + 1]
    return f"byte 0x{bad.hex()} at offset {e.start}" if bad else str(e)


def _flag_values(flags: Sequence[str]) -> dict[str, str | None]:
    """--flag value / --flag=value / --switch -> {flag: value or None}."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(flags):
        tok = flags[i]
        if not tok.startswith("--"):
            raise ValueError(f"unexpected value {tok!r} (flags must start with --)")
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v
            i += 1
        elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[tok] = flags[i + 1]
            i += 2
        else:
            out[tok] = None
            i += 1
    return out


def _int_flag(vals: Mapping[str, str | None], name: str) -> int | None:
    v = vals.get(name)
    if name in vals and v is None:
        raise ValueError(f"{name} needs a value")
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None


def profile_spec(
    name: str, profile: ProfileSettings, common_flags: Sequence[str] = ()
) -> ProfileSpec:
    """The speculation shape of a profile, resolved with SGLang 0.5.23's rules
    (srt/arg_groups/speculative_hook.py): steps unset -> topk and draft tokens must be unset too and
    SGLang picks (3 steps, topk 1, 4 tokens); topk 1 -> draft tokens = steps + 1. Its max running
    requests: `--max-running-requests` from the profile's flags, else from `common_flags` (they
    come first on the command line), else 48 with speculation (SGLang's rule), else unknown.
    Raises ValueError with the flag and the reason for flags SGLang would reject."""
    if profile.candidate_steps is not None and profile.kind != "adaptive":
        raise ValueError("candidate_steps is for kind = 'adaptive' profiles only")
    vals = _flag_values(profile.flags)
    cap = _max_running({**_flag_values(common_flags), **vals})
    algo = vals.get("--speculative-algorithm")
    if "--speculative-algorithm" in vals and algo is None:
        raise ValueError("--speculative-algorithm needs a value")
    steps = _int_flag(vals, "--speculative-num-steps")
    topk = _int_flag(vals, "--speculative-eagle-topk")
    tokens = _int_flag(vals, "--speculative-num-draft-tokens")
    adaptive = "--speculative-adaptive" in vals
    if algo is None:
        if steps is not None or topk is not None or tokens is not None or adaptive:
            raise ValueError("--speculative-* flags given without --speculative-algorithm")
        if profile.kind == "adaptive":
            raise ValueError("kind = 'adaptive' needs --speculative-algorithm EAGLE or EAGLE3")
        return ProfileSpec(name=name, max_running_requests=max_running_requests(cap, False))
    algo = algo.upper()
    if algo not in SPEC_ALGORITHMS:
        raise ValueError(
            f"--speculative-algorithm {algo!r} is not one of {', '.join(SPEC_ALGORITHMS)}"
        )
    if algo == "NEXTN":
        algo = "EAGLE"
    explicit_steps = steps
    if steps is None:
        if topk is not None or tokens is not None:
            raise ValueError(
                "--speculative-eagle-topk / --speculative-num-draft-tokens need "
                "--speculative-num-steps (SGLang rejects them alone)"
            )
        steps, topk, tokens = 3, 1, 4
    if steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1, got {steps}")
    topk = 1 if topk is None else topk
    if topk < 1:
        raise ValueError(f"--speculative-eagle-topk must be >= 1, got {topk}")
    if topk == 1:
        tokens = steps + 1
    elif tokens is None:
        raise ValueError("--speculative-num-draft-tokens is required when topk > 1")
    if adaptive and (algo not in ("EAGLE", "EAGLE3") or topk != 1):
        raise ValueError("--speculative-adaptive works only with EAGLE/EAGLE3 and topk 1")
    if profile.kind == "adaptive" and not adaptive:
        raise ValueError("kind = 'adaptive' needs the --speculative-adaptive flag")
    candidates: tuple[int, ...] = ()
    if adaptive:
        cfg = vals.get("--speculative-adaptive-config")
        if cfg and profile.candidate_steps is not None:
            raise ValueError(
                "candidate_steps is for tables specpilot writes; with "
                "--speculative-adaptive-config the table is yours"
            )
        if cfg:
            candidates = _adaptive_candidates(cfg)
        elif profile.candidate_steps is not None:
            candidates = tuple(profile.candidate_steps)
        else:
            candidates = (0, 1, 3, 5, 7)
        if explicit_steps is None:
            # SGLang starts an adaptive server at the middle of its candidate steps.
            positive = [c for c in candidates if c > 0] or [1]
            steps = positive[len(positive) // 2]
            tokens = steps + 1
    return ProfileSpec(
        name=name,
        num_steps=steps,
        draft_tokens=tokens,
        topk=topk,
        algorithm=algo,
        adaptive=adaptive,
        candidate_steps=candidates,
        max_running_requests=max_running_requests(cap, True),
    )


def max_running_requests(flag: int | None, speculative: bool) -> int | None:
    """The most requests SGLang runs at once: `--max-running-requests` when set, else 48 with
    speculation (SGLang forces it), else None (the server picks it from its KV pool)."""
    if flag is None and speculative:
        return sg.SPEC_DEFAULT_MAX_RUNNING_REQUESTS
    return flag


def _max_running(vals: Mapping[str, str | None]) -> int | None:
    """`--max-running-requests` (None when unset); raises ValueError unless it is >= 1."""
    cap = _int_flag(vals, sg.FLAG_MAX_RUNNING_REQUESTS)
    if cap is not None and cap < 1:
        raise ValueError(f"{sg.FLAG_MAX_RUNNING_REQUESTS} must be >= 1, got {cap}")
    return cap


def _adaptive_candidates(path: str) -> tuple[int, ...]:
    import json

    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--speculative-adaptive-config {path}: {e}") from e
    steps: set[int] = set()
    try:
        for bucket in table.values():
            steps.update(int(s) for s in bucket["candidate_steps"])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--speculative-adaptive-config {path}: bad table ({e})") from e
    return tuple(sorted(steps))


def _fmt_loc(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc)


def load_settings(path: str | os.PathLike[str]) -> Settings:
    """Read and validate config.toml. Raises ConfigError naming the file, key and problem."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{p}: not UTF-8 text ({decode_problem(e)}); TOML must be UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: TOML syntax error: {e}") from e
    return settings_from_dict(raw, source=str(p))


def settings_from_dict(raw: Mapping[str, Any], *, source: str = "<config>") -> Settings:
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as e:
        lines = [f"{source}: invalid configuration:"]
        for err in e.errors():
            lines.append(f"  {_fmt_loc(err['loc']) or '(top)'}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None
    for name, prof in settings.profiles.items():
        try:
            profile_spec(name, prof, settings.server.common_flags)
        except ValueError as e:
            raise ConfigError(f"{source}: profiles.{name}.flags: {e}") from None
    try:
        policy_settings(settings, read_routing=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: policy: {e}") from None
    return settings


# PolicySettings fields that are facts of the deployment, set by the controller that runs it.
DERIVED_POLICY_KEYS = {
    "explore_canary_share": "the fleet controller sets it from [fleet] (1 / replicas with "
    "canaries on, else 1)",
}


def policy_settings(settings: Settings, read_routing: bool = True) -> PolicySettings:
    """policies.settings.PolicySettings with the [policy] overrides applied (unknown key -> error).
    Where [policy] gives no MoE routing, it is read from the model's config.json
    (`model_routing`) unless `read_routing` is False (validating the file needs no model)."""
    import dataclasses

    defaults = PolicySettings()
    known = {f.name for f in dataclasses.fields(PolicySettings)}
    known -= DERIVED_POLICY_KEYS.keys()
    for key, value in settings.policy.items():
        if key in DERIVED_POLICY_KEYS:
            raise ValueError(f"{key} is not a [policy] key: {DERIVED_POLICY_KEYS[key]}")
        if key not in known:
            raise ValueError(f"unknown key {key!r} (known: {', '.join(sorted(known))})")
        _check_policy_value(key, value, getattr(defaults, key))
    values = dict(settings.policy)
    if read_routing and routing_from(settings) is None:
        routing = model_routing(settings)
        if routing is not None:
            values.update(moe_experts=routing.experts, moe_topk=routing.topk)
    return PolicySettings(**values)


def routing_from(settings: Settings, experts: int = 0) -> str | None:
    """Where the MoE routing in force came from: "[policy]" when the file sets it, else
    "config.json" when `experts` (the settings in force) says one was read, else None."""
    if "moe_experts" in settings.policy or "moe_topk" in settings.policy:
        return "[policy]"
    return "config.json" if experts else None


def model_routing(settings: Settings) -> Any:
    """The MoE routing in the config.json of the server's --model-path, where that model is on
    this machine (controller.model_routing.Routing), else None: what [policy] moe_experts and
    moe_topk default to."""
    from controller.model_routing import find_routing

    try:
        path = _flag_values(settings.server.common_flags).get("--model-path")
    except ValueError:
        return None
    return find_routing(path)


def policy_help() -> list[tuple[str, Any, str]]:
    """Every [policy] key: (name, default, the reason its source gives for it), read from the
    comments above each field of policies.settings.PolicySettings (empty where the source is not
    installed beside the package)."""
    import dataclasses
    import inspect
    import re

    defaults = PolicySettings()
    notes: dict[str, str] = {}
    try:
        lines = inspect.getsource(PolicySettings).splitlines()
    except (OSError, TypeError):
        lines = []
    comment: list[str] = []
    head = ""  # the first field of a group one comment explains (no blank line between)
    for line in lines:
        text = line.strip()
        if text.startswith("#"):
            comment.append(text.lstrip("#").strip())
            continue
        m = re.match(r"(\w+)\s*:\s*[^=]+=", text)
        if m and comment:
            head = m.group(1)
            notes[head] = " ".join(comment)
        elif m and head:
            notes[m.group(1)] = f"(see {head})"
        else:
            head = ""
        comment = []
    return [
        (f.name, getattr(defaults, f.name), notes.get(f.name, ""))
        for f in dataclasses.fields(PolicySettings)
        if f.name not in DERIVED_POLICY_KEYS
    ]


# [policy] settings that are shares of a whole (weights kept or learnt, a fraction of a
# threshold): 0..1. Every other number is a duration, count, budget, ratio or threshold: >= 0.
POLICY_FRACTIONS = frozenset(
    {"restart_learning_rate", "boot_carryover", "change_discount", "suspect_fraction"}
)


def _check_policy_value(key: str, value: Any, default: Any) -> None:
    """A [policy] override must have its setting's type (a float setting takes an integer too)
    and, when a number, be finite (the policy would otherwise fail at its first tick) and in
    range: no PolicySettings number means anything below 0 (a negative dwell, budget, margin or
    count), and the POLICY_FRACTIONS are at most 1."""
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float):
        num = isinstance(value, int | float) and not isinstance(value, bool)
        ok, want = num and math.isfinite(value), "a finite number"
    else:
        ok, want = isinstance(value, type(default)), type(default).__name__
    if not ok:
        raise ValueError(f"{key}: must be {want} (got {value!r})")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if value < 0:
        raise ValueError(f"{key}: must be >= 0 (got {value!r})")
    if key in POLICY_FRACTIONS and value > 1:
        raise ValueError(f"{key}: must be between 0 and 1 (got {value!r})")
