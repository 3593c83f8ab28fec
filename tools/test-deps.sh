#!/usr/bin/env bash
# The external tools some tests drive: Debian's prometheus (promtool + a real Prometheus server),
# chromium (the status page in a headless browser) and systemd (systemd-analyze verify). Idempotent: does nothing when they are
# installed. Never fails the test command: without them (no apt-get, not root, no network) it
# says so, and the tests that need them skip with that reason.
set -u

missing=()
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  missing+=(prometheus)
fi
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  missing+=(chromium)
fi
if ! command -v systemd-analyze >/dev/null 2>&1; then
  missing+=(systemd)  # systemd-analyze verify checks the shipped units
fi
[ "${#missing[@]}" -eq 0 ] && exit 0

say() { echo "tools/test-deps.sh: $*" >&2; }
if ! command -v apt-get >/dev/null 2>&1; then
  say "no apt-get here: install ${missing[*]} yourself; the tests that need them will skip"
  exit 0
fi
as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    say "not root and no passwordless sudo: cannot install ${missing[*]}; those tests will skip"
    exit 0
  fi
fi

# Debian's prometheus package starts its service on install where systemd runs; the tests start
# their own, so keep the package from starting one (policy-rc.d answers 101: do not start).
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null \
    && "${as_root[@]}" chmod 755 "$policy" && made_policy=1
fi

say "installing ${missing[*]} (apt-get)..."
export DEBIAN_FRONTEND=noninteractive
if "${as_root[@]}" apt-get update -q >/dev/null 2>&1 \
  && "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1
then
  say "installed ${missing[*]}"
else
  say "apt-get could not install ${missing[*]}; the tests that need them will skip"
fi
[ "$made_policy" -eq 1 ] && "${as_root[@]}" rm -f "$policy"
exit 0
