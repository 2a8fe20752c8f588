"""``faults.short_cause``: the few words a run's failure line ends with, read off real dead actors
and failed tasks of the session's Ray (and, for a lost node, off the reason Ray's GCS writes)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from raytrain_mp.faults import ABRUPT, actor_death, short_cause


@ray.remote(num_cpus=0)
class Victim:
    def pid(self) -> int:
        return os.getpid()

    def wait(self) -> None:
        time.sleep(60)


@ray.remote(num_cpus=0)
def raises() -> None:
    raise ValueError("bad value\nsecond line")


def cause_of(kill) -> str:
    """The short cause of a call in flight on a ``Victim`` when ``kill(actor, pid)`` ends it."""
    victim = Victim.remote()
    pid = ray.get(victim.pid.remote())
    call = victim.wait.remote()
    kill(victim, pid)
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(call, timeout=60)
    return short_cause(info.value)


def test_a_dead_actor_says_why_in_a_few_words(ray_session):
    assert cause_of(lambda actor, pid: ray.kill(actor)) == "its actor died: killed by ray.kill"
    assert cause_of(lambda actor, pid: os.kill(pid, signal.SIGKILL)) == f"its actor died: {ABRUPT}"


def test_an_exception_raised_inside_is_its_type_and_first_line(ray_session):
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(raises.remote(), timeout=60)
    assert short_cause(info.value) == "ValueError: bad value"


def test_the_reasons_ray_writes_for_a_lost_node_an_owner_an_exit_code_and_an_unknown_one():
    headline = "The actor died unexpectedly before finishing this task.\n\tclass_name: StageWorker\n\tactor_id: 3ce7\n"
    assert actor_death(headline + "The actor died because its node has died. Node Id: 5f35") == "node lost"
    assert actor_death(headline + "The actor is dead because its owner has died. Owner Id: 01") == "its owner died"
    sigterm = (
        "its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker exits unexpectedly. "
    )
    assert (
        actor_death(headline + sigterm + "Worker exits with an exit code 1. The process receives a SIGTERM.")
        == "exit code 1 (SIGTERM)"
    )
    assert actor_death("Something new.\nmore") == "Something new."
