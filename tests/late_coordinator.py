"""A Ray Train callback for ``RAY_TRAIN_CALLBACKS`` (``module.Class``, made in the driver as a run
starts): it puts in place of Ray's autoscaling coordinator one that answers after Ray Train's 5 s
wait, as the real one does while it is still starting on a loaded machine."""

from __future__ import annotations

import time

import ray
from ray.train.v2._internal.execution.callback import RayTrainCallback

ANSWER_AFTER_S = 6.0


class _LateCoordinator:
    def request_resources(self, **request) -> None:
        time.sleep(ANSWER_AFTER_S)

    def cancel_request(self, **request) -> None:
        time.sleep(ANSWER_AFTER_S)


class LateCoordinator(RayTrainCallback):
    def __init__(self) -> None:
        # Ray Train's controller gets the coordinator by this name (get_if_exists): it finds this one.
        ray.remote(num_cpus=0)(_LateCoordinator).options(
            name="AutoscalingCoordinator", namespace="AutoscalingCoordinator", lifetime="detached", get_if_exists=True
        ).remote()
