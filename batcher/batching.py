"""Pure batching functions: which queued requests form the next batch, stacking inputs, splitting outputs.

No event loop here (after MLServer's ``batching/requests.py``): the scheduler calls these and they are tested
directly.

Rules:

* Only requests whose inputs have identical non-batch shapes and datatypes share a batch (:func:`shape_key`):
  recogniser crops of different widths go to different batches.
* A batch holds at most ``max_batch_size`` rows; a request counts all its rows and is never split.
* The batch is led by the most urgent waiting request - highest priority level, then earliest deadline, then
  queue order (:func:`urgency`); requests with the same key join in that order while they fit (a request that does not
  fit is skipped, not split, and leads a later batch). Waiting longer than a bound promotes a request above every
  priority level, so low priorities are never starved longer than that bound.
* With allowed batch sizes (:mod:`batcher.batch_sizes`), when the queue holds more rows of the key than one batch
  can take and the batch above would be padded, the batch is formed of exactly the allowed size it would be padded
  to where whole requests can fill it: same execution, more real rows, the rest in the next batch.
* With ``preferred_batch_size``, the batch goes at once at the largest preferred size its leading requests reach,
  the rest staying queued (Triton's rule, :func:`preferred_cut`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .batch_sizes import padded_size


def shape_key(inputs: dict[str, np.ndarray]) -> Hashable:
    """Key that is equal for requests that may share a batch: per input, name, dtype and non-batch dims."""
    if len(inputs) == 1:  # most models
        ((name, a),) = inputs.items()
        return ((name, a.dtype.str, a.shape[1:]),)
    return tuple((name, a.dtype.str, a.shape[1:]) for name, a in sorted(inputs.items()))


class State(enum.Enum):
    QUEUED = "queued"
    EXECUTING = "executing"
    DONE = "done"  # answered (expired, cancelled or completed)


@dataclass(eq=False)
class Pending:
    """One request waiting for, or in, a batch.

    Attributes:
        inputs: validated inputs, first dim ``rows``.
        arrival: event-loop monotonic time (s) the request was received.
        deadline: monotonic time (s) after which it must not start executing; None for no deadline.
        future: settled exactly once, with the request's outputs or an error (opaque here).
    """

    inputs: dict[str, np.ndarray]
    rows: int
    key: Hashable
    arrival: float
    deadline: float | None = None
    future: Any = None
    state: State = State.QUEUED
    timer: Any = field(default=None, repr=False)
    #: priority level, 1 = highest (Triton's ``priority`` request parameter; 0 there means "the default level").
    priority: int = 1
    #: held from here while the inputs may be read (:class:`batcher.protocol.Lease`); :meth:`settle` ends the hold.
    lease: Any = field(default=None, repr=False)
    #: the order it reached the queue (the scheduler numbers its requests from 1): first in, first out among
    #: equal level and deadline, as Triton's queue. Arrival times need not agree with it: a request is received
    #: before its body is read, and front-end processes each stamp their own. 0 (unnumbered): arrival decides.
    seq: int = 0

    def __post_init__(self) -> None:
        if self.lease is not None:
            self.lease.acquire()

    def settle(self) -> None:
        """Done with: it left the queue, or its batch ended. Its deadline timer is off and its inputs will not be
        read again (the lease ends)."""
        self.state = State.DONE
        if self.timer is not None:
            self.timer.cancel()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()


def priority_level(priority: int | None, levels: int, default_level: int) -> int:
    """The priority level of a request's ``parameters.priority``: 1..levels as given; none, 0 or above the model's
    levels mean the default level (Triton's rule: clients that always send a priority are never refused)."""
    if priority is None or priority < 1 or priority > levels:
        return default_level
    return priority


def urgency(p: Pending, now: float, starve_after_s: float | None = None) -> tuple[int, float, int, float]:
    """Sort key of the queue: priority level (1 = highest, Triton's convention), then earliest deadline, then
    queue order (:attr:`Pending.seq`), then arrival. A request that has waited ``starve_after_s`` is promoted
    above every level (level 0), which bounds how long lower priorities can be starved."""
    level = p.priority
    if starve_after_s is not None and now - p.arrival >= starve_after_s:
        level = 0
    return level, (p.deadline if p.deadline is not None else math.inf), p.seq, p.arrival


#: :func:`exact_fill` looks at this many of the most urgent requests of the batch's key at most.
EXACT_FILL_CANDIDATES = 256


def plan_batch(
    queue: Iterable[Pending], max_batch_size: int, now: float = 0.0, starve_after_s: float | None = None,
    allowed: Sequence[int] | None = None, presorted: bool = False,
) -> tuple[list[Pending], int]:
    """Choose the next batch from ``queue`` without changing it.

    The most urgent QUEUED request (:func:`urgency`: priority, then earliest deadline, then queue order) leads; other
    QUEUED requests with its shape key join in urgency order while they fit within ``max_batch_size`` rows. With
    ``allowed`` sizes (ascending, the last ``max_batch_size``), when the key's queued rows exceed
    ``max_batch_size`` and that batch's rows are not an allowed size, the batch is instead made of exactly the
    allowed size it would be padded to, if whole requests (the leader among them) can fill it (:func:`exact_fill`).

    ``presorted``: the caller knows ``queue`` is in urgency order already (the scheduler tracks it as requests
    arrive: one priority level and deadlines in arrival order, the common case), so it is not sorted again, and the
    walk stops as soon as the batch holds ``max_batch_size`` rows (a full batch is an allowed size), so that a long
    queue at saturation costs the batch's length, not the queue's.

    Returns:
        ``(batch, rows)``, the batch in urgency order; ``([], 0)`` when nothing is queued.
    """
    if presorted:
        live = []
        key, rows = None, 0
        for p in queue:
            if p.state is not State.QUEUED:
                continue
            if key is None:
                key = p.key
            live.append(p)
            if p.key == key and rows + p.rows <= max_batch_size:
                rows += p.rows
                if rows == max_batch_size:
                    break  # full: the greedy walk below takes exactly these
    else:
        live = sorted((p for p in queue if p.state is State.QUEUED), key=lambda p: urgency(p, now, starve_after_s))
    same = [p for p in live if p.key == live[0].key] if live else []
    batch: list[Pending] = []
    rows = 0
    for p in same:
        if rows + p.rows > max_batch_size:
            if rows == max_batch_size:
                break
            continue
        batch.append(p)
        rows += p.rows
    if allowed and rows not in allowed and sum(p.rows for p in same) > max_batch_size:
        target = min(b for b in allowed if b >= rows)
        exact = exact_fill(same[:EXACT_FILL_CANDIDATES], target)
        if exact is not None:
            return exact, target
    return batch, rows


def exact_fill(candidates: Sequence[Pending], target: int) -> list[Pending] | None:
    """Whole requests whose rows sum to exactly ``target``, ``candidates[0]`` (the leader) among them and the
    others as early in ``candidates`` (urgency order) as possible; None when no such set exists.

    Subset sum over row counts with integers as bit sets: ``reach[i]`` has bit ``s`` set when ``s`` rows can be
    made of the leader and some of ``candidates[1..i]``; the scan stops at the first ``i`` that reaches
    ``target``, and the walk back leaves out every request it can.
    """
    if not candidates or candidates[0].rows > target:
        return None
    mask = (1 << (target + 1)) - 1
    reach = [1 << candidates[0].rows]
    for p in candidates[1:]:
        if reach[-1] >> target & 1:
            break
        reach.append((reach[-1] | reach[-1] << p.rows) & mask)
    if not reach[-1] >> target & 1:
        return None
    chosen, s = [], target
    for i in range(len(reach) - 1, 0, -1):
        if not reach[i - 1] >> s & 1:  # s rows need candidates[i]
            chosen.append(candidates[i])
            s -= candidates[i].rows
    return [candidates[0], *reversed(chosen)]


def batch_is_full(rows: int, max_batch_size: int, preferred_batch_sizes: Sequence[int] = ()) -> bool:
    """Whether ``rows`` of one key are enough for a batch to go now instead of waiting out the queue delay.

    They are at ``max_batch_size`` rows, and at the largest preferred batch size: from there on
    :func:`preferred_cut` always finds a batch to send at once (which may hold fewer rows).
    """
    if rows >= max_batch_size:
        return True
    return bool(preferred_batch_sizes) and rows >= max(preferred_batch_sizes)


def preferred_cut(batch: Sequence[Pending], preferred_batch_sizes: Collection[int]) -> int:
    """How many of ``batch``'s leading requests go at once by the preferred batch sizes; 0: none do (wait).

    Triton's rule (``DynamicBatchScheduler::GetDynamicBatch``, triton-inference-server/core
    ``src/dynamic_batch_scheduler.cc``), walking the batch in order and counting each request's rows:

    * the largest preferred size that the leading requests sum to exactly goes at once, the rest of the batch
      staying queued (preferred [4, 8], 10 rows queued: 8 go);
    * when no preferred size is reached before the next request would pass the largest preferred size, the
      requests before it go at once (3 + 3 + 3 rows with [4, 8]: 6 go), a lone request past it alone;
    * otherwise 0: the batch waits for more requests until its window closes, then goes as it is.

    The caller applies it only while the batch's window is open (or there is no window): Triton sends a batch whose
    queue delay has expired as it is, up to ``max_batch_size`` rows. The sizes may come in any order.
    """
    if not preferred_batch_sizes:
        return 0
    largest = max(preferred_batch_sizes)
    rows = best = 0
    for i, p in enumerate(batch):
        if i and rows + p.rows > largest:
            return best or i
        rows += p.rows
        if rows in preferred_batch_sizes:
            best = i + 1
    return best or (1 if rows > largest else 0)


class BatchTimes:
    """Measured execution seconds per batch size (moving averages, like Triton's per-batch-size statistics) and
    estimates for the sizes not measured yet.

    An estimate is a lower bound wherever it extrapolates, so that admission control (:func:`admission`) refuses
    only work that cannot finish in time, never work that merely might not: execution time grows with rows but
    at most linearly once the fixed cost is paid (``t(n) = a + b * n`` with ``a, b >= 0``), so

    * between two measured sizes, linear interpolation (exact for that model);
    * above the largest measured size ``m``: ``t(m)`` (a batch is never faster with more rows);
    * below the smallest measured size ``m``: ``t(m) * n / m`` (the fixed cost is not assumed).
    """

    def __init__(self, alpha: float = 0.2, allowed: Sequence[int] | None = None) -> None:
        """``allowed``: the allowed batch sizes; a batch of ``n`` rows then runs (and is estimated) at
        :func:`~batcher.batch_sizes.padded_size` rows."""
        self.alpha = alpha
        self.allowed = tuple(allowed) if allowed else None
        self.by_size: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        """One executed batch of ``rows`` rows (padding rows included) took ``seconds``."""
        old = self.by_size.get(rows)
        self.by_size[rows] = seconds if old is None else old + self.alpha * (seconds - old)

    def estimate(self, rows: int) -> float | None:
        """Seconds one batch of ``rows`` rows should take; None before any batch ran."""
        if not self.by_size:
            return None
        if rows <= 0:
            return 0.0
        rows = padded_size(rows, self.allowed)
        if rows in self.by_size:
            return self.by_size[rows]
        below = [n for n in self.by_size if n < rows]
        above = [n for n in self.by_size if n > rows]
        if below and above:
            lo, hi = max(below), min(above)
            t_lo, t_hi = self.by_size[lo], self.by_size[hi]
            return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        if below:
            return self.by_size[max(below)]
        hi = min(above)
        return self.by_size[hi] * rows / hi

    def drain(self, ahead_rows: int, max_batch_size: int, contexts: int) -> float | None:
        """Seconds until ``ahead_rows`` rows (queued and executing) are done: full batches of ``max_batch_size``
        and one remainder batch, spread over ``contexts``. None before any batch ran."""
        full, rest = divmod(ahead_rows, max_batch_size)
        t_full, t_rest = self.estimate(max_batch_size), self.estimate(rest)
        if t_full is None or t_rest is None:
            return None
        return (full * t_full + t_rest) / contexts


#: seconds a window closed for a deadline leaves beside the batch's estimated time: the timer that closes it, the
#: hand-off to the context's thread and the deadline check there (:func:`batcher.batch_steps.stage_batch`) all come
#: a little after it. A fresh user's 20 ms deadlines in a 50 ms window were all 504: the window closed at exactly
#: the deadline less the estimate, so any lateness dropped the batch, and before any batch had run (no estimate)
#: the deadline was not looked at at all.
DEADLINE_MARGIN_S = 0.002


def window_wait(now: float, first_arrival: float, delay_s: float, earliest_deadline: float | None = None,
                batch_seconds: float | None = None) -> float:
    """Seconds a batch may still wait for more requests (<= 0: dispatch now).

    The window opens at the batch's first request (Triton's ``max_queue_delay_microseconds``, after Ray Serve's
    ``batch_wait_timeout_s``: the wait starts at the first request, not at the call); it closes early when the
    batch's earliest deadline needs the time left to execute the batch (``batch_seconds``, estimated; 0 before
    any batch has run) and :data:`DEADLINE_MARGIN_S`. A wait under one microsecond (the window's unit) is 0: float
    rounding of ``arrival + delay - now`` would otherwise leave waits of ~1e-18 s that a clock cannot advance by.
    """
    wait = first_arrival + delay_s - now
    if earliest_deadline is not None:
        wait = min(wait, earliest_deadline - now - (batch_seconds or 0.0) - DEADLINE_MARGIN_S)
    return wait if wait >= 1e-6 else 0.0


def arrival_may_end_window(now: float, window_end: float | None, deadline: float | None, queued_rows: int,
                           max_batch_size: int, preferred_batch_sizes: Sequence[int], priority_levels: int) -> bool:
    """Whether a request that arrived at ``now`` (with ``deadline``) must wake the batcher to look at the queue again.

    Always, unless the batcher is waiting out a batch window that ends at ``window_end`` and has not ended: then the
    window's timer wakes it, and an arrival matters only if it may close the window sooner. The window closes when
    the batch reaches the maximum or a preferred size (:func:`preferred_cut`; either takes at least the smallest of
    them in rows, and the batch's rows are at most the ``queued_rows``) or at ``first arrival + delay``
    (:func:`window_wait`), earlier for a deadline. The newest arrival cannot move its own shape's first arrival
    earlier, so only its deadline or, with ``priority_levels`` above 1, a batch led by another shape's older
    requests can. Not waking saves the batcher a task switch, a re-plan and a new timer per arrival.
    """
    return (window_end is None or now >= window_end or deadline is not None or priority_levels > 1
            or queued_rows >= min((max_batch_size, *preferred_batch_sizes)))


def worth_waiting(mean_gap_s: float, delay_s: float) -> bool:
    """Whether holding a batch open for up to ``delay_s`` is likely to gather another request (the rule of
    ``adaptive_queue_delay``).

    When requests arrive on average more than two windows apart, a lone request would almost always wait the
    whole window for nothing, so it runs at once. At load, gaps shrink below the window and batches form as
    configured.
    """
    return delay_s > 0 and mean_gap_s < 2 * delay_s


#: weight of the newest gap in the moving average of inter-arrival times (adaptive_queue_delay).
GAP_EWMA_ALPHA = 0.2


@dataclass
class ArrivalGaps:
    """The moving average of a queue's inter-arrival times that :func:`worth_waiting` reads: an exponentially
    weighted mean (weight :data:`GAP_EWMA_ALPHA` for the newest gap), each gap capped at 1 s so one quiet spell
    does not outweigh a burst.

    Attributes:
        mean_s: the mean gap, seconds; 0.0 ("busy") before the second arrival.
        last: the latest arrival, event-loop seconds; None before the first.
    """

    mean_s: float = 0.0
    last: float | None = None

    def arrive(self, t: float) -> None:
        """Count an arrival at event-loop time ``t`` (seconds)."""
        if self.last is not None:
            self.mean_s += GAP_EWMA_ALPHA * (min(t - self.last, 1.0) - self.mean_s)
        self.last = t


class Verdict(enum.Enum):
    """Admission control's answer for a request (:func:`admission`)."""

    ADMIT = "admit"
    LATE = "late"  #: its deadline has passed already (504)
    CANNOT_FINISH = "cannot_finish"  #: the work ahead cannot drain in time (503 + Retry-After)


def admission(now: float, deadline: float, rows: int, ahead_rows: int, times: BatchTimes, max_batch_size: int,
              contexts: int) -> tuple[Verdict, float]:
    """Whether a request of ``rows`` rows can finish before ``deadline`` behind ``ahead_rows`` rows.

    Finished in time means: the rows ahead and its own drained before the deadline (:meth:`BatchTimes.drain`, a
    lower bound where it extrapolates). Without an estimate (no batch ran yet) every request is admitted.

    Returns:
        the verdict and the estimated drain time of the rows ahead, in seconds (0.0 without an estimate).
    """
    drain = times.drain(ahead_rows, max_batch_size, contexts)
    if drain is None:
        return Verdict.ADMIT, 0.0
    if now >= deadline:
        return Verdict.LATE, drain
    if now + times.drain(ahead_rows + rows, max_batch_size, contexts) > deadline:
        return Verdict.CANNOT_FINISH, drain
    return Verdict.ADMIT, drain


def stack_inputs(
    batch: Sequence[Pending], buffer: Callable[[str, tuple[int, ...], np.dtype], np.ndarray | None] | None = None,
    padded_rows: int | None = None,
    gather: Callable[[str, list[np.ndarray], int], Any] | None = None,
) -> dict[str, Any]:
    """Concatenate the batch's inputs along the batch dim.

    Args:
        buffer: optional ``(name, shape, dtype) -> array | None`` giving the array to stack into (a GPU
            context's pinned staging buffer, see ``ExecutionContext.host_buffer``), saving one copy.
        padded_rows: the first dim of the result (an allowed batch size >= the batch's rows): the rows past the
            requests' are zeros (empty strings for BYTES). Default: the requests' rows.
        gather: optional ``(name, parts, rows) -> RowParts | None`` (``ExecutionContext.gather_rows``): a context
            that reads the requests' arrays where they lie takes them unstacked (no host copy at all).

    Without a buffer and padding a lone request's inputs are passed through uncopied.
    """
    out: dict[str, Any] = {}
    rows = sum(p.rows for p in batch)
    total = rows if padded_rows is None else padded_rows
    for name, first in batch[0].inputs.items():
        shape = (total, *first.shape[1:])
        if gather is not None and first.dtype != object:
            parts = gather(name, [p.inputs[name] for p in batch], total)
            if parts is not None:
                out[name] = parts
                continue
        target = None
        if buffer is not None and first.dtype != object:
            target = buffer(name, shape, first.dtype)
        if target is None and total == rows:
            out[name] = first if len(batch) == 1 else np.concatenate([p.inputs[name] for p in batch], axis=0)
            continue
        if target is None:
            target = np.empty(shape, first.dtype)
        np.concatenate([p.inputs[name] for p in batch], axis=0, out=target[:rows])
        target[rows:] = b"" if first.dtype == object else 0
        out[name] = target
    return out


def split_outputs(outputs: dict[str, np.ndarray], row_counts: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Split each output along the batch dim back into the requests' shares, in order.

    Returns views, not copies.

    Raises:
        ValueError: an output's first dimension is not the batch's total rows (a broken engine).
    """
    total = sum(row_counts)
    for name, arr in outputs.items():
        if arr.ndim == 0 or arr.shape[0] != total:
            raise ValueError(f"output '{name}' has shape {list(arr.shape)}, expected {total} rows first")
    parts = []
    start = 0
    for n in row_counts:
        parts.append({name: arr[start : start + n] for name, arr in outputs.items()})
        start += n
    return parts
