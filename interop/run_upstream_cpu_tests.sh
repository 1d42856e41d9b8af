#!/usr/bin/env bash
# Every upstream verl *_on_cpu.py test file that imports a module this package has at the same path (the frozen
# list in interop/upstream_tests.py), against THIS package, one result line per file:
#   bash interop/run_upstream_cpu_tests.sh [UPSTREAM_GIT_DIR] [--json OUT] [--only SUBSTRING] [pytest args...]
# See interop/upstream_tests.sh and docs/upstream-interop.md.
exec bash "$(dirname "$0")/upstream_tests.sh" cpu "$@"
