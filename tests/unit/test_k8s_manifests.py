"""The Kubernetes manifests in ``deploy/k8s`` render, validate, and run kiln as it is.

Each overlay is rendered by :func:`render`, a small Python implementation of the part of
kustomize the manifests use (``resources`` and strategic-merge ``patches``), so the test
needs no binary; where ``kubectl`` or ``kustomize`` is installed, the render must equal
theirs. Every built-in object is validated offline against the Kubernetes schemas with the
``kubernetes-validate`` package (strict: unknown fields fail). The KEDA ``ScaledObject``,
a custom resource those schemas lack, is checked field by field. Then, as
``test_deploy_files.py`` does for systemd and Compose: every container's command line
parses with the real CLI, every ``KILN_*`` variable it gets is one its command reads, and
the values are ones ``Settings.from_env`` accepts.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from test_deploy_files import _check_vars, _dockerfile_entrypoint, _parse

from kiln.api.metrics import DwellHistogram, StoreCollector, StoreSnapshot
from kiln.autoscaling import Autoscaling, KindSignals, PoolSignals
from kiln.config import Settings
from kiln.demo import KIND as IMAGE_GENERATE

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("sqlite", "postgres-s3", "comfy")
#: The oldest Kubernetes the manifests are written for (policy/v1, autoscaling/v2).
KUBERNETES_VERSION = "1.30.0"
#: Strategic merge: lists merged item by item on this key; any other list is replaced.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
#: Shutdown grace + this: the give-back writes, the requests in flight, closing the pool
#: (docs/deployment.md, "Grace periods").
DRAIN_MARGIN_S = 10
Manifest = dict[str, Any]


# rendering


def _documents(path: Path) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _identity(obj: Manifest) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _merge(base: Manifest, patch: Manifest) -> None:
    """Strategic merge of ``patch`` into ``base``, for the shapes these manifests use."""
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(base.get(key), list):
            _merge_list(base[key], value, MERGE_KEYS[key])
        else:
            base[key] = copy.deepcopy(value)


def _merge_list(base: list[Manifest], patch: list[Manifest], key: str) -> None:
    """Items merged on ``key``; new ones come first, as kustomize orders them."""
    by_key = {item[key]: item for item in base}
    added = []
    for item in patch:
        if item[key] in by_key:
            _merge(by_key[item[key]], item)
        else:
            added.append(copy.deepcopy(item))
    base[:0] = added


def render(folder: Path) -> list[Manifest]:
    """The objects ``kustomize build folder`` makes, for ``resources`` and ``patches``."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - {"apiVersion", "kind", "resources", "patches"}
    assert not unsupported, f"{folder}: render() does not implement {sorted(unsupported)}"
    objects: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        objects += render(path) if path.is_dir() else _documents(path)
    names = [_identity(obj) for obj in objects]
    assert len(names) == len(set(names)), f"{folder}: an object is defined twice"
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{folder}: only file patches are rendered: {patch}"
        for doc in _documents(folder / patch["path"]):
            [target] = [obj for obj in objects if _identity(obj) == _identity(doc)]
            _merge(target, doc)
    return objects


@cache
def rendered(overlay: str) -> dict[tuple[str, str], Manifest]:
    return {_identity(obj): obj for obj in render(K8S / "overlays" / overlay)}


def _kustomize_command(folder: Path) -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build", str(folder)]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize", str(folder)]
    return None


# reading the objects


def _deployments(overlay: str) -> dict[str, Manifest]:
    return {name: obj for (kind, name), obj in rendered(overlay).items() if kind == "Deployment"}


def _container(deployment: Manifest) -> Manifest:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _environment(overlay: str, container: Manifest) -> dict[str, str]:
    """The variables the container gets: its envFrom sources, then its own env."""
    objects = rendered(overlay)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(objects["ConfigMap", source["configMapRef"]["name"]]["data"])
        else:
            env.update(objects["Secret", source["secretRef"]["name"]]["stringData"])
    for item in container.get("env", []):
        env[item["name"]] = item["value"]
    return env


def _command(container: Manifest) -> tuple[str, dict[str, Any]]:
    assert "command" not in container, "the image's entrypoint (kiln) must run"
    assert _dockerfile_entrypoint() == ["kiln"]
    return _parse(list(container["args"]))


def _grace_s(env: dict[str, str]) -> float:
    return Settings.from_env(env).shutdown_grace_s


def _probe(container: Manifest, name: str) -> tuple[str, int]:
    """(path, port number) of an httpGet probe; a named port is looked up."""
    get = container[name]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    port = get["port"]
    return get["path"], ports[port] if isinstance(port, str) else port


def _selects(selector: dict[str, str], deployment: Manifest) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return selector.items() <= labels.items()


def _api_metric_names() -> set[str]:
    """The metric names the API's /metrics shows, autoscaling families included."""
    collector = StoreCollector(DwellHistogram())
    signals = Autoscaling({IMAGE_GENERATE: KindSignals()}, {"gpu": PoolSignals()})
    collector.snapshot = StoreSnapshot(autoscaling=signals)
    return {family.name for family in collector.collect()}


# the tests


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_python_render_equals_kustomize(overlay: str) -> None:
    # Given a kustomize binary (kubectl has one built in)
    folder = K8S / "overlays" / overlay
    command = _kustomize_command(folder)
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: the Python render is used")
    # When it renders the overlay
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    # Then it makes the same objects as render()
    theirs = {_identity(obj): obj for obj in yaml.safe_load_all(output) if obj}
    assert theirs == rendered(overlay)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    # Given the rendered overlay
    for (kind, name), obj in rendered(overlay).items():
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # a custom resource: test_keda_scales_the_workers_on_kiln_metrics
        # Then each object is valid, unknown fields included, for the oldest Kubernetes
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        # And a Deployment's selector picks its own pods
        if kind == "Deployment":
            assert _selects(obj["spec"]["selector"]["matchLabels"], obj), name


def test_the_hpa_example_validates() -> None:
    for obj in _documents(K8S / "extras" / "hpa-external.yaml"):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["spec"]["scaleTargetRef"]["name"] in _deployments("postgres-s3")
        # The adapter rule that serves its metric is in the autoscaling guide
        metric = obj["spec"]["metrics"][0]["external"]["metric"]["name"]
        assert metric in (ROOT / "docs" / "autoscaling.md").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_run_kiln_commands_with_settings_they_read(overlay: str) -> None:
    for name, deployment in _deployments(overlay).items():
        # Given a container, its command line and its environment
        container = _container(deployment)
        command, _ = _command(container)  # Then the real CLI parses it
        env = _environment(overlay, container)
        # And it gets only variables its command reads, with values kiln accepts
        _check_vars(f"{overlay}: {name}", set(env), command)
        Settings.from_env(env)
        # And an API listening beyond loopback has keys (else kiln serve refuses to start)
        if command == "serve":
            assert env.get("KILN_API_KEYS") or env.get("KILN_ADMIN_KEY"), name


def test_sqlite_runs_one_serve_pod_on_its_volume() -> None:
    # Given the one-node overlay
    deployments = _deployments("sqlite")
    [serve] = deployments.values()
    container = _container(serve)
    env = _environment("sqlite", container)
    command, options = _command(container)
    # Then one kiln serve runs everything, never two at once
    assert (command, options["no_workers"], options["no_supervisor"]) == ("serve", False, False)
    assert serve["spec"]["replicas"] == 1
    assert serve["spec"]["strategy"] == {"type": "Recreate"}
    # And the database and results live in the data dir, on the claim
    assert "KILN_DATABASE_URL" not in env and "KILN_STORAGE_URL" not in env
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in serve["spec"]["template"]["spec"]["volumes"]}
    claim = volumes["data"]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in rendered("sqlite")
    assert mounts["data"] == env["KILN_DATA_DIR"]
    # And its in-process workers have time to drain
    grace_s = serve["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s >= _grace_s(env) + DRAIN_MARGIN_S


def test_api_pods_are_probed_on_healthz_and_readyz() -> None:
    for overlay in OVERLAYS:
        api = _deployments(overlay)["kiln-api"]
        container = _container(api)
        _, options = _command(container)
        # Then liveness asks whether the process answers, readiness whether it can serve
        assert _probe(container, "livenessProbe") == ("/healthz", options["port"])
        assert _probe(container, "startupProbe") == ("/healthz", options["port"])
        assert _probe(container, "readinessProbe") == ("/readyz", options["port"])
        # And the readiness timeout is above /readyz's own 5 s
        assert container["readinessProbe"]["timeoutSeconds"] > 5
        service = rendered(overlay)["Service", "kiln-api"]
        assert _selects(service["spec"]["selector"], api)
        assert service["spec"]["ports"][0]["targetPort"] in {"http", options["port"]}


def test_postgres_layout_runs_api_nodes_gpu_workers_and_two_supervisors() -> None:
    deployments = _deployments("postgres-s3")
    commands = {name: _command(_container(d)) for name, d in deployments.items()}
    # Then the API nodes run no workers and no supervisor, two or more of them
    assert commands["kiln-api"][0] == "serve"
    assert commands["kiln-api"][1]["no_workers"] and commands["kiln-api"][1]["no_supervisor"]
    assert deployments["kiln-api"]["spec"]["replicas"] >= 2
    # And two supervisors run
    assert commands["kiln-supervisor"][0] == "supervisor"
    assert deployments["kiln-supervisor"]["spec"]["replicas"] == 2
    # And the store is PostgreSQL, the storage S3
    env = _environment("postgres-s3", _container(deployments["kiln-api"]))
    assert env["KILN_DATABASE_URL"].startswith("postgresql://")
    assert env["KILN_STORAGE_URL"].startswith("s3://")


def test_workers_get_a_gpu_and_the_time_their_drain_takes() -> None:
    worker = _deployments("postgres-s3")["kiln-worker"]
    container = _container(worker)
    command, options = _command(container)
    env = _environment("postgres-s3", container)
    assert command == "worker"
    # Then each asks for one GPU (an extended resource: request and limit alike)
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert options["gpus"] == 1
    # And Kubernetes waits out the drain before its SIGKILL
    grace_s = worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s >= _grace_s(env) + DRAIN_MARGIN_S
    # And a rolling update stops a worker before it starts another (no spare GPU needed)
    assert worker["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}


def test_worker_and_supervisor_probes_use_their_metrics_port() -> None:
    # A worker and a supervisor serve no /healthz or /readyz: only /metrics on --metrics-port
    for name in ("kiln-worker", "kiln-supervisor"):
        container = _container(_deployments("postgres-s3")[name])
        _, options = _command(container)
        env = _environment("postgres-s3", container)
        assert options["metrics_port"] is not None, name
        assert Settings.from_env(env).metrics_host == "0.0.0.0", name
        for probe in ("startupProbe", "livenessProbe"):
            assert _probe(container, probe) == ("/metrics", options["metrics_port"]), name
        assert "readinessProbe" not in container, f"{name} takes no traffic"


@pytest.mark.parametrize("overlay", ["postgres-s3", "comfy"])
def test_disruption_budgets_cover_every_deployment(overlay: str) -> None:
    objects = rendered(overlay)
    deployments = _deployments(overlay)
    budgets = [obj for (kind, _), obj in objects.items() if kind == "PodDisruptionBudget"]
    covered = {
        name
        for budget in budgets
        for name, deployment in deployments.items()
        if _selects(budget["spec"]["selector"]["matchLabels"], deployment)
    }
    assert covered == set(deployments)
    assert len(budgets) == len(deployments), "one budget per Deployment"


def test_keda_scales_the_workers_on_kiln_metrics() -> None:
    # Given the ScaledObject of the postgres-s3 overlay
    scaled = rendered("postgres-s3")["ScaledObject", "kiln-worker"]
    spec = scaled["spec"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    # Then it scales the worker Deployment, within bounds
    assert spec["scaleTargetRef"] == {"name": "kiln-worker"}
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert set(meta) <= {"serverAddress", "query", "threshold", "activationThreshold",
                         "metricType"}  # fmt: skip
    # And its query reads backlog and running work, metrics the API shows, of a real kind
    names = set(re.findall(r"\b(kiln_[a-z_]+)\{", meta["query"]))
    assert names == {"kiln_queue_waiting", "kiln_queue_running"}
    assert names <= _api_metric_names()
    assert set(re.findall(r'kind="([^"]+)"', meta["query"])) == {IMAGE_GENERATE}
    # And the threshold is the slots of one worker
    _, options = _command(_container(_deployments("postgres-s3")["kiln-worker"]))
    assert float(meta["threshold"]) == options["concurrency"]
    assert meta["metricType"] == "AverageValue"


def test_comfy_pods_pair_one_comfyui_on_a_gpu_with_the_worker_that_drives_it() -> None:
    # Given the comfy overlay's ComfyUI pods
    objects = rendered("comfy")
    pod = _deployments("comfy")["kiln-comfy-worker"]
    spec = pod["spec"]["template"]["spec"]
    [comfyui] = spec["initContainers"]
    kiln = _container(pod)
    command, options = _command(kiln)
    env = _environment("comfy", kiln)
    # Then N of them run (a rolling update frees a GPU before it takes one)
    assert pod["spec"]["replicas"] >= 2
    assert pod["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    # And ComfyUI is a sidecar that starts first and stops last, with the pod's one GPU
    assert comfyui["restartPolicy"] == "Always" and "startupProbe" in comfyui
    resources = comfyui["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(kiln["resources"])
    # And the kiln worker claims comfy.workflow jobs one at a time from that instance
    assert command == "worker"
    assert (options["kinds"], options["concurrency"]) == ("comfy.workflow", 1)
    url = urlparse(Settings.from_env(env).comfyui_url)
    argv = comfyui["args"]
    assert url.hostname == argv[argv.index("--listen") + 1] == "127.0.0.1"
    assert url.port == int(argv[argv.index("--port") + 1]) == comfyui["ports"][0]["containerPort"]
    assert _probe(comfyui, "startupProbe")[1] == url.port
    # And it drains before its pod is killed, on the same database and bucket as the API
    assert spec["terminationGracePeriodSeconds"] >= _grace_s(env) + DRAIN_MARGIN_S
    api_env = _environment("comfy", _container(_deployments("comfy")["kiln-api"]))
    for name in ("KILN_DATABASE_URL", "KILN_STORAGE_URL"):
        assert env[name] == api_env[name]
    # And the models volume is a claim the overlay makes
    volumes = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in volumes]
    assert claims and all(("PersistentVolumeClaim", c) in objects for c in claims)


def test_the_other_workers_leave_comfy_workflow_jobs_to_the_comfyui_pods() -> None:
    # Given the comfy overlay's kiln workers
    kinds = {
        name: _command(_container(d))[1]["kinds"]
        for name, d in _deployments("comfy").items()
        if _command(_container(d))[0] == "worker"
    }
    # Then only the ComfyUI pods name the kind (a worker without --kinds never claims it)
    assert kinds == {"kiln-worker": None, "kiln-comfy-worker": "comfy.workflow"}
