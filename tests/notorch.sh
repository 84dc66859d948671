#!/usr/bin/env bash
# tests/unit in a venv that has the daemon's dependencies and the unit tier's, never torch, on one interpreter.
#   tests/notorch.sh python3        `make unit`: the unit tier proves it needs no torch
#   tests/notorch.sh 3.10 --mypy    `make pythons`: the oldest and newest Python pyproject claims (3.10, 3.13);
#                                   mypy checks supervisor/ as that version first
# A version found neither under pyenv nor on PATH is skipped with one line (CI's machine has both in pyenv).
set -euo pipefail
cd "$(dirname "$0")/.."
want=${1:?usage: tests/notorch.sh VERSION|INTERPRETER [--mypy]}
if [[ $want =~ ^3\.[0-9]+$ ]]; then
  py=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want".*/bin/python3 2>/dev/null | sort -V | tail -n 1 || true)
  [ -n "$py" ] || py=$(command -v "python$want" || true)
  [ -n "$py" ] || { echo "notorch: no Python $want on this machine (pyenv install $want): skipped"; exit 0; }
else
  py=$(command -v "$want")
fi
ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv=.venv-notorch-$ver
# The dev extra's pins for the tools that run here (pyproject.toml says why they are exact).
deps=(tqdm pytest pytest-timeout hypothesis pyyaml mypy==2.4.1 types-psutil==7.2.2.20261111 types-tqdm==4.70.0.20261106
      "tomli==2.5.0")
if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ]; then
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --progress-bar off -e . "${deps[@]}"
  touch "$venv/.installed"
fi
if "$venv/bin/python" -c 'import torch' 2>/dev/null; then echo "notorch: $venv has torch" >&2; exit 1; fi
echo "notorch: Python $("$venv/bin/python" -V 2>&1 | cut -d' ' -f2), no torch ($venv)"
if [ "${2:-}" = --mypy ]; then "$venv/bin/mypy" --python-version "$ver" supervisor fsdp_supervisor_entry.py; fi
OMP_NUM_THREADS=1 exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/unit
