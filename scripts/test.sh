#!/usr/bin/env bash
# Create or reuse .venv, install the package with its test extras on requirements.txt's exact stack (setup.py
# declares ranges; the suite runs the pinned releases, transformers 5.19 with vLLM's CPU build), then lint and run the
# whole suite.
# Beside it, the transformers 4.57 leg: the same stack but transformers 4.57 and no vLLM in .venv-transformers4,
# running the tests of fix 1, fix 2, the model families, the HF names and one CLI save and resume
# (TRANSFORMERS4_TESTS); then the Python 3.12 leg: requirements-py312.txt's stack (megatron-core 0.18,
# Megatron-Bridge, torch 2.14) in .venv-py312, running PY312_TESTS; then the main leg's second lane
# (MAIN_SECOND_LANE). Their venvs install at the lowest CPU priority; their tests run while the main leg's other
# files do (other_legs says why). With arguments (pytest's), only the main leg runs, on them.
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

TRANSFORMERS4_TESTS=(
  tests/test_megatron_utils.py                 # fix 1
  tests/test_megatron_checkpoint_manager.py    # fix 2, resume
  tests/test_model_families.py                 # parity, export, resume per family
  tests/test_transformers_versions.py          # the HF files' names
  tests/test_parallel_hf_export.py
  "tests/test_resume_schedules_cli.py::test_a_run_resumed_from_a_saved_step_equals_the_uninterrupted_one[cosine-bf16-1rank]"
)
# what checks no transformers behaviour runs on the main leg only: the offload round trips, the optimizer layout refusal
TRANSFORMERS4_DESELECT=(
  tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues
  tests/test_megatron_checkpoint_manager.py::test_distributed_optimizer_state_at_another_layout_is_refused_clearly
)

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
# offload at the 8-rank layout runs on the main leg; here one multi-rank layout (TP2 PP2) with both optimizer settings
PY312_DESELECT=(
  "tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues[DO=True-tp2pp2ep2etp2]"
  "tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues[DO=False-tp2pp2ep2etp2]"
)

# the GPU check from a built bundle and the offload round trips at TP2 PP2 run on the Python 3.12 leg, which leaves the
# 8-rank ones to this leg
MAIN_DESELECT=(
  "tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues[DO=False-tp2pp2]"
  "tests/test_megatron_utils.py::test_offload_reload_is_bit_exact_and_training_continues[DO=True-tp2pp2]"
  tests/test_gpu_check.py::test_the_device_bundle_resolves_offline_under_the_carry_limit
  tests/test_gpu_check.py::test_each_run_installs_one_wheel_of_each_name
  tests/test_gpu_check.py::test_the_check_passes_on_cpu_from_the_bundle
  tests/test_gpu_check.py::test_a_carried_megatron_bridge_that_does_not_import_fails_the_check
)

# The main leg's second lane: these files run in the background once the other legs' tests are done (the main leg
# alone leaves ~30% of the CPU idle), in the main venv; the foreground runs the rest.
MAIN_SECOND_LANE=(
  tests/test_trainer_cli.py
  tests/test_verl091_interop.py
  tests/test_vllm_resume_cli.py
  tests/test_vllm_rollout.py
  tests/test_vllm_stack.py
  tests/test_vpp.py
  tests/test_resume_schedules_cli.py
  tests/test_divergence.py
  tests/test_bf16_resume_cli.py
)

legs_dir="$(mktemp -d)"  # the other legs' output, statuses, times and pytest temporary directories

# lowest_priority: this subshell (pip) takes only the CPU and disk time the tests leave
lowest_priority() {
  renice -n 19 -p "$BASHPID" > /dev/null || true
  ionice -c 2 -n 7 -p "$BASHPID" 2> /dev/null || true
}

# leg_tests NAME VENV ARGS...: a leg's pytest in its venv, its own temporary directory; NAME.status and NAME.seconds
leg_tests() {
  local name=$1 venv=$2 started=$SECONDS status=0
  shift 2
  echo "[test.sh] $name leg ($venv)"
  # shellcheck disable=SC1091
  (source "$venv/bin/activate" && run_pytest --basetemp="$legs_dir/$name-tmp" "$@") || status=$?
  echo "$status" > "$legs_dir/$name.status"
  echo "$((SECONDS - started))" > "$legs_dir/$name.seconds"
}

# other_legs: the transformers 4.57 and Python 3.12 legs, then the main leg's second lane, beside the main leg's
# foreground tests: each venv installs at the lowest priority (the 3.12 one while the 4.57 leg's tests run), the tests
# at the same priority as the foreground's, which alone leave ~30% of the CPU idle (ranks waiting on each other,
# fsyncs, start-ups). A failed install is that leg's status; the lanes after it still run.
other_legs() {
  local started=$SECONDS status=0
  ( lowest_priority; install_transformers4_leg ) > "$legs_dir/transformers4-install.log" 2>&1 || status=$?
  ( lowest_priority; install_py312_leg ) > "$legs_dir/py312-install.log" 2>&1 &
  local py312_install=$!
  installed_leg_tests transformers4 "$status" "$started" .venv-transformers4 "${TRANSFORMERS4_TESTS[@]}" "${TRANSFORMERS4_DESELECT[@]/#/--deselect=}"
  status=0
  wait "$py312_install" || status=$?
  installed_leg_tests py312 "$status" "$started" .venv-py312 "${PY312_TESTS[@]}" "${PY312_DESELECT[@]/#/--deselect=}"
  leg_tests main-lane2 .venv "${MAIN_SECOND_LANE[@]}"
}

# installed_leg_tests NAME INSTALL_STATUS STARTED VENV ARGS...: the leg's tests where its venv installed, else its
# install log and a failed status
installed_leg_tests() {
  local name=$1 installed=$2 started=$3
  shift 3
  echo "[test.sh] $name leg installed (status $installed) by $((SECONDS - started)) s"
  if [ "$installed" -eq 0 ]; then
    leg_tests "$name" "$@"
  else
    cat "$legs_dir/$name-install.log"
    echo "installing the $name leg failed" > "$legs_dir/$name.status"
  fi
}

# kill_tree PID: PID and everything below it (a stopped run leaves no pip or pytest of the other legs behind)
kill_tree() {
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2> /dev/null || true
}

deactivate
( other_legs ) > "$legs_dir/legs.log" 2>&1 &
legs_pid=$!
trap 'kill_tree "$legs_pid"; rm -rf "$legs_dir"' EXIT
# shellcheck disable=SC1091
source .venv/bin/activate

main_status=0
run_pytest --durations=40 "${MAIN_SECOND_LANE[@]/#/--ignore=}" "${MAIN_DESELECT[@]/#/--deselect=}" || main_status=$?
main_seconds=$((SECONDS - main_started))
deactivate

echo "[test.sh] main leg's first lane done; waiting for the other legs and its second lane"
legs_status=0
wait "$legs_pid" || legs_status=$?
cat "$legs_dir/legs.log"
status_of() { cat "$legs_dir/$1.status" 2> /dev/null || echo "not run"; }
seconds_of() { cat "$legs_dir/$1.seconds" 2> /dev/null || echo 0; }
echo "[test.sh] main leg (transformers 5.19, vLLM): status $main_status, ${main_seconds} s (its install included)," \
  "second lane status $(status_of main-lane2), $(seconds_of main-lane2) s; transformers 4.57 leg: status" \
  "$(status_of transformers4), $(seconds_of transformers4) s; Python 3.12 leg: status $(status_of py312), $(seconds_of py312) s;" \
  "all legs: $SECONDS s (the other legs and the second lane ran beside the main leg's first lane)"
[ "$legs_status" -eq 0 ] && [ "$main_status" -eq 0 ] && [ "$(status_of main-lane2)" = 0 ] \
  && [ "$(status_of transformers4)" = 0 ] && [ "$(status_of py312)" = 0 ]
