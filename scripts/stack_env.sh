#!/usr/bin/env bash
# stack_env.sh — makes (once) and prints the Python of the current-stack environment: the
# PyPI wheels of scripts/current-stack.txt (torch runs on a machine without a GPU) in a
# virtual environment outside the clone, keyed by that file's contents, so that CI and
# developers download it once per version set.
#
#   python=$(scripts/stack_env.sh)    # e.g. ~/.cache/vramscope/stack-1a2b3c4d5e6f/bin/python
#
# VRAMSCOPE_STACK_VENV overrides the directory. Progress goes to stderr; exit 1 when PyPI
# cannot be reached, with pip's message.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
requirements="$root/scripts/current-stack.txt"
key=$(sha256sum "$requirements" | cut -c1-12)
venv="${VRAMSCOPE_STACK_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/vramscope/stack-$key}"
if [[ ! -f "$venv/.complete" ]]; then
  if [[ -e "$venv" && ! -f "$venv/pyvenv.cfg" && -n "$(ls -A "$venv" 2>/dev/null)" ]]; then
    echo "stack_env: $venv exists and is not a virtual environment; not touching it" >&2
    exit 1
  fi
  echo "stack_env: making $venv from $requirements (about 6 GB, a few minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements" >&2
  # bitsandbytes where it imports (QLoRA's layers); the checks that need it skip without it.
  if "$venv/bin/python" -m pip install -q --disable-pip-version-check bitsandbytes >&2 2>/dev/null &&
     ! "$venv/bin/python" -c "import bitsandbytes" >/dev/null 2>&1; then
    "$venv/bin/python" -m pip uninstall -q -y bitsandbytes >&2
  fi
  touch "$venv/.complete"
fi
echo "$venv/bin/python"
