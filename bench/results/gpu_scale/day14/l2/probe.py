"""The host's CPU speed now: seconds of a fixed pure-Python loop, once alone (best of 3), then in 16 processes at
once (each one's best of 3): ``alone=0.185 all16=min/median/max``. Run between benchmark steps to see whether the
machine's cores slow down over a lease."""
import multiprocessing as mp
import statistics
import time


def work(_=None) -> float:
    best = 1e9
    for _ in range(3):
        t, s = time.perf_counter(), 0
        for i in range(3_000_000):
            s += i * i % 7
        best = min(best, time.perf_counter() - t)
    return best


if __name__ == "__main__":
    alone = work()
    with mp.Pool(16) as pool:
        each = sorted(pool.map(work, range(16)))
    print(f"alone={alone:.3f} all16={each[0]:.3f}/{statistics.median(each):.3f}/{each[-1]:.3f} "
          f"sum_speed={sum(alone / t for t in each):.1f}", flush=True)
