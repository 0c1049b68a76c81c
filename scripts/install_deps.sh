#!/usr/bin/env bash
# install_deps.sh — installs the Debian/Ubuntu packages vramscope builds and tests with,
# those missing only (apt-get update first, as a fresh machine needs). The README's first
# command and .ci/run both run it, so the two cannot drift. Uses sudo when not root.
#
#   scripts/install_deps.sh            # build + tests + benchmarks (what the README needs)
#   scripts/install_deps.sh --ci       # also clang + libFuzzer for the fuzz preset (.ci/run)
set -euo pipefail

packages=(cmake g++ make ninja-build python3 pkg-config          # ninja: what pip install . builds with
          libgtest-dev libgmock-dev libbenchmark-dev         # tests, benchmarks
          libcli11-dev nlohmann-json3-dev libfmt-dev libopenblas-dev
          python3-pytest python3-jsonschema                  # the Python package's tests, model files' schema
          python3-venv)                                      # pip install . into a virtual environment
if [[ "${1:-}" == "--ci" ]]; then
  packages+=(clang libclang-rt-14-dev)                       # clang + libFuzzer for the fuzz preset
elif [[ -n "${1:-}" ]]; then
  echo "usage: scripts/install_deps.sh [--ci]" >&2
  exit 2
fi

missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install_deps: every package is installed" >&2
  exit 0
fi
command -v apt-get >/dev/null || {
  echo "install_deps: no apt-get here; install the equivalents of: ${missing[*]}" >&2
  exit 1
}
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo"
echo "install_deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
