"""Every query the deployment reads returns data from a real Prometheus scraping a live server.

A `specserve serve` subprocess on the tiny (target, noisy-copy draft) pair with draft-model
speculation (a static gamma, whose plans the cost tables price too) is scraped every
second by Debian's `prometheus` (the package `make test` installs for promtool), with the target
labels the Prometheus Operator's ServiceMonitor would add (namespace, pod). Client threads drive a
mix of streaming and non-streaming completions and chat completions, some with n > 1, some under a
JSON schema (structured outputs), and streams
that the client drops mid-way (aborts), for ~12 s. Then each expression of each Grafana panel (its
variables filled in as Grafana would), the dashboard's variable query, and the prometheus-adapter
rule the HPA reads (seriesQuery, and metricsQuery with its templates expanded for the pod) is
evaluated through Prometheus' HTTP API and must succeed with a non-empty result of finite values.

Nothing is exempt: every series the dashboard reads exists under this load (counters and histograms
by finish reason, preemptions, k = 0 buckets are created at 0 from the start; rates of them are 0,
not absent). Should an expression ever have to be exempted, it goes in NO_DATA_EXPECTED with the
reason, and the test checks that exactly those return nothing.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from ci import require_tool
from conftest import ServerProcess, free_port, stop_process
from promql import (adapter_rules, dashboard_queries, expand_adapter_query, fill_grafana_variables,
                    hpa_metric_names, load_dashboard, template_variable_queries)

pytestmark = pytest.mark.slow   # a real server scraped by a real Prometheus

MODEL = "tiny-live"
NAMESPACE, POD = "specserve-test", "specserve-0"   # target labels, as the ServiceMonitor's scrape adds them
LOAD_SECONDS = 12
RATE_INTERVAL = "10s"   # $__rate_interval: well inside the load, >= 4 scrapes (Grafana's own minimum)
CLIENTS = 3

# {(panel title, refId): why it returns nothing under this test's load}. Empty: every query has data.
NO_DATA_EXPECTED: dict[tuple[str, str], str] = {}


# ---------------------------------------------------------------------------- processes

@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    return require_tool("prometheus", "apt-get install -y --no-install-recommends prometheus",
                        path="/usr/bin/prometheus")


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    # A static gamma: every query needs drafts in the load's last window, and the adaptive policy
    # may rightly stop drafting a tiny pair (its draft forward costs what the target's does), so its
    # drafts came from probes and first looks alone and a window could miss them.
    spec = json.dumps({"method": "draft", "draft": {"model": str(draft)}, "num_speculative_tokens": 3, "adaptive": False})
    log = tmp_path_factory.mktemp("live_server") / "server.log"
    process = ServerProcess(["--model", str(target), "--served-model-name", MODEL, "--dtype", "float32",
                             "--speculative-config", spec, "--max-num-seqs", "4"], log_path=log).start()
    try:
        yield process
    finally:
        process.stop()


class Prometheus:
    def __init__(self, binary: str, tmp_path, scrape_target: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{
                "job_name": "specserve", "metrics_path": "/metrics",
                "static_configs": [{"targets": [scrape_target], "labels": {"namespace": NAMESPACE, "pod": POD}}],
            }],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = tmp_path / "prometheus.log"
        self.command = [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                        f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                        "--log.level=warn"]
        self.process: subprocess.Popen | None = None

    def start(self) -> "Prometheus":
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout} s:\n{self.log()}")

    def wait_target_up(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            targets = httpx.get(self.url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            if targets and all(t["health"] == "up" for t in targets):
                return
            time.sleep(0.3)
        raise RuntimeError(f"scrape target not up after {timeout} s: {targets}\n{self.log()}")

    def query(self, expr: str, at: float) -> dict:
        """An instant query evaluated at unix time `at`."""
        response = httpx.get(self.url + "/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{expr!r}: {response.text}"
        return body["data"]

    def stop(self) -> None:
        stop_process(self.process)


# ---------------------------------------------------------------------------- load

FLAG_FORMAT = {"type": "json_schema", "json_schema": {"name": "flag", "schema": {
    "type": "object", "properties": {"a_rather_long_flag_name": {"enum": ["raised", "lowered"]}},
    "required": ["a_rather_long_flag_name"], "additionalProperties": False}}}


def _requests(i: int) -> list[tuple[str, dict]]:
    """One round of a client's mix: (path, body) of completions and chat, streaming or not, n > 1."""
    seed = {"seed": i} if i % 2 else {"temperature": 0}
    return [
        ("/v1/completions", {"prompt": f"def f{i}(x):", "max_tokens": 12, "ignore_eos": True, **seed}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": 10,
                                  "n": 2, "ignore_eos": True, "temperature": 1.0, "seed": i}),
        ("/v1/completions", {"prompt": "for i in range(", "max_tokens": 14, "stream": True, "ignore_eos": True,
                             "stream_options": {"include_usage": True}, **seed}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 10,
                                  "stream": True, "n": 2, "temperature": 0.8, "seed": i}),
        # structured: a grammar compiled (cached after the first), masks, and forced tokens drafted
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"flag {i}"}], "max_tokens": 32,
                                  "response_format": FLAG_FORMAT, **seed}),
    ]


def _abort_stream(client: httpx.Client, i: int) -> None:
    """A stream the client drops after its first chunk: the server aborts the request."""
    body = {"model": MODEL, "prompt": f"abort {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        next(response.iter_lines())


def drive_load(url: str, seconds: float) -> dict[str, int]:
    """CLIENTS threads sending _requests rounds (and an aborted stream per round) until `seconds` pass."""
    deadline = time.monotonic() + seconds
    counts = {"ok": 0, "aborted": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def client_loop(worker: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            i = worker
            while time.monotonic() < deadline and not errors:
                try:
                    for path, body in _requests(i):
                        if body.get("stream"):
                            with client.stream("POST", path, json={"model": MODEL, **body}) as response:
                                assert response.status_code == 200, response.read()
                                lines = [line for line in response.iter_lines() if line]
                            assert lines[-1] == "data: [DONE]", lines[-3:]
                        else:
                            response = client.post(path, json={"model": MODEL, **body})
                            assert response.status_code == 200, response.text
                        with lock:
                            counts["ok"] += 1
                    _abort_stream(client, i)
                    with lock:
                        counts["aborted"] += 1
                except Exception as exc:   # reported by the main thread
                    errors.append(f"client {worker}: {type(exc).__name__}: {exc}")
                i += CLIENTS

    threads = [threading.Thread(target=client_loop, args=(w,), daemon=True) for w in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 120)
    assert not errors, errors
    return counts


# ---------------------------------------------------------------------------- the test

def _values(data: dict) -> list[float]:
    if data["resultType"] in ("vector", "matrix"):
        return [float(v[1]) for r in data["result"] for v in ([r["value"]] if "value" in r else r["values"])]
    return [float(data["result"][1])]   # scalar


def check_dashboard(prometheus: Prometheus, at: float) -> tuple[list[str], set, dict[str, float]]:
    """(failures, (panel, refId) pairs with no data, {finished_reason: rate}) of every panel target,
    for Grafana's "All" models and for the one model picked."""
    failures, no_data, finished = [], set(), {}
    for title, ref_id, expr in dashboard_queries(load_dashboard()):
        for model_name in (".*", MODEL):
            query = fill_grafana_variables(expr, rate_interval=RATE_INTERVAL, range_="1h", interval="1s",
                                           model_name=model_name)
            data = prometheus.query(query, at)
            values = _values(data)
            if title == "Finished requests/s":
                finished = {r["metric"]["finished_reason"]: float(r["value"][1]) for r in data["result"]}
            if not values:
                no_data.add((title, ref_id))
                if (title, ref_id) not in NO_DATA_EXPECTED:
                    failures.append(f"panel {title!r} target {ref_id}: no data for {query}")
            elif not all(math.isfinite(v) for v in values):
                failures.append(f"panel {title!r} target {ref_id}: {values} for {query}")
    return failures, no_data, finished


def check_hpa_metrics(prometheus: Prometheus, at: float) -> list[str]:
    """The HPA's custom metrics, as prometheus-adapter discovers (seriesQuery, name.matches) and
    computes them (metricsQuery expanded) for this pod: one finite value, labelled with the pod."""
    failures = []
    rules = {rule["name"]["as"]: rule for rule in adapter_rules()}
    metrics = hpa_metric_names()
    assert metrics and set(metrics) <= rules.keys(), (metrics, rules.keys())
    for metric in metrics:
        rule = rules[metric]
        series = httpx.get(prometheus.url + "/api/v1/series", params={"match[]": rule["seriesQuery"]}).json()
        names = {s["__name__"] for s in series["data"]}
        found = [name for name in names if re.fullmatch(rule["name"]["matches"], name)]
        if len(found) != 1:
            failures.append(f"adapter seriesQuery {rule['seriesQuery']!r} found {sorted(names)} for {metric}")
            continue
        resources = {override["resource"]: label for label, override in rule["resources"]["overrides"].items()}
        assert resources.keys() == {"namespace", "pod"}, resources
        for pods in ([POD], [POD, "specserve-1"]):   # one pod, and the regex the adapter writes for several
            query = expand_adapter_query(rule["metricsQuery"], found[0],
                                         {resources["namespace"]: NAMESPACE, resources["pod"]: pods},
                                         [resources["pod"]])
            result = prometheus.query(query, at)
            pods_seen = [r["metric"].get(resources["pod"]) for r in result["result"]]
            if pods_seen != [POD] or not all(math.isfinite(v) for v in _values(result)):
                failures.append(f"HPA metric {metric}: {result['result']} for {query}")
    return failures


def test_every_deployed_query_returns_data(server, prometheus_bin, tmp_path):
    started = time.monotonic()
    prometheus = Prometheus(prometheus_bin, tmp_path, f"127.0.0.1:{server.port}").start()
    try:
        prometheus.wait_ready()
        server.wait_ready()
        prometheus.wait_target_up()
        counts = drive_load(server.url, LOAD_SECONDS)
        assert counts["ok"] >= 8 and counts["aborted"] >= 2, counts
        time.sleep(1.5)   # the last scrape after the load
        at = time.time() - 1.0   # every query sees the same window: the load's last RATE_INTERVAL

        # the $model_name variable: Grafana's label_values() query, through the labels API
        variables = {}
        for name, query in template_variable_queries(load_dashboard()):
            metric, label = (part.strip() for part in query.removeprefix("label_values(").removesuffix(")").split(","))
            response = httpx.get(f"{prometheus.url}/api/v1/label/{label}/values", params={"match[]": metric})
            variables[name] = response.json()["data"]
        assert variables == {"model_name": [MODEL]}

        failures, no_data, finished = check_dashboard(prometheus, at)
        failures += check_hpa_metrics(prometheus, at)
        assert not failures, "\n".join(failures) + f"\n(prometheus log)\n{prometheus.log()}"
        assert no_data == set(NO_DATA_EXPECTED), no_data
        assert finished["length"] > 0 and finished["abort"] > 0, finished   # the dropped streams show
    finally:
        prometheus.stop()
    print(f"load {counts}, {time.monotonic() - started:.1f} s")
