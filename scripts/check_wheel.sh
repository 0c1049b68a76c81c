#!/usr/bin/env bash
# check_wheel.sh — the Python user's install, as CI checks it: a source archive of HEAD
# (git archive: commit first, uncommitted changes are not in it) built into a wheel by pip,
# installed into a fresh virtual environment, and run there with no VRAMSCOPE_* variable
# set: the `vramscope` command, the library through ctypes, the package's tests, and the
# README's Python quick start (the exporter needs torch: the current-stack environment's,
# scripts/stack_env.sh, when VRAMSCOPE_STACK_PYTHON names it).
#
#   scripts/check_wheel.sh        # about 4 minutes on 2 cores, most of it the C++ build
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/vramscope-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
stack_python=${VRAMSCOPE_STACK_PYTHON:-}
for v in $(env | sed -n 's/^\(VRAMSCOPE_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done

git -C "$root" archive --format=tar.gz --prefix=vramscope/ -o "$work/vramscope.tar.gz" HEAD
python3 -m venv "$work/venv"
echo "check_wheel: building and installing the wheel from a source archive of $(git -C "$root" rev-parse --short HEAD)" >&2
start=$SECONDS
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$work/vramscope.tar.gz" pytest
echo "check_wheel: installed in $((SECONDS - start)) s" >&2
export PATH="$work/venv/bin:$PATH"
cd "$work"

# The README's Python quick start, as written there.
vramscope sweep --model resnet18 --batch 64 --segments 0,4 --brief
VRAMSCOPE_TEST_INSTALLED=1 python -m pytest -q -p no:cacheprovider "$root/python/tests"
if [[ -n "$stack_python" ]]; then
  site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  PYTHONPATH="$site" "$stack_python" -m vramscope.export torchvision.models:resnet18 --input 64,3,224,224 \
    -o resnet18.json
  PYTHONPATH="$site" "$stack_python" -c 'import vramscope, pathlib, sys; sys.exit(pathlib.Path(vramscope.__file__).is_relative_to(pathlib.Path(sys.argv[1])) is False)' "$site"
  vramscope sweep --model-file resnet18.json --segments 0,4 --brief
else
  echo "check_wheel: VRAMSCOPE_STACK_PYTHON is not set: the exporter's quick start is not run" >&2
fi
echo "check_wheel: ok" >&2
