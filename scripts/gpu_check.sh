#!/usr/bin/env bash
# The GPU check, offline, once per megatron-core release carried in the bundle (docs/gpu.md):
#   bash scripts/gpu_check.sh --device cuda --out DIR      on the GPU host (bundle: .gpu_bundle/cp312)
#   bash scripts/gpu_check.sh --device cpu --out DIR       here: gloo, .gpu_bundle/cp<this python>
# Build the bundle first, where PyPI is reachable: python scripts/gpu_bundle.py.
# For each megatron_core-*.whl of the bundle: pip install --no-index --no-deps --target <dir> of that wheel, the
# others at the bundle's top and those of megatron-core-<version>/ (Megatron-Bridge with the megatron-core release
# the Python 3.12 leg tests it with), then scripts/gpu_check.py with PYTHONPATH=<dir>:<repo> (a venv made from the host's python would not
# see its torch). --device cpu runs the interpreter with -S and, beside the bundle, only links to its own copies of
# the GPU host's packages (scripts/gpu_device_stack.json), so the CPU run imports what the GPU host has.
# DIR/megatron-core-<version>/result.{json,md} per release, DIR/summary.{md,json}: one table. Exit 1 on a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEVICE="" OUT="" BUNDLE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --bundle) BUNDLE="$2"; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1; use --device cuda|cpu --out DIR [--bundle DIR]" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check.sh: --device cuda|cpu is required" >&2; exit 2 ;; esac
[ -n "$OUT" ] || { echo "gpu_check.sh: --out DIR is required (on the device tool: --out \"\$OUT\")" >&2; exit 2; }
BUNDLE="${BUNDLE:-.gpu_bundle/cp$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')}"
shopt -s nullglob
MEGATRON=("$BUNDLE"/megatron_core-*.whl)
OTHERS=()
for wheel in "$BUNDLE"/*.whl; do
  case "$(basename "$wheel")" in megatron_core-*) ;; *) OTHERS+=("$wheel") ;; esac
done
if [ ${#MEGATRON[@]} -eq 0 ]; then
  echo "gpu_check.sh: no megatron_core wheel in $BUNDLE; build it with: python scripts/gpu_bundle.py (carry .gpu_bundle)" >&2
  exit 2
fi
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/verl_gpu_check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
FLAGS=()
SITE=""
if [ "$DEVICE" = cpu ]; then
  "$PY" scripts/gpu_bundle.py --device-site "$WORK/site"
  FLAGS=(-S)
  SITE=":$WORK/site"
fi
# install TARGET WHEEL...: pip without an index; a python without pip gets the wheels unpacked, which is all pip
# does with these (no scripts, no compiled steps).
install() {
  local target=$1
  shift
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-index --no-deps --target "$target" "$@"
  else
    for w in "$@"; do "$PY" -m zipfile -e "$w" "$target"; done
  fi
}
status=0
for wheel in "${MEGATRON[@]}"; do
  version="$(basename "$wheel" | cut -d- -f2)"
  target="$WORK/megatron-core-$version"
  install "$target" "${OTHERS[@]}" "$wheel" "$BUNDLE/megatron-core-$version"/*.whl
  echo "[gpu_check] megatron-core $version: installed into $target"
  PYTHONPATH="$target:$PWD$SITE" "$PY" "${FLAGS[@]}" scripts/gpu_check.py --device "$DEVICE" \
    --out "$OUT/megatron-core-$version" --work "$WORK/run-$version" --no-table || status=1
done
"$PY" scripts/gpu_check.py --summarize "$OUT" || status=1
exit $status
