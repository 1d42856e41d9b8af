"""``ProfilerConfig`` with upstream verl's name, fields and defaults: a role's ``profiler`` node.

Config only: no profiler runs here, so upstream's configs and the code that merges a role's profiler settings
with another's (``union`` / ``intersect``) load and behave as upstream's; the trainer lists set profiler keys
at start as having no effect.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from verl.base_config import BaseConfig

__all__ = ["ProfilerConfig"]


def _ranks(owner: str, name: str, value: Any) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set)):
        raise ValueError(f"{owner}.{name} must be a list of ranks, got {value!r}")
    if any(isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 for rank in value):
        raise ValueError(f"{owner}.{name} must hold ranks (integers >= 0), got {value!r}")
    return sorted(value) if isinstance(value, set) else list(value)


@dataclasses.dataclass
class ProfilerConfig(BaseConfig):
    """A role's profiler settings.

    Args:
        tool: the profiling tool's name (upstream's: nsys, npu, torch, torch_memory, precision_debugger).
        enable: profile this role; all_ranks / ranks: on every rank, or on these.
        save_path: where the traces go; tool_config / global_tool_config: the tool's own settings.
        relocate_results: move traces a framework writes elsewhere into save_path.
        finish_hook_cmd / finish_hook_all_ranks / finish_hook_ranks: a shell command run once after the last
            profiled step, on every rank or on these.
    """

    tool: str | None = None
    enable: bool = False
    all_ranks: bool = False
    ranks: list[int] = dataclasses.field(default_factory=list)
    save_path: str | None = None
    tool_config: Any = None
    global_tool_config: Any = None
    relocate_results: bool = False
    finish_hook_cmd: str | None = None
    finish_hook_all_ranks: bool = False
    finish_hook_ranks: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("ranks", "finish_hook_ranks"):
            self._normalize(name, _ranks(owner, name, getattr(self, name)))
        for name in ("enable", "all_ranks", "relocate_results", "finish_hook_all_ranks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be true or false, got {getattr(self, name)!r}")
        if self.finish_hook_cmd is not None and not isinstance(self.finish_hook_cmd, str):
            raise ValueError(f"{owner}.finish_hook_cmd must be a shell command or null, got {self.finish_hook_cmd!r}")

    def _same_tool(self, other: ProfilerConfig, operation: str) -> None:
        if self.tool != other.tool:
            raise ValueError(f"cannot {operation} profiler settings of different tools: {self.tool!r} and {other.tool!r}")

    def union(self, other: ProfilerConfig) -> ProfilerConfig:
        """Profile what either profiles (the same tool; this one's save_path and tool_config)."""
        self._same_tool(other, "union")
        return ProfilerConfig(
            tool=self.tool, enable=self.enable or other.enable, all_ranks=self.all_ranks or other.all_ranks,
            ranks=sorted(set(self.ranks) | set(other.ranks)), save_path=self.save_path, tool_config=self.tool_config,
            global_tool_config=self.global_tool_config or other.global_tool_config,
            relocate_results=self.relocate_results or other.relocate_results,
            finish_hook_cmd=self.finish_hook_cmd or other.finish_hook_cmd,
            finish_hook_all_ranks=self.finish_hook_all_ranks or other.finish_hook_all_ranks,
            finish_hook_ranks=sorted(set(self.finish_hook_ranks) | set(other.finish_hook_ranks)),
        )  # fmt: skip

    def intersect(self, other: ProfilerConfig) -> ProfilerConfig:
        """Profile what both profile (the same tool; this one's save_path and tool_config)."""
        self._same_tool(other, "intersect")
        return ProfilerConfig(
            tool=self.tool, enable=self.enable and other.enable, all_ranks=self.all_ranks and other.all_ranks,
            ranks=sorted(set(self.ranks) & set(other.ranks)), save_path=self.save_path, tool_config=self.tool_config,
            global_tool_config=self.global_tool_config or other.global_tool_config,
            relocate_results=self.relocate_results and other.relocate_results,
            finish_hook_cmd=self.finish_hook_cmd or other.finish_hook_cmd,
            finish_hook_all_ranks=self.finish_hook_all_ranks and other.finish_hook_all_ranks,
            finish_hook_ranks=sorted(set(self.finish_hook_ranks) & set(other.finish_hook_ranks)),
        )  # fmt: skip
