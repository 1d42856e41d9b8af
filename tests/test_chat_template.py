"""The chat template's renderer process: it dies with the driver and never keeps the checkpoint directory locked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from verl.utils.checkpoint.dir_lock import lock_checkpoint_dir

_ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"

# A driver that holds the writer lock of argv[1] and renders one prompt through an endless template; it prints its
# renderer's pid once the renderer runs.
_DRIVER = f"""
import sys, threading, time
import psutil
from verl.models.tiny import build_tokenizer
from verl.utils.checkpoint.dir_lock import lock_checkpoint_dir
from verl.utils.dataset.chat_template import render_prompts

lock = lock_checkpoint_dir(sys.argv[1])
tokenizer = build_tokenizer()
tokenizer.chat_template = {_ENDLESS!r}

def report():
    while not psutil.Process().children():
        time.sleep(0.02)
    print(psutil.Process().children()[0].pid, flush=True)

threading.Thread(target=report, daemon=True).start()
list(render_prompts(tokenizer, [[{{"role": "user", "content": "2+2="}}]], {{}}, 100, "the template", "the data"))
"""


def _env() -> dict[str, str]:
    """This checkout's ``verl`` first on the path of a driver started with ``python -c``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_driver_leaves_no_renderer_and_no_lock(tmp_path):
    directory = str(tmp_path / "run")
    env = _env()
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, directory], stdout=subprocess.PIPE, text=True, env=env)
    renderer = int(driver.stdout.readline())
    try:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 3
        while not _gone(renderer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(renderer), "the renderer outlived its driver"
        lock_checkpoint_dir(directory).release()  # raises CheckpointDirBusyError while anything keeps the lock
    finally:
        if not _gone(renderer):
            os.kill(renderer, signal.SIGKILL)


# A driver whose hard address-space limit is lower than the renderer's own cap would be (``ulimit -v``, a batch
# scheduler's h_vmem): its size now plus 512 MiB.
_LIMITED_DRIVER = """
import resource
from verl.models.tiny import build_tokenizer
from verl.utils.dataset.chat_template import render_prompts

tokenizer = build_tokenizer()
tokenizer.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
with open("/proc/self/statm") as handle:
    size = int(handle.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (512 << 20), size + (512 << 20)))
(rendered,) = render_prompts(tokenizer, [[{"role": "user", "content": "2+2="}]], {}, 100, "the template", "the data")
print(rendered.text)
"""


def test_a_template_renders_under_a_hard_memory_limit_lower_than_the_renderers_cap():
    env = _env()
    done = subprocess.run([sys.executable, "-c", _LIMITED_DRIVER], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[2+2=]", done.stderr[-2000:]
