#!/usr/bin/env bash
# Shared entry of run_upstream_ckpt_tests.sh / run_upstream_cpu_tests.sh: upstream verl's own tests against
# THIS package, per file (interop/upstream_tests.py has the suites and the options; docs/upstream-interop.md).
#
#   bash interop/upstream_tests.sh {ckpt,cpu} [UPSTREAM_GIT_DIR] [options] [extra pytest args...]
#
# UPSTREAM_GIT_DIR, else $VERL_UPSTREAM_GIT_DIR: a git directory (bare or a checkout) of upstream verl holding
# the pinned commit; there is no default. Python: $PYTHON, else this repository's .venv. Not part of CI.
# Exit status: 0 when every collected test passed, 1 otherwise, 2 on bad input.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
if [ ! -x "$PY" ]; then
  echo "no python at $PY: create the venv first (bash scripts/test.sh does) or set PYTHON=" >&2
  exit 2
fi
exec "$PY" "$REPO/interop/upstream_tests.py" "$@"
