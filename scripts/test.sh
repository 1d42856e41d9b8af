#!/usr/bin/env bash
# Create or reuse .venv, install the package with its test extras on requirements.txt's exact stack (setup.py
# declares ranges; the suite runs the pinned releases, transformers 5.19 with vLLM's CPU build), then lint and run the
# whole suite.
# Then the transformers 4.57 leg: the same stack but transformers 4.57 and no vLLM in .venv-transformers4, running the
# tests of fix 1, fix 2, the model families, the HF names and one CLI save and resume (TRANSFORMERS4_TESTS).
# Then the Python 3.12 leg: requirements-py312.txt's stack (megatron-core 0.18, Megatron-Bridge, torch 2.14) in
# .venv-py312, running PY312_TESTS. The two other legs' venvs install, at the lowest CPU priority, while
# the main leg's tests run. With arguments (pytest's), only the main leg runs, on them.
set -euo pipefail
cd "$(dirname "$0")/.."
main_started=$SECONDS  # each leg's time is printed at the end
source scripts/venv.sh
install_stack -e ".[test]"  # requirements.txt and requirements-vllm.txt (vLLM's CPU build)
ruff check verl tests scripts benchmarks interop

# run_pytest ARGS...: pytest's status, but "collected nothing" (5) is a failure.
run_pytest() {
  set +e
  python -m pytest -q -p no:cacheprovider "$@"
  local status=$?
  set -e
  if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests" >&2
    return 1
  fi
  return "$status"
}

if [ $# -gt 0 ]; then
  run_pytest "$@"
  exit $?
fi

# install_transformers4_leg: .venv-transformers4, requirements.txt only (requirements-vllm.txt, vLLM's CPU build,
# needs transformers >=5.16.1) with transformers 4.57
install_transformers4_leg() {
  local python=.venv-transformers4/bin/python
  if [ ! -x "$python" ]; then
    python3 -m venv .venv-transformers4
    "$python" -m pip install -q --upgrade pip
  fi
  "$python" -c "import torch" 2>/dev/null || "$python" -m pip install -q "torch==2.13.0"
  "$python" -m pip install -q -r <(grep -v '^transformers' requirements.txt) "transformers==4.57.6" -e ".[test]"
}

# install_py312_leg: .venv-py312 as a GPU user installs it (README): the stack with verl, then megatron-bridge
# without its declared dependencies (requirements-py312.txt says why; tests/test_declared_ranges.py holds setup.py's
# ranges to this stack). pyenv's 3.12 where there is one (these machines), else python3.12 on PATH.
install_py312_leg() {
  local python=.venv-py312/bin/python
  if [ ! -x "$python" ]; then
    local py312
    py312="$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3"
    [ -x "$py312" ] || py312=python3.12
    "$py312" -m venv .venv-py312
    "$python" -m pip install -q --upgrade pip
  fi
  "$python" -c "import torch" 2>/dev/null || "$python" -m pip install -q "$(grep '^torch==' requirements-py312.txt | cut -d' ' -f1)"
  "$python" -m pip install -q -r <(grep -v '^megatron-bridge' requirements-py312.txt) -e . "pytest>=8"
  "$python" -m pip install -q --no-deps "$(grep '^megatron-bridge' requirements-py312.txt | cut -d' ' -f1)"
}

legs_log="$(mktemp)"
legs_started=$SECONDS
(
  renice -n 19 -p "$BASHPID" > /dev/null || true  # the main leg's ranks come first; pip takes what they leave
  ionice -c 2 -n 7 -p "$BASHPID" 2> /dev/null || true
  deactivate
  install_transformers4_leg
  echo "[test.sh] transformers 4.57 leg installed after $((SECONDS - legs_started)) s"
  install_py312_leg
  echo "[test.sh] Python 3.12 leg installed after $((SECONDS - legs_started)) s"
) > "$legs_log" 2>&1 &
legs_pid=$!
trap 'pkill -P "$legs_pid" 2> /dev/null; kill "$legs_pid" 2> /dev/null || true' EXIT  # a stopped run leaves no pip behind

main_status=0
# the GPU check from a built bundle and the offload round trips at TP2 PP2 run on the Python 3.12 leg (below), which
# leaves the 8-rank ones to this leg
MAIN_DESELECT=(
  "tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues[DO=False-tp2pp2]"
  "tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues[DO=True-tp2pp2]"
  tests/test_gpu_check.py::test_the_device_bundle_resolves_offline_under_the_carry_limit
  tests/test_gpu_check.py::test_each_run_installs_one_wheel_of_each_name
  tests/test_gpu_check.py::test_the_check_passes_on_cpu_from_the_bundle
  tests/test_gpu_check.py::test_a_carried_megatron_bridge_that_does_not_import_fails_the_check
)
run_pytest --durations=40 "${MAIN_DESELECT[@]/#/--deselect=}" || main_status=$?
main_seconds=$((SECONDS - main_started))
deactivate

legs_status=0
wait "$legs_pid" || legs_status=$?
trap - EXIT
cat "$legs_log"
rm -f "$legs_log"
if [ "$legs_status" -ne 0 ]; then
  echo "[test.sh] installing the transformers 4.57 and Python 3.12 legs failed (status $legs_status); main leg: status $main_status" >&2
  exit 1
fi

TRANSFORMERS4_TESTS=(
  tests/test_megatron_utils.py                 # fix 1
  tests/test_megatron_checkpoint_manager.py    # fix 2, resume
  tests/test_model_families.py                 # parity, export, resume per family
  tests/test_transformers_versions.py          # the HF files' names
  tests/test_parallel_hf_export.py
  "tests/test_resume_schedules_cli.py::test_a_sigterm_stopped_and_resumed_run_equals_the_uninterrupted_one[cosine-bf16-1rank]"
)
# what checks no transformers behaviour runs on the main leg only: the offload round trips, the optimizer layout refusal
TRANSFORMERS4_DESELECT=(
  tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues
  tests/test_megatron_checkpoint_manager.py::test_distributed_optimizer_state_at_another_layout_is_refused_clearly
)
tf4_started=$SECONDS
echo "[test.sh] transformers 4.57 leg (.venv-transformers4): ${#TRANSFORMERS4_TESTS[@]} test files/cases"
# shellcheck disable=SC1091
source .venv-transformers4/bin/activate
tf4_status=0
run_pytest "${TRANSFORMERS4_TESTS[@]}" "${TRANSFORMERS4_DESELECT[@]/#/--deselect=}" || tf4_status=$?
deactivate
tf4_seconds=$((SECONDS - tf4_started))

PY312_TESTS=(
  tests/test_cpu_runtime.py                    # the CPU runtime on megatron-core 0.18 and torch 2.14
  tests/test_internals_contract.py             # every private internal verl reads, as 0.18 has it
  tests/test_internals_capability.py
  tests/test_megatron_utils.py                 # fix 1, both optimizer settings (model build through mbridge on 0.18)
  tests/py312/test_megatron_bridge.py          # Megatron-Bridge: HF -> Megatron -> HF bit-identical, logits = transformers'
  tests/py312/test_megatron_bridge_fix2.py     # fix 2 against Megatron-Bridge's own HF save, PP2 EP2, both orders
  tests/py312/test_megatron_bridge_engine.py   # the engine through Megatron-Bridge: dist save/resume/reshard/async, across bridges
  tests/py312/test_megatron_bridge_vpp.py      # VPP2 at PP2 through Megatron-Bridge: every chunk saved, exact resume
  tests/py312/test_megatron_bridge_cli.py      # CLI GRPO on the default bridge, TP1 PP2 EP2 ETP1: trains, saves, SIGTERM-stopped and resumed exactly, exports
  # the GPU check's CPU run from the device's own bundle: both megatron-core releases, Megatron-Bridge's lines
  tests/test_gpu_check.py::test_the_device_bundle_resolves_offline_under_the_carry_limit
  tests/test_gpu_check.py::test_each_run_installs_one_wheel_of_each_name
  tests/test_gpu_check.py::test_the_check_passes_on_cpu_from_the_bundle
  tests/test_gpu_check.py::test_a_carried_megatron_bridge_that_does_not_import_fails_the_check
)
py312_started=$SECONDS
echo "[test.sh] Python 3.12 leg (.venv-py312): ${#PY312_TESTS[@]} test files/cases"
# shellcheck disable=SC1091
source .venv-py312/bin/activate
py312_status=0
# offload at the 8-rank layout runs on the main leg; here one multi-rank layout (TP2 PP2) with both optimizer settings
PY312_DESELECT=(
  "tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues[DO=True-tp2pp2ep2etp2]"
  "tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues[DO=False-tp2pp2ep2etp2]"
)
run_pytest "${PY312_TESTS[@]}" "${PY312_DESELECT[@]/#/--deselect=}" || py312_status=$?
py312_seconds=$((SECONDS - py312_started))
echo "[test.sh] main leg (transformers 5.19, vLLM): status $main_status, ${main_seconds} s; transformers 4.57 leg: status $tf4_status, ${tf4_seconds} s;" \
  "Python 3.12 leg: status $py312_status, ${py312_seconds} s (the main leg's time includes its install; the other legs' tests only, installed beside it)"
[ "$main_status" -eq 0 ] && [ "$tf4_status" -eq 0 ] && [ "$py312_status" -eq 0 ]
