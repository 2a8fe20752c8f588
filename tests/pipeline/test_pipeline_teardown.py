"""``teardown.stop_actors``: once it returns, the actors are dead, also one that was never placed."""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import ActorDiedError

from raytrain_mp.pipeline.teardown import stop_actors


def test_stop_actors_returns_once_every_actor_is_dead(ray_session: object) -> None:
    @ray.remote(num_cpus=0)
    class Idle:  # defined here so that Ray ships it by value: workers cannot import test modules
        def ready(self) -> bool:
            return True

    running = [Idle.remote() for _ in range(2)]
    assert ray.get([actor.ready.remote() for actor in running]) == [True, True]
    never_placed = Idle.options(resources={"no_such_resource": 1}).remote()
    actors = [*running, never_placed]
    assert stop_actors(actors) == []
    for actor in actors:  # a call sent right after is refused, never run on a live actor
        with pytest.raises(ActorDiedError):
            ray.get(actor.ready.remote(), timeout=10)
    assert stop_actors(actors) == []  # stopping twice is harmless
