"""The Grafana dashboard and the Prometheus alert rules in configs/, checked against a real Prometheus.

A real ``batcher serve`` (two models, lru with a budget, repository API) takes a short concurrent load with some
bad and timed-out requests; a real Prometheus (``prometheus`` on PATH or in /usr/bin) scrapes it every second with
configs/prometheus.yml adapted to the test and the alert rules loaded. Then every PromQL expression of the
dashboard (template variables substituted) and of the alert rules (the signal left of the top-level threshold
comparison, and the whole expression) is evaluated through ``/api/v1/query`` at a moment of the load, and each
must return data: at least one series with a finite value.

Without Prometheus the live test is skipped (``apt-get install prometheus``); set BATCHER_REQUIRE_PROMETHEUS=1 to
make that a failure instead (CI installs it). BATCHER_PROMETHEUS / BATCHER_PROMTOOL name the binaries explicitly.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import yaml

from helpers import infer_kwargs, require_program

from bench.server import Subprocess, free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana-dashboard.json"
ALERTS = ROOT / "configs" / "prometheus-alerts.yml"
PROMETHEUS_CONFIG = ROOT / "configs" / "prometheus.yml"

MODELS = ("tiny_cnn", "ppocr_cls")
INPUTS = {"tiny_cnn": ("input", (3, 224, 224)), "ppocr_cls": ("x", (3, 48, 192))}
RATE_INTERVAL = "15s"
#: Grafana variables as Grafana would expand them for this test (multi-value `$model`: a regex alternation).
VARIABLES = {
    "model": "(" + "|".join(MODELS) + ")",
    "__rate_interval": RATE_INTERVAL,
    "__interval": RATE_INTERVAL,
    "__range": "1m",
}
#: Every metric family the server exports must be shown somewhere on the dashboard.
DASHBOARD_METRICS = (
    "batcher_request_success_total", "batcher_request_failure_total", "batcher_inference_count_total",
    "batcher_execution_count_total", "batcher_queue_duration_seconds_bucket", "batcher_compute_duration_seconds_bucket",
    "batcher_request_duration_seconds_bucket", "batcher_batch_size_bucket", "batcher_compute_input_seconds_total",
    "batcher_compute_infer_seconds_total", "batcher_compute_output_seconds_total", "batcher_queue_depth",
    "batcher_model_loaded", "batcher_model_memory_bytes", "batcher_memory_used_bytes", "batcher_memory_budget_bytes",
    "batcher_model_load_total", "batcher_model_unload_total", "batcher_model_load_duration_seconds_bucket",
    "batcher_throughput_requests_per_second", "batcher_retention_ratio",
)
ALERT_NAMES = {"BatcherHighP99Latency", "BatcherQueueDepthHigh", "BatcherHighFailureRatio",
               "BatcherMemoryBudgetNearlyFull", "BatcherModelUnloadChurn"}


# ---------------------------------------------------------------------------------------------- expressions
def dashboard_expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) for every ``expr`` anywhere in the dashboard (panels, rows' nested panels, ...)."""
    found: list[tuple[str, str]] = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            title = node.get("title")
            here = f"{where} / {title}" if isinstance(title, str) and "targets" in node else where
            for key, value in node.items():
                if key == "expr" and isinstance(value, str) and value.strip():
                    found.append((f"{here} [{node.get('refId', '?')}]", value))
                else:
                    walk(value, here)
        elif isinstance(node, list):
            for item in node:
                walk(item, where)

    walk(dashboard.get("panels", []), "panel")
    return found


def substitute(expr: str) -> str:
    """Expand Grafana's ``$var``, ``${var}`` and ``${var:format}`` with VARIABLES."""
    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return VARIABLES.get(name, m.group(0))
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def alert_rules(rules_doc: dict) -> list[dict]:
    return [r for g in rules_doc["groups"] for r in g["rules"] if "alert" in r]


_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")


def split_threshold(expr: str) -> tuple[str, str, str] | None:
    """``(signal, op, threshold)`` when ``expr`` is ``signal <op> number`` at its top level, else None.

    Tracks (), {}, [] and quoted strings so matchers (``=~``, ``!~``, ``!=`` inside braces) and comparisons nested in
    parentheses (``(x > 0)``) are not taken for the alert's threshold.
    """
    depth, quote, i, last = 0, "", 0, None
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and c == "#":
            break
        elif depth == 0:
            for op in _COMPARISONS:
                if expr.startswith(op, i) and not expr.startswith("=~", i) and not expr.startswith("!~", i):
                    last = (i, op)
                    i += len(op) - 1
                    break
        i += 1
    if last is None:
        return None
    pos, op = last
    rhs = expr[pos + len(op):].strip()
    if rhs.startswith("bool "):
        rhs = rhs[5:].strip()
    try:
        float(rhs)
    except ValueError:
        return None
    return expr[:pos].strip(), op, rhs


def test_split_threshold():
    assert split_threshold('sum by (m) (rate(x{a!~"b|c"}[5m])) / (y > 0) > 0.9') == \
        ('sum by (m) (rate(x{a!~"b|c"}[5m])) / (y > 0)', ">", "0.9")
    assert split_threshold("x >= 1e3") == ("x", ">=", "1e3")
    assert split_threshold('x{a="1>2"}') is None
    assert split_threshold("x > y") is None


# ---------------------------------------------------------------------------------------------- static checks
def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    model = variables["model"]
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query == "label_values(batcher_request_success_total, model)"
    assert model["multi"] and model["includeAll"]

    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]

    exprs = dashboard_expressions(dashboard)
    assert len(exprs) >= 10
    text = " ".join(e for _, e in exprs)
    assert not [m for m in DASHBOARD_METRICS if m not in text], "metrics missing from the dashboard"
    for where, expr in exprs:
        assert "$" not in substitute(expr), f"{where}: unknown variable in {expr}"
        if "batcher_memory" not in expr and "retention" not in expr:
            assert '{model=~"$model"' in expr, f"{where}: not filtered by $model: {expr}"


def test_alert_rules_are_well_formed():
    rules = alert_rules(yaml.safe_load(ALERTS.read_text()))
    assert {r["alert"] for r in rules} == ALERT_NAMES
    for r in rules:
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        assert split_threshold(r["expr"]) is not None, f"{r['alert']}: no top-level threshold comparison"
    assert any("histogram_quantile(0.99" in r["expr"] and "batcher_request_duration_seconds_bucket" in r["expr"]
               and r["for"] == "5m" for r in rules)


def _binary(name: str) -> str | None:
    explicit = os.environ.get(f"BATCHER_{name.upper()}")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    usr_bin = Path("/usr/bin") / name
    return shutil.which(name) or (str(usr_bin) if os.access(usr_bin, os.X_OK) else None)


def _require(name: str) -> str:
    why = (f"{name} not found on PATH or in /usr/bin: install Prometheus (Debian/Ubuntu: apt-get install -y "
           f"prometheus) or set BATCHER_{name.upper()} to the binary")
    return require_program(_binary(name), why, "BATCHER_REQUIRE_PROMETHEUS")


def test_promtool_checks_rules_and_config():
    promtool = _require("promtool")
    outputs = []
    for args in (["check", "rules", str(ALERTS)], ["check", "config", str(PROMETHEUS_CONFIG)]):
        r = subprocess.run([promtool, *args], check=False, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}{r.stderr}"
        outputs.append(r.stdout + r.stderr)
    assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in outputs[0], outputs[0]
    assert "SUCCESS: 1 rule files found" in outputs[1], outputs[1]  # the config loads the rules file


# ---------------------------------------------------------------------------------------------- live Prometheus
class Prometheus(Subprocess):
    """A ``prometheus`` process on 127.0.0.1 with its own config and TSDB under ``workdir``, ready when
    ``/-/ready`` answers."""

    def __init__(self, binary: str, config: dict, workdir: Path) -> None:
        port = free_port()
        cfg_path = workdir / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(config))
        super().__init__([binary, f"--config.file={cfg_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{port}"], workdir, "prometheus", port, timeout_s=30,
                         ready_path="/-/ready")

    def get(self, path: str, **params: object) -> dict:
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422 carry {"status": "error", "error": ...}
            return json.loads(e.read() or b"{}") or {"status": "error", "error": f"HTTP {e.code}"}

    def query(self, expr: str, at: float | None = None) -> dict:
        return self.get("/api/v1/query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))

    def wait(self, what: str, check, timeout_s: float, interval_s: float = 0.25):
        """Poll ``check()`` until it returns something truthy; fail with Prometheus's log after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode} while waiting for {what}:\n"
                            f"{self.log()[-4000:]}")
            try:
                last = check()
                if last:
                    return last
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as exc:
                last = exc
            time.sleep(interval_s)
        pytest.fail(f"timed out after {timeout_s} s waiting for {what} (last: {last!r}):\n{self.log()[-4000:]}")


def _infer_body(model: str, rows: int, *, bad: bool = False, timeout_us: int | None = None) -> dict:
    name, dims = INPUTS[model]
    if bad:  # declared dims violated: 400, counted as reason="invalid"
        dims = (dims[0], dims[1], dims[2] // 2)
    # timeout_us: a deadline that has passed before the request is queued: 504, reason="timeout"
    return infer_kwargs(np.full((rows, *dims), 0.5, np.float32), name, timeout_us=timeout_us)


async def _load(base: str, models: tuple[str, ...], duration_s: float, rps: float = 40.0, workers: int = 2,
                faulty: bool = False) -> Counter:
    """``rps`` requests per second to each model (paced, ``workers`` clients per model) for ``duration_s``.

    With ``faulty``, every 10th request is invalid (400) and every 10th (offset 5) has a 1 us deadline (504).
    Returns the count of (model, status)."""
    statuses: Counter = Counter()
    issued = Counter()
    start = time.monotonic()
    end = start + duration_s

    async def client(session: aiohttp.ClientSession, model: str) -> None:
        while True:
            n = issued[model]
            issued[model] += 1
            due = start + n / rps
            if due >= end:
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            kw = {}
            if faulty and n % 10 == 3:
                kw = {"bad": True}
            elif faulty and n % 10 == 8:
                kw = {"timeout_us": 1}
            async with session.post(f"{base}/v2/models/{model}/infer", **_infer_body(model, 1 + n % 3, **kw)) as r:
                await r.read()
                statuses[(model, r.status)] += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(client(session, m) for m in models for _ in range(workers)))
    return statuses


def _post(base: str, path: str) -> int:
    req = urllib.request.Request(base + path, data=b"{}", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status


def _verdict(resp: dict) -> str | None:
    """None when the query returned data with at least one finite value, else why not."""
    if resp.get("status") != "success":
        return f"error: {resp.get('errorType')}: {resp.get('error')}"
    data = resp["data"]
    if data["resultType"] == "scalar":
        values = [data["result"][1]]
    elif data["resultType"] == "vector":
        values = [s["value"][1] for s in data["result"]]
    else:
        return f"unexpected result type {data['resultType']}"
    if not values:
        return "no data (empty result)"
    if not any(math.isfinite(float(v)) for v in values):
        return f"no finite value ({len(values)} series, all NaN/Inf)"
    return None


def test_every_dashboard_and_alert_expression_returns_data(start_server, tmp_path):
    prometheus_bin = _require("prometheus")
    started = time.monotonic()
    server = start_server({
        "server": {"load_strategy": "lru", "memory_budget_mb": 1024, "repository_api": True},
        "models": [
            {"name": "tiny_cnn", "path": "zoo:tiny_cnn", "intra_op_threads": 1, "max_batch_size": 8,
             "dynamic_batching": {"max_queue_delay_microseconds": 2000}},
            {"name": "ppocr_cls", "path": "zoo:ppocr_cls", "intra_op_threads": 1, "max_batch_size": 8,
             "dynamic_batching": {"max_queue_delay_microseconds": 2000}, "inputs": [{"name": "x", "dims": [3, 48, 192]}]},
        ],
    })

    # configs/prometheus.yml, scraping this server every second and loading configs/prometheus-alerts.yml
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS)]
    job = config["scrape_configs"][0]
    job["static_configs"] = [{"targets": [server.url]}]
    job_name = job["job_name"]
    workdir = tmp_path / "prometheus"
    workdir.mkdir()

    dashboard = json.loads(DASHBOARD.read_text())
    rules_doc = yaml.safe_load(ALERTS.read_text())

    # The retention ratio needs each model's solo throughput (batcher/retention.py: the best throughput seen while
    # it was the only active model) before both run at once. 1. ppocr_cls alone (lru loads it on first use).
    solo = asyncio.run(_load(server.base, ("ppocr_cls",), duration_s=2.5))
    assert solo[("ppocr_cls", 200)] >= 5, solo
    prom = Prometheus(prometheus_bin, config, workdir)
    try:
        up = f'up{{job="{job_name}"}}'
        prom.wait("two successful scrapes of the server",
                  lambda: prom.query(f"sum_over_time({up}[30s]) >= 2")["data"]["result"], 20)

        # 2. once ppocr_cls has left the server's throughput window, tiny_cnn alone
        prom.wait("ppocr_cls idle in the server's throughput window",
                  lambda: server.metric("batcher_throughput_requests_per_second", model="ppocr_cls", version="1") == 0,
                  30)
        solo = asyncio.run(_load(server.base, ("tiny_cnn",), duration_s=2.5))
        assert solo[("tiny_cnn", 200)] >= 5, solo

        # 3. an unload and a load (lifecycle series; a load inside the panels' rate window)
        assert _post(server.base, "/v2/repository/models/tiny_cnn/unload") == 200
        assert _post(server.base, "/v2/repository/models/tiny_cnn/load") == 200

        # 4. both models at once, with some invalid (400) and timed-out (504) requests
        load_start = time.time()
        statuses = asyncio.run(_load(server.base, MODELS, duration_s=5.0, faulty=True))
        load_end = time.time()
        for m in MODELS:
            assert statuses[(m, 200)] >= 10 and statuses[(m, 400)] >= 1 and statuses[(m, 504)] >= 1, statuses
        assert {s for _, s in statuses} <= {200, 400, 504}, statuses

        # evaluate at a successful scrape taken while both models were busy (the retention ratio is defined only
        # then; NaN otherwise), once Prometheus has scraped past the end of the load
        def scrapes() -> list[tuple[float, float]] | None:
            result = prom.query(f"{up}[2m]")["data"]["result"]
            samples = [(float(t), float(v)) for t, v in result[0]["values"]] if result else []
            return samples if samples and samples[-1][0] > load_end else None

        samples = prom.wait("a scrape after the load", scrapes, 20)
        ok = [t for t, v in samples if v == 1 and load_start + 1.5 <= t <= load_end - 0.2] or \
            [t for t, v in samples if v == 1 and load_start <= t <= load_end]
        assert ok, f"no successful scrape during the load {load_start:.1f}..{load_end:.1f}: {samples}"
        at = ok[-1] + 0.25

        # the rules file loaded, every rule evaluated without error
        def rules_ok():
            groups = prom.get("/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return groups if rules and all(r["health"] == "ok" for r in rules) else None

        groups = prom.wait("every alert rule evaluated with health ok", rules_ok, 20)
        assert [g["name"] for g in groups] == [g["name"] for g in rules_doc["groups"]]
        assert {r["name"] for g in groups for r in g["rules"]} == ALERT_NAMES
        assert all(not r.get("lastError") for g in groups for r in g["rules"])

        # the dashboard's model variable lists our models
        series = prom.query("group by (model) (batcher_request_success_total)", at)["data"]["result"]
        assert {s["metric"]["model"] for s in series} >= set(MODELS)

        checks: list[tuple[str, str]] = [(where, substitute(e)) for where, e in dashboard_expressions(dashboard)]
        for rule in alert_rules(rules_doc):
            expr = " ".join(rule["expr"].split())
            signal, op, threshold = split_threshold(expr)
            checks.append((f"alert {rule['alert']} (signal, before {op} {threshold})", signal))
        failures = []
        for where, expr in checks:
            why = _verdict(prom.query(expr, at))
            if why:
                failures.append(f"{where}: {why}\n    {expr}")
        for rule in alert_rules(rules_doc):  # the whole expression must at least evaluate (not fire)
            resp = prom.query(" ".join(rule["expr"].split()), at)
            if resp.get("status") != "success":
                failures.append(f"alert {rule['alert']} (whole expression): {resp.get('error')}")

        print(f"\n{len(checks)} expressions evaluated at {at:.2f} (load {load_start:.2f}..{load_end:.2f}), "
              f"{len(failures)} without data; requests {dict(statuses)}; {time.monotonic() - started:.1f} s")
        assert len(checks) >= 10
        assert not failures, f"{len(failures)} of {len(checks)} expressions returned no data:\n" + "\n".join(failures)
    finally:
        prom.stop()
