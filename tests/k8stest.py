"""Kubernetes manifests as the kubelet would run them, without a cluster.

    render(folder)                 ``kubectl kustomize FOLDER``, parsed into dicts
    pods(docs)                     one :class:`Pod` per pod the workloads make
                                   (every StatefulSet ordinal; one for the others)
    expand(text, env)              the kubelet's ``$(VAR)`` expansion (``$$`` escapes)
    quantity_bytes(q)              a memory quantity (``4160Mi``) in bytes
    launch(pod, container, docs, root)
                                   that container's argv and environment, its
                                   volumes made as folders under ``root`` (secrets
                                   and config maps written out) and every mount
                                   path in the command line pointed there

Used by tests/integration/test_deploy.py to run each kvstore container's
real command line with ``--check-config``.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

WORKLOADS = ("StatefulSet", "Deployment", "DaemonSet")

#: What the downward API gives a pod here (any well-formed values do).
POD_IP = "10.0.0.10"
NODE_NAME = "worker-1"


def kubectl() -> str | None:
    """The kubectl on PATH, or None."""
    return shutil.which("kubectl")


def render(folder: str | os.PathLike, timeout_s: float = 60.0) -> list[dict]:
    """The resources ``kubectl kustomize FOLDER`` renders.

    Raises:
        subprocess.CalledProcessError: kustomize refused the folder.
        ValueError: it rendered something that is not a resource.
    """
    out = subprocess.run([kubectl() or "kubectl", "kustomize", str(folder)], check=True,
                         capture_output=True, text=True, timeout=timeout_s).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    for d in docs:      # e.g. old kustomize's leftovers of a deleted resource
        if "kind" not in d or "name" not in d.get("metadata", {}):
            raise ValueError(f"{folder}: rendered a resource without kind or name: {d}")
    return docs


def find(docs: list[dict], kind: str, name: str) -> dict:
    """The rendered resource of ``kind`` named ``name``.

    Raises:
        KeyError: there is none.
    """
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise KeyError(f"no {kind} {name}")


@dataclass(frozen=True)
class Pod:
    """One pod a workload makes."""

    workload: dict          # the StatefulSet, Deployment or DaemonSet
    name: str               # its pod name (and hostname)
    ordinal: int | None     # a StatefulSet pod's ordinal, else None

    @property
    def namespace(self) -> str:
        return self.workload["metadata"].get("namespace", "default")

    @property
    def spec(self) -> dict:
        return self.workload["spec"]["template"]["spec"]


def pods(docs: list[dict]) -> list[Pod]:
    """Every pod of the rendered workloads: each StatefulSet ordinal, one pod of a
    Deployment or DaemonSet (their pods are alike)."""
    out = []
    for d in docs:
        if d["kind"] not in WORKLOADS:
            continue
        name = d["metadata"]["name"]
        if d["kind"] == "StatefulSet":
            out += [Pod(d, f"{name}-{i}", i) for i in range(d["spec"].get("replicas", 1))]
        else:
            out.append(Pod(d, f"{name}-7d4b9c8f6-x2x9q" if d["kind"] == "Deployment"
                           else f"{name}-x2x9q", None))
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """``text`` with ``$(NAME)`` replaced by ``env[NAME]`` as the kubelet does it:
    ``$$`` is a literal ``$``; an unknown or malformed reference stays as written."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c != "$" or i + 1 >= n:
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:
                out.append(text[i:])
                break
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _field(pod: Pod, path: str) -> str:
    values = {"metadata.name": pod.name, "metadata.namespace": pod.namespace,
              "status.podIP": POD_IP, "spec.nodeName": NODE_NAME,
              "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default")}
    return values[path]


def _data(docs: list[dict], kind: str, name: str) -> dict[str, bytes]:
    """A Secret's or ConfigMap's entries, decoded."""
    res = find(docs, kind, name)
    if kind == "Secret":
        return {k: base64.b64decode(v) for k, v in (res.get("data") or {}).items()} | {
            k: v.encode() for k, v in (res.get("stringData") or {}).items()}
    return {k: v.encode() for k, v in (res.get("data") or {}).items()}


def environment(pod: Pod, container: dict, docs: list[dict]) -> dict[str, str]:
    """The container's ``env``, in order (a value may use the ones before it): what
    ``$(VAR)`` in its command line may name."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
            continue
        ref = e["valueFrom"]
        if "fieldRef" in ref:
            env[e["name"]] = _field(pod, ref["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in ref:
            r = ref["configMapKeyRef"]
            env[e["name"]] = _data(docs, "ConfigMap", r["name"])[r["key"]].decode()
        elif "secretKeyRef" in ref:
            r = ref["secretKeyRef"]
            env[e["name"]] = _data(docs, "Secret", r["name"])[r["key"]].decode()
        else:
            raise NotImplementedError(f"env {e['name']}: {sorted(ref)}")
    return env


def mount_folders(pod: Pod, container: dict, docs: list[dict], root: Path) -> dict[str, Path]:
    """Each of the container's mount paths -> a folder under ``root`` holding what
    the volume would: a secret's or config map's entries as files, else nothing."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    out = {}
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        folder = root / pod.name / container["name"] / m["mountPath"].strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        source = (("Secret", vol["secret"]["secretName"]) if "secret" in vol else
                  ("ConfigMap", vol["configMap"]["name"]) if "configMap" in vol else None)
        if source is not None:
            for key, value in _data(docs, *source).items():
                (folder / key).write_bytes(value)
        out[m["mountPath"]] = folder
    return out


def _mount_pattern(paths) -> re.Pattern:
    """Any of ``paths`` where it starts a path: ``/dev/shm/x``, not ``/x/dev/shm``
    nor ``/dev/shmx`` (longest first)."""
    alt = "|".join(re.escape(p.rstrip("/")) for p in sorted(paths, key=len, reverse=True))
    return re.compile(rf"(?<![\w./-])({alt})(?=/|$|[^\w.-])")


def _relocate(text: str, mounts: dict[str, Path]) -> str:
    """``text`` with each mount path replaced by its folder, in one pass."""
    if not mounts:
        return text
    paths = {p.rstrip("/"): str(f) for p, f in mounts.items()}
    return _mount_pattern(paths).sub(lambda m: paths[m.group(1)], text)


def runs_kvstore(container: dict) -> bool:
    """Whether the container's command line runs ``kvstore SERVICE``."""
    line = container.get("command", []) + container.get("args", [])
    return any(a == "kvstore" and i + 1 < len(line) for i, a in enumerate(line))


KVSTORE_HERE = (sys.executable, "-m", "kvstore.tools.cli.cli")


def launch(pod: Pod, container: dict, docs: list[dict], root: Path,
           extra_args: tuple[str, ...] = (),
           program: tuple[str, ...] = KVSTORE_HERE) -> tuple[list[str], dict[str, str]]:
    """The argv and environment the container would start with, runnable here:
    ``$(VAR)`` expanded, mount paths moved under ``root``, the ``kvstore`` program
    replaced by ``program`` (this Python's kvstore CLI), and ``extra_args`` added
    to the end of its args (a shell wrapper in ``command`` still runs as written)."""
    env = environment(pod, container, docs)
    mounts = mount_folders(pod, container, docs, root)
    command = [_relocate(expand(a, env), mounts) for a in container.get("command", [])]
    args = [_relocate(expand(a, env), mounts) for a in container.get("args", [])]
    for a in command + args:     # e.g. a wrapper's rm of /dev/shm/... must stay in root
        for folder in sorted(map(str, mounts.values()), key=len, reverse=True):
            a = a.replace(folder, "<mounted>")
        left = _mount_pattern(mounts).search(a) if mounts else None
        if left:
            raise AssertionError(f"{pod.name}: mount path {left[1]} not relocated in {a!r}")
    argv = []
    for a in command + args + list(extra_args):
        argv += list(program) if a == "kvstore" else [a]
    base = {k: os.environ[k] for k in ("PATH", "LANG") if k in os.environ}
    base["HOSTNAME"] = pod.name                  # the runtime sets it; not for $(VAR)
    return argv, base | {k: _relocate(v, mounts) for k, v in env.items()}


_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}


def quantity_bytes(q: str | int) -> int:
    """A Kubernetes memory quantity (``4160Mi``, ``5Gi``, ``512M``) in bytes.

    Raises:
        ValueError: not a quantity of that form.
    """
    m = re.fullmatch(r"(\d+)([KMGT]i|[kMGT]|)", str(q))
    if m is None:
        raise ValueError(f"not a memory quantity: {q!r}")
    return int(m.group(1)) * _SUFFIXES[m.group(2)]
