"""Points of a save where a test run's processes stop or die, set by the run's environment.

``VERL_TEST_SAVE_POINT``: one of ``on_save_phase``'s phases (in whichever process runs it: the rank or an
async save's fork), ``fork_start`` (the first instant of a process a rank forks: the async save's fork) or
``writer`` (one of megatron's dist-checkpoint writer processes: killed before it writes, paused once its file is
written and reported) or ``generate`` (a rank's vLLM rollout mid-generation: once the engine's first step of a
``generate`` call has sampled; every call counts, a validation's too: a rank's second call is ``2``);
``VERL_TEST_SAVE_RANKS``: the ranks it applies to (``0,1``); ``VERL_TEST_SAVE_NTH``: the how-manieth time a process
reaches the point counts (default 1: a rank's second save is ``2``). There the process records
``<VERL_TEST_SAVE_DIR>/<point>.<rank>.<pid>``, then (``VERL_TEST_SAVE_ACTION``) waits (``pause``) or SIGKILLs
itself (``kill``). Patched in
when the modules load (``arm``), through the manager's public ``on_save_phase`` hook, megatron's writer and
vLLM's public ``LLMEngine.step``.
"""

import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time

POINT, RANKS, ACTION, DIR = "VERL_TEST_SAVE_POINT", "VERL_TEST_SAVE_RANKS", "VERL_TEST_SAVE_ACTION", "VERL_TEST_SAVE_DIR"
NTH = "VERL_TEST_SAVE_NTH"
MANAGER = "verl.utils.checkpoint.checkpoint_manager"
WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
ENGINE = "vllm.v1.engine.llm_engine"


_arrivals = 0  # how often this process reached the point


def reached(point: str) -> None:
    global _arrivals
    rank = os.environ.get("RANK", "")
    if point != os.environ.get(POINT) or rank not in os.environ.get(RANKS, "").split(","):
        return
    _arrivals += 1
    if _arrivals != int(os.environ.get(NTH, "1")):
        return
    with open(os.path.join(os.environ[DIR], f"{point}.{rank}.{os.getpid()}"), "w"):
        pass
    if os.environ.get(ACTION) == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def _patch_manager(module) -> None:
    original = module.BaseCheckpointManager.on_save_phase

    def on_save_phase(self, phase: str) -> None:
        _hold_forks()
        reached(phase)
        original(self, phase)

    module.BaseCheckpointManager.on_save_phase = on_save_phase


def _patch_writer(module) -> None:
    original = module.FileSystemWriterAsync.write_preloaded_data

    def write_preloaded_data(*args, **kwargs):
        if os.environ.get(ACTION) == "kill":  # before it reports done: a writer killed after that harms nothing
            reached("writer")
        original(*args, **kwargs)
        reached("writer")  # a paused writer holds its parent in megatron's wait, as the survivors were

    module.FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)


def _patch_engine(module) -> None:
    original = module.LLMEngine.step
    generating = False  # within a burst of steps that ends with no request unfinished: one ``generate`` call

    def step(self):
        nonlocal generating
        outputs = original(self)
        if not generating:  # the first step of a call has sampled; its requests go on (unless it ended them all)
            generating = True
            reached("generate")
        if not self.has_unfinished_requests():
            generating = False
        return outputs

    module.LLMEngine.step = step


class _Patcher(importlib.abc.MetaPathFinder):
    patches = {MANAGER: _patch_manager, WRITER: _patch_writer, ENGINE: _patch_engine}

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.patches[name](module)

        spec.loader.exec_module = exec_module
        return spec


_forks_held = False


def _hold_forks() -> None:
    """``fork_start``, from the first save phase on: after the hook ``verl.utils.process_lifetime`` installed when
    the rank started, which runs first in the child, as it does whatever other fork hooks a process has."""
    global _forks_held
    if os.environ.get(POINT) == "fork_start" and not _forks_held:
        os.register_at_fork(after_in_child=lambda: reached("fork_start"))
        _forks_held = True


def arm() -> None:
    sys.meta_path.insert(0, _Patcher())
