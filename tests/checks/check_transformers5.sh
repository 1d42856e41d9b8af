#!/usr/bin/env bash
# The bridge adapter on transformers 5: verl 0.9.1 asks for transformers >= 5.5.3, while this
# project pins 4.57. Makes a separate venv OUTSIDE the repository (default ~/.cache/verl-tf5-venv, or $TF5_VENV)
# with requirements.txt's stack but transformers >= 5.5, then runs tests/checks/check_model_families.py there:
# every family's Megatron log-probs against transformers 5's in fp32 and the HF round trip (load through
# the bridge, export, bit-exact), on 1 rank and at TP2 EP2. Results: docs/models.md ("transformers 5").
#
#   bash tests/checks/check_transformers5.sh [--json FILE]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${TF5_VENV:-$HOME/.cache/verl-tf5-venv}"
case "$(realpath -m "$VENV")" in "$(pwd)"/*) echo "TF5_VENV must lie outside the repository" >&2; exit 2 ;; esac
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  grep -v '^transformers' requirements.txt > "$VENV/requirements-tf5.txt"
  "$VENV/bin/python" -m pip install -q -r "$VENV/requirements-tf5.txt" "transformers>=5.5"
fi
"$VENV/bin/python" -c "import transformers; from packaging.version import Version; assert Version(transformers.__version__) >= Version('5.5'), transformers.__version__"
FAMILIES=(mixtral qwen2_moe qwen3_moe qwen3_moe-dense-layers llama qwen2 qwen3)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$VENV/bin/python" -m tests.checks.check_model_families --no-resume --kinds "${FAMILIES[@]}" "$@" || status=1
"$VENV/bin/python" -m tests.checks.check_model_families --no-resume --tp 2 --ep 2 --kinds mixtral qwen2_moe qwen3_moe "$@" || status=1
exit $status
