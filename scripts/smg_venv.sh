#!/usr/bin/env bash
# SMG (PyPI `smg`), the Rust gateway `python -m bench.full_path` measures our path against, in a
# venv of its own (.venv-smg/ at the repository root, git-ignored): a benchmark-only dependency,
# never one of the product's. Installs exactly bench/smg-requirements.txt (every version pinned,
# every file's hash checked); does nothing when that venv already matches it (safe to run every
# time). `make bench-peer-setup` runs this; so does the benchmark when the venv is missing.
#
#   scripts/smg_venv.sh            create or update .venv-smg/ (SMG_VENV=DIR for another place)
#   scripts/smg_venv.sh --compile  re-resolve bench/smg-requirements.txt from bench/smg-requirements.in
#                                  (with the project's pinned uv; commit both files)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
requirements="$root/bench/smg-requirements.txt"
venv="${SMG_VENV:-$root/.venv-smg}"
python="${PY:-python3}"

if [ "${1:-}" = "--compile" ]; then
  uv="$root/.venv/bin/uv"
  if [ ! -x "$uv" ]; then
    echo "no $uv: run make setup first (uv is a pinned dev dependency)" >&2
    exit 1
  fi
  cd "$root"
  exec "$uv" pip compile bench/smg-requirements.in --generate-hashes --universal \
    --python-version 3.11 --custom-compile-command "scripts/smg_venv.sh --compile" --quiet \
    --output-file bench/smg-requirements.txt
fi

stamp="$venv/.installed"
if [ -x "$venv/bin/smg" ] && [ -f "$stamp" ] && cmp -s "$requirements" "$stamp"; then
  exit 0
fi
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
  --only-binary :all: -r "$requirements"
cp "$requirements" "$stamp"
echo "SMG installed in $venv: $("$venv/bin/smg" --version 2>/dev/null | head -n 1)"
