#!/usr/bin/env bash
# Start a Ray head on loopback, submit the trainer to it as a Ray job, wait for the job, stop the head.
#
#   bash scripts/ray_job_submit.sh [main_ppo overrides...]
#
# The head listens on 127.0.0.1 only, so token authentication is switched off for it and for the
# submission (RAY_AUTH_MODE=disabled). The submission is the usual one:
#
#   ray job submit --address http://127.0.0.1:$RAY_DASHBOARD_PORT -- python -m verl.trainer.main_ppo ...
#
# and main_ppo joins the cluster through the RAY_ADDRESS the job runs with. Only the head this script
# started is stopped at the end (its process group); `ray stop` would stop every Ray instance on the
# machine. Environment: RAY_PORT (GCS, default 6390), RAY_DASHBOARD_PORT (default 8265), RAY_NUM_CPUS
# (default: all), RAY_TEMP_DIR (default: a new directory under /tmp). Checkpoints go to
# checkpoints/verl_megatron_ckpt/ray_job unless trainer.default_local_dir is given. The model is built
# through mbridge (vanilla_mbridge=True, as scripts/run.sh: this stack has no Megatron-Bridge); an override
# after it wins.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
source scripts/venv.sh
python -c "import verl.trainer.main_ppo" 2>/dev/null || python -m pip install -q -e .

export RAY_AUTH_MODE=disabled
gcs_port=${RAY_PORT:-6390}
dashboard_port=${RAY_DASHBOARD_PORT:-8265}
num_cpus=${RAY_NUM_CPUS:-$(nproc)}
temp_dir=${RAY_TEMP_DIR:-$(mktemp -d /tmp/ray_job.XXXXXX)}
address="http://127.0.0.1:${dashboard_port}"
free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# The head in a session of its own, so that stopping it stops everything it started.
# Nothing is left to drain once the job is over: stop without Ray's 30 s drain on SIGTERM.
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 setsid ray start --head --block --node-ip-address=127.0.0.1 --port="$gcs_port" --num-cpus="$num_cpus" \
  --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$dashboard_port" \
  --dashboard-agent-listen-port="$(free_port)" --dashboard-agent-grpc-port="$(free_port)" \
  --ray-client-server-port="$(free_port)" --metrics-export-port="$(free_port)" \
  --runtime-env-agent-port="$(free_port)" --temp-dir="$temp_dir" --disable-usage-stats \
  >"$temp_dir/head.log" 2>&1 &
head_pid=$!
stop_head() {
  # SIGTERM to `ray start --block` shuts its processes down; whatever of its group is left after 30 s
  # is killed.
  kill -TERM "$head_pid" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 -- "-$head_pid" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$head_pid" 2>/dev/null || true
}
trap stop_head EXIT

echo "[ray_job_submit] head: GCS 127.0.0.1:${gcs_port}, dashboard ${address}, logs ${temp_dir}"
for _ in $(seq 1 120); do
  if ray job list --address "$address" >/dev/null 2>&1; then break; fi
  kill -0 "$head_pid" 2>/dev/null || { cat "$temp_dir/head.log"; echo "[ray_job_submit] the head did not start" >&2; exit 1; }
  sleep 1
done

job_id="verl_main_ppo_$(date +%s)_$$"
# The dashboard answers before the head's job agent has registered with it; until then a submission is
# refused with "No available agent to submit job" (after the head waited 10 s for one). Submit without waiting,
# retrying only that refusal until 90 s have passed (a submission that reached the head is not repeated: its id
# is then known), then follow the job's logs.
submitted=0
retry_until=$((SECONDS + 90))
while :; do
  if out=$(ray job submit --no-wait --address "$address" --submission-id "$job_id" \
      --runtime-env-json "{\"env_vars\": {\"PYTHONPATH\": \"${repo}\"}}" \
      -- python -m verl.trainer.main_ppo actor_rollout_ref.actor.megatron.vanilla_mbridge=True \
      "trainer.default_local_dir=${repo}/checkpoints/verl_megatron_ckpt/ray_job" "$@" 2>&1); then
    submitted=1; break
  fi
  ray job status --address "$address" "$job_id" >/dev/null 2>&1 && { submitted=1; break; }
  grep -q "No available agent" <<<"$out" && [ "$SECONDS" -lt "$retry_until" ] || break
  sleep 2
done
if [ "$submitted" != 1 ]; then
  echo "$out" >&2
  echo "[ray_job_submit] the job was not accepted by ${address}: see the error above and ${temp_dir}/head.log" >&2
  exit 1
fi
echo "[ray_job_submit] submitted ${job_id}"
ray job logs --address "$address" --follow "$job_id"

status=$(python -c 'import sys
from ray.job_submission import JobSubmissionClient
print(JobSubmissionClient(sys.argv[1]).get_job_status(sys.argv[2]).value)' "$address" "$job_id")
echo "[ray_job_submit] job ${job_id}: ${status}"
[ "$status" = "SUCCEEDED" ]
