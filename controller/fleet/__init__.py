"""Fleet mode: several SGLang replicas behind SGLang's own router (`sglang-router`).

router.py (the router process and its worker API), actuator.py (replicas, rolling switches,
the canary move), observe.py (per-replica windows, the mean replica, fleet totals), canary.py (a
canary in progress), controller.py (the deployment's loop), settings.py ([fleet] of config.toml),
demo.py (`specpilot demo --fleet N`). The statistics of a canary are pure: policies/canary.py.
"""
