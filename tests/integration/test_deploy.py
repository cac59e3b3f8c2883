"""deploy/: the Kubernetes manifests render, validate, and their command lines run.

Nothing starts a cluster. ``kubectl kustomize`` renders deploy/kubernetes
(and its overlays) and every resource is validated, strictly, against the
schemas of Kubernetes :data:`K8S_VERSION` (kubernetes-validate). Each kvstore
container's command line is then rebuilt as the kubelet would (``$(VAR)``,
the downward API, the mounted secret written to a folder, a shell wrapper
run as written) and run with ``--check-config``: it must be accepted, with
real tokens in the secret, and refused with the placeholders committed. A
copy with a misspelled flag must fail the same check. The rest reads the
rendered resources: the masters' shard layout, every in-cluster address, the
node's memory rule, probes, scrape settings, the dashboard and the image.

What needs kubectl is skipped without it (CI installs Debian's kubernetes-client;
.ci/run).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import k8stest
from k8stest import find, launch, pods, quantity_bytes, render, runs_kvstore

needs_kubectl = pytest.mark.skipif(
    k8stest.kubectl() is None,
    reason="kubectl is not installed (Debian: apt-get install kubernetes-client; .ci/run does)")

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BASE = DEPLOY / "kubernetes"
K8S_VERSION = "1.33.0"
ROLES = ("admin", "client", "node", "metrics")
CHECK_TIMEOUT_S = 120.0
README_BASE = "../kvstore/deploy/kubernetes"     # the base, as docs/kubernetes.md's overlay names it


# ---- rendering ----

def with_secrets(tmp: Path, base: Path) -> Path:
    """The docs' overlay of ``base`` (docs/kubernetes.md's kustomization.yaml, word for word but
    for the path of the base), with freshly generated tokens."""
    readme = (REPO / "docs" / "kubernetes.md").read_text()
    kustomization = re.search(r"cat > kustomization.yaml <<'YAML'\n(.*?)\nYAML\n", readme, re.S)
    assert kustomization and README_BASE in kustomization.group(1), "docs/kubernetes.md's overlay moved"
    overlay = tmp / "overlay"
    overlay.mkdir()
    tokens = {role: secrets.token_hex(16) for role in ROLES}
    (overlay / "tokens").write_text("".join(f"{r} {t}\n" for r, t in tokens.items()))
    for role in ("node", "client", "metrics"):
        (overlay / f"{role}.token").write_text(tokens[role] + "\n")
    (overlay / "kustomization.yaml").write_text(kustomization.group(1).replace(
        README_BASE, Path(os.path.relpath(base, overlay)).as_posix()) + "\n")
    return overlay


def in_one_namespace(docs: list[dict]) -> list[dict]:
    """``docs``, checked to be all in namespace kvstore (old kustomize, for one,
    drops the namespace of a secret an overlay replaces unless it names one)."""
    spaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert spaces == {"kvstore"}
    return docs


@pytest.fixture(scope="module")
def base_docs() -> list[dict]:
    return in_one_namespace(render(BASE))


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[dict]:
    """The base with a usable secret."""
    return in_one_namespace(render(with_secrets(tmp_path_factory.mktemp("overlay"), BASE)))


def validate(docs: list[dict]) -> None:
    import kubernetes_validate

    for d in docs:
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{d['kind']} {d['metadata']['name']}: {exc.message} "
                                 f"at {'.'.join(map(str, exc.path))}") from None


def kvstore_containers(docs: list[dict]):
    """(pod, container) for every container that runs ``kvstore SERVICE``."""
    for pod in pods(docs):
        for c in pod.spec["containers"]:
            if runs_kvstore(c):
                yield pod, c


def args_of(container: dict) -> dict[str, str]:
    """``--flag=value`` args as a dict (the manifests write every flag that way)."""
    out = {}
    for a in container.get("args", []):
        if a.startswith("--"):
            name, _, value = a.partition("=")
            out[name] = value
    return out


def check_configs(docs: list[dict], root: Path, only: str | None = None,
                  first_pods: bool = False) -> dict:
    """Run every kvstore container with --check-config (only workload ``only``'s;
    with ``first_pods`` only each workload's first pod); pod/container name -> the
    finished process."""
    jobs, workloads = {}, set()
    for pod, c in kvstore_containers(docs):
        name = pod.workload["metadata"]["name"]
        if (only is not None and name != only) or (first_pods and name in workloads):
            continue
        workloads.add(name)
        jobs[f"{pod.name}/{c['name']}"] = launch(pod, c, docs, root, ("--check-config",))

    def run(job):
        argv, env = job
        return subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S, cwd=root)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(jobs, pool.map(run, jobs.values())))


# ---- render and validate ----

@needs_kubectl
def test_base_renders_and_every_resource_validates(base_docs):
    kinds = sorted({(d["kind"], d["metadata"]["name"]) for d in base_docs})
    for expected in [("StatefulSet", "kvstore-etcd"), ("StatefulSet", "kvstore-master"),
                     ("PodDisruptionBudget", "kvstore-master"), ("DaemonSet", "kvstore-node"),
                     ("StatefulSet", "kvstore-prefill"), ("StatefulSet", "kvstore-decode"),
                     ("Deployment", "kvstore-conductor"), ("Secret", "kvstore-secrets"),
                     ("ConfigMap", "kvstore-config"), ("Service", "kvstore-conductor")]:
        assert expected in kinds
    validate(base_docs)


@needs_kubectl
def test_external_etcd_overlay_drops_etcd_and_points_the_masters_away(docs):
    ext = in_one_namespace(render(DEPLOY / "overlays" / "external-etcd"))
    validate(ext)
    assert not [d for d in ext if "etcd" in d["metadata"]["name"]]
    url = find(ext, "ConfigMap", "kvstore-config")["data"]["etcd-url"]
    assert url != find(docs, "ConfigMap", "kvstore-config")["data"]["etcd-url"]
    master = find(ext, "StatefulSet", "kvstore-master")
    pod = next(p for p in pods(ext) if p.workload is master)
    env = k8stest.environment(pod, pod.spec["containers"][0], ext)
    assert env["ETCD_URL"] == url


@needs_kubectl
def test_service_monitor_scrapes_every_metrics_port_with_the_metrics_token(docs):
    """The ServiceMonitor's CRD is not in kubernetes-validate's schemas: its shape is
    checked here, against the Services and the secret it names."""
    (monitor,) = in_one_namespace(render(BASE / "monitoring"))
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1",
                                                        "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    creds = endpoint["authorization"]["credentials"]
    assert creds["key"] in find(docs, "Secret", creds["name"])["data"]
    assert monitor["metadata"]["namespace"] == find(docs, "Secret", creds["name"])[
        "metadata"]["namespace"]
    wanted = {e["key"]: set(e["values"]) for e in monitor["spec"]["selector"]["matchExpressions"]}
    selected = [s for s in docs if s["kind"] == "Service"
                and all(s["metadata"]["labels"].get(k) in v for k, v in wanted.items())]
    components = {p.workload["metadata"]["labels"]["app.kubernetes.io/component"]
                  for p, _ in kvstore_containers(docs)}
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} \
        == components
    for s in selected:
        assert endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}


# ---- the command lines, run ----

@needs_kubectl
def test_every_kvstore_command_line_passes_check_config(docs, tmp_path):
    results = check_configs(docs, tmp_path)
    assert len(results) >= 8          # 4 masters, a node, prefill, decode, conductor
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}: {proc.stderr.strip()[-2000:]}"
        assert "configuration ok" in proc.stdout, name


@needs_kubectl
def test_placeholder_secrets_are_refused(base_docs, tmp_path):
    """The committed secret is placeholders: applied as is, every server refuses."""
    results = check_configs(base_docs, tmp_path, first_pods=True)
    assert len(results) == 5          # masters, nodes, prefill, decode, conductor
    for name, proc in results.items():
        assert proc.returncode == 2, f"{name}: {proc.returncode} {proc.stdout} {proc.stderr}"
        assert "16 characters" in proc.stderr, name


@needs_kubectl
def test_a_misspelled_flag_fails_the_check(tmp_path):
    base = tmp_path / "kubernetes"
    shutil.copytree(BASE, base)
    node = base / "node.yaml"
    text = node.read_text()
    assert "--drain-s=5" in text
    node.write_text(text.replace("--drain-s=5", "--drain-sec=5"))
    mutated = render(with_secrets(tmp_path, base))
    (proc,) = check_configs(mutated, tmp_path, only="kvstore-node").values()
    assert proc.returncode == 2
    assert "unrecognized arguments: --drain-sec" in proc.stderr


# ---- the rendered resources, read ----

def final_args(pod, container, docs, root: Path) -> list[str]:
    """The args ``kvstore`` gets once the container's wrapper ran (printed, not run)."""
    argv, env = launch(pod, container, docs, root, program=("printf", "%s\\n"))
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True,
                         timeout=10).stdout
    return out.splitlines()


def flag(argv: list[str], name: str) -> str:
    values = [a.partition("=")[2] if "=" in a else argv[i + 1]
              for i, a in enumerate(argv) if a == name or a.startswith(name + "=")]
    assert len(values) == 1, (name, argv)
    return values[0]


@needs_kubectl
def test_each_master_serves_the_shard_that_lists_its_address(docs, tmp_path):
    from kvstore.shardmap import ShardMap

    masters = [(p, c) for p, c in kvstore_containers(docs)
               if p.workload["metadata"]["name"] == "kvstore-master"]
    listed, served = set(), set()
    for pod, c in masters:
        argv = final_args(pod, c, docs, tmp_path)
        shard_map = ShardMap.parse(flag(argv, "--shard-map"))
        shard = int(flag(argv, "--shard-id"))
        me = f"{flag(argv, '--advertise-host')}:{flag(argv, '--port')}"
        mine = [r for r in shard_map.ranges if r.shard_id == shard]
        assert len(mine) == 1, f"{pod.name}: shard {shard} is not in the shard map"
        assert me in mine[0].addresses, f"{pod.name} serves shard {shard}, listed elsewhere"
        served.add(me)
        listed |= {a for r in shard_map.ranges for a in r.addresses}
    assert listed == served                   # every listed master is a pod, and back
    shards = {r.shard_id for r in shard_map.ranges}
    assert all(len([a for r in shard_map.ranges if r.shard_id == s for a in r.addresses]) >= 2
               for s in shards), "every shard has a standby"


@needs_kubectl
def test_in_cluster_addresses_name_services_and_pods_that_exist(docs, tmp_path):
    services = {s["metadata"]["name"]: s for s in docs if s["kind"] == "Service"}
    sets = {d["spec"]["serviceName"]: d for d in docs if d["kind"] == "StatefulSet"}
    seen = 0
    for pod, c in kvstore_containers(docs):
        argv, env = launch(pod, c, docs, tmp_path)
        for value in [*argv, *env.values()]:
            for host, port in re.findall(r"([a-z0-9.-]+\.svc):(\d+)", value):
                seen += 1
                labels = host.split(".")
                ns = labels[-2]
                assert ns == pod.namespace, value
                if len(labels) == 3:          # SERVICE.NS.svc
                    svc, member = labels[0], None
                else:                         # POD.SERVICE.NS.svc (a headless Service)
                    member, svc = labels[0], labels[1]
                assert svc in services, value
                ports = {p["port"] for p in services[svc]["spec"]["ports"]}
                assert int(port) in ports, value
                if member is not None:
                    assert services[svc]["spec"].get("clusterIP") == "None", value
                    owner = sets[svc]
                    ordinal = int(member.rsplit("-", 1)[1])
                    assert member == f"{owner['metadata']['name']}-{ordinal}", value
                    assert ordinal < owner["spec"]["replicas"], value
    assert seen >= 20
    etcd = find(docs, "ConfigMap", "kvstore-config")["data"]["etcd-url"]
    host, port = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", etcd).groups()
    assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}


@needs_kubectl
def test_node_memory_limit_is_dram_plus_headroom(docs):
    from kvstore.sizes import parse_size

    ds = find(docs, "DaemonSet", "kvstore-node")
    spec = ds["spec"]["template"]["spec"]
    (node,) = [c for c in spec["containers"] if runs_kvstore(c)]
    dram = parse_size(args_of(node)["--dram"])
    shm_mount = next(m for m in node["volumeMounts"] if m["mountPath"] == "/dev/shm")
    shm = next(v for v in spec["volumes"] if v["name"] == shm_mount["name"])["emptyDir"]
    assert shm["medium"] == "Memory"
    limit = quantity_bytes(node["resources"]["limits"]["memory"])
    assert quantity_bytes(node["resources"]["requests"]["memory"]) == limit
    assert dram < quantity_bytes(shm["sizeLimit"]) <= dram + 2**27          # + up to 128 MiB
    assert limit - dram >= 2**29, "headroom of at least 512 MiB over --dram"
    ssd = args_of(node)["--ssd-path"]
    assert any(m["mountPath"] == ssd for m in node["volumeMounts"])


@needs_kubectl
def test_probes_drain_and_scrape_settings(docs):
    for pod, c in kvstore_containers(docs):
        tpl = pod.workload["spec"]["template"]
        args = args_of(c)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == int(args["--metrics-port"]), pod.name
        assert tpl["metadata"]["annotations"]["prometheus.io/port"] == args["--metrics-port"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]["httpGet"]
            assert probe["port"] == "metrics" and probe["path"] in ("/ready", "/health")
        component = tpl["metadata"]["labels"]["app.kubernetes.io/component"]
        # standbys are ready: a master's readiness is /ready, the others' /health
        assert c["readinessProbe"]["httpGet"]["path"] == (
            "/ready" if component == "master" else "/health"), pod.name
        assert c["livenessProbe"]["httpGet"]["path"] == "/ready", pod.name
        grace = tpl["spec"]["terminationGracePeriodSeconds"]
        assert grace > float(args["--drain-s"]) + 5, pod.name       # + calls in flight
        assert "--auth" in args and args["--host"] == "0.0.0.0", pod.name


def test_dashboard_charts_every_exported_metric_by_its_real_name():
    exported = {}
    for folder in ("kvstore", "client", "engines", "conductor", "tools"):
        for path in (REPO / folder).rglob("*.py"):
            for call, name in re.findall(r"(\w+)\(\s*\"(kvstore_\w+)\"", path.read_text()):
                kind = ("histogram" if "istogram" in call else
                        "counter" if call.lower() == "counter" else "gauge")
                exported[name] = kind
    series = {n: n for n, k in exported.items() if k == "gauge"}
    series |= {n + "_total": n for n, k in exported.items() if k == "counter"}
    series |= {n + s: n for n, k in exported.items() if k == "histogram"
               for s in ("_bucket", "_sum", "_count")}
    board = json.loads((DEPLOY / "grafana" / "kvstore.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", {}).get("query", "") if isinstance(v.get("query"), dict)
              else v.get("query", "") for v in board["templating"]["list"]]
    charted = {m for e in exprs for m in re.findall(r"\bkvstore_\w+", e)}
    unknown = charted - set(series)
    assert not unknown, f"not exported (or with the wrong suffix): {sorted(unknown)}"
    missing = set(exported) - {series[m] for m in charted}
    assert not missing, f"exported but not charted: {sorted(missing)}"


def test_dockerfile_copies_every_package_folder():
    text = (DEPLOY / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", text, flags=re.M))
    pyproject = (REPO / "pyproject.toml").read_text()
    section = pyproject.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    folders = set(re.findall(r'^"[\w.]+" = "(\w+)"$', section, flags=re.M)) | {"kvstore", "proto"}
    assert len(folders) >= 6, folders
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"
    assert "-c /tmp/constraints.txt" in text


def test_ci_installs_kubectl():
    assert re.search(r"^ensure kubectl kubernetes-client$", (REPO / ".ci" / "run").read_text(),
                     flags=re.M)
