# Sourced by scripts/run.sh and scripts/test.sh: create .venv inside the repo once, then reuse it.
# torch==2.13.0 first and only when missing, so a build installed into .venv beforehand (the CPU wheel,
# or a CUDA build matching the host) is kept; otherwise pip's configured index picks it (docs/cpu.md).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# shellcheck disable=SC1091
source .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
