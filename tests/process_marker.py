"""Find and stop every process a test run started, however deep, by a marker in its environment."""

import os

import psutil

MARKER = "VERL_TEST_RUN"


def kill_marked(marker: str) -> None:
    """Kill every process whose environment carries ``marker``: what a SIGKILLed run leaves behind, e.g.
    the multiprocessing Manager megatron's dist-checkpoint writer spawns in each rank (~290 MB each),
    which outlives a rank that dies without cleaning up."""
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(MARKER) == marker:
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
