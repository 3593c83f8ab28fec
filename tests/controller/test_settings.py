"""config.toml: the shipped file loads, bad files fail with the key and exit 78."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controller.settings import (
    EXIT_CONFIG,
    ConfigError,
    ProfileSettings,
    Settings,
    load_settings,
    profile_spec,
    settings_from_dict,
)

ROOT = Path(__file__).resolve().parents[2]


def _base(**profiles: list[str]) -> dict:
    return {
        "server": {"initial_profile": "baseline"},
        "profiles": {"baseline": {"flags": []}, **{k: {"flags": v} for k, v in profiles.items()}},
    }


def test_shipped_config_loads() -> None:
    s = load_settings(ROOT / "config.toml")
    assert set(s.profiles) == {"baseline", "eagle3-2step", "eagle3-5step"}
    specs = {p.name: p for p in s.profile_specs()}
    assert specs["baseline"].num_steps == 0 and not specs["baseline"].speculative
    assert (specs["eagle3-2step"].num_steps, specs["eagle3-2step"].draft_tokens) == (2, 3)
    assert (specs["eagle3-5step"].num_steps, specs["eagle3-5step"].draft_tokens) == (5, 6)
    assert s.controller.mode.value == "active"
    argv = s.launch_argv("eagle3-2step")
    assert argv[argv.index("--port") + 1] == "30000"
    assert "--speculative-num-steps" in argv


def test_example_config_for_real_sglang_is_advisory() -> None:
    p = ROOT / "deploy" / "config.example.toml"
    if not p.exists():
        pytest.skip("deploy/config.example.toml not written yet")
    s = load_settings(p)
    assert s.controller.mode.value == "advisory"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[controller\nmode=1", "TOML syntax error"),
        ("[profiles.baseline]\nflags=[]\n[controler]\n", "controler"),
        ("[controller]\npoll_interval_s = -1\n[profiles.baseline]\n", "controller.poll_interval_s"),
        ("[controller]\nmode = 'sometimes'\n[profiles.baseline]\n", "controller.mode"),
        ("[server]\ninitial_profile = 'x'\n[profiles.baseline]\n", "initial_profile"),
        (
            "[profiles.baseline]\n[profiles.bad]\nflags=['--speculative-algorithm','MEDUSA']\n",
            "profiles.bad.flags",
        ),
        (
            "[profiles.baseline]\n[profiles.bad]\n"
            "flags=['--speculative-algorithm','EAGLE3','--speculative-eagle-topk','1']\n",
            "need --speculative-num-steps",
        ),
        ("[profiles.baseline]\nflags=['--port','1']\n", "set by [server]"),
        ("[policy]\nno_such_knob = 1\n[profiles.baseline]\n", "no_such_knob"),
        (
            "[policy]\nexplore_canary_share = 0.5\n[profiles.baseline]\n",
            "explore_canary_share is not a [policy] key: the fleet controller sets it",
        ),
        (
            "[policy]\nboot_carryover_max_windows = 'many'\n[profiles.baseline]\n",
            "boot_carryover_max_windows: must be a finite number",
        ),
        ("[policy]\nmargin_frac = inf\n[profiles.baseline]\n", "margin_frac: must be a finite"),
        ("[policy]\nmin_windows = 2.5\n[profiles.baseline]\n", "min_windows: must be an integer"),
        ("[policy]\nexplore = 1\n[profiles.baseline]\n", "explore: must be true or false"),
        ("[policy]\nmoe_experts = 384\n[profiles.baseline]\n", "moe_experts and moe_topk"),
        (
            "[policy]\nmoe_experts = 8\nmoe_topk = 16\n[profiles.baseline]\n",
            "1 <= moe_topk <= moe_experts (got 8 and 16)",
        ),
        # Infinite or nan durations: a poll that never comes, a deadline that never passes.
        *(
            (
                f"[{table}]\n{key} = {v}\n[profiles.baseline]\n",
                f"{table}.{key}: Input should be a finite number",
            )
            for table, key in (
                ("controller", "poll_interval_s"),
                ("controller", "scrape_timeout_s"),
                ("server", "start_timeout_s"),
                ("server", "stop_timeout_s"),
                ("server", "drain_timeout_s"),
                ("server", "crash_backoff_max_s"),
            )
            for v in ("inf", "nan")
        ),
        ("[policy]\nmin_dwell_s = -5\n[profiles.baseline]\n", "min_dwell_s: must be >= 0"),
        ("[policy]\nmargin_frac = -1\n[profiles.baseline]\n", "margin_frac: must be >= 0"),
        (
            "[policy]\nrestart_budget_per_hour = -1\n[profiles.baseline]\n",
            "restart_budget_per_hour: must be >= 0",
        ),
        (
            "[policy]\nboot_carryover = 1.5\n[profiles.baseline]\n",
            "boot_carryover: must be between 0 and 1",
        ),
        ("[server]\nlaunch = []\n[profiles.baseline]\n", "server.launch: "),
        ("[server]\nlaunch = ['']\n[profiles.baseline]\n", "server.launch: "),
        ("[api]\nhost = ''\n[profiles.baseline]\n", "api.host: "),
        ("[server]\nhost = ' '\n[profiles.baseline]\n", "server.host: "),
        (
            "[api]\ntoken = 'a'\ntoken_file = '/etc/t'\n[profiles.baseline]\n",
            "api.token and api.token_file are both set",
        ),
        # A value of the wrong TOML type is an error, not coerced.
        ("[server]\nowns_server = 'no'\n[profiles.baseline]\n", "server.owns_server: "),
        ("[server]\nport = true\n[profiles.baseline]\n", "server.port: "),
        ("[api]\nport = '8471'\n[profiles.baseline]\n", "api.port: "),
        ("[controller]\npoll_interval_s = '10'\n[profiles.baseline]\n", "poll_interval_s: "),
        ("[api]\nenabled = 1\n[profiles.baseline]\n", "api.enabled: "),
        ("[controller]\ndatabase = ''\n[profiles.baseline]\n", "database: Value error, must no"),
        ("[controller]\ndatabase = 'db/'\n[profiles.baseline]\n", "'db/' names a directory"),
        (
            "[api]\nport = 30000\n[profiles.baseline]\n",
            "api.port 30000 is server.port too (127.0.0.1)",
        ),
        (
            "[api]\nhost = '0.0.0.0'\nport = 9\n[server]\nport = 9\nhost = 'localhost'\n"
            "[profiles.baseline]\n",
            "the API and the server cannot listen on one port",
        ),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    assert needle in str(e.value)
    assert str(p) in str(e.value)


def test_ports_apart_and_types_a_toml_reader_gives_are_fine() -> None:
    raw = _base()
    raw["server"] |= {"host": "10.0.0.7", "port": 8471, "owns_server": False}
    raw["controller"] = {"poll_interval_s": 10, "mode": "advisory"}  # an int for a float
    s = settings_from_dict(raw)  # the API on loopback, the server on another machine
    assert (s.api.port, s.server.port, s.controller.poll_interval_s) == (8471, 8471, 10.0)
    raw["api"] = {"enabled": False, "port": 8471}
    raw["server"]["host"] = "127.0.0.1"
    settings_from_dict(raw)  # no API listens


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_settings("/nonexistent/specpilot.toml")


def test_exit_code_78_for_bad_config(tmp_path: Path) -> None:
    from controller.daemon import run_daemon

    p = tmp_path / "c.toml"
    p.write_text("[controller]\nmode = 'sometimes'\n[profiles.baseline]\n")
    assert run_daemon(p) == EXIT_CONFIG == 78


@pytest.mark.parametrize(
    ("flags", "steps", "topk", "tokens"),
    [
        (["--speculative-algorithm", "EAGLE3"], 3, 1, 4),  # SGLang's defaults when steps unset
        (
            [
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-num-steps",
                "2",
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                "9",
            ],
            2,
            1,
            3,
        ),
        (["--speculative-algorithm=NEXTN", "--speculative-num-steps=4"], 4, 1, 5),
        (
            [
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-num-steps",
                "5",
                "--speculative-eagle-topk",
                "4",
                "--speculative-num-draft-tokens",
                "8",
            ],
            5,
            4,
            8,
        ),
    ],
)
def test_sglang_flag_rules(flags: list[str], steps: int, topk: int, tokens: int) -> None:
    spec = profile_spec("p", ProfileSettings(flags=flags))
    assert (spec.num_steps, spec.topk, spec.draft_tokens) == (steps, topk, tokens)


def test_max_running_requests_per_profile_as_sglang_resolves_it() -> None:
    """A profile's flags win over common_flags (they come later on the command line); unset,
    SGLang runs 48 with speculation and picks its own without; bad values are config errors."""
    e2 = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2"]
    raw = _base(e2=e2, e2big=[*e2, "--max-running-requests", "96"])
    specs = {p.name: p for p in settings_from_dict(raw).profile_specs()}
    assert specs["baseline"].max_running_requests is None
    assert specs["e2"].max_running_requests == 48
    assert specs["e2big"].max_running_requests == 96
    raw["server"]["common_flags"] = ["--max-running-requests=64"]
    specs = {p.name: p for p in settings_from_dict(raw).profile_specs()}
    assert [specs[n].max_running_requests for n in ("baseline", "e2", "e2big")] == [64, 64, 96]
    for bad in ("0", "many"):
        raw = _base(e2=[*e2, "--max-running-requests", bad])
        with pytest.raises(ConfigError, match=r"profiles\.e2\.flags: --max-running-requests"):
            settings_from_dict(raw)


def test_time_scale_must_match_sim_speed() -> None:
    raw = _base()
    raw["server"]["common_flags"] = ["--sim-speed", "20"]
    with pytest.raises(ConfigError, match="time_scale"):
        settings_from_dict(raw)
    raw["controller"] = {"time_scale": 20}
    assert settings_from_dict(raw).controller.time_scale == 20


def test_launch_env_drops_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _base()
    raw["profiles"]["baseline"]["env"] = {"NCCL_PROTO": "LL"}
    s = settings_from_dict(raw)
    env = s.launch_env("baseline", base={"NOTIFY_SOCKET": "/run/x", "PATH": "/bin"})
    assert "NOTIFY_SOCKET" not in env and env["NCCL_PROTO"] == "LL" and env["PATH"] == "/bin"


def test_api_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _base()
    tok = tmp_path / "tok"
    tok.write_text("s3cret\n")
    raw["api"] = {"token_file": str(tok)}
    monkeypatch.delenv("SPECPILOT_API_TOKEN", raising=False)
    assert settings_from_dict(raw).api_token() == "s3cret"
    monkeypatch.setenv("SPECPILOT_API_TOKEN", "fromenv")
    assert settings_from_dict(raw).api_token() == "fromenv"


def test_config_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    p = tmp_path / "binary.toml"
    p.write_bytes(b"[profiles.baseline]\n# caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    assert str(e.value) == f"{p}: not UTF-8 text (byte 0xe9 at offset 25); TOML must be UTF-8"


def test_poll_interval_nan_says_finite_not_greater_than_0() -> None:
    raw = _base()
    raw["controller"] = {"poll_interval_s": float("nan")}
    with pytest.raises(ConfigError) as e:
        settings_from_dict(raw)
    assert "poll_interval_s: Input should be a finite number" in str(e.value)
    assert "greater than" not in str(e.value)


def test_policy_range_checks_keep_every_default_and_zero() -> None:
    """No default is out of range, and 0 (no dwell, no automatic restart, no margin) is fine."""
    import dataclasses

    from controller.settings import DERIVED_POLICY_KEYS
    from policies.settings import PolicySettings

    defaults = PolicySettings()
    raw = _base()
    raw["policy"] = {
        f.name: getattr(defaults, f.name)
        for f in dataclasses.fields(PolicySettings)
        if f.name not in DERIVED_POLICY_KEYS and f.name != "trial"
    }
    assert settings_from_dict(raw).policy == raw["policy"]
    raw["policy"] = {"min_dwell_s": 0, "restart_budget_per_hour": 0, "margin_frac": 0.0}
    assert settings_from_dict(raw).policy["restart_budget_per_hour"] == 0


def test_command_actuator_may_leave_launch_empty() -> None:
    raw = _base()
    raw["server"].update(actuator="command", launch=[], switch_command=["true"])
    assert settings_from_dict(raw).server.launch == []


@pytest.mark.parametrize(
    ("actuator", "where", "value", "problem"),
    [
        ("systemd", "profile_env", {"NOTE": "two\nlines"}, "profiles.p.env.NOTE: 'two\\nlines'"),
        ("systemd", "server_env", {"CR": "a\rb"}, "server.env.CR: 'a\\rb' contains a newline"),
        ("systemd", "profile_env", {"BAD-NAME": "1"}, "profiles.p.env.BAD-NAME: not an env"),
        ("systemd", "flags", ["--x", "a\nb"], "profiles.p.flags: 'a\\nb' contains a newline"),
        ("process", "flags", ["--x\0"], "profiles.p.flags: '--x\\x00' contains a NUL"),
        ("command", "server_env", {"Z": "\0"}, "server.env.Z: '\\x00' contains a NUL"),
    ],
)
def test_what_no_launch_can_carry_is_a_config_error_naming_the_key(
    actuator: str, where: str, value: object, problem: str
) -> None:
    """A newline in an environment value reached the systemd actuator's environment file only
    at the first switch (UNKNOWN, actuation blocked); a NUL failed every launch."""
    raw = _base(p=[])
    raw["server"].update(actuator=actuator, initial_profile="p", switch_command=["true"])
    if where == "server_env":
        raw["server"]["env"] = value
    elif where == "profile_env":
        raw["profiles"]["p"]["env"] = value
    else:
        raw["profiles"]["p"]["flags"] = value
    with pytest.raises(ConfigError) as e:
        settings_from_dict(raw)
    assert problem in str(e.value)


def test_newlines_and_any_env_names_are_fine_outside_systemd() -> None:
    raw = _base(p=["--x", "a\nb"])
    raw["server"]["initial_profile"] = "p"
    raw["profiles"]["p"]["env"] = {"NOTE": "two\nlines", "lower-case": "1"}
    assert settings_from_dict(raw).profiles["p"].env["NOTE"] == "two\nlines"


def _token_settings(path: Path) -> Settings:
    raw = _base()
    raw["api"] = {"token_file": str(path)}
    return settings_from_dict(raw)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "no such file"),
        ("", "its first line is empty"),
        ("\ns3cret\n", "its first line is empty"),
        ("   \n", "its first line is empty"),
        (b"\xff\xfe\n", "not UTF-8 text"),
        ("dir", "is a directory, not a file"),
    ],
)
def test_bad_token_file_is_a_config_error_naming_key_file_and_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | bytes | None, problem: str
) -> None:
    monkeypatch.delenv("SPECPILOT_API_TOKEN", raising=False)
    tok = tmp_path / "tok"
    if content == "dir":
        tok.mkdir()
    elif isinstance(content, bytes):
        tok.write_bytes(content)
    elif content is not None:
        tok.write_text(content)
    with pytest.raises(ConfigError) as e:
        _token_settings(tok).api_token()
    msg = str(e.value)
    assert msg.startswith(f"api.token_file {tok}: ") and problem in msg and "\n" not in msg


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_unreadable_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECPILOT_API_TOKEN", raising=False)
    tok = tmp_path / "tok"
    tok.write_text("s3cret\n")
    tok.chmod(0)
    with pytest.raises(ConfigError, match=r"api\.token_file .*: cannot read it: permission denied"):
        _token_settings(tok).api_token()
