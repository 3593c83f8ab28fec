"""`specpilot bench`: replay scenarios in virtual time through the policies and the simulator's
window engine, against peers and oracles (see scenarios/README.md).

Modules: scenario (TOML files), harness (the virtual-time server and control loop), peers (the
policies compared), oracles (oracle_free, oracle_dp), metrics (switch and detection accounting),
report (tables, JSON, PNG), cli (the typer command).
"""
