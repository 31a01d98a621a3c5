"""`deploy/docker-compose.yml`, `docker-compose.cpu.yml` and the role files: valid for Compose v2,
and every lorabus service in them starts a real entry point with config keys that exist and a
config that loads. (test_compose_up*.py bring them up on an engine.)"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec
import pytest

from services.cli import COMMANDS
from services.common import nats_client
from services.config.loader import load_config
from tests.deploy.compose import (
    COMPOSE_FILE,
    CPU_COMPOSE_FILE,
    DEPLOY,
    ENV_EXAMPLE,
    REPO,
    ROLES,
    compose,
    read_env_file,
    rendered,
)
from tests.deploy.natsauth import users

ALL_PROFILES = ("vllm", "sglang", "tools", "eval")
GPU_SERVICES = {"trainer", "vllm-0", "sglang-0", "evaluator"}
SLIM_SERVICES = {"registry", "exporter", "watch"}


# each file with the lorabus config its services mount
CONFIGS = {COMPOSE_FILE: DEPLOY / "lorabus.yaml", CPU_COMPOSE_FILE: DEPLOY / "lorabus.cpu.yaml"}


@pytest.fixture(scope="module")
def project() -> dict:
    return rendered(ALL_PROFILES)


@pytest.fixture(scope="module")
def cpu_project() -> dict:
    return rendered((), file=CPU_COMPOSE_FILE)


@pytest.fixture(scope="module", params=list(CONFIGS), ids=["gpu", "cpu"])
def any_project(request) -> tuple[dict, Path]:
    """Either file's resolved project, with the lorabus config its services mount."""
    profiles = ALL_PROFILES if request.param == COMPOSE_FILE else ()
    return rendered(profiles, file=request.param), CONFIGS[request.param]


def lorabus_services(project: dict) -> dict[str, dict]:
    """Services running our images (ENTRYPOINT lorabus): built from deploy/Dockerfile.*, where
    the third-party images (NATS, S3, Prometheus) build from deploy/<name>/Dockerfile."""
    return {
        name: svc
        for name, svc in project["services"].items()
        if svc.get("build", {}).get("dockerfile", "").startswith("deploy/Dockerfile.")
    }


def split_command(command: list[str]) -> tuple[str, list[str], list[str]]:
    """`[cmd, --flag, value, ..., key=value, ...]` -> (cmd, flags, overrides)."""
    flags = [a for a in command[1:] if a.startswith("--")]
    overrides = [a for a in command[1:] if re.fullmatch(r"[a-z_][a-z0-9_.]*=.*", a)]
    return command[0], flags, overrides


@pytest.mark.parametrize("profiles", [(), ("sglang",), ALL_PROFILES])
def test_compose_file_validates(profiles):
    result = compose("config", "-q", profiles=profiles)
    assert result.returncode == 0, result.stderr


def test_default_profile_is_vllm(project):
    services = compose("config", "--services").stdout.split()
    assert {
        "nats",
        "s3",
        "s3-init",
        "registry",
        "trainer",
        "exporter",
        "vllm-0",
        "rollout-vllm-0",
        "prometheus",
        "grafana",
    } <= set(services)
    assert "sglang-0" not in services
    sglang = compose("config", "--services", profiles=("sglang",)).stdout.split()
    assert {"sglang-0", "rollout-sglang-0"} <= set(sglang) and "vllm-0" not in sglang


def test_validator_rejects_a_broken_file(tmp_path):
    """The validator is not a rubber stamp: an unknown key and a dangling depends_on fail."""
    text = COMPOSE_FILE.read_text()
    bad_key = tmp_path / "bad-key.yml"
    bad_key.write_text(text.replace("    shm_size: 8gb\n", "    shm_size: 8gb\n    gpus_please: 1\n"))
    result = compose("config", "-q", file=bad_key)
    assert result.returncode != 0 and "gpus_please" in result.stderr
    dangling = tmp_path / "dangling.yml"
    dangling.write_text(
        text.replace("registry: {condition: service_healthy}", "regsitry: {condition: service_healthy}", 1)
    )
    result = compose("config", "-q", file=dangling)
    assert result.returncode != 0 and "regsitry" in result.stderr


def test_missing_password_is_an_error(tmp_path):
    env = tmp_path / ".env"
    env.write_text(
        "\n".join(
            line for line in ENV_EXAMPLE.read_text().splitlines() if not line.startswith("NATS_TRAINER_PASSWORD=")
        )
    )
    result = compose("config", "-q", env_file=env)
    assert result.returncode != 0 and "NATS_TRAINER_PASSWORD" in result.stderr


def test_every_command_is_a_real_entry_point(any_project):
    project, _ = any_project
    checked = 0
    for name, svc in lorabus_services(project).items():
        assert svc.get("entrypoint") in (None, []), f"{name}: our images' entrypoint is lorabus"
        commands = [svc["command"]]
        health = (svc.get("healthcheck") or {}).get("test") or []
        if health[:2] == ["CMD", "lorabus"]:
            commands.append(health[2:])
        for command in commands:
            sub, flags, _ = split_command(command)
            assert sub in COMMANDS, f"{name}: `lorabus {sub}` is not a command of services.cli"
            module = COMMANDS[sub][0]
            argv = [sys.executable, "-m", module.removesuffix(".__main__")]
            if sub == "registry" and command[1:2] == ["status"]:
                argv.append("status")
            tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
            assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), module
            help_text = subprocess.run(argv + ["--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
            assert help_text.returncode == 0, f"{name}: {' '.join(argv)} --help: {help_text.stderr}"
            for flag in flags:
                assert flag in help_text.stdout, f"{name}: `lorabus {sub}` has no {flag} option"
            checked += 1
    assert checked >= 7


def test_overrides_and_config_load_for_every_service(any_project, monkeypatch):
    """Each service's `key=value` overrides name real config keys, and the lorabus config the
    file mounts loads with them under exactly the environment compose gives that service."""
    project, config = any_project
    config_text = config.read_text()
    env_refs = set(re.findall(r"\$\{oc\.env:([A-Z0-9_]+)", config_text))
    nats_users = users()
    for name, svc in lorabus_services(project).items():
        _, _, overrides = split_command(svc["command"])
        env = svc.get("environment") or {}
        missing = env_refs - set(env)
        assert not missing, f"{name}: compose does not pass {sorted(missing)} used by {config.name}"
        with monkeypatch.context() as mp:
            for key in list(__import__("os").environ):
                if key.startswith(("LORABUS_", "NATS_", "MINIO_")):
                    mp.delenv(key)
            for key, value in env.items():
                mp.setenv(key, value or "")
            cfg = load_config(config, overrides=overrides)
        assert cfg.bus.user in nats_users, f"{name}: bus.user {cfg.bus.user!r} is not in nats.conf"
        assert cfg.bus.password_env == nats_users[cfg.bus.user], name
        assert cfg.bus.password_env in env, f"{name}: {cfg.bus.password_env} not in its environment"
        # a service sees its own NATS password and no other
        others = {v for v in nats_users.values() if v != cfg.bus.password_env}
        assert not others & set(env), f"{name}: gets other services' passwords {others & set(env)}"
        assert cfg.store.uri.startswith("s3://") and cfg.store.endpoint == "s3:9000"


def test_metrics_ports_are_distinct_and_scraped(any_project):
    project, _ = any_project
    ports = {}
    for name, svc in lorabus_services(project).items():
        for arg in svc["command"]:
            if arg.startswith("metrics.port="):
                ports[name] = int(arg.split("=", 1)[1])
    assert len(set(ports.values())) == len(ports)
    scrape = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    for name, port in ports.items():
        assert f"{name}:{port}" in scrape, f"prometheus.yml does not scrape {name}:{port}"
        health = project["services"][name]["healthcheck"]["test"]
        if "METRICS_PORT" in " ".join(health):
            assert project["services"][name]["environment"]["METRICS_PORT"] == str(port), name


def test_gpus_only_where_needed_and_slim_images_elsewhere(project, cpu_project):
    for name, svc in cpu_project["services"].items():
        assert not (svc.get("deploy") or {}).get("resources"), f"{name}: the CPU file reserves devices"
    for name, svc in project["services"].items():
        devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
        if name in GPU_SERVICES:
            assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
        else:
            assert not devices, f"{name} reserves a GPU it does not need"
        if name in SLIM_SERVICES:
            assert svc["build"]["dockerfile"] == "deploy/Dockerfile.slim", name


def test_start_up_order(any_project):
    project, _ = any_project
    services = project["services"]
    # the bucket: made by s3-init next to MinIO, by the SeaweedFS server itself at start
    bucket = ("s3-init", "service_completed_successfully") if "s3-init" in services else ("s3", "service_healthy")
    for name, svc in lorabus_services(project).items():
        deps = svc.get("depends_on") or {}
        assert deps.get("nats", {}).get("condition") == "service_healthy", name
        if name not in {"registry", "watch"}:
            assert deps.get("registry", {}).get("condition") == "service_healthy", name
        if name != "watch":
            assert deps.get(bucket[0], {}).get("condition") == bucket[1], name
    for svc in services.values():
        for dep, cond in (svc.get("depends_on") or {}).items():
            if dep not in services:  # a service of a profile that is off (the cluster's nodes)
                assert cond.get("required") is False, f"{dep}: a required dependency no profile here starts"
            elif cond["condition"] == "service_healthy":
                assert services[dep].get("healthcheck", {}).get("test"), f"{dep} has no healthcheck"


CLUSTER_NODES = ["nats", "nats-1", "nats-2"]


def test_cluster_profile_runs_nats_as_three_routed_nodes(tmp_path, monkeypatch):
    """Issue 30: profile `cluster` with the settings .env.example names makes NATS three nodes
    (each its own name and store, routed to the three), the registry waits for all three, and
    every service gets all three URLs and creates its streams with 3 replicas."""
    hint = ENV_EXAMPLE.read_text()
    settings = dict(re.findall(r"^#\s+(NATS_CONF_FILE|LORABUS_NATS_URL|LORABUS_STREAM_REPLICAS)=(\S+)$", hint, re.M))
    assert set(settings) == {"NATS_CONF_FILE", "LORABUS_NATS_URL", "LORABUS_STREAM_REPLICAS"}, settings
    env = tmp_path / ".env"
    env.write_text(ENV_EXAMPLE.read_text() + "".join(f"\n{k}={v}" for k, v in settings.items()) + "\n")
    services = rendered(("vllm", "cluster"), env_file=env)["services"]
    assert "nats-1" not in rendered(("vllm",))["services"]

    routes = re.findall(r"nats://([a-z0-9-]+):6222", (DEPLOY / "nats" / "cluster.conf").read_text())
    assert sorted(routes) == CLUSTER_NODES
    names, stores = set(), set()
    for node in CLUSTER_NODES:
        command = services[node]["command"]
        assert command[:2] == ["-c", "/etc/nats/cluster.conf"], node
        names.add(command[command.index("--server_name") + 1] if "--server_name" in command else "lorabus")
        stores |= {v["source"] for v in services[node]["volumes"] if v["target"] == "/data"}
        assert {v["target"] for v in services[node]["volumes"]} >= {"/etc/nats/nats.conf", "/etc/nats/tls.conf"}
        assert services[node]["healthcheck"]["test"], node
    assert len(names) == len(stores) == 3, (names, stores)
    assert "server_name: lorabus" in (DEPLOY / "nats" / "nats.conf").read_text()  # the first node's

    deps = services["registry"]["depends_on"]
    assert all(deps[node]["condition"] == "service_healthy" for node in CLUSTER_NODES), deps
    urls = [f"nats://{node}:4222" for node in CLUSTER_NODES]
    for name, svc in lorabus_services({"services": services}).items():
        assert svc["environment"]["LORABUS_NATS_URL"].split(",") == urls, name
        with monkeypatch.context() as mp:
            for key in list(os.environ):
                if key.startswith(("LORABUS_", "NATS_", "MINIO_")):
                    mp.delenv(key)
            for key, value in svc["environment"].items():
                mp.setenv(key, value or "")
            cfg = load_config(DEPLOY / "lorabus.yaml", overrides=split_command(svc["command"])[2])
        assert nats_client.servers(cfg.bus) == urls and cfg.bus.stream_replicas == 3, name


def test_inference_servers_preload_v0_under_the_configured_name(project):
    env = read_env_file()
    name = f"{env['LORABUS_LORA_NAME']}-v0"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in project["services"]["rollout-vllm-0"]["environment"].items():
            mp.setenv(key, value or "")
        # what `--engine vllm` does to the config
        cfg = load_config(DEPLOY / "lorabus.yaml", overrides=["rollout.engine=vllm"])
    assert cfg.vllm.lora_modules == [f"{name}=/adapters/{name}"]
    vllm = project["services"]["vllm-0"]
    script = vllm["command"][0].replace("$$", "$")
    assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    for flag in (
        "--enable-lora",
        "--max-lora-rank",
        "--max-loras",
        "--max-cpu-loras",
        '--lora-modules "${LORABUS_LORA_NAME}-v0=/adapters/${LORABUS_LORA_NAME}-v0"',
    ):
        assert flag in script, flag
    assert vllm["environment"]["LORABUS_LORA_NAME"] == env["LORABUS_LORA_NAME"]
    sglang = project["services"]["sglang-0"]["command"][0].replace("$$", "$")
    assert "sglang.launch_server" in sglang and "--enable-lora" in sglang
    assert '--lora-paths "${LORABUS_LORA_NAME}-v0=/adapters/${LORABUS_LORA_NAME}-v0"' in sglang
    # sidecar and server see the adapters volume at the same path
    for sidecar, server in (("rollout-vllm-0", "vllm-0"), ("rollout-sglang-0", "sglang-0")):

        def mounts(s: str) -> set[tuple[str, str]]:
            return {(v["source"], v["target"]) for v in project["services"][s]["volumes"] if v["type"] == "volume"}

        assert ("adapters", "/adapters") in mounts(sidecar) & mounts(server)


@pytest.mark.parametrize("file", [COMPOSE_FILE, CPU_COMPOSE_FILE, *sorted(ROLES.glob("*.yml"))], ids=lambda f: f.name)
def test_env_example_sets_every_variable_the_file_uses(file):
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", file.read_text()))
    documented = set(read_env_file())
    assert used - documented == set(), f"add to .env.example: {sorted(used - documented)}"


def test_slim_image_installs_only_declared_dependencies():
    text = (DEPLOY / "Dockerfile.slim").read_text()
    installed = {re.split(r"[<>=\[]", spec)[0].lower() for spec in re.findall(r'"([A-Za-z0-9_.-]+[<>=][^"]*)"', text)}
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.split(r"[<>=\[ ]", d)[0].lower() for d in deps}
    assert installed and installed <= declared, installed - declared
    assert "torch" in installed and "transformers" not in installed and "peft" not in installed


BLOCKER = """
import importlib, importlib.abc, sys
blocked = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is not in the slim image")
sys.meta_path.insert(0, Block())
for module in sys.argv[2:]:
    importlib.import_module(module)
"""


@pytest.mark.parametrize(
    "blocked,modules",
    [
        (
            "torch,safetensors,transformers,peft",
            [
                "services.registry.__main__",
                "services.registry.service",
                "services.registry.status",
                "services.clients.watch",
            ],
        ),
        ("transformers,peft,accelerate", ["services.exporter.__main__", "services.exporter.service"]),
    ],
)
def test_slim_services_import_without_the_gpu_stack(blocked, modules):
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER, blocked, *modules], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_cpu_config_is_the_tiny_task(monkeypatch):
    """deploy/lorabus.cpu.yaml runs examples/tiny.yaml's job; only where things live differs."""
    for key in list(__import__("os").environ):
        if key.startswith(("LORABUS_", "MINIO_")):
            monkeypatch.delenv(key)
    deployed = msgspec.to_builtins(load_config(DEPLOY / "lorabus.cpu.yaml"))
    tiny = msgspec.to_builtins(load_config(REPO / "examples" / "tiny.yaml"))

    def leaves(tree: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in tree.items():
            out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = leaves(deployed), leaves(tiny)
    differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    # where things live: the run directory (and what defaults under it), NATS, S3, the model
    assert differ == {
        "run_dir",
        "actor.checkpoint_dir",
        "rollout.adapter_dir",
        "bus.url",
        "store.uri",
        "store.endpoint",
        "exporter.uri",
        "actor.path",
        "vllm.model",
        "sglang.model_path",
    }, differ
    assert a["actor.path"] == "/app/examples/tiny/model"  # where Dockerfile.cpu copies examples/
    assert a["bus.url"] == "nats://nats:4222" and a["store.endpoint"] == "s3:9000"


def test_localimages_builds_each_image_of_the_cpu_file_once(cpu_project):
    from localimages import one_service_per_image  # deploy/ is on sys.path (tests.deploy.compose)

    services = cpu_project["services"]
    chosen = one_service_per_image(cpu_project)
    images = [services[name]["image"] for name in chosen]
    assert len(images) == len(set(images))
    assert set(images) == {svc["image"] for svc in services.values() if "build" in svc}
    assert len(set(images)) == 5  # lorabus-cpu, lorabus-slim, nats, seaweedfs, prometheus


@pytest.mark.parametrize("base", [COMPOSE_FILE, CPU_COMPOSE_FILE], ids=["gpu", "cpu"])
def test_role_files_split_either_file_by_host(tmp_path, base):
    """Each role takes its services from the single-host file named by LORABUS_ROLES_BASE; the
    services wait only for services of their own host, and those off the control host find
    NATS and S3 at LORABUS_CONTROL_HOST."""
    env = tmp_path / ".env"
    env.write_text(ENV_EXAMPLE.read_text() + f"\nLORABUS_ROLES_BASE=../{base.name}\nLORABUS_CONTROL_HOST=ctl.example\n")
    single = rendered(ALL_PROFILES if base == COMPOSE_FILE else (), file=base)["services"]
    roles = {}
    for role, profiles in (("control", ()), ("trainer", ("eval",)), ("rollout", ("vllm", "sglang", "cpu"))):
        roles[role] = rendered(profiles, file=ROLES / f"{role}.yml", env_file=env)["services"]
    assert set(roles["control"]) == {"nats", "s3", "registry", "exporter", "prometheus"}
    assert set(roles["trainer"]) == {"trainer", "evaluator"}
    assert {"rollout-vllm-0", "rollout-sglang-0", "rollout-cpu-0", "rollout-cpu-1"} <= set(roles["rollout"])
    for role, services in roles.items():
        for name, svc in services.items():
            assert set(svc.get("depends_on") or {}) <= set(services), f"{role}/{name} waits for another host"
            if name in single:  # the role's service is the single-host file's, command and image
                assert svc.get("command") == single[name].get("command"), f"{role}/{name}"
            env_vars = svc.get("environment") or {}
            if role != "control" and "LORABUS_NATS_URL" in env_vars:
                assert env_vars["LORABUS_NATS_URL"] == "nats://ctl.example:4222", f"{role}/{name}"
                assert env_vars["LORABUS_S3_ENDPOINT"] == "ctl.example:9000", f"{role}/{name}"
