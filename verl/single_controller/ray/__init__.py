from verl.single_controller.ray.base import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerGroupError,
)
from verl.single_controller.ray.megatron import MegatronRayWorkerGroup

__all__ = ["MegatronRayWorkerGroup", "RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "WorkerGroupError"]
