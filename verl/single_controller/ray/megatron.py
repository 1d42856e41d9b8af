"""A Ray worker group of Megatron ranks: data goes to data-parallel groups, results come from their output ranks."""

from __future__ import annotations

from typing import Any

import ray

from verl.single_controller.base.decorator import Dispatch
from verl.single_controller.base.megatron.worker import is_output_rank
from verl.single_controller.ray.base import RayWorkerGroup


class MegatronRayWorkerGroup(RayWorkerGroup):
    """``RayWorkerGroup`` whose workers are ``MegatronWorker``s; adds ``Dispatch.MEGATRON_COMPUTE``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank_info: list[dict] = self.execute_all_sync("get_megatron_rank_info")
        self.dp_size = self.rank_info[0]["dp_size"]
        self.tp_size = self.rank_info[0]["tp_size"]
        self.pp_size = self.rank_info[0]["pp_size"]
        self.cp_size = self.rank_info[0]["cp_size"]
        # Per DP rank, the rank whose result stands for its group.
        self._output_rank = {info["dp_rank"]: info["rank"] for info in self.rank_info if is_output_rank(info)}

    def dispatch(self, method: str, mode: Dispatch, *args: Any, **kwargs: Any) -> list:
        if mode is not Dispatch.MEGATRON_COMPUTE:
            return super().dispatch(method, mode, *args, **kwargs)
        for value in (*args, *kwargs.values()):
            if not isinstance(value, (list, tuple)) or len(value) != self.dp_size:
                raise ValueError(f"{method}: every argument must be a list of {self.dp_size} entries (one per DP rank)")
        dp_of_rank = [info["dp_rank"] for info in self.rank_info]
        # One object per DP rank in the object store, however many ranks share it.
        args = tuple([ray.put(item) for item in value] for value in args)
        kwargs = {key: [ray.put(item) for item in value] for key, value in kwargs.items()}
        results = self.execute_per_rank(
            method,
            *([a[dp] for dp in dp_of_rank] for a in args),
            **{k: [v[dp] for dp in dp_of_rank] for k, v in kwargs.items()},
        )
        return [results[self._output_rank[dp]] for dp in range(self.dp_size)]
