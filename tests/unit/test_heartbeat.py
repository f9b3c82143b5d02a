"""Liveness of multi-process mode's children (:mod:`batcher.heartbeat`): a child's heartbeat, and which children the
supervisor kills as stalled (:meth:`batcher.supervisor.Supervisor._kill_stalled`), on clocks the test sets."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from types import SimpleNamespace

import pytest

from batcher.config import ServerConfig
from batcher.heartbeat import Heartbeat, beat
from batcher.supervisor import Supervisor


def test_a_heartbeat_is_stalled_only_past_the_timeout_and_never_before_its_first_beat():
    hb = Heartbeat()
    assert hb.stalled(1000.0, 30) is None  # still starting
    hb.set(100.0)
    assert hb.stalled(130.0, 30) is None
    assert hb.stalled(130.5, 30) == pytest.approx(30.5)
    hb.close()
    hb.close()


def _beat_in_child(hb: Heartbeat, when: float) -> None:
    hb.set(when)


def test_a_short_stall_timeout_still_kills():
    """stall_timeout_s 3 (the least allowed) with the supervisor's checks 0.5-1 s apart: checks are not skipped
    as the supervisor's own stall (with half the timeout alone as that bound, every check was skipped at 1 s)."""
    child = _child("engine-cpu", 96.0)
    sup = _supervisor([child], 3, checked_at=99.0)
    Supervisor._kill_stalled(sup, 100.0)
    assert child.process.killed


def test_stall_timeout_s_below_3_is_refused():
    with pytest.raises(ValueError, match="greater than or equal to 3"):
        ServerConfig(stall_timeout_s=1)


def test_a_heartbeat_passed_to_a_spawned_child_is_the_same_memory_and_not_in_dev_shm():
    hb = Heartbeat()
    assert all("/dev/shm/" not in os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))
    child = mp.get_context("spawn").Process(target=_beat_in_child, args=(hb, 1234.5))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert hb.last == 1234.5
    hb.close()


async def test_beat_writes_the_clock_until_cancelled():
    hb = Heartbeat()
    ticks = iter([5.0, 6.0, 7.0])
    task = asyncio.get_running_loop().create_task(beat(hb, clock=lambda: next(ticks), interval_s=0))
    while hb.last < 6.0:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hb.last in (6.0, 7.0)
    hb.close()


class _Process:
    def __init__(self, pid: int) -> None:
        self.pid, self.killed = pid, False

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout: float) -> None:
        pass


def _child(name: str, last_beat: float, ready: bool = True, started_at: float = 95.0) -> SimpleNamespace:
    hb = Heartbeat()
    hb.set(last_beat)
    return SimpleNamespace(name=name, process=_Process(len(name)), alive=True, is_ready=ready, heartbeat=hb,
                           started_at=started_at)


def _supervisor(children: list, timeout: float | None, checked_at: float, stopping: str | None = None):
    return SimpleNamespace(server=ServerConfig(stall_timeout_s=timeout), stopping=stopping, _checked_at=checked_at,
                           engines=children[:1], frontends=children[1:])


def test_the_supervisor_kills_the_children_whose_heartbeat_is_older_than_stall_timeout_s_loading_or_ready():
    """A child stuck while it loads its models (not ready yet) is killed too (a new user's report: a restarted
    engine process stopped while loading kept its models 503 for good); one that has not beaten yet is not, nor
    one that beat within the timeout; during a drain (SIGTERM) too (its requests then get 503 at once)."""
    children = [_child("engine-cpu", 60.0), _child("frontend-0", 99.0), _child("frontend-1", 60.0, ready=False),
                _child("frontend-2", 99.0, ready=False), _child("frontend-3", 0.0, ready=False)]
    sup = _supervisor(children, 30, checked_at=99.5, stopping="drain")
    Supervisor._kill_stalled(sup, 100.0)
    assert [c.process.killed for c in children] == [True, False, True, False, False]
    assert sup._checked_at == 100.0


@pytest.mark.parametrize("case", ["the supervisor itself did not run", "after SIGINT", "never"])
def test_no_child_is_killed_when_the_supervisor_stalled_after_sigint_or_when_the_check_is_off(case):
    child = _child("engine-cpu", 10.0)
    timeout, checked_at, stopping = 30, 99.5, None
    if case == "the supervisor itself did not run":
        checked_at = 80.0  # its last check 20 s ago, more than half the timeout: every heartbeat looks old
    elif case == "after SIGINT":
        stopping = "now"
    else:
        timeout = None
    sup = _supervisor([child], timeout, checked_at, stopping)
    Supervisor._kill_stalled(sup, 100.0)
    assert not child.process.killed
    assert sup._checked_at == 100.0
    Supervisor._kill_stalled(sup, 100.5)  # the next check: killed unless stopping or off
    assert child.process.killed == (case == "the supervisor itself did not run")


def test_a_child_that_never_beats_is_killed_first_beat_s_after_its_start():
    """Stuck before its first beat (a new user stopped an engine process 0.3 s after its spawn: the server never
    came up, or a restarted one never came back): killed FIRST_BEAT_S (or stall_timeout_s, if longer) after its
    start; one starting within that is left alone."""
    from batcher.supervisor import FIRST_BEAT_S

    stuck = _child("engine-cpu", 0.0, ready=False, started_at=100.0 - FIRST_BEAT_S - 1)
    starting = _child("frontend-0", 0.0, ready=False, started_at=100.0 - FIRST_BEAT_S + 1)
    sup = _supervisor([stuck, starting], 30, checked_at=99.5)
    Supervisor._kill_stalled(sup, 100.0)
    assert [c.process.killed for c in (stuck, starting)] == [True, False]
