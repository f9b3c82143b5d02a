"""deploy/: the Helm chart, the KServe resources, the Dockerfiles and the scaling rules, checked offline with the
tools the ecosystem uses (all installed by the test extras, no network):

* the chart rendered by Helm's own Go engine (``helm-python-sdk``, no helm binary) with the default values and the
  files in ``deploy/helm/trt-batcher/ci/`` (GPU, KEDA, HPA); the output validated with ``kubernetes-validate
  --strict`` against the Kubernetes 1.30 and the newest bundled schemas, the custom resources (KServe, KEDA,
  ServiceMonitor) with ``check-jsonschema`` against the CRD schemas vendored in ``deploy/schemas``;
* what the rendered objects say: probes on the server's real health routes, the container port is the config's
  port, grace periods consistent with the config, resources and GPUs exactly when asked for, the ConfigMap a valid
  server config;
* hadolint on both Dockerfiles; the image's ENTRYPOINT + CMD (and the chart's and the KServe runtime's args) parsed
  by the real ``batcher`` command line;
* the scaling queries (KEDA trigger, prometheus-adapter rule) and the scaling/alert rules evaluated by ``promtool``
  against recorded series (promtool: Debian's ``prometheus`` package, as tests/integration/test_prometheus.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import require_program

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "trt-batcher"
SCHEMAS = DEPLOY / "schemas"
RELEASE, NAMESPACE = "demo", "serving"
FULLNAME = f"{RELEASE}-trt-batcher"
VALUES = {"default": {}, **{p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text())
                            for p in sorted((CHART / "ci").glob("*-values.yaml"))}}
CRD_SCHEMAS = {
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): SCHEMAS / "serving.kserve.io/clusterservingruntime_v1alpha1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): SCHEMAS / "serving.kserve.io/inferenceservice_v1beta1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "keda.sh/scaledobject_v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "monitoring.coreos.com/servicemonitor_v1.json",
    ("networking.istio.io/v1", "DestinationRule"): SCHEMAS / "networking.istio.io/destinationrule_v1.json",
    ("networking.istio.io/v1", "VirtualService"): SCHEMAS / "networking.istio.io/virtualservice_v1.json",
}


def _tool(name: str) -> str:
    """A console script of the test extras (next to this Python), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if os.access(here, os.X_OK) else shutil.which(name)
    assert found, f"{name} is missing: pip install -e '.[test]'"
    return found


def _run(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT)


def render(values: dict | None = None, **overrides) -> list[dict]:
    """The chart's objects for ``values`` (deep-merged with ``overrides``), as Helm renders them offline."""
    import helm_python as helm

    merged = json.loads(json.dumps(values or {}))
    for key, value in overrides.items():
        node = merged
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(merged, name=RELEASE, namespace=NAMESPACE)
    return [doc for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def container(docs: list[dict]) -> dict:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def server_config(docs: list[dict]) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap")["data"]["config.yaml"])


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in VALUES.items()}


# -------------------------------------------------------------------------------------------- validation


def test_values_files_cover_gpu_and_both_autoscalers():
    assert {"default", "gpu", "keda", "hpa"} <= set(VALUES)


@pytest.mark.parametrize("k8s", ["1.30.0", "latest"])
def test_rendered_chart_validates_against_kubernetes_schemas(rendered, tmp_path, k8s):
    files = []
    for name, docs in rendered.items():
        for i, doc in enumerate(docs):
            path = tmp_path / f"{name}-{i}-{doc['kind']}.yaml"
            path.write_text(yaml.safe_dump(doc))
            files.append(path)
    args = ["--strict", *(["-k", k8s] if k8s != "latest" else []), *map(str, files)]
    r = _run(_tool("kubernetes-validate"), *args)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # every built-in kind was validated; only the custom resources are left to check-jsonschema
    passed = len(re.findall(r"^INFO .* passed for resource", out, re.M))
    unknown = set(re.findall(r"Couldn't find schema for kind (\w+)", out))
    custom = {f.name for f in files if f.name.rsplit("-", 1)[1].removesuffix(".yaml") in ("ScaledObject", "ServiceMonitor")}
    assert unknown <= {"ScaledObject", "ServiceMonitor"}, out
    assert passed == len(files) - len(custom), out
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceAccount", "HorizontalPodAutoscaler"} <= {
        d["kind"] for docs in rendered.values() for d in docs}


def test_custom_resources_validate_against_their_crd_schemas(rendered, tmp_path):
    instances: dict[Path, list[Path]] = {schema: [] for schema in CRD_SCHEMAS.values()}
    for name, docs in rendered.items():
        for doc in docs:
            if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
                path = tmp_path / f"{name}-{doc['kind']}.yaml"
                path.write_text(yaml.safe_dump(doc))
                instances[CRD_SCHEMAS[doc["apiVersion"], doc["kind"]]].append(path)
    for path in sorted((DEPLOY / "kserve").glob("*.yaml")) + sorted((DEPLOY / "routing").glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            single = tmp_path / f"{path.parent.name}-{path.stem}-{i}.yaml"
            single.write_text(yaml.safe_dump(doc))
            instances[CRD_SCHEMAS[doc["apiVersion"], doc["kind"]]].append(single)
    assert all(instances.values()), {k.name: v for k, v in instances.items()}  # each schema checks something
    for schema, paths in instances.items():
        r = _run(_tool("check-jsonschema"), "--schemafile", str(schema), *map(str, paths))
        assert r.returncode == 0, f"{schema.name}:\n{r.stdout}{r.stderr}"
    # the schemas are strict: a misspelt key is an error (the API server would silently drop it)
    so = yaml.safe_load(instances[CRD_SCHEMAS["keda.sh/v1alpha1", "ScaledObject"]][0].read_text())
    so["spec"]["pollInterval"] = so["spec"].pop("pollingInterval")
    bad = tmp_path / "bad-scaledobject.yaml"
    bad.write_text(yaml.safe_dump(so))
    r = _run(_tool("check-jsonschema"), "--schemafile", str(CRD_SCHEMAS["keda.sh/v1alpha1", "ScaledObject"]), str(bad))
    assert r.returncode == 1 and "pollInterval" in r.stdout, r.stdout


@pytest.mark.parametrize("name", list(VALUES))
def test_helm_lint_strict_finds_no_warning(name):
    import helm_python as helm

    report = helm.lint(str(CHART), VALUES[name], strict=True, kube_version="v1.30.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report  # info ("icon is recommended") only


def test_values_schema_rejects_bad_values():
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        for values in VALUES.values():
            chart.validate_schema(values)
        for bad, where in [({"config": {"server": {"port": "8000"}}}, "/config/server/port"),
                           ({"gpu": {"count": -1, "resource": "nvidia.com/gpu"}}, "/gpu/count"),
                           ({"replicas": 3}, "replicas"),
                           ({"resources": {"limit": {"cpu": 1}}}, "limit")]:
            with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
                chart.validate_schema(bad)


# ----------------------------------------------------------------------------------- what the chart says


def _health_routes() -> set[str]:
    from batcher.routes import routes

    return {r.path for r in routes if getattr(r, "method", None) == "GET"}


@pytest.mark.parametrize("name", list(VALUES))
def test_probes_ports_and_grace_follow_the_server_config(rendered, name):
    docs = rendered[name]
    c, cfg = container(docs), server_config(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    port = cfg["server"]["port"]
    (http,) = c["ports"]
    assert http == {"name": "http", "containerPort": port, "protocol": "TCP"}
    routes = _health_routes()
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert {"/v2/health/live", "/v2/health/ready"} <= routes
    # the startup probe gives up only after the slowest load the values allow for
    startup = {**VALUES["default"], **VALUES[name]}.get("probes", {}).get("startup", {"maxLoadSeconds": 300})
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] > startup["maxLoadSeconds"]
    # shutdown: preStop sleep, then the server's drain; the kubelet's grace covers both
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep > 0
    assert pod["terminationGracePeriodSeconds"] > sleep + cfg["server"]["shutdown_grace_s"]
    # the service reaches the named port; the pod is scraped on it
    svc = one(docs, "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["spec"]["selector"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port) and annotations["prometheus.io/path"] == "/metrics"
    # the config file the container reads is the ConfigMap's
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert c["args"][:2] == ["--config", f"{mount['mountPath']}/config.yaml"]
    assert "config.yaml" in one(docs, "ConfigMap")["data"]
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]


def test_port_and_grace_follow_changed_values():
    docs = render(VALUES["default"], **{"config.server.port": 9100, "config.server.shutdown_grace_s": 75,
                                        "preStopSleepSeconds": 15})
    c, pod = container(docs), one(docs, "Deployment")["spec"]["template"]["spec"]
    assert c["ports"][0]["containerPort"] == 9100 == server_config(docs)["server"]["port"]
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == 15
    assert pod["terminationGracePeriodSeconds"] == 15 + 75 + 10
    # an explicit grace period that cannot fit the preStop sleep and the drain is refused at render time
    import helm_python as helm

    with pytest.raises(helm.HelmError, match="must exceed preStopSleepSeconds"):
        render(VALUES["default"], terminationGracePeriodSeconds=40)
    assert one(render(VALUES["default"], terminationGracePeriodSeconds=41), "Deployment")[
        "spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 41


def test_resources_and_gpus_appear_exactly_when_asked_for(rendered):
    assert "resources" not in container(rendered["default"])
    pod = one(rendered["default"], "Deployment")["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert "nvidia.com/gpu" not in json.dumps(rendered["default"])

    gpu = container(rendered["gpu"])["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == 1 and gpu["requests"]["nvidia.com/gpu"] == 1
    assert gpu["requests"]["cpu"] == "4" and gpu["limits"]["memory"] == "16Gi"
    pod = one(rendered["gpu"], "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in pod["volumes"])
    assert server_config(rendered["gpu"])["models"][0]["instance_group"][0]["kind"] == "KIND_GPU"

    # GPUs alone, no CPU/memory asked for: only the GPU appears
    only = container(render({"gpu": {"count": 2, "resource": "nvidia.com/gpu"}}))["resources"]
    assert only == {"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 2}}
    # CPU/memory alone: no GPU
    cpu = container(render({"resources": {"requests": {"cpu": "1"}}}))["resources"]
    assert cpu == {"requests": {"cpu": "1"}}


@pytest.mark.parametrize("name", ["default", "gpu"])
def test_configmap_is_a_valid_server_config(rendered, name):
    from batcher.config import parse_config

    config = parse_config(server_config(rendered[name]), f"chart ConfigMap ({name} values)")
    assert config.models and config.server.port == container(rendered[name])["ports"][0]["containerPort"]


def test_optional_resources_only_when_enabled(rendered):
    kinds = {name: {d["kind"] for d in docs} for name, docs in rendered.items()}
    assert kinds["default"] == {"ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"}
    assert {"ScaledObject", "ServiceMonitor"} <= kinds["keda"] and "HorizontalPodAutoscaler" not in kinds["keda"]
    assert {"HorizontalPodAutoscaler", "ServiceMonitor"} <= kinds["hpa"] and "ScaledObject" not in kinds["hpa"]
    # with an autoscaler the Deployment leaves replicas to it
    assert "replicas" not in one(rendered["keda"], "Deployment")["spec"]
    assert one(rendered["default"], "Deployment")["spec"]["replicas"] == 2


def test_autoscalers_target_the_deployment_and_the_queue(rendered):
    so = one(rendered["keda"], "ScaledObject")
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "8"
    assert trigger["metadata"]["query"] == (
        f'sum(avg_over_time(batcher_queue_depth{{namespace="{NAMESPACE}",service="{FULLNAME}"}}[1m]))')
    # the ServiceMonitor gives the series the labels the query selects on (namespace, service of the endpoints)
    sm = one(rendered["keda"], "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "http" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    hpa = one(rendered["hpa"], "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == FULLNAME
    (metric,) = hpa["spec"]["metrics"]
    adapter = yaml.safe_load((DEPLOY / "autoscaling" / "prometheus-adapter-values.yaml").read_text())
    assert metric["pods"]["metric"]["name"] == adapter["rules"]["custom"][0]["name"]["as"]
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "50m"}


def test_routing_example_balances_on_least_request_and_retries_503_within_a_budget():
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "routing" / "istio.yaml").read_text())}
    host = f"{FULLNAME}.{NAMESPACE}.svc.cluster.local"
    rule = docs["DestinationRule"]["spec"]
    assert rule["host"] == host and rule["trafficPolicy"]["loadBalancer"]["simple"] == "LEAST_REQUEST"
    assert 0 < rule["trafficPolicy"]["retryBudget"]["percent"] <= 20
    (route,) = docs["VirtualService"]["spec"]["http"]
    assert "503" in route["retries"]["retryOn"].split(",") and route["retries"]["retryIgnorePreviousHosts"] is True
    svc = one(render(), "Service")
    assert route["route"][0]["destination"] == {"host": host, "port": {"number": svc["spec"]["ports"][0]["port"]}}


def test_kserve_runtime_serves_the_mounted_repository_on_v2():
    runtime = yaml.safe_load((DEPLOY / "kserve" / "cluster-serving-runtime.yaml").read_text())
    spec = runtime["spec"]
    assert spec["protocolVersions"] == ["v2"]
    (c,) = spec["containers"]
    assert c["name"] == "kserve-container"
    args = c["args"]
    assert args[args.index("--model-repository") + 1] == "/mnt/models"
    port = int(args[args.index("--port") + 1])
    assert c["ports"][0]["containerPort"] == port
    assert spec["annotations"] == {"prometheus.kserve.io/port": str(port), "prometheus.kserve.io/path": "/metrics"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert {"/v2/health/live", "/v2/health/ready"} <= _health_routes()
    isvc = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice.yaml").read_text())
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] == "v2"
    assert model["modelFormat"]["name"] in {f["name"] for f in spec["supportedModelFormats"]}
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] > (
        c["lifecycle"]["preStop"]["sleep"]["seconds"] + 30)  # + the server's default shutdown_grace_s


# ------------------------------------------------------------------------------------------ images


DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.gpu"]


def test_hadolint_passes_on_both_dockerfiles():
    r = _run(_tool("hadolint"), *map(str, DOCKERFILES))
    assert r.returncode == 0, r.stdout + r.stderr


def _instruction(dockerfile: Path, name: str) -> list[str]:
    """The exec-form (JSON) argument list of the last ``name`` instruction (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    found = [line.split(None, 1)[1] for line in text.splitlines() if line.upper().startswith(name + " ")]
    assert found, f"{dockerfile.name}: no {name}"
    return json.loads(found[-1])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_entrypoint_exists_and_parses_its_arguments(dockerfile):
    from batcher.cli import _parser

    entrypoint, cmd = _instruction(dockerfile, "ENTRYPOINT"), _instruction(dockerfile, "CMD")
    assert entrypoint == ["batcher", "serve", "--host", "0.0.0.0"]
    # the command exists (the console script pip installs) and takes these arguments
    r = _run(_tool(entrypoint[0]), *entrypoint[1:], *cmd, "--help")
    assert r.returncode == 0 and "--model-repository" in r.stdout, r.stderr
    # parsed in full by the real parser (--help would stop before unknown arguments are reported)
    args = _parser().parse_args(entrypoint[1:] + cmd)
    assert (args.command, args.host, args.config) == ("serve", "0.0.0.0", "/etc/trt-batcher/config.yaml")
    # ... and so are the arguments the chart and the KServe runtime give the same entrypoint
    chart_args = container(render(VALUES["default"], **{"modelRepository.volume": {"emptyDir": {}}}))["args"]
    args = _parser().parse_args(entrypoint[1:] + chart_args)
    assert (args.config, args.model_repository) == ("/etc/trt-batcher/config.yaml", "/mnt/models")
    runtime = yaml.safe_load((DEPLOY / "kserve" / "cluster-serving-runtime.yaml").read_text())
    args = _parser().parse_args(entrypoint[1:] + runtime["spec"]["containers"][0]["args"])
    assert (args.model_repository, args.port, args.config) == ("/mnt/models", 8080, None)
    # the healthcheck asks the live route; the zoo models are generated at build time
    text = dockerfile.read_text()
    assert "/v2/health/live" in text and "HEALTHCHECK" in text and "batcher zoo" in text
    assert re.search(r"^USER 10001", text, re.M)


# ------------------------------------------------------------------------------------------ scaling rules


def _promtool() -> str:
    explicit = os.environ.get("BATCHER_PROMTOOL")
    path = explicit or shutil.which("promtool") or ("/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK)
                                                    else None)
    return require_program(path, "promtool not found: apt-get install -y prometheus, or set BATCHER_PROMTOOL",
                           "BATCHER_REQUIRE_PROMETHEUS")


def test_scaling_rules_pass_promtool_check_and_unit_tests():
    promtool = _promtool()
    rules = DEPLOY / "autoscaling" / "scaling-rules.yml"
    r = _run(promtool, "check", "rules", str(rules))
    assert r.returncode == 0 and "SUCCESS: 5 rules found" in r.stdout, r.stdout + r.stderr
    r = _run(promtool, "test", "rules", str(rules.with_suffix(".test.yml")))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_chart_and_adapter_queries_evaluate_on_recorded_series(rendered, tmp_path):
    """The KEDA trigger's query as the chart renders it and prometheus-adapter's metricsQuery as the adapter expands
    it, evaluated by promtool on series as a ServiceMonitor scrape labels them."""
    promtool = _promtool()
    keda_query = one(rendered["keda"], "ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]
    adapter = yaml.safe_load((DEPLOY / "autoscaling" / "prometheus-adapter-values.yaml").read_text())
    metrics_query = adapter["rules"]["custom"][0]["metricsQuery"]
    # how the adapter expands it for `kubectl get --raw .../namespaces/serving/pods/*/batcher_queue_time_seconds`
    adapter_query = (metrics_query.replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{FULLNAME}-.*"')
                     .replace("<<.GroupBy>>", "pod"))
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": [
        {"record": "keda_query", "expr": keda_query}, {"record": "adapter_query", "expr": adapter_query}]}]}))

    def labels(pod: str, model: str, namespace: str = NAMESPACE, service: str = FULLNAME) -> str:
        return f'namespace="{namespace}",service="{service}",pod="{pod}",model="{model}",version="1"'

    a, b = f"{FULLNAME}-5d9c7-a", f"{FULLNAME}-5d9c7-b"
    series = [
        # queue depth: a: 3 + 1, b: 12 (16 in all: 2 replicas at a threshold of 8); another release's 50 not counted
        (f"batcher_queue_depth{{{labels(a, 'resnet18')}}}", "3x20"),
        (f"batcher_queue_depth{{{labels(a, 'tiny_cnn')}}}", "1x20"),
        (f"batcher_queue_depth{{{labels(b, 'resnet18')}}}", "12x20"),
        (f"batcher_queue_depth{{{labels('other-x', 'resnet18', service='other')}}}", "50x20"),
        # queue time: a: 2 requests per 15 s waiting 0.25 s in all (125 ms each), b: idle (0, not NaN)
        (f"batcher_queue_duration_seconds_sum{{{labels(a, 'resnet18')}}}", "0+0.25x20"),
        (f"batcher_queue_duration_seconds_count{{{labels(a, 'resnet18')}}}", "0+2x20"),
        (f"batcher_queue_duration_seconds_sum{{{labels(b, 'resnet18')}}}", "0x20"),
        (f"batcher_queue_duration_seconds_count{{{labels(b, 'resnet18')}}}", "0x20"),
        (f"batcher_queue_duration_seconds_sum{{{labels('other-x', 'resnet18', namespace='other')}}}", "0+9x20"),
        (f"batcher_queue_duration_seconds_count{{{labels('other-x', 'resnet18', namespace='other')}}}", "0+1x20"),
    ]
    test = {"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "promql_expr_test": [
            {"expr": "keda_query", "eval_time": "4m", "exp_samples": [{"labels": "keda_query", "value": 16}]},
            {"expr": "adapter_query", "eval_time": "4m", "exp_samples": [
                {"labels": f'adapter_query{{pod="{a}"}}', "value": 0.125},
                {"labels": f'adapter_query{{pod="{b}"}}', "value": 0}]},
        ]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    r = _run(promtool, "test", "rules", str(tmp_path / "test.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
