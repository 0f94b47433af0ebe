"""The reference deploy files set only settings kiln reads and run only commands it has.

The systemd units, ``kiln.env.example`` and ``compose.yaml`` in ``deploy/`` are read as an
operator would use them. Every ``KILN_*`` variable they set must be one that
``Settings.from_env`` reads or that an option of the kiln command they run reads, and
every kiln command line in them must parse with the real CLI, flags and values included.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import typer.main
import yaml

from kiln.cli import cli
from kiln.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
ENV_EXAMPLE = SYSTEMD / "kiln.env.example"
GUIDE = ROOT / "docs" / "deployment.md"

KILN_VAR = re.compile(r"\bKILN_[A-Z0-9_]+\b")
ENV_LINE = re.compile(r"^(?P<comment>#\s*)?(?P<name>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")
AWS_VARS = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"})
PROCESSES = ("serve", "worker", "supervisor", "reconcile")

#: Settings docs/deployment.md documents that kiln does not read yet. They may appear in
#: the guide and, commented out, in kiln.env.example; no deploy file may set them. Once
#: kiln reads one, remove it from here: test_pending_settings_are_not_read_yet fails
#: until then.
PENDING: frozenset[str] = frozenset()


# what kiln reads


class _RecordingEnv(Mapping[str, str]):
    """An empty environment that remembers every name looked up in it."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.names.add(name)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _config_vars() -> set[str]:
    """The variables ``Settings.from_env`` looks up."""
    env = _RecordingEnv()
    Settings.from_env(env)
    return env.names


def _commands() -> dict[str, Any]:
    """The CLI's commands by name (Typer's own click objects)."""
    commands: dict[str, Any] = typer.main.get_command(cli).commands  # type: ignore[attr-defined]
    return commands


def _cli_vars(command: str) -> set[str]:
    """The variables the options of ``kiln <command>`` read."""
    names: set[str] = set()
    for param in _commands()[command].params:
        envvar = param.envvar
        names.update([envvar] if isinstance(envvar, str) else envvar or [])
    return names


def _readable_by(command: str) -> set[str]:
    return _config_vars() | _cli_vars(command)


def _parse(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse ``kiln <argv>`` as the CLI would, without running it: (command, options)."""
    name, *rest = argv
    command = _commands().get(name)
    assert command is not None, f"kiln has no command {name!r}"
    with command.make_context(f"kiln {name}", rest) as ctx:
        return name, dict(ctx.params)


# reading the files


def _unit(path: Path) -> dict[str, list[str]]:
    """The ``Key=value`` lines of a systemd unit by key (keys may repeat)."""
    lines: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        assert not line.endswith("\\"), f"{path.name}: continued lines are not checked"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a Key=value line: {line!r}"
        lines.setdefault(key.strip(), []).append(value.strip())
    return lines


def _expand(value: str, instance: str) -> str:
    """Expand ``%i``; any other specifier or a ``$`` variable is beyond this test."""
    expanded = value.replace("%%", "\0").replace("%i", instance)
    assert "%" not in expanded and "$" not in expanded, f"cannot check {value!r}"
    return expanded.replace("\0", "%")


def _exec_start(path: Path, instance: str = "0") -> list[str]:
    """The kiln arguments of a unit's ExecStart= (after the ``kiln`` executable)."""
    [line] = _unit(path)["ExecStart"]
    argv = shlex.split(_expand(line.lstrip("-@:+!"), instance))
    assert Path(argv[0]).name == "kiln", f"{path.name} does not run kiln: {argv[0]}"
    return argv[1:]


def _env_file(path: Path) -> tuple[dict[str, str], set[str]]:
    """(the variables a file sets, the names of its commented-out ``# NAME=`` lines)."""
    assigned: dict[str, str] = {}
    commented: set[str] = set()
    for line in path.read_text().splitlines():
        match = ENV_LINE.match(line.strip())
        if match is None:
            continue
        if match["comment"]:
            commented.add(match["name"])
        else:
            assigned[match["name"]] = match["value"]
    return assigned, commented


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return loaded


def _kiln_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = _compose()["services"]
    return {
        name: service
        for name, service in services.items()
        if "build" in service or str(service.get("image", "")).startswith("kiln")
    }


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _dockerfile_entrypoint() -> list[str]:
    match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert match is not None, "deploy/Dockerfile has no exec-form ENTRYPOINT"
    entrypoint: list[str] = json.loads(match[1])
    return entrypoint


def _compose_command(service: dict[str, Any]) -> list[str]:
    entrypoint = service.get("entrypoint") or _dockerfile_entrypoint()
    assert entrypoint == ["kiln"], f"a kiln service runs {entrypoint}"
    command = service.get("command")
    return shlex.split(command) if isinstance(command, str) else list(command)


def _check_vars(where: str, names: set[str], command: str) -> None:
    unknown = {n for n in names if n.startswith("KILN_")} - _readable_by(command)
    assert not unknown, f"{where} sets {sorted(unknown)}, which `kiln {command}` never reads"
    others = {n for n in names if not n.startswith("KILN_")} - AWS_VARS
    assert not others, f"{where} sets {sorted(others)}, which kiln does not read"


# the tests


def test_settings_are_found_by_looking_them_up() -> None:
    # Given an environment that records lookups, When Settings.from_env runs on it
    names = _config_vars()

    # Then it saw the settings every process needs (the recording works)
    assert {"KILN_DATABASE_URL", "KILN_STORAGE_URL", "KILN_LEASE_TTL"} <= names


def test_pending_settings_are_not_read_yet() -> None:
    # Given every variable config.py and the process commands read
    read = _config_vars().union(*(_cli_vars(c) for c in PROCESSES))

    # Then no PENDING setting is among them; one that is must leave the PENDING list
    now_read = sorted(PENDING & read)
    assert not now_read, f"kiln reads {now_read} now: remove them from PENDING in this file"


def test_systemd_units_run_kiln_commands_that_exist_with_their_flags() -> None:
    # Given every systemd service unit in deploy/systemd
    units = sorted(SYSTEMD.glob("*.service"))

    # When each ExecStart= is parsed by the real CLI (worker instances 0 and 7)
    parsed = {path.name: _parse(_exec_start(path)) for path in units}
    _parse(_exec_start(SYSTEMD / "kiln-worker@.service", instance="7"))

    # Then each parses, and the units run an API-only node, a worker and a supervisor
    commands = {name: command for name, (command, _) in parsed.items()}
    assert commands == {
        "kiln-api.service": "serve",
        "kiln-worker@.service": "worker",
        "kiln-supervisor.service": "supervisor",
        "kiln-reconcile.service": "reconcile",
    }
    assert parsed["kiln-api.service"][1]["no_workers"] is True
    assert parsed["kiln-api.service"][1]["host"] == "0.0.0.0"
    assert parsed["kiln-reconcile.service"][1]["repair"] is True


def test_systemd_units_are_hardened_and_stop_gracefully() -> None:
    for path in sorted(SYSTEMD.glob("*.service")):
        # Given a unit
        unit = _unit(path)

        # Then it runs as kiln, with the shared settings, on a read-only system
        assert unit["User"] == ["kiln"], path.name
        assert unit["EnvironmentFile"] == ["/etc/kiln/kiln.env"], path.name
        assert unit["NoNewPrivileges"] == ["yes"], path.name
        assert unit["ProtectSystem"] == ["strict"], path.name
        assert "/var/lib/kiln" in unit["ReadWritePaths"], path.name
        assert unit["KillSignal"] == ["SIGTERM"], path.name
        assert float(unit["TimeoutStopSec"][0]) >= 10, path.name
        if unit.get("Type") != ["oneshot"]:
            assert unit["Restart"] == ["on-failure"], path.name


def test_worker_unit_gets_one_gpu_and_time_to_give_its_attempts_back() -> None:
    # Given the templated worker unit
    unit = _unit(SYSTEMD / "kiln-worker@.service")

    # Then instance i sees GPU i only, and the GPU device nodes stay reachable
    assert "CUDA_VISIBLE_DEVICES=%i" in unit["Environment"]
    hiding_devices = {"PrivateDevices", "ProtectClock", "DeviceAllow", "DevicePolicy"}
    assert not hiding_devices & unit.keys(), sorted(hiding_devices & unit.keys())
    # And a stop leaves room for the give-back writes (2 s each) before a SIGKILL
    assert float(unit["TimeoutStopSec"][0]) >= 30


def test_units_and_env_example_set_only_settings_kiln_reads() -> None:
    # Given the shared EnvironmentFile and each unit's own Environment= lines
    assigned, commented = _env_file(ENV_EXAMPLE)
    commands = {_exec_start(p)[0] for p in SYSTEMD.glob("*.service")}

    # Then every variable set is read by config.py or by one of the units' commands
    readable = set().union(*(_readable_by(c) for c in commands))
    unknown = {n for n in assigned if n.startswith("KILN_")} - readable
    assert not unknown, f"kiln.env.example sets {sorted(unknown)}, which kiln never reads"
    assert not set(assigned) - readable - AWS_VARS
    assert {"KILN_DATABASE_URL", "KILN_STORAGE_URL"} | AWS_VARS <= set(assigned)
    # And the optional (commented) ones are read too, or explicitly pending
    assert not {n for n in commented if n.startswith("KILN_")} - readable - PENDING
    assert not PENDING & set(assigned), "a pending setting is set: kiln would ignore it"
    for path in SYSTEMD.glob("*.service"):
        names = {e.partition("=")[0] for e in _unit(path).get("Environment", [])}
        _check_vars(path.name, names - {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"},
                    _exec_start(path)[0])  # fmt: skip


def test_compose_runs_kiln_commands_that_exist_with_settings_they_read() -> None:
    # Given the kiln services of compose.yaml
    services = _kiln_services()
    assert services, "compose.yaml has no kiln service"
    parsed: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, service in services.items():
        # When its command is parsed by the real CLI
        parsed[name] = _parse(_compose_command(service))

        # Then it parses, and it sets only settings its command reads
        _check_vars(f"compose service {name}", set(_environment(service)), parsed[name][0])

    # And the layout is the guide's: two API-only nodes, a worker, two supervisors
    api = [n for n, (cmd, opts) in parsed.items() if cmd == "serve" and opts["no_workers"]]
    assert len(api) >= 2
    assert any(cmd == "worker" for cmd, _ in parsed.values())
    supervisors = [services[n] for n, (cmd, _) in parsed.items() if cmd == "supervisor"]
    assert sum(s.get("deploy", {}).get("replicas", 1) for s in supervisors) >= 2


def test_compose_backing_services_match_the_kiln_settings() -> None:
    # Given the compose file and the settings its kiln services share
    compose = _compose()
    env = _environment(next(iter(_kiln_services().values())))
    storage = urlparse(env["KILN_STORAGE_URL"])

    # Then the database is health-checked before kiln starts on it
    assert urlparse(env["KILN_DATABASE_URL"]).hostname == "postgres"
    assert "healthcheck" in compose["services"]["postgres"]
    # And the bucket kiln uses is the one created, with the key pair SeaweedFS accepts
    assert storage.scheme == "s3"
    assert f"-name {storage.netloc}" in str(compose["services"]["seaweedfs-bucket"]["command"])
    identities = json.loads((DEPLOY / "seaweedfs" / "s3.json").read_text())["identities"]
    pairs = {(c["accessKey"], c["secretKey"]) for i in identities for c in i["credentials"]}
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) in pairs
    # And the load balancer sends traffic to the API services, checked with /readyz
    caddy = (DEPLOY / "Caddyfile").read_text()
    upstreams = set(re.findall(r"\b(kiln-api-\d+):8000\b", caddy))
    assert upstreams == {n for n, s in _kiln_services().items() if "serve" in s["command"]}
    assert "health_uri /readyz" in caddy


def test_dockerfile_installs_kiln_with_the_backend_extras() -> None:
    # Given the Dockerfile and pyproject.toml
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    # Then the image's entrypoint is the kiln console script
    assert _dockerfile_entrypoint() == ["kiln"]
    assert project["scripts"]["kiln"] == "kiln.cli:main"
    # And every extra it installs exists
    match = re.search(r'"\.\[([a-z0-9,]+)\]"', dockerfile)
    assert match is not None, "the Dockerfile does not pip install the repository"
    extras = set(match[1].split(","))
    assert {"postgres", "s3"} <= extras <= set(project["optional-dependencies"])


def test_deployment_guide_documents_every_setting_and_no_unknown_one() -> None:
    # Given the guide and every variable the processes and the client commands read
    guide = GUIDE.read_text()
    read = _config_vars().union(*(_cli_vars(c) for c in (*PROCESSES, "submit")))

    # Then the guide names each of them, and names no KILN_* variable kiln never reads
    named = set(KILN_VAR.findall(guide))
    assert not read - named, f"docs/deployment.md misses {sorted(read - named)}"
    assert not named - read - PENDING, f"unknown settings {sorted(named - read - PENDING)}"
    assert set(re.findall(r"\bAWS_[A-Z_]+\b", guide)) >= AWS_VARS


def test_compose_comfy_profile_pairs_each_comfyui_gpu_with_its_worker() -> None:
    # Given the services of the comfy profile
    services = {
        name: s for name, s in _compose()["services"].items() if "comfy" in s.get("profiles", [])
    }
    comfyuis = {n: s for n, s in services.items() if n not in _kiln_services()}
    workers = {n: s for n, s in services.items() if n in _kiln_services()}
    api_env = _environment(_kiln_services()["kiln-api-1"])
    assert len(comfyuis) >= 2 and len(workers) == len(comfyuis)

    # Then each ComfyUI instance reserves a GPU of its own
    devices = [s["deploy"]["resources"]["reservations"]["devices"] for s in comfyuis.values()]
    assert all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for [d] in devices)
    gpus = [tuple(d["device_ids"]) for [d] in devices]
    assert len(set(gpus)) == len(gpus) and all(len(ids) == 1 for ids in gpus)
    # And it runs your ComfyUI image, named when you start it
    assert all("${COMFYUI_IMAGE" in s["image"] for s in comfyuis.values())

    # And each worker claims comfy.workflow jobs one at a time from its own instance
    driven = []
    for name, worker in workers.items():
        command, options = _parse(_compose_command(worker))
        assert command == "worker", name
        assert (options["kinds"], options["concurrency"]) == ("comfy.workflow", 1), name
        env = _environment(worker)
        _check_vars(f"compose service {name}", set(env), command)
        url = urlparse(Settings.from_env(env).comfyui_url)
        assert url.hostname in comfyuis and url.port == 8188, name
        assert url.hostname in worker["depends_on"], name
        driven.append(url.hostname)
        # on the same database and bucket as the API nodes
        for setting in ("KILN_DATABASE_URL", "KILN_STORAGE_URL"):
            assert env[setting] == api_env[setting], name
    assert sorted(driven) == sorted(comfyuis)

    # And the default worker leaves those jobs to them
    _, options = _parse(_compose_command(_kiln_services()["kiln-worker"]))
    assert options["kinds"] is None
