"""What becomes of an inference request after the data plane queued it (:mod:`batcher.dataplane`): its outcome
counted later by a transport that learns it later (:class:`CountedLater`), a request queued without a task of
its own (:class:`Started`, from :meth:`DataPlane.start_infer`), and the requests in flight that the SIGTERM drain
waits for (:class:`Inflight`). Counting itself stays in one place, ``DataPlane._count``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from .errors import BatcherError
from .protocol import InferRequest, InferResponse

if TYPE_CHECKING:
    from .dataplane import DataPlane
    from .slots import ModelSlot
    from .scheduler import ModelRunner

log = logging.getLogger(__name__)

#: the message a request's task is cancelled with when the front-end process holding it died (counted ``dropped``).
FRONTEND_LOST = "front end lost"
#: the message a request is cancelled with when its front end answered 504 itself, the engine process not having
#: answered by the request's deadline (:meth:`batcher.remote.EngineLink.overdue`; counted ``timeout``).
OVERDUE = "overdue"


#: the message a request is cancelled with when its front end answered 503 itself at the end of SIGTERM's grace
#: (:meth:`batcher.frontend.RemoteDataPlane.shed`; counted ``rejected``, as a request shed in one process).
SHED = "shed"


#: the message a request is cancelled with when its engine process closes the connection itself (SIGTERM to that
#: process, its grace over): its front end answers 503 and counts it ``rejected`` (an engine process lost,
#: :class:`batcher.remote.EngineLost`), so the engine process does not count it (:data:`NOT_COUNTED`).
ENGINE_STOPPING = "engine stopping"
#: the "reason" of an outcome that another process counts: :meth:`batcher.dataplane.DataPlane._count` skips it.
NOT_COUNTED = "not counted"


def cancel_reason(message: str | None) -> str:
    """The failure reason a request cancelled with ``message`` is counted under: ``dropped``
    (:data:`FRONTEND_LOST`), ``timeout`` (:data:`OVERDUE`), ``rejected`` (:data:`SHED`), :data:`NOT_COUNTED`
    (:data:`ENGINE_STOPPING`), else ``canceled`` (its client went away)."""
    return {FRONTEND_LOST: "dropped", OVERDUE: "timeout", SHED: "rejected",
            ENGINE_STOPPING: NOT_COUNTED}.get(message, "canceled")


class CountedLater:
    """What a ``deliver`` returns when its transport learns the answer's fate only later (an engine process: its
    front end's acknowledgement): :meth:`DataPlane.infer` then counts nothing and returns it, and the transport
    calls :meth:`settle` exactly once - ``None`` (delivered) or the failure's reason (``timeout``: too late,
    ``canceled``, ``dropped``, ...). The answer is counted then, on the version that answered, from the request's
    arrival, as it would have been after ``deliver`` returned. Saves the engine process a wake-up of the request's
    task per request."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: Callable[[str | None], None] | None = None

    def bind(self, count: Callable[[str | None], None]) -> None:
        """Called by the data plane as soon as ``deliver`` returned this, before anything else runs on the loop
        (so before any message that could settle it is read)."""
        self._count = count

    def settle(self, reason: str | None) -> None:
        """The answer's outcome (None: delivered). Only the first call counts."""
        count, self._count = self._count, None
        if count is not None:
            count(reason)


class Started:
    """A request :meth:`DataPlane.start_infer` queued: its pins (the model version, shared-memory regions, the
    drain's count) are given back and its outcome handed over and counted once, when its future settles."""

    __slots__ = ("_dp", "_slot", "_runner", "_received", "_deadline", "_request", "_held", "_pending", "_deliver",
                 "_fail", "_reason", "_task")

    def __init__(self, dp: DataPlane, slot: ModelSlot, runner: ModelRunner, received: float,
                 deadline: float | None, request: InferRequest, held: Any, pending: Any,
                 deliver: Callable[[InferResponse], CountedLater], fail: Callable[[BaseException | None], None]
                 ) -> None:
        self._dp, self._slot, self._runner = dp, slot, runner
        self._received, self._deadline, self._request, self._held = received, deadline, request, held
        self._pending, self._deliver, self._fail = pending, deliver, fail
        self._reason: str | None = None  # set by cancel(): how the request ends, whatever its batch did
        self._task: asyncio.Task | None = None

    def cancel(self, reason: str | None = None) -> None:
        """The client went away (``reason``: :func:`cancel_reason`'s message): a queued request is never executed;
        counted under :func:`cancel_reason` and ended without an answer - also when its batch has ended and the
        answer is not handed over yet - unless its outcome was handed over already."""
        if self._pending is None or self._reason is not None:  # its outcome was handed over, or cancelled before
            return
        self._reason = cancel_reason(reason)
        self._runner.withdraw(self._pending)
        if self._task is not None:
            self._task.cancel()

    def _done(self, fut: asyncio.Future) -> None:
        self._dp.router.release(self._slot)
        if fut.cancelled() or self._reason is not None:
            self._end(self._reason or "canceled", None)
            return
        exc = fut.exception()
        if exc is not None:
            self._end(exc.reason if isinstance(exc, BatcherError) else "other", exc)
            return
        outputs = fut.result()
        held = self._held
        try:
            if held is not None and held.writes and not held.write_now(outputs):  # a large output: in a thread
                self._task = asyncio.get_running_loop().create_task(held.write(outputs))
                self._task.add_done_callback(partial(self._written, outputs))  # runs even if cancelled unstarted
                return
        except BatcherError as exc:  # an output larger than its region
            self._end(exc.reason, exc)
            return
        except Exception as exc:  # a bug
            log.exception("model %s: writing an output to shared memory failed", self._slot.name)
            self._end("other", exc)
            return
        self._answer(outputs)

    def _written(self, outputs: dict[str, Any], task: asyncio.Task) -> None:
        """The end of :meth:`Hold.write` for a large output (in a thread): answer, or end as it went."""
        if task.cancelled() or self._reason is not None:
            self._end(self._reason or "canceled", None)
            return
        exc = task.exception()
        if isinstance(exc, BatcherError):
            self._end(exc.reason, exc)
        elif exc is not None:
            log.error("model %s: writing an output to shared memory failed", self._slot.name, exc_info=exc)
            self._end("other", exc)
        else:
            self._answer(outputs)

    def _answer(self, outputs: dict[str, Any]) -> None:
        slot = self._slot
        try:
            later = self._deliver(InferResponse(slot.name, slot.version, outputs, self._request, self._deadline))
        except Exception as exc:  # a bug in the transport
            log.exception("model %s: handing over an answer failed", slot.name)
            self._end("other", exc)
            return
        self._release()
        later.bind(partial(self._dp._count, slot, received=self._received))

    def _end(self, reason: str, error: BaseException | None) -> None:
        """Not answered: count ``reason``, give the pins back, tell the transport."""
        fail = self._fail
        self._release()
        self._dp._count(self._slot, reason, self._received)
        fail(error)

    def _release(self) -> None:
        """Give the pins back and drop the request: nothing here keeps its inputs (views of a shared-memory
        region that its client may unregister next) or the transport's callbacks (which refer back to this)."""
        if self._held is not None:
            self._held.release()
            self._held = None
        self._pending = self._request = self._deliver = self._fail = None
        self._dp._inflight.leave()


class Inflight:
    """Accepted inference requests not yet answered, and the SIGTERM drain that waits for them."""

    def __init__(self) -> None:
        self.count = 0
        self._quiet = asyncio.Event()  # set while count is 0
        self._quiet.set()

    def enter(self) -> None:
        self.count += 1
        self._quiet.clear()

    def leave(self) -> None:
        self.count -= 1
        if not self.count:
            self._quiet.set()

    async def wait_quiet(self, grace_s: float) -> None:
        """Until no request is in flight, at most ``grace_s`` seconds."""
        try:
            await asyncio.wait_for(self._quiet.wait(), grace_s)
        except asyncio.TimeoutError:
            pass
