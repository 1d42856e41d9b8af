#!/usr/bin/env bash
# Create or reuse .venv, install the package with its test extras on requirements.txt's exact stack (setup.py
# declares ranges; the suite runs the pinned releases), then lint and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python -m pip install -q -r requirements.txt -e ".[test]"
ruff check verl tests scripts
set +e
python -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$status"
