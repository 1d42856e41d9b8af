"""A worker whose rank is part of a Megatron layout: joins torch.distributed and megatron parallel state."""

from __future__ import annotations

import os

from verl.single_controller.base.worker import Worker
from verl.utils.megatron.parallel import ParallelSizes


def is_output_rank(info: dict) -> bool:
    """Whether the rank described by ``info`` (``get_megatron_rank_info``) answers for its data-parallel group:
    TP rank 0, CP rank 0, last pipeline stage (where the outputs are). One rule, because the worker group
    returns that rank's result and the worker runs the rollout there: the two must pick the same rank."""
    return info["tp_rank"] == 0 and info["cp_rank"] == 0 and info["pp_rank"] == info["pp_size"] - 1


class MegatronWorker(Worker):
    def init_megatron(self, sizes: ParallelSizes, seed: int, timeout_s: float) -> None:
        """Join the process group (gloo on CPU hosts) and initialise megatron-core's parallel state; a subclass
        calls it once, in its constructor, before building a model.

        Runs ``cpu_runtime.enable()`` first (inside ``init_rank``); it does nothing on a GPU host.
        """
        import torch

        from verl.utils.device import get_device_name, get_torch_device
        from verl.utils.distributed import init_rank

        threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # already set in this process
            pass
        device_index = None
        if get_device_name() != "cpu":
            # Ray hands each actor its own GPU (one visible device); without that isolation, LOCAL_RANK.
            device_index = 0 if get_torch_device().device_count() == 1 else self.local_rank
        init_rank(self.rank, self.world_size, sizes, seed, timeout_s, device_index=device_index)

    def get_megatron_rank_info(self) -> dict:
        """This rank's place in the Megatron layout (the worker group dispatches data by it)."""
        from megatron.core import parallel_state as mpu

        pp_rank, pp_size = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
        return {
            "rank": self.rank,
            "tp_rank": mpu.get_tensor_model_parallel_rank(),
            "tp_size": mpu.get_tensor_model_parallel_world_size(),
            "pp_rank": pp_rank,
            "pp_size": pp_size,
            "cp_rank": mpu.get_context_parallel_rank(),
            "cp_size": mpu.get_context_parallel_world_size(),
            "dp_rank": mpu.get_data_parallel_rank(),
            "dp_size": mpu.get_data_parallel_world_size(),
        }

    def _is_output_rank(self) -> bool:
        """Whether this rank answers for its data-parallel group (``is_output_rank``)."""
        return is_output_rank(self.get_megatron_rank_info())
