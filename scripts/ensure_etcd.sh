#!/usr/bin/env bash
# The fleet tests start a real etcd server. Install Debian's etcd-server package when the
# `etcd` binary is missing; do nothing when it is there (idempotent, safe to run every time).
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "etcd is not installed and this is not a Debian-like system: install etcd (v3.4+) so that" \
       "\`etcd\` is on PATH" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
# The package also ships a system service; the tests run their own server on free ports.
command -v etcd >/dev/null
