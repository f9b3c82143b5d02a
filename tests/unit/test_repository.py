"""The model repository and its router in-process: Triton states, load strategies, the LRU budget, pinning, versions, fallback.

Models are loaded by :class:`fakes.FakeLoader` (no file; each counts a chosen number of MB), on a virtual clock.
"""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from fakes import MiB, FakeLoader

from batcher.config import parse_config
from batcher.errors import ConfigError, ModelNotFound, Unavailable
from batcher.lru import Candidate, NoRoom, choose_victims
from batcher.metrics import Metrics
from batcher.repository import LOADING, READY, UNAVAILABLE, ModelRepository
from batcher.routing import Router

pytestmark = pytest.mark.looptime


class Repo(ModelRepository):
    """The repository with its router's acquire/release, as the data plane uses them."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.router = Router(self)
        self.acquire, self.release = self.router.acquire, self.router.release


def repo(models: list[dict], loader: FakeLoader | None = None, **server) -> tuple[Repo, FakeLoader]:
    loader = loader or FakeLoader()
    config = parse_config({"server": server, "models": [{"path": "unused.onnx", **m} for m in models]})
    return Repo(config, Metrics(), loader=loader), loader


def states(r: ModelRepository) -> dict[str, str]:
    return {f"{s.name}:{s.version}": s.state for s in r.all()}


async def test_eager_loads_every_served_version_at_start():
    r, loader = repo([{"name": "a"}, {"name": "b"}])
    await r.start()
    assert states(r) == {"a:1": READY, "b:1": READY} and loader.loads == ["a", "b"]
    assert [e["event"] for e in r.lifecycle.events] == ["load", "load"]
    await r.close()
    assert states(r) == {"a:1": UNAVAILABLE, "b:1": UNAVAILABLE}


async def test_eager_start_fails_on_a_broken_model_and_releases_the_others():
    r, _ = repo([{"name": "a"}, {"name": "b"}], FakeLoader(fail={"b"}))
    with pytest.raises(ConfigError, match="broken on purpose"):
        await r.start()
    assert r.slot("a").loaded is None and r.slot("b").failed


async def test_lazy_loads_on_first_use_and_concurrent_requests_share_one_load():
    r, loader = repo([{"name": "a"}], load_strategy="lazy")
    await r.start()
    slot = r.slot("a")
    assert slot.state == UNAVAILABLE
    got = await asyncio.gather(*(r.acquire(slot) for _ in range(5)))
    assert loader.loads == ["a"] and all(s is slot for s in got) and slot.inflight == 5
    for s in got:
        r.release(s)
    await r.close()


async def test_on_cold_reject_answers_503_while_the_load_runs():
    r, _ = repo([{"name": "a"}], load_strategy="lazy", on_cold="reject")
    with pytest.raises(Unavailable, match="is loading"):
        await r.acquire(r.slot("a"))
    assert r.slot("a").state == LOADING
    await asyncio.sleep(0.1)
    assert r.slot("a").state == READY
    await r.close()


async def test_lru_evicts_the_least_recently_used_idle_model_to_stay_within_budget():
    r, _ = repo([{"name": n} for n in "abc"], FakeLoader({"a": 40, "b": 40, "c": 40}),
                load_strategy="lru", memory_budget_mb=100)
    for name in "abc":
        r.release(await r.acquire(r.slot(name)))
        await asyncio.sleep(1)
        assert r.used_bytes <= 100 * MiB
    assert states(r) == {"a:1": UNAVAILABLE, "b:1": READY, "c:1": READY}
    assert [(e["event"], e["model"]) for e in r.lifecycle.events] == [
        ("load", "a"), ("load", "b"), ("evict", "a"), ("load", "c")]
    await r.close()


async def test_lru_evicts_one_large_model_where_plain_lru_would_evict_two():
    """Issue 11: small a (20 MB) and b (20 MB) are older than big c (60 MB); d needs 60 MB in a 110 MB budget.
    Plain LRU would evict a and b (40 MB, not enough) and then c; the size-aware rule evicts c alone."""
    r, _ = repo([{"name": n} for n in "abcd"], FakeLoader({"a": 20, "b": 20, "c": 60, "d": 60}),
                load_strategy="lru", memory_budget_mb=110)
    for name in "abc":
        r.release(await r.acquire(r.slot(name)))
        await asyncio.sleep(1)
    r.release(await r.acquire(r.slot("d")))
    assert states(r) == {"a:1": READY, "b:1": READY, "c:1": UNAVAILABLE, "d:1": READY}
    assert [e["model"] for e in r.lifecycle.events if e["event"] == "evict"] == ["c"]
    await r.close()


async def test_the_heap_is_trimmed_before_a_first_load_not_before_a_reload(monkeypatch):
    """Issue 11: a trim between an eviction and a reload made the reload fault every page back in. A first load
    still follows a trimmed heap (its growth is what it counts); a reload reuses the evicted model's heap."""
    trims = []
    r, loader = repo([{"name": n, "memory_mb": 60} for n in "ab"], FakeLoader({"a": 60, "b": 60}),
                     load_strategy="lru", memory_budget_mb=100)
    monkeypatch.setattr("batcher.repository.trim_heap", lambda: trims.append(len(loader.loads)))
    for name in "aba":
        r.release(await r.acquire(r.slot(name)))
        await asyncio.sleep(1)
    assert [(e["event"], e["model"]) for e in r.lifecycle.events] == [
        ("load", "a"), ("evict", "a"), ("load", "b"), ("evict", "b"), ("load", "a")]
    assert trims == [1]  # after a's first load, before b's; none before a's reload
    await r.close()


async def test_a_reload_of_the_same_file_counts_at_least_what_its_first_load_measured():
    """A repository-API load with a new config measures the new load beside the old one, in the heap the old one
    holds: tiny_cnn grew 0.37 MB there against 42.6 MB at its first load (a new user's report), which under lru
    would let models past the budget. The same file keeps its first load's figure as a floor; another file counts
    what its own load measured."""
    loader = FakeLoader({"a": 60})
    r, _ = repo([{"name": "a", "max_batch_size": 4}], loader)
    await r.start()
    slot = r.slot("a")
    assert slot.measured_bytes == 60 * MiB
    loader.sizes_mb["a"] = 1  # what the new load's growth shows beside the old one
    await r.reload(slot, slot.cfg.model_copy(update={"max_batch_size": 8}))
    assert slot.cfg.max_batch_size == 8 and slot.measured_bytes == 60 * MiB
    await r.reload(slot, slot.cfg.model_copy(update={"path": "other.onnx"}))
    assert slot.measured_bytes < 60 * MiB  # another file: its own load's figure
    await r.close()


def instances(cfg, n: int):
    """``cfg`` with ``n`` CPU contexts."""
    from batcher.model_config import InstanceGroup

    return cfg.model_copy(update={"instance_group": [InstanceGroup(count=n)]})


async def test_a_reload_makes_room_for_its_estimate_and_gives_back_a_load_over_the_budget():
    """A repository-API reload is held to the memory budget as a first load is (it was not: a reload to 12
    instances went 2x past the budget, and one more with 64 intra-op threads had the kernel kill the server, a new
    user's report). Room is made for its estimate first (what the model counts, scaled by the instances added):
    idle models are evicted, and what cannot fit is a 503 with the old load serving on. A new load measured over
    the budget after all is given back."""
    loader = FakeLoader({"a": 30, "b": 30})
    r, _ = repo([{"name": "a"}, {"name": "b"}], loader, load_strategy="lru", memory_budget_mb=100)
    for name in "ab":
        r.release(await r.acquire(r.slot(name)))
    a = r.slot("a")
    old_loaded = a.loaded
    with pytest.raises(Unavailable, match=re.escape("model 'a' needs 120 MB, more than the whole memory budget (100 MB)")):
        await r.reload(a, instances(a.cfg, 4))  # 4 x 30 MB: more than the whole budget
    assert a.cfg.instances == 1 and a.loaded is old_loaded and a.state == READY
    await r.reload(a, instances(a.cfg, 3))  # 90 MB beside b's 30: b (idle) is evicted to make room
    assert a.cfg.instances == 3 and states(r) == {"a:1": READY, "b:1": UNAVAILABLE}
    assert [(e["event"], e["model"]) for e in r.lifecycle.events][-2:] == [("evict", "b"), ("load", "a")]
    old_loaded = a.loaded
    loader.sizes_mb["a"] = 150  # the new load measures over the budget
    with pytest.raises(Unavailable, match="measured 150 MB and does not fit the memory budget; the old load"):
        await r.reload(a, a.cfg.model_copy(update={"max_batch_size": 4}))
    assert a.loaded is old_loaded and a.cfg.instances == 3 and a.cfg.max_batch_size != 4 and a.state == READY
    assert r.used_bytes <= 100 * MiB
    r.release(await r.acquire(a))
    await r.close()


async def test_a_reload_of_a_version_not_loaded_loads_it_once_with_the_new_config(caplog):
    """A repository-API load with a config of a version not loaded (unloaded, evicted) loads it once, with that
    config (a new user's report: it was loaded as configured first, then again; under lru that first load evicted
    the other models for a config then refused as larger than the whole budget). A config larger than the whole
    budget changes nothing; one that fails to load leaves the old config."""
    loader = FakeLoader({"a": 30, "b": 30})
    r, _ = repo([{"name": "a"}, {"name": "b"}], loader, load_strategy="lru", memory_budget_mb=100)
    for name in "ab":
        r.release(await r.acquire(r.slot(name)))
    a = r.slot("a")
    await r.unload(a)
    loads = len(loader.loads)
    with pytest.raises(Unavailable, match=re.escape("model 'a' version 1 would need about 120 MB with this config, "
                                                    "more than the whole memory budget (100 MB): nothing was changed")):
        await r.reload(a, instances(a.cfg, 4))
    assert states(r) == {"a:1": UNAVAILABLE, "b:1": READY} and len(loader.loads) == loads
    assert a.cfg.instances == 1
    await r.reload(a, instances(a.cfg, 3))  # 90 MB beside b's 30: b (idle) is evicted, a loaded once
    assert loader.loads[loads:] == ["a"] and a.cfg.instances == 3
    assert states(r) == {"a:1": READY, "b:1": UNAVAILABLE} and a.measured_bytes == 30 * MiB
    await r.unload(a)
    reason, sticky = a.reason, a.sticky_unloaded
    loader.fail.add("a")
    with caplog.at_level(logging.WARNING, logger="batcher.repository"):
        with pytest.raises(ConfigError, match="broken on purpose"):
            await r.reload(a, a.cfg.model_copy(update={"max_batch_size": 4}))
    assert a.state == UNAVAILABLE and a.cfg.instances == 3 and a.cfg.max_batch_size != 4
    # as it was: unloaded by request, not "load failed" (a request would have loaded the old config then)
    assert (a.reason, a.sticky_unloaded, a.failed) == (reason, sticky, None) and sticky
    assert not caplog.records  # the client's config: its 400 says why, no ERROR line
    await r.close()


def test_victim_choice_rule():
    cands = [Candidate("a", 20, 1.0), Candidate("b", 20, 2.0), Candidate("c", 60, 3.0), Candidate("e", 70, 4.0)]
    assert choose_victims(cands, 0) == []
    assert choose_victims(cands, 50) == ["c"]  # least recently used of those big enough alone
    assert choose_victims(cands, 15) == ["a"]
    assert choose_victims(cands[:2], 30) == ["a", "b"]  # none alone: LRU order until enough
    with pytest.raises(NoRoom):
        choose_victims(cands[:2], 50)


async def test_a_model_in_use_is_never_evicted_and_the_newcomer_gets_503_naming_the_budget():
    r, _ = repo([{"name": "a"}, {"name": "b", "memory_mb": 60}], FakeLoader({"a": 60, "b": 60}),
                load_strategy="lru", memory_budget_mb=100)
    held = await r.acquire(r.slot("a"))
    with pytest.raises(Unavailable, match=r"memory budget 100 MB: model 'b' needs 60 MB.*'a \(60 MB\)'"):
        await r.acquire(r.slot("b"))
    assert states(r) == {"a:1": READY, "b:1": UNAVAILABLE}
    r.release(held)
    r.release(await r.acquire(r.slot("b")))  # now a is idle and goes
    assert states(r) == {"a:1": UNAVAILABLE, "b:1": READY}
    await r.close()


async def test_a_load_measured_above_its_estimate_is_refitted_or_given_back():
    r, _ = repo([{"name": "a"}, {"name": "b"}], FakeLoader({"a": 60, "b": 60}),
                load_strategy="lru", memory_budget_mb=100)  # b is estimated at 32 MB before its first load
    held = await r.acquire(r.slot("a"))
    with pytest.raises(Unavailable, match="needs 60 MB as measured at load"):
        await r.acquire(r.slot("b"))
    assert states(r) == {"a:1": READY, "b:1": UNAVAILABLE} and r.used_bytes == 60 * MiB
    r.release(held)
    await r.close()


async def test_requests_waiting_for_a_load_pin_the_model():
    r, _ = repo([{"name": "a"}, {"name": "b"}], FakeLoader({"a": 60, "b": 60}),
                load_strategy="lru", memory_budget_mb=100)
    a_waiters = [asyncio.ensure_future(r.acquire(r.slot("a"))) for _ in range(3)]
    await asyncio.sleep(0)
    b = asyncio.ensure_future(r.acquire(r.slot("b")))
    got = await asyncio.gather(*a_waiters, return_exceptions=True)
    assert all(s is r.slot("a") for s in got)
    with pytest.raises(Unavailable, match="memory budget"):
        await b
    for s in got:
        r.release(s)
    await r.close()


NEVER_FITS = ("model 'a' version 1 needs 500 MB (its memory_mb), more than the whole memory budget (100 MB): no "
              "eviction can make room for it")


@pytest.mark.parametrize("on_cold", ["wait", "reject"])
async def test_a_model_larger_than_the_whole_budget_is_refused_saying_so_without_a_load(on_cold):
    """A new user's report: under ``on_cold: reject`` a model larger than the whole budget answered "is loading; try
    again shortly" with Retry-After 1 forever (each request started a load that failed in the background), and under
    ``wait`` the same model said "needs 500 MB" with Retry-After 1. Now both answer what is true, the same way:
    it cannot fit, Retry-After LOAD_RETRY_S (as for other models that are not loaded), no load is tried, the index
    says why, and the repository API's load gets the same answer."""
    from batcher.slots import LOAD_RETRY_S

    r, loader = repo([{"name": "a", "memory_mb": 500}], load_strategy="lru", memory_budget_mb=100, on_cold=on_cold)
    # before any request too (it said "not loaded" until one came: a fresh user's report)
    assert r.index() == [{"name": "a", "version": "1", "state": UNAVAILABLE,
                          "reason": NEVER_FITS.removeprefix("model 'a' version 1 ")}]
    for _ in range(3):
        with pytest.raises(Unavailable) as exc:
            await r.acquire(r.slot("a"))
        assert (exc.value.message, exc.value.retry_after_s) == (NEVER_FITS, LOAD_RETRY_S)
        await asyncio.sleep(LOAD_RETRY_S)  # virtual time: past any retry window, still the same answer
    with pytest.raises(Unavailable) as exc:
        await r.load(r.slot("a"))
    assert (exc.value.message, exc.value.retry_after_s) == (NEVER_FITS, LOAD_RETRY_S)
    assert loader.loads == [] and r.slot("a").task is None
    assert r.index() == [{"name": "a", "version": "1", "state": UNAVAILABLE,
                          "reason": NEVER_FITS.removeprefix("model 'a' version 1 ")}]
    await r.close()


async def test_a_model_measured_over_the_whole_budget_is_not_loaded_again_and_says_why():
    """Estimated at 32 MB before its first load, measured at 150 MB in a 100 MB budget: given back once, then every
    request (on_cold reject) gets the measured figure, not "is loading" and another load."""
    from batcher.slots import LOAD_RETRY_S

    r, loader = repo([{"name": "a"}], FakeLoader({"a": 150}), load_strategy="lru", memory_budget_mb=100,
                     on_cold="reject")
    with pytest.raises(Unavailable, match="is loading"):  # true: its load starts
        await r.acquire(r.slot("a"))
    await asyncio.wait([r.slot("a").task])  # the load it started, given back over the budget (no guessed wait)
    message = ("model 'a' version 1 needs 150 MB (as measured at its load), more than the whole memory budget "
               "(100 MB): no eviction can make room for it")
    for _ in range(2):
        with pytest.raises(Unavailable) as exc:
            await r.acquire(r.slot("a"))
        assert (exc.value.message, exc.value.retry_after_s) == (message, LOAD_RETRY_S)
        await asyncio.sleep(LOAD_RETRY_S)
    assert loader.loads == ["a"] and r.used_bytes == 0
    assert (r.slot("a").state, r.slot("a").reason) == (UNAVAILABLE, message.removeprefix("model 'a' version 1 "))
    await r.close()


@pytest.mark.parametrize("on_cold", ["wait", "reject"])
async def test_no_room_now_is_the_same_answer_under_reject_and_wait_and_a_later_request_loads(on_cold):
    """b (60 MB) cannot fit beside a (60 MB, in use) in 100 MB: under ``reject`` it answered "is loading" while its
    load failed in the background, request after request; now both strategies answer what a load would, naming
    the budget (Retry-After 1: it can fit once a is idle), and once a is released a request loads b."""
    r, loader = repo([{"name": "a", "memory_mb": 60}, {"name": "b", "memory_mb": 60}], FakeLoader({"a": 60, "b": 60}),
                     load_strategy="lru", memory_budget_mb=100, on_cold=on_cold)
    await r.load(r.slot("a"))
    held = await r.acquire(r.slot("a"))
    message = ("memory budget 100 MB: model 'b' needs 60 MB, 60 MB are held by models with requests in flight: "
               "['a (60 MB)']")
    for _ in range(2):
        with pytest.raises(Unavailable) as exc:
            await r.acquire(r.slot("b"))
        assert (exc.value.message, exc.value.retry_after_s) == (message, 1)
    assert loader.loads == ["a"] and (r.slot("b").state, r.slot("b").reason) == (UNAVAILABLE, message)
    r.release(held)
    if on_cold == "reject":
        with pytest.raises(Unavailable, match="is loading"):
            await r.acquire(r.slot("b"))
        await r.slot("b").task  # the load it started (no guessed wait: a busy machine made 0.1 s too short)
    r.release(await r.acquire(r.slot("b")))
    assert states(r) == {"a:1": UNAVAILABLE, "b:1": READY} and loader.loads == ["a", "b"]
    await r.close()


async def test_versions_policy_and_mismatch_rules():
    models = [{"name": "m", "version": v} for v in (1, 2, 3)]
    r, _ = repo([*models[:2], {**models[2], "version_policy": {"latest": 2}}])
    assert r.served_versions("m") == ["2", "3"] and r.slot("m").version == "3"
    assert r.slot("m", "2").version == "2"
    with pytest.raises(ModelNotFound, match="has no version '1'"):
        r.slot("m", "1")
    with pytest.raises(ModelNotFound, match="unknown model 'zz'"):
        r.slot("zz")
    config = parse_config({"routing": {"version_mismatch": "fallback"},
                           "models": [{"path": "unused.onnx", **m} for m in models[:2]]})
    r2 = Repo(config, Metrics(), loader=FakeLoader())
    assert r2.slot("m", "7").version == "2"


async def test_unload_is_sticky_and_load_brings_it_back():
    r, loader = repo([{"name": "a"}], load_strategy="lazy")
    slot = r.slot("a")
    r.release(await r.acquire(slot))
    await r.unload(slot)
    assert slot.state == UNAVAILABLE and slot.reason == "unloaded by request"
    with pytest.raises(Unavailable, match="unloaded by request"):
        await r.acquire(slot)
    await r.load(slot)
    assert slot.state == READY and loader.loads == ["a", "a"]
    await r.close()


async def test_fallback_takes_requests_when_the_model_cannot_load():
    r, _ = repo([{"name": "a", "fallback": "b"}, {"name": "b"}], FakeLoader(fail={"a"}), load_strategy="lazy")
    got = await r.acquire(r.slot("a"))
    assert got is r.slot("b") and r.slot("a").failed
    r.release(got)
    await r.close()


async def test_when_the_fallback_cannot_serve_either_the_503_names_the_model_asked_for_then_its_fallback():
    """A fresh user's find: the 503 named only the fallback, not the model the client had asked for."""
    r, _ = repo([{"name": "a", "fallback": "b"}, {"name": "b"}], FakeLoader(fail={"a", "b"}), load_strategy="lazy")
    with pytest.raises(Unavailable) as exc:
        await r.acquire(r.slot("a"))
    asked, fallback = exc.value.message.split("; its fallback: ")
    assert "model 'a' failed to load" in asked and "model 'b' failed to load" in fallback
    assert exc.value.retry_after_s == 5  # a failed load's
    await r.close()


async def test_a_failed_lazy_load_is_retried_at_most_every_load_retry_s_and_logged_at_error_once(caplog):
    """A client cannot make the server load a broken model, and log an ERROR, once per request: within LOAD_RETRY_S
    of a failure requests get 503 at once, naming the failure and when to retry; the same failure again is a
    WARNING; the repository API's load always tries."""
    from batcher.slots import LOAD_RETRY_S

    r, loader = repo([{"name": "a"}], FakeLoader(fail={"a"}), load_strategy="lazy")
    for _ in range(3):
        with pytest.raises(Unavailable) as exc:
            await r.acquire(r.slot("a"))
    assert loader.loads == ["a"] and "broken on purpose" in exc.value.message and exc.value.retry_after_s == 5
    assert [rec.levelname for rec in caplog.records if "broken on purpose" in rec.message] == ["ERROR"]
    await asyncio.sleep(LOAD_RETRY_S)  # virtual time
    with pytest.raises(Unavailable):
        await r.acquire(r.slot("a"))
    assert loader.loads == ["a", "a"]
    assert [rec.levelname for rec in caplog.records if "broken on purpose" in rec.message] == ["ERROR", "WARNING"]
    with pytest.raises(ConfigError):
        await r.load(r.slot("a"))  # an operator's explicit load is not held back
    assert loader.loads == ["a", "a", "a"]
    await r.close()


async def test_index_filters_by_readiness():
    r, _ = repo([{"name": "a"}, {"name": "b"}], load_strategy="lazy")
    r.release(await r.acquire(r.slot("a")))
    assert [e["name"] for e in r.index(ready=True)] == ["a"]
    assert [e["name"] for e in r.index(ready=False)] == ["b"]
    assert [e["state"] for e in r.index()] == [READY, UNAVAILABLE]
    await r.close()
