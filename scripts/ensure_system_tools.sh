#!/usr/bin/env bash
# The system programs the test suite runs besides Python: a real etcd server (the fleet tests),
# etcdctl (the README's by-hand etcd fleet, run by tests/deploy/test_doc_commands.py) and
# systemd-analyze (the unit's verify and security checks). Installs the Debian packages that
# provide whichever is missing; does nothing when all are there (safe to run every time).
set -euo pipefail
missing=()
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "missing ${missing[*]} and this is not a Debian-like system: install etcd and etcdctl (v3.4+)" \
       "and systemd-analyze so that all are on PATH" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# etcd-server also ships a system service; the tests run their own server on free ports.
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v etcd >/dev/null && command -v etcdctl >/dev/null && command -v systemd-analyze >/dev/null
