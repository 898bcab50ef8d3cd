"""The deployment files of deploy/ (issue 8), loaded and checked against the code they deploy.

No container engine or cluster runs here, so nothing is built or applied: every file is parsed, the broker's
and the agent's configurations (with the environment compose and Kubernetes give them) are validated by the
same code that reads them at start, the Kubernetes objects are checked against the API's own models (the
``kubernetes`` package), and the agent's RBAC is compared with the Kubernetes API calls of its adapter.
"""

from __future__ import annotations

import fnmatch
import importlib
import ipaddress
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes import client as k8s

from adapters.agent import AgentConfig
from broker.cli import parser as cli_parser
from broker.config import FederationConfig, is_shared_database, load_config
from broker.models import SiteSpec
from tests.pod_security import restricted_violations

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
IMAGE = "ghcr.io/heliotrope/heliotrope:0.1.0"
BROKER_CONFIG = DEPLOY / "config" / "heliotrope.yaml"
AGENT_CONFIG = DEPLOY / "config" / "agent.yaml"

# What compose reads from deploy/.env, with the values `openssl rand -hex 32` would give.
COMPOSE_ENV = {"POSTGRES_PASSWORD": "9f" * 32, "HELIOTROPE_ADMIN_TOKEN": "a1" * 32}
# What the Kubernetes Secret `heliotrope` and the downward API give the broker's pods.
SECRET_VALUES = {"db-url": "postgresql://heliotrope:" + "9f" * 32 + "@postgres.example.internal:5432/heliotrope",
                 "admin-token": "a1" * 32}
POD_IP = "10.1.2.3"
# How long a broker pod may take to first answer /healthz: it compiles its decision kernels before it listens
# (62 s measured on a busy 2-CPU machine; a pod's CPU request is a quarter of one), with room to spare.
STARTUP_ALLOWANCE_S = 240

EXPECTED_KINDS = {"Namespace", "ServiceAccount", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
                  "ClusterRole", "ClusterRoleBinding", "RoleBinding", "PersistentVolumeClaim", "NetworkPolicy"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}

# Every Kubernetes API call of the site's adapter (adapters/kubernetes.py, KubernetesSite), read from the code:
# the client method, and the (API group, resource, verbs) it needs. `_watch` calls the two list methods again
# with watch=True, which the API server authorises as the verb watch.
K8S_CALLS: dict[str, tuple[str, str, frozenset[str]]] = {
    "list_node": ("", "nodes", frozenset({"list"})),                            # _refresh_inventory
    "list_pod_for_all_namespaces": ("", "pods", frozenset({"list", "watch"})),  # _read_pods; _watch("pods")
    "list_job_for_all_namespaces": ("batch", "jobs", frozenset({"list", "watch"})),  # _list_jobs; _watch("jobs")
    "read_namespaced_job": ("batch", "jobs", frozenset({"get"})),               # _get_job
    "create_namespaced_job": ("batch", "jobs", frozenset({"create"})),          # _create_job
    "delete_namespaced_job": ("batch", "jobs", frozenset({"delete"})),          # _delete_job
    "create_namespaced_resource_quota": ("", "resourcequotas", frozenset({"create"})),  # _mirror_quota
    "patch_namespaced_resource_quota": ("", "resourcequotas", frozenset({"patch"})),    # _mirror_quota (409)
    "delete_namespaced_resource_quota": ("", "resourcequotas", frozenset({"delete"})),  # remove_quota
    "list_namespaced_event": ("", "events", frozenset({"list"})),               # _refused_why
    "read_namespaced_pod_log": ("", "pods/log", frozenset({"get"})),            # logs
    "read_namespaced_config_map": ("", "configmaps", frozenset({"get"})),       # ClusterStops.read, ._write
    "create_namespaced_config_map": ("", "configmaps", frozenset({"create"})),  # ClusterStops._write
    "patch_namespaced_config_map": ("", "configmaps", frozenset({"patch"})),    # ClusterStops._write
}
WATCHED = {"list_pod_for_all_namespaces", "list_job_for_all_namespaces"}
ADAPTER_SOURCES = [ROOT / "adapters" / name
                   for name in ("kubernetes.py", "kubernetes_nodes.py", "kubernetes_stops.py", "kubernetes_logs.py",
                                "agent.py")]
EXPECTED_GRANTS = {(group, resource, verb) for group, resource, verbs in K8S_CALLS.values() for verb in verbs}
READ_VERBS = {"get", "list", "watch"}


# --- loading --------------------------------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def k8s_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, doc) for p in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(p.read_text())
            if doc is not None]


def find(kind: str, name: str) -> dict[str, Any]:
    found = [o for _, o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name} in deploy/kubernetes, found {len(found)}"
    return found[0]


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's ${NAME}, ${NAME:-default} and ${NAME:?error} (an error when unset or empty), and $$."""
    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        got = env.get(name, "")
        if op == ":?" and not got:
            raise KeyError(f"compose needs {name}: {arg}")
        return got or (arg if op == ":-" else "")
    return re.sub(r"\$\{(\w+)(?:(:[?-])([^}]*))?\}", one, value).replace("$$", "$")


def service_env(service: dict[str, Any], env: Mapping[str, str] = COMPOSE_ENV) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {k: interpolate(str(v), env) for k, v in raw.items()}


def heliotrope_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose()["services"].items() if s.get("image") == IMAGE or "build" in s}


def broker_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in heliotrope_services().items() if command(s)[0] == "serve"}


def command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command") or dockerfile_instruction("CMD")
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def duration_s(text: str) -> float:
    """A compose duration such as 30s or 1m30s."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(a + u for a, u in parts) == text, f"not a compose duration: {text!r}"
    return sum(float(a) * units[u] for a, u in parts)


def broker_config_in_compose(name: str) -> FederationConfig:
    return load_config(BROKER_CONFIG, service_env(compose()["services"][name]))


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        stages[-1].append((word.upper(), rest.strip()))
    return stages  # stages[0]: what comes before the first FROM (ARGs)


def dockerfile_instruction(word: str, stage: int = -1) -> Any:
    """The last ``word`` instruction of a stage; JSON-array (exec) form as a list."""
    found = [rest for w, rest in dockerfile_stages()[stage] if w == word]
    assert found, f"deploy/Dockerfile: the stage has no {word}"
    return yaml.safe_load(found[-1]) if found[-1].startswith("[") else found[-1]


def dockerignore_excludes(path: str) -> bool:
    patterns = [p.strip().strip("/") for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    suffixes = ["/".join(parts[i:]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(s, pattern[3:]) for s in suffixes):
                return True
        elif any(fnmatch.fnmatch(p, pattern) for p in prefixes):
            return True
    return False


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A port given by number or by the container's port name."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"container {container['name']} has no port named {port}"
    return named[port]


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: $(VAR) expanded from variables above it, the
    Secret and the downward API replaced by sample values."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            env[item["name"]] = SECRET_VALUES[item["valueFrom"]["secretKeyRef"]["key"]]
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = POD_IP
    return env


def config_map_file(deployment: dict[str, Any], tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The file a Deployment's first container reads with --config, written out from its ConfigMap, and
    that container's environment."""
    pod, container = deployment["spec"]["template"]["spec"], containers(deployment)[0]
    path = container["args"][container["args"].index("--config") + 1]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    data = find("ConfigMap", volume["configMap"]["name"])["data"]
    key = path[len(mount["mountPath"].rstrip("/")) + 1:]
    assert key in data, f"{deployment['metadata']['name']} reads {path}, but its ConfigMap has no key {key}"
    out = tmp_path / key
    out.write_text(data[key])
    return out, literal_env(container)


def broker_deployment() -> dict[str, Any]:
    return find("Deployment", "heliotrope-broker")


def agent_deployment() -> dict[str, Any]:
    return find("Deployment", "heliotrope-agent")


def service_host_port(host: str, port: int) -> tuple[str, int] | None:
    """The Service of the manifests that ``host`` names (NAME, NAME.NS, NAME.NS.svc[.cluster.local]) with
    the port it serves on, or None."""
    parts = host.split(".")
    if len(parts) not in (1, 2, 3, 5) or parts[3:] not in ([], ["cluster", "local"]) or parts[2:3] not in ([], ["svc"]):
        return None
    for _, o in k8s_objects():
        if o["kind"] == "Service" and o["metadata"]["name"] == parts[0] and \
                (len(parts) == 1 or o["metadata"]["namespace"] == parts[1]):
            ports = [p["port"] for p in o["spec"]["ports"]]
            return (o["metadata"]["name"], port) if port in ports else None
    return None


def site_without_adapter(site: SiteSpec) -> dict[str, Any]:
    return site.model_dump(exclude={"adapter"})


# --- every file ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: f"{p.relative_to(ROOT)} parses as YAML")
def test_every_yaml_file_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("file,obj", k8s_objects(),
                         ids=[f"{o['kind']} {o['metadata']['name']} in {f} is named, of a known kind and placed"
                              for f, o in k8s_objects()])
def test_every_kubernetes_object_is_complete(file: str, obj: dict[str, Any]) -> None:
    assert obj["apiVersion"] and obj["metadata"]["name"]
    assert obj["kind"] in EXPECTED_KINDS
    assert ("namespace" in obj["metadata"]) == (obj["kind"] not in CLUSTER_SCOPED)


@pytest.mark.parametrize("file,obj", k8s_objects(),
                         ids=[f"{o['kind']} {o['metadata']['name']} in {f} has only fields the Kubernetes API knows"
                              for f, o in k8s_objects()])
def test_kubernetes_objects_round_trip_through_the_api_models(file: str, obj: dict[str, Any]) -> None:
    # The client's models drop a field they do not know (a typo such as readinesProbe) and refuse a
    # missing required one, so an object that comes back equal is one the API server would read the same.
    api = k8s.ApiClient()
    model = api._ApiClient__deserialize(obj, f"V1{obj['kind']}")  # type: ignore[attr-defined]
    assert api.sanitize_for_serialization(model) == obj


# --- the image ------------------------------------------------------------------------------------------


def test_the_dockerfile_builds_in_a_builder_stage_and_ships_a_slim_python_3_11_stage() -> None:
    stages = dockerfile_stages()[1:]
    assert len(stages) >= 2, "multi-stage: a builder and the final image"
    args = {k: v for w, rest in dockerfile_stages()[0] if w == "ARG" for k, _, v in [rest.partition("=")]}
    final = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stages[-1][0][1]).split()[0]
    assert final == "python:3.11-slim"
    assert any(w == "COPY" and rest.startswith("--from=") for w, rest in stages[-1]), "the final stage copies the build"


def test_the_image_runs_as_a_numeric_non_root_user() -> None:
    user = str(dockerfile_instruction("USER")).split(":")
    assert all(part.isdigit() and int(part) != 0 for part in user), f"USER {':'.join(user)}"


def test_the_image_exposes_the_port_the_broker_config_listens_on() -> None:
    assert int(dockerfile_instruction("EXPOSE")) == broker_config_in_compose("broker-1").broker.port


def test_the_image_entrypoint_is_the_console_script_of_pyproject() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert dockerfile_instruction("ENTRYPOINT") == ["heliotrope"] and "heliotrope" in scripts


def test_the_image_serves_the_config_file_that_compose_and_kubernetes_mount() -> None:
    cmd = dockerfile_instruction("CMD")
    assert cmd[:2] == ["serve", "--config"]
    assert all(f"./config/heliotrope.yaml:{cmd[2]}:ro" in s["volumes"] for s in broker_services().values())
    assert containers(broker_deployment())[0]["args"] == cmd


def test_the_image_health_check_asks_healthz_on_the_exposed_port_and_stops_on_sigterm() -> None:
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(r for w, r in dockerfile_stages()[-1] if w == "ENV")))
    url = urlsplit(env["HELIOTROPE_HEALTHCHECK_URL"])
    assert (url.path, url.port) == ("/healthz", int(dockerfile_instruction("EXPOSE")))
    assert "HELIOTROPE_HEALTHCHECK_URL" in dockerfile_instruction("HEALTHCHECK")
    assert dockerfile_instruction("STOPSIGNAL") == "SIGTERM"


def wheel_inputs() -> list[str]:
    """What building the wheel reads: pyproject.toml, the long description, the top-level package folders and
    the folders pyproject.toml maps into packages (config/ and data/, as package data)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})
    packages = {p.split(".")[0] for p in setuptools["packages"] if p not in mapped} | set(mapped.values())
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    return ["pyproject.toml", readme, *sorted(packages)]


@pytest.mark.parametrize("path", wheel_inputs(), ids=lambda p: f"the image build copies {p}, which the wheel needs")
def test_the_build_copies_what_the_wheel_needs_from_the_context(path: str) -> None:
    sources = {src for w, rest in dockerfile_stages()[1] if w == "COPY" for src in rest.split()[:-1]}
    assert path in sources or f"./{path}" in sources or "." in sources
    assert (ROOT / path).exists()
    assert not dockerignore_excludes(path), f".dockerignore leaves {path} out of the build context"


# --- the wheel the image installs ---------------------------------------------------------------------

DEMO_AND_SIMULATE_PROBE = """
import json
from broker.cli import parser
from broker.config import load_config
from broker.data.carbon import load_carbon

demo = parser().parse_args(["demo"])
config = load_config(demo.config)
carbon = load_carbon(config.broker.carbon.path, zones=[site.grid_zone for site in config.sites])
simulate = parser().parse_args(["simulate", "--trace", "jobs.csv", "--preset", "philly", "--policy", "green"])
print(json.dumps({"demo --config": demo.config, "demo carbon": config.broker.carbon.path,
                  "demo zones": list(carbon.zones()),
                  **{f"simulate --{flag}": getattr(simulate, flag) for flag in ("carbon", "prices", "latency", "regions")}}))
"""


@pytest.fixture(scope="module")
def image_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel as the image's builder stage makes it: ``pip wheel --no-deps`` on what the stage copies from
    the build context (and nothing that .dockerignore leaves out)."""
    context = tmp_path_factory.mktemp("context")
    ignored = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source in sorted({src for w, rest in dockerfile_stages()[1] if w == "COPY" for src in rest.split()[:-1]}):
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, context / source, ignore=ignored)
        else:
            shutil.copy2(ROOT / source, context / source)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(context)],
                   check=True, capture_output=True, timeout=180)
    [wheel] = out.glob("heliotrope-*.whl")
    return wheel


def test_the_wheel_ships_the_demo_config_and_every_data_slice(image_wheel: Path) -> None:
    with zipfile.ZipFile(image_wheel) as whl:
        names = set(whl.namelist())
    shipped = {f"broker/shipped/{p.relative_to(ROOT).as_posix()}"
               for folder in ("config", "data") for p in (ROOT / folder).rglob("*") if p.is_file()}
    assert "broker/shipped/config/demo.yaml" in shipped and "broker/shipped/data/SOURCES.md" in shipped
    assert not shipped - names, f"left out of the wheel: {sorted(shipped - names)}"


def test_the_installed_wheel_runs_the_demo_and_simulate_defaults_from_its_own_files(image_wheel: Path,
                                                                                    tmp_path: Path) -> None:
    # Installed as in the image: the wheel's files on the path (the test environment's dependencies), and
    # run from a folder with no config/ or data/, as the image's /var/lib/heliotrope.
    site, work = tmp_path / "site-packages", tmp_path / "work"
    with zipfile.ZipFile(image_wheel) as whl:
        whl.extractall(site)
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    probe = subprocess.run([sys.executable, "-c", DEMO_AND_SIMULATE_PROBE], cwd=work, env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    for what, path in found.items():
        if what != "demo zones":
            assert Path(path).is_relative_to(site) and Path(path).exists(), f"{what}: {path}"
    assert len(found["demo zones"]) == 8

    shutil.copy2(ROOT / "tests" / "data" / "tiny-trace.csv", work / "jobs.csv")
    simulate = ["simulate", "--trace", "jobs.csv", "--columns", "submit=submit,duration=seconds,gpus=gpus,tenant=team",
                "--start", "2022-06-01", "--policy", "baseline-carbon-greedy", "--no-bound", "--json", "out.json"]
    run = subprocess.run([sys.executable, "-m", "broker.cli", *simulate],
                         cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    figures = json.loads((work / "out.json").read_text())
    jobs = len((work / "jobs.csv").read_text().splitlines()) - 1
    assert figures["jobs"] == jobs and figures["policies"]["baseline-carbon-greedy"]["carbon_kg"] > 0


@pytest.mark.parametrize("path", [".venv", ".git", "var/heliotrope.db", "deploy/.env", "broker/__pycache__/x.pyc"],
                         ids=lambda p: f"the build context leaves out {p}")
def test_the_build_context_leaves_out_local_state_and_secrets(path: str) -> None:
    assert dockerignore_excludes(path)


def build_python_snippets() -> list[str]:
    """The ``python -c "..."`` programs the builder stage runs."""
    runs = " ".join(rest for w, rest in dockerfile_stages()[1] if w == "RUN")
    return re.findall(r'python -c "((?:[^"\\]|\\.)*)"', runs)


def test_the_build_compiles_the_decision_kernels_with_code_that_exists() -> None:
    # `docker build` is the only place these run; a renamed function would break the image and nothing else.
    imports = [m for snippet in build_python_snippets() for m in re.findall(r"from ([\w.]+) import (\w+)", snippet)]
    assert ("policies.timeshift", "warm_up") in imports, "the build compiles what a broker compiles at start"
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"deploy/Dockerfile imports {name} from {module}"
    # ... and the broker's start compiles the same kernels (broker.service), so the image's cache is the one used.
    assert "from policies.timeshift import warm_up" in (ROOT / "broker" / "service.py").read_text()


def test_the_numba_cache_the_build_fills_is_the_one_the_image_reads() -> None:
    runs = " ".join(rest for w, rest in dockerfile_stages()[1] if w == "RUN")
    [built] = re.findall(r"NUMBA_CACHE_DIR=(\S+) python", runs)
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(r for w, r in dockerfile_stages()[-1] if w == "ENV")))
    copies = [rest.split()[-2:] for w, rest in dockerfile_stages()[-1] if w == "COPY" and "--from=builder" in rest]
    assert env["NUMBA_CACHE_DIR"] == built and [built, built] in copies


def test_the_build_compiles_the_kernels_of_the_installed_package_not_of_the_copied_sources() -> None:
    # Numba keys its cache by the folder of the source file. `python -c` imports from its working directory
    # first, so run where the sources were copied (the builder's WORKDIR) it would compile /src/policies, and
    # the image, which runs /opt/venv's copy, would compile the kernels again at every container's start.
    builder = dockerfile_stages()[1]
    workdir = [rest for w, rest in builder if w == "WORKDIR"][-1]
    [run] = [rest for w, rest in builder if w == "RUN" and "warm_up" in rest]
    cwd = (re.findall(r"\bcd (\S+)", run[:run.index("warm_up")]) or [workdir])[-1]
    copied = {posixpath.normpath(posixpath.join(workdir, rest.split()[-1]))
              for w, rest in builder if w == "COPY" and rest.split()[0] == "policies"}
    assert copied and posixpath.join(posixpath.normpath(posixpath.join(workdir, cwd)), "policies") not in copied


def readme_deploy_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text[text.index("\n## Deploy\n"):text.index("\n## Development\n")]


def test_the_readme_builds_and_runs_the_image_the_deploy_files_name() -> None:
    section = readme_deploy_section()
    [(dockerfile, tag)] = re.findall(r"docker build -f (\S+) -t (\S+) \.", section)
    assert (ROOT / dockerfile).resolve() == DEPLOY / "Dockerfile" and tag == IMAGE
    assert f"-t {IMAGE} ." in (DEPLOY / "Dockerfile").read_text(), "the Dockerfile's own build line"
    for compose_file in re.findall(r"docker compose -f (\S+)", section):
        assert (ROOT / compose_file).resolve() == DEPLOY / "compose.yaml"
    [(example, env_file)] = re.findall(r"cp (deploy/example\.env) (deploy/\.env)", section)
    assert (ROOT / example).is_file() and dockerignore_excludes(env_file)
    named = set(re.findall(r"fill in (\w+) and (\w+)", section)[0])
    assert named == set(COMPOSE_ENV), "the README names every secret compose requires"


def test_the_readmes_token_command_runs_in_a_broker_service_on_the_file_it_mounts() -> None:
    [(service, args)] = re.findall(r"docker compose -f \S+ exec (\S+) heliotrope (token create [^`]+)`",
                                   readme_deploy_section())
    assert service in broker_services()
    parsed = cli_parser().parse_args(shlex.split(args))
    assert f"./config/heliotrope.yaml:{parsed.config}:ro" in compose()["services"][service]["volumes"]


def test_the_readmes_kubernetes_secret_has_the_keys_the_broker_reads() -> None:
    keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in containers(broker_deployment())[0]["env"]
            if "secretKeyRef" in e.get("valueFrom", {})}
    section = readme_deploy_section()
    assert set(re.findall(r"--from-literal=([\w-]+)=", section)) == keys
    for path in re.findall(r"kubectl apply -f (\S+)", section):
        assert (ROOT / path).exists(), path


# --- compose --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(heliotrope_services()),
                         ids=lambda n: f"compose service {n} builds the one image from deploy/Dockerfile")
def test_compose_services_build_the_image_from_deploy_dockerfile(name: str) -> None:
    service = compose()["services"][name]
    assert service["image"] == IMAGE
    context = (DEPLOY / service["build"]["context"]).resolve()
    assert context == ROOT and (context / service["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"


@pytest.mark.parametrize("name,published", [("broker-1", 8080), ("broker-2", 8081)],
                         ids=["broker-1 is published on port 8080 of this machine",
                              "broker-2 is published on port 8081 of this machine"])
def test_each_broker_replica_is_published_on_its_own_port_to_the_port_it_listens_on(name: str, published: int) -> None:
    port = broker_config_in_compose(name).broker.port
    [mapping] = compose()["services"][name]["ports"]
    host_ip, host_port, target = mapping.rsplit(":", 2) if mapping.count(":") == 2 else ("", *mapping.split(":"))
    assert (int(host_port), int(target)) == (published, port)
    assert host_ip == "127.0.0.1", "plain HTTP with bearer tokens: published on loopback only"


@pytest.mark.parametrize("name", sorted(broker_services()),
                         ids=lambda n: f"{n}'s environment applied to config/heliotrope.yaml is a valid shared setup")
def test_each_broker_replica_loads_its_config_with_its_environment(name: str) -> None:
    env = service_env(compose()["services"][name])
    assert any(k.startswith("HELIOTROPE_BROKER__") for k in env)
    broker = load_config(BROKER_CONFIG, env).broker  # an unknown setting in a variable's name fails here
    services = compose()["services"]
    assert is_shared_database(broker.db), "the replicas must share PostgreSQL to elect one leader"
    assert urlsplit(broker.db).hostname in services and "postgres" in services[urlsplit(broker.db).hostname]["image"]
    assert broker.mqtt is not None and broker.mqtt.host in services and "mosquitto" in services[broker.mqtt.host]["image"]
    assert broker.replicas is not None and broker.replicas.advertise_url == f"http://{name}:{broker.port}"
    assert broker.auth.enabled and env.get(broker.auth.admin_token_env or "") == COMPOSE_ENV["HELIOTROPE_ADMIN_TOKEN"]
    assert broker.mqtt.password_env is None or broker.mqtt.password_env in env


def test_the_broker_replicas_advertise_different_addresses() -> None:
    urls = [broker_config_in_compose(n).broker.replicas.advertise_url for n in broker_services()]  # type: ignore[union-attr]
    assert len(urls) == 2 and len(set(urls)) == 2


@pytest.mark.parametrize("name", sorted(broker_services()),
                         ids=lambda n: f"{n} gets longer to stop than the broker's shutdown grace")
def test_broker_stop_grace_period_exceeds_shutdown_grace(name: str) -> None:
    grace = broker_config_in_compose(name).broker.shutdown_grace_s
    assert duration_s(compose()["services"][name]["stop_grace_period"]) > grace


@pytest.mark.parametrize("name", sorted(broker_services()),
                         ids=lambda n: f"{n} starts only once PostgreSQL answers pg_isready")
def test_brokers_wait_for_a_healthy_postgres(name: str) -> None:
    assert compose()["services"][name]["depends_on"]["postgres"] == {"condition": "service_healthy"}
    assert "pg_isready" in " ".join(compose()["services"]["postgres"]["healthcheck"]["test"])


def test_compose_refuses_to_start_without_the_secrets_that_example_env_lists() -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    required = set(re.findall(r"\$\{(\w+):\?", text))
    listed = set(re.findall(r"^(\w+)=", (DEPLOY / "example.env").read_text(), re.M))
    assert required == listed == set(COMPOSE_ENV)
    with pytest.raises(KeyError, match="openssl rand -hex 32"):
        service_env(compose()["services"]["broker-1"], {})


@pytest.mark.parametrize("name", sorted(compose()["services"]),
                         ids=lambda n: f"every file compose service {n} mounts from deploy/ exists")
def test_compose_bind_mounts_exist(name: str) -> None:
    for volume in compose()["services"][name].get("volumes", []):
        source = volume.split(":")[0]
        if source.startswith("."):
            assert (DEPLOY / source).is_file(), f"{name} mounts {source}, which is not a file in deploy/"


def test_the_compose_agent_runs_the_site_the_brokers_reach_over_mqtt() -> None:
    services = compose()["services"]
    agent_service = services["agent"]
    assert command(agent_service) == ["agent", "--config", "/etc/heliotrope/agent.yaml"]
    assert f"./config/agent.yaml:{command(agent_service)[2]}:ro" in agent_service["volumes"]
    assert agent_service["healthcheck"] == {"disable": True}, "the agent serves no /healthz"
    agent = AgentConfig.model_validate(yaml.safe_load(AGENT_CONFIG.read_text()))
    broker = broker_config_in_compose("broker-1")
    assert agent.mqtt.host in services and broker.broker.mqtt is not None
    assert (agent.mqtt.host, agent.mqtt.port) == (broker.broker.mqtt.host, broker.broker.mqtt.port)
    registered = {s.name: s for s in broker.sites}
    assert registered[agent.site.name].adapter.kind == "mqtt"
    assert site_without_adapter(registered[agent.site.name]) == site_without_adapter(agent.site)
    assert agent.state_dir is not None and any(v.endswith(":/var/lib/heliotrope") and v.startswith(
        "agent-state") for v in agent_service["volumes"]) and agent.state_dir.startswith("/var/lib/heliotrope/")


def test_a_broker_on_every_address_always_has_authentication() -> None:
    for config in [broker_config_in_compose(n) for n in broker_services()]:
        host = config.broker.host
        if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
            assert config.broker.auth.enabled and config.broker.auth.admin_token_env


# --- Kubernetes -----------------------------------------------------------------------------------------


def heliotrope_deployments() -> list[dict[str, Any]]:
    return [o for _, o in k8s_objects() if o["kind"] == "Deployment" and containers(o)[0]["image"] == IMAGE]


def all_deployments() -> list[dict[str, Any]]:
    return [o for _, o in k8s_objects() if o["kind"] == "Deployment"]


def test_kubernetes_runs_the_image_that_compose_builds() -> None:
    assert {d["metadata"]["name"] for d in heliotrope_deployments()} == {"heliotrope-broker", "heliotrope-agent"}
    assert {s["image"] for s in heliotrope_services().values()} == {IMAGE}


def test_the_broker_deployment_runs_two_replicas_on_a_shared_database(tmp_path: Path) -> None:
    path, env = config_map_file(broker_deployment(), tmp_path)
    broker = load_config(path, env).broker  # the literal env names must be real settings
    assert broker_deployment()["spec"]["replicas"] == 2
    assert is_shared_database(broker.db)
    assert broker.replicas is not None and broker.replicas.advertise_url == f"http://{POD_IP}:{broker.port}"
    assert broker.auth.enabled and env.get(broker.auth.admin_token_env or "") == SECRET_VALUES["admin-token"]
    assert broker.host == "0.0.0.0"


def test_the_anonymous_mosquitto_is_reachable_from_the_broker_and_the_agent_only() -> None:
    # Whoever publishes on a site's topics acts as its agent or as the broker to it; a Service alone is open
    # to every pod of the cluster.
    def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
        return not selector.get("matchExpressions") and selector["matchLabels"].items() <= labels.items()

    mosquitto = find("Deployment", "mosquitto")
    assert "allow_anonymous true" in find("ConfigMap", "mosquitto")["data"]["mosquitto.conf"]
    policy = find("NetworkPolicy", "mosquitto")
    assert selects(policy["spec"]["podSelector"], mosquitto["spec"]["template"]["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert all(set(peer) == {"podSelector"} for peer in peers), "no other namespace or address block"
    allowed = {d["metadata"]["name"] for d in all_deployments()
               if any(selects(p["podSelector"], d["spec"]["template"]["metadata"]["labels"]) for p in peers)}
    assert allowed == {"heliotrope-broker", "heliotrope-agent"}


def test_the_pod_ip_is_defined_before_the_advertise_url_that_uses_it() -> None:
    names = [e["name"] for e in containers(broker_deployment())[0]["env"]]
    assert names.index("POD_IP") < names.index("HELIOTROPE_BROKER__REPLICAS__ADVERTISE_URL")


def test_the_broker_container_service_and_probes_use_the_port_the_config_listens_on(tmp_path: Path) -> None:
    path, env = config_map_file(broker_deployment(), tmp_path)
    port = load_config(path, env).broker.port
    container = containers(broker_deployment())[0]
    assert [p["containerPort"] for p in container["ports"]] == [port]
    service = find("Service", "heliotrope")
    assert [container_port(container, p["targetPort"]) for p in service["spec"]["ports"]] == [port]
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert (get["path"], container_port(container, get["port"])) == (path, port), probe


def probe_allowance_s(probe: dict[str, Any]) -> float:
    """How long a probe lets a container go unanswered from its start before the kubelet acts (its defaults:
    period 10 s, 3 failures)."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_a_broker_pod_compiling_its_kernels_is_not_restarted_before_it_listens(tmp_path: Path) -> None:
    # The broker compiles its Numba kernels before it listens, and under the read-only root file system each new
    # pod compiles them again (README, Deploy): 62 s were measured on a busy 2-CPU machine. A liveness probe that
    # fires first restarts the container, which compiles again: a crash loop on a busy node.
    container = containers(broker_deployment())[0]
    path, env = config_map_file(broker_deployment(), tmp_path)
    port = load_config(path, env).broker.port
    startup = container.get("startupProbe")
    assert startup is not None, "a startup probe holds the liveness probe back until the broker first answers"
    assert (startup["httpGet"]["path"], container_port(container, startup["httpGet"]["port"])) == ("/healthz", port)
    assert probe_allowance_s(startup) >= STARTUP_ALLOWANCE_S


def test_the_broker_pods_get_longer_to_stop_than_the_shutdown_grace(tmp_path: Path) -> None:
    path, env = config_map_file(broker_deployment(), tmp_path)
    grace = load_config(path, env).broker.shutdown_grace_s
    assert broker_deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace


@pytest.mark.parametrize("deployment", all_deployments(),
                         ids=lambda d: f"{d['metadata']['name']} runs as non-root, read-only, without capabilities")
def test_every_deployment_is_locked_down(deployment: dict[str, Any]) -> None:
    pod = deployment["spec"]["template"]["spec"]
    for container in pod["containers"]:
        ctx = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0
        assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"]["drop"] == ["ALL"] and "add" not in ctx["capabilities"]
        assert "resources" in container and "memory" in container["resources"]["limits"]


@pytest.mark.parametrize("deployment", all_deployments(),
                         ids=lambda d: f"{d['metadata']['name']} meets the Pod Security profile of its namespace")
def test_every_deployments_pods_meet_the_restricted_profile_their_namespace_enforces(
        deployment: dict[str, Any]) -> None:
    # 00-namespace.yaml labels heliotrope pod-security.kubernetes.io/enforce: restricted: a Pod that breaks the
    # profile would be refused there, its Deployment never ready. No cluster runs here, so the checks are made here.
    namespaces = {o["metadata"]["name"]: o for _, o in k8s_objects() if o["kind"] == "Namespace"}
    labels = namespaces[deployment["metadata"]["namespace"]]["metadata"].get("labels", {})
    assert labels.get("pod-security.kubernetes.io/enforce") == "restricted"
    assert restricted_violations(deployment["spec"]["template"]["spec"]) == []


@pytest.mark.parametrize("deployment", heliotrope_deployments(),
                         ids=lambda d: f"{d['metadata']['name']} can write where heliotrope writes")
def test_heliotrope_pods_run_as_the_image_user_with_writable_state_and_tmp(deployment: dict[str, Any]) -> None:
    pod = deployment["spec"]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == str(dockerfile_instruction("USER")).split(":")[0]
    mounts = {m["mountPath"] for m in containers(deployment)[0]["volumeMounts"] if not m.get("readOnly")}
    assert {dockerfile_instruction("WORKDIR"), "/tmp"} <= mounts


@pytest.mark.parametrize("obj", [o for _, o in k8s_objects() if o["kind"] in ("Service", "PodDisruptionBudget")],
                         ids=lambda o: f"{o['kind']} {o['metadata']['name']} selects the pods of a Deployment")
def test_selectors_match_a_deployments_pods(obj: dict[str, Any]) -> None:
    selector = obj["spec"]["selector"]
    selector = selector.get("matchLabels", selector)
    matched = [d for d in all_deployments() if d["metadata"]["namespace"] == obj["metadata"]["namespace"]
               and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert len(matched) == 1


@pytest.mark.parametrize("deployment", all_deployments(),
                         ids=lambda d: f"every ConfigMap, claim and account {d['metadata']['name']} uses is deployed")
def test_deployments_refer_only_to_objects_in_the_manifests(deployment: dict[str, Any]) -> None:
    pod = deployment["spec"]["template"]["spec"]
    for volume in pod["volumes"]:
        if "configMap" in volume:
            find("ConfigMap", volume["configMap"]["name"])
        if "persistentVolumeClaim" in volume:
            find("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    if "serviceAccountName" in pod:
        find("ServiceAccount", pod["serviceAccountName"])


def test_the_secret_keys_the_broker_reads_are_the_ones_the_instructions_create() -> None:
    keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in containers(broker_deployment())[0]["env"]
            if "secretKeyRef" in e.get("valueFrom", {})}
    instructions = (K8S / "00-namespace.yaml").read_text()
    assert keys == set(SECRET_VALUES) == set(re.findall(r"--from-literal=([\w-]+)=", instructions))


def test_the_broker_and_the_agent_reach_the_in_cluster_mosquitto(tmp_path: Path) -> None:
    path, env = config_map_file(broker_deployment(), tmp_path)
    broker = load_config(path, env).broker
    agent_path, _ = config_map_file(agent_deployment(), tmp_path)
    agent = AgentConfig.model_validate(yaml.safe_load(agent_path.read_text()))
    assert broker.mqtt is not None and service_host_port(broker.mqtt.host, broker.mqtt.port) == ("mosquitto", 1883)
    assert service_host_port(agent.mqtt.host, agent.mqtt.port) == ("mosquitto", 1883)


def test_the_agent_runs_the_brokers_mqtt_site_on_this_cluster_with_its_service_account(tmp_path: Path) -> None:
    agent_path, _ = config_map_file(agent_deployment(), tmp_path)
    agent = AgentConfig.model_validate(yaml.safe_load(agent_path.read_text()))
    assert agent.site.adapter.kind == "kubernetes" and agent.site.adapter.in_cluster
    broker_path, env = config_map_file(broker_deployment(), tmp_path)
    registered = {s.name: s for s in load_config(broker_path, env).sites}
    assert registered[agent.site.name].adapter.kind == "mqtt"
    assert site_without_adapter(registered[agent.site.name]) == site_without_adapter(agent.site)
    pod = agent_deployment()["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert agent_deployment()["spec"]["strategy"]["type"] == "Recreate", "never two agents for one site"
    assert agent_deployment()["spec"]["replicas"] == 1
    state = next(m for m in containers(agent_deployment())[0]["volumeMounts"] if m["name"] == "state")
    assert agent.state_dir is not None and agent.state_dir.startswith(state["mountPath"] + "/")
    assert "persistentVolumeClaim" in next(v for v in pod["volumes"] if v["name"] == "state")


def test_the_broker_has_no_kubernetes_credentials() -> None:
    pod = broker_deployment()["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    bound = [o for _, o in k8s_objects() if o["kind"].endswith("Binding")
             and any(s["name"] == pod["serviceAccountName"] for s in o["subjects"])]
    assert bound == []


# --- RBAC -----------------------------------------------------------------------------------------------


def agent_bindings() -> list[dict[str, Any]]:
    account = agent_deployment()["spec"]["template"]["spec"]["serviceAccountName"]
    namespace = agent_deployment()["metadata"]["namespace"]
    return [o for _, o in k8s_objects() if o["kind"] in ("ClusterRoleBinding", "RoleBinding")
            and any(s == {"kind": "ServiceAccount", "name": account, "namespace": namespace} for s in o["subjects"])]


def grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def role_of(binding: dict[str, Any]) -> dict[str, Any]:
    return find(binding["roleRef"]["kind"], binding["roleRef"]["name"])


def adapter_calls() -> set[str]:
    return {m for path in ADAPTER_SOURCES for m in re.findall(r"\.(\w+)_without_preload_content", path.read_text())}


def test_the_rbac_table_lists_every_kubernetes_call_the_adapter_makes() -> None:
    assert adapter_calls() == set(K8S_CALLS), "a Kubernetes API call was added or removed: update RBAC"
    source = (ROOT / "adapters" / "kubernetes.py").read_text()
    watch = source[source.index("async def _watch("):source.index("def _on_watch_event(")]
    assert "watch=True" in watch and set(re.findall(r"\.(\w+)_without_preload_content", watch)) == WATCHED
    assert set(re.findall(r"k8s\.(\w+Api)\(", source)) == {"CoreV1Api", "BatchV1Api"}


def test_the_agent_is_granted_exactly_what_its_adapter_calls() -> None:
    granted = set().union(*(grants(role_of(b)) for b in agent_bindings()))
    assert granted == EXPECTED_GRANTS


@pytest.mark.parametrize("role", [o for _, o in k8s_objects() if o["kind"] in ("ClusterRole", "Role")],
                         ids=lambda r: f"{r['kind']} {r['metadata']['name']} names every group, resource and verb")
def test_no_rbac_rule_uses_a_wildcard(role: dict[str, Any]) -> None:
    for rule in role["rules"]:
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"]
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule


def test_the_agent_writes_only_in_tenant_namespaces(tmp_path: Path) -> None:
    cluster_wide = set().union(*(grants(role_of(b)) for b in agent_bindings() if b["kind"] == "ClusterRoleBinding"))
    assert {verb for _, _, verb in cluster_wide} <= READ_VERBS
    agent_path, _ = config_map_file(agent_deployment(), tmp_path)
    site = AgentConfig.model_validate(yaml.safe_load(agent_path.read_text())).site
    assert site.adapter.kind == "kubernetes"
    tenant_namespaces = {site.adapter.namespace_prefix + q.tenant for q in site.quotas}
    writers = [b for b in agent_bindings() if b["kind"] == "RoleBinding"]
    state = site.adapter.state_namespace
    assert state is not None and state not in tenant_namespaces
    assert {b["metadata"]["namespace"] for b in writers} == tenant_namespaces | {state}
    assert all(find("Namespace", ns) for ns in tenant_namespaces | {state})
    # In the state namespace, the ConfigMap of the stops only; a namespace of its own, not the agent's (whose
    # ConfigMaps configure the agent and the broker).
    assert set().union(*(grants(role_of(b)) for b in writers if b["metadata"]["namespace"] == state)) == {
        ("", "configmaps", verb) for verb in ("get", "create", "patch")}
    assert state != agent_deployment()["metadata"]["namespace"]


def rule_comments(path: Path) -> Iterator[str]:
    """The comment lines right above each rule (``- apiGroups:``) of a manifest, in order."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("- apiGroups:"):
            above = []
            while i > 0 and lines[i - 1].strip().startswith("#"):
                i -= 1
                above.append(lines[i])
            yield " ".join(above)


def test_every_rbac_rule_names_the_adapter_calls_that_need_it() -> None:
    rules = [r for f, o in k8s_objects() if f == "agent.yaml" and o["kind"] in ("ClusterRole", "Role")
             for r in o["rules"]]
    comments = list(rule_comments(K8S / "agent.yaml"))
    assert all(f == "agent.yaml" for f, o in k8s_objects() if "rules" in o) and len(comments) == len(rules)
    for rule, comment in zip(rules, comments, strict=True):
        named = [m for m in K8S_CALLS if f".{m}" in comment or f" {m}" in comment]
        assert named, f"a rule without the call that needs it: {rule}"
        covered = {(K8S_CALLS[m][0], K8S_CALLS[m][1], v) for m in named for v in K8S_CALLS[m][2]}
        assert grants({"rules": [rule]}) <= covered, f"{rule} grants more than {', '.join(named)} need"
