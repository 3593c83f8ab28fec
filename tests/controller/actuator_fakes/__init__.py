"""Fakes for the actuator tests: a minimal SGLang-like HTTP server, a fake `systemctl` and a fake
orchestrator command. Test code only."""
