#!/usr/bin/env python3
"""Checks the files under deploy/ against the code they describe.

No network, no container engine. With the standard library alone it checks:
- every JSON file parses; the Grafana dashboard has its variables and
  well-formed panels;
- every metric name and every method/code/reason/state/component label value
  used by the dashboard, the Prometheus rules and docs/DEPLOY.md exists in
  service/metrics.cc (and the sources it names);
- every kvq-server flag set by the Dockerfile and the Kubernetes flag file is
  defined in service/server_config.cc;
- every path the Dockerfile copies from the build context exists, and the
  build targets and binaries it names are defined by the CMake files.
With PyYAML it also parses every YAML file and checks the Kubernetes
manifests against each other (ports, names, shutdown timing, memory versus
--capacity_bytes). With promtool on PATH it runs `promtool check rules`, the
rule unit tests and `promtool check config` on the example prometheus.yml.
Missing optional tools are reported as skipped; scripts/install_deps.sh
installs them all. The real tools' checks are in the other tests here:
kubectl kustomize and kubernetes-validate (test_k8s_manifests.py), a live
Prometheus (test_live_prometheus.py), hadolint and the image's libraries
(test_dockerfile.py).

Usage: check_deploy.py [--root REPO_ROOT]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml  # PyYAML, optional
except ImportError:  # pragma: no cover - depends on the machine
    yaml = None


class Checker:
    def __init__(self, root):
        self.root = root
        self.passed = 0
        self.failed = 0
        self.skipped = 0

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def read(self, *parts):
        with open(self.path(*parts), encoding="utf-8") as f:
            return f.read()

    def ok(self, name):
        self.passed += 1
        print(f"ok    {name}")

    def fail(self, name, why):
        self.failed += 1
        print(f"FAIL  {name}: {why}")

    def skip(self, name, why):
        self.skipped += 1
        print(f"skip  {name}: {why}")

    def expect(self, name, problems):
        if problems:
            self.fail(name, "; ".join(problems))
        else:
            self.ok(name)


def deploy_files(c, *exts):
    out = []
    for d, _, files in os.walk(c.path("deploy")):
        for f in sorted(files):
            if f.endswith(exts):
                out.append(os.path.relpath(os.path.join(d, f), c.root))
    return sorted(out)


# ---------------------------------------------------------- the code's facts

def metric_facts(c):
    """Metric names and label values, read from the service sources."""
    src = c.read("service", "metrics.cc")
    names = set(re.findall(r'Gauge\(\s*"(kvq_\w+)"', src))
    for kind, name in re.findall(r'Build(Counter|Gauge|Histogram)\(\)\s*\.Name\(\s*"(kvq_\w+)"', src):
        names.add(name)
        if kind == "Histogram":
            names.update({name + "_bucket", name + "_sum", name + "_count"})

    def array(var):
        m = re.search(var + r"\[[^\]]*\]\s*=\s*\{(.*?)\};", src, re.S)
        return set(re.findall(r'"(\w+)"', m.group(1))) if m else set()

    store = c.read("service", "sequence_store.cc")
    m = re.search(r"GoneReasonName\(GoneReason r\)\s*\{(.*?)\n\}", store, re.S)
    reasons = set(re.findall(r'return "(\w+)"', m.group(1))) - {"gone"} if m else set()
    labels = {
        "method": array("kNames"),
        "code": array("kCodeNames"),
        "reason": reasons,
        "state": set(re.findall(r'\{"state", "(\w+)"\}', src)),
        "component": set(re.findall(r'\{"(\w+)", st\.bytes\.\w+\}', src)),
    }
    return names, labels


def server_flags(c):
    src = c.read("service", "server_config.cc")
    return set(re.findall(r"ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)\s*,", src)) | {
        "flagfile", "fromenv", "tryfromenv", "undefok"}


# --------------------------------------------------------------------- checks

def check_json(c):
    for rel in deploy_files(c, ".json"):
        try:
            with open(c.path(rel), encoding="utf-8") as f:
                json.load(f)
            c.ok(f"{rel} is valid JSON")
        except ValueError as e:
            c.fail(f"{rel} is valid JSON", str(e))


def check_dashboard(c):
    rel = os.path.join("deploy", "grafana", "kvq-dashboard.json")
    with open(c.path(rel), encoding="utf-8") as f:
        d = json.load(f)
    problems = []
    variables = {v.get("name"): v for v in d.get("templating", {}).get("list", [])}
    if variables.get("datasource", {}).get("type") != "datasource":
        problems.append("no datasource variable")
    for name in ("job", "instance"):
        if variables.get(name, {}).get("type") != "query":
            problems.append(f"no {name} query variable")
    ids = set()
    for p in d.get("panels", []):
        title = p.get("title", "?")
        if p.get("id") in ids:
            problems.append(f"duplicate panel id {p.get('id')}")
        ids.add(p.get("id"))
        if "gridPos" not in p:
            problems.append(f"{title}: no gridPos")
        if p.get("type") == "row":
            continue
        if p.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"{title}: datasource is not the variable")
        targets = p.get("targets", [])
        if not targets:
            problems.append(f"{title}: no queries")
        for t in targets:
            expr = t.get("expr", "")
            if not expr:
                problems.append(f"{title}: empty query")
            if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
                problems.append(f"{title}: unbalanced brackets in {expr!r}")
            if "kvq_" in expr and '$instance' not in expr:
                problems.append(f"{title}: query ignores the instance variable")
    c.expect(f"{rel} has its variables and well-formed panels", problems)


def check_metric_names(c, names, labels):
    files = deploy_files(c, ".yaml", ".yml", ".json")
    files = [f for f in files if os.sep + "prometheus" + os.sep in f or os.sep + "grafana" + os.sep in f]
    if os.path.exists(c.path("docs", "DEPLOY.md")):
        files.append(os.path.join("docs", "DEPLOY.md"))
    not_metrics = {"kvq_server", "kvq_cli", "kvq_client", "kvq_service", "kvq_store",
                   "kvq_kernels", "kvq_proto", "kvq_test_util"}
    for rel in files:
        text = c.read(rel)
        problems = []
        for name in sorted(set(re.findall(r"\bkvq_[a-z0-9_]+\b(?!:)", text)) - not_metrics):
            if name not in names:
                problems.append(f"unknown metric {name}")
        for label, op, value in re.findall(
                r'\b(method|code|reason|state|component)\s*(=~|!~|=|!=)\s*\\?"([^"\\]*)\\?"', text):
            if op in ("=~", "!~") and not re.fullmatch(r"[A-Za-z_|]+", value):
                continue  # a real regular expression: not checked
            for v in value.split("|") if op in ("=~", "!~") else [value]:
                if v not in labels[label]:
                    problems.append(f'{label}="{v}" is not a value kvq-server exports')
        c.expect(f"{rel}: metric names and label values exist in service/", problems)


def flag_args(text):
    return re.findall(r"(?<![\w-])--([a-z_]+)(?:=|\b)", text)


def check_flags(c, known):
    problems = []
    flags_file = os.path.join("deploy", "k8s", "base", "kvq.flags")
    for line in c.read(flags_file).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"--(\w+)(=\S*)?", line)
        if not m:
            problems.append(f"{flags_file}: not a --flag[=value] line: {line!r}")
        elif m.group(1) not in known:
            problems.append(f"{flags_file}: unknown kvq-server flag --{m.group(1)}")
    docker = c.read("deploy", "Dockerfile")
    for instr in ("ENTRYPOINT", "CMD"):
        for m in re.finditer(rf"^{instr}\s+(\[.*\])\s*$", docker, re.M):
            argv = json.loads(m.group(1))
            if instr == "ENTRYPOINT" and not argv[0].endswith("kvq-server"):
                problems.append(f"Dockerfile ENTRYPOINT runs {argv[0]}, not kvq-server")
            for a in argv:
                f = re.match(r"--(\w+)", a)
                if f and f.group(1) not in known:
                    problems.append(f"Dockerfile {instr}: unknown kvq-server flag --{f.group(1)}")
    c.expect("kvq-server flags in deploy/ are defined in service/server_config.cc", problems)


def check_dockerfile(c):
    rel = os.path.join("deploy", "Dockerfile")
    text = re.sub(r"\\\n", " ", c.read(rel))
    problems = []
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M | re.I))
    for m in re.finditer(r"^COPY\s+(.*)$", text, re.M):
        args = m.group(1).split()
        opts = [a for a in args if a.startswith("--")]
        paths = [a for a in args if not a.startswith("--")]
        frm = [o.split("=", 1)[1] for o in opts if o.startswith("--from=")]
        if frm:
            if frm[0] not in stages:
                problems.append(f"COPY --from={frm[0]}: no such stage")
            continue
        for src in paths[:-1]:
            if not os.path.exists(c.path(src)):
                problems.append(f"COPY {src}: not in the repository")
    ignore = c.path("deploy", "Dockerfile.dockerignore")
    if os.path.exists(ignore):
        lines = [ln.strip() for ln in open(ignore, encoding="utf-8")
                 if ln.strip() and not ln.strip().startswith("#")]
        if lines and lines[0] == "*":
            allowed = [ln[1:].rstrip("/") for ln in lines if ln.startswith("!")]
            for m in re.finditer(r"^COPY\s+(?!--from)(.*)$", text, re.M):
                for src in m.group(1).split()[:-1]:
                    src = src.rstrip("/")
                    if not any(src == a or src.startswith(a + "/") for a in allowed):
                        problems.append(f"COPY {src}: excluded by Dockerfile.dockerignore")
    executables = {}
    for d, dirs, files in os.walk(c.root):
        # Skip build trees and hidden directories (.git, caches).
        dirs[:] = [x for x in dirs if not x.startswith(("build", "."))]
        if "CMakeLists.txt" in files:
            cm = open(os.path.join(d, "CMakeLists.txt"), encoding="utf-8").read()
            for target in re.findall(r"add_executable\((\w+)", cm):
                out = re.search(rf"set_target_properties\({target}\s+PROPERTIES\s+OUTPUT_NAME\s+([\w-]+)", cm)
                executables[target] = (os.path.relpath(d, c.root), out.group(1) if out else target)
    for m in re.finditer(r"--target\s+([\w ]+?)\s*(?:&&|$)", text, re.M):
        for target in m.group(1).split():
            if target not in executables:
                problems.append(f"cmake --target {target}: no such executable in the CMake files")
    for subdir, binary in re.findall(r"/build/([\w/]+)/([\w-]+)\b", text):
        if (subdir, binary) not in executables.values():
            problems.append(f"/build/{subdir}/{binary}: no CMake executable builds it there")
    # The folders the top-level CMakeLists.txt always adds (not under an
    # option such as tests or benchmarks) must be in the image's source, or
    # its configure step fails.
    copied = {src.rstrip("/") for m in re.finditer(r"^COPY\s+(?!--from)(.*)$", text, re.M)
              for src in m.group(1).split()[:-1]}
    top = c.read("CMakeLists.txt")
    for sub in re.findall(r"^add_subdirectory\((\S+?)\)", top, re.M):
        if sub not in copied:
            problems.append(f"COPY: the build always needs {sub}/ (CMakeLists.txt adds it)")
    c.expect(f"{rel}: copied paths, stages, targets and binaries exist", problems)


def quantity_bytes(q):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTE]i?)?", str(q))
    if not m:
        raise ValueError(f"unknown quantity {q!r}")
    mult = {None: 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "E": 10**18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Ei": 2**60}[m.group(2)]
    return int(float(m.group(1)) * mult)


def load_yaml_docs(c, rel):
    with open(c.path(rel), encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def check_yaml(c):
    if yaml is None:
        c.skip("YAML files parse and Kubernetes manifests agree", "PyYAML is not installed")
        return
    docs = {}
    for rel in deploy_files(c, ".yaml", ".yml"):
        try:
            docs[rel] = load_yaml_docs(c, rel)
            c.ok(f"{rel} parses")
        except yaml.YAMLError as e:
            c.fail(f"{rel} parses", str(e).replace("\n", " "))
    # The base's objects; the overlays' patches are partial objects and are
    # checked in the rendering (tests/deploy/test_k8s_manifests.py).
    k8s = os.path.join("deploy", "k8s", "base")
    objects = {}
    for rel, ds in docs.items():
        if rel.startswith(k8s + os.sep):
            for d in ds:
                if isinstance(d, dict) and "kind" in d and d["kind"] != "Kustomization":
                    objects[(d["kind"], d.get("metadata", {}).get("name"))] = d

    problems = []
    kust = docs.get(os.path.join(k8s, "kustomization.yaml"), [{}])[0]
    for res in kust.get("resources", []):
        if not os.path.exists(c.path(k8s, res)):
            problems.append(f"kustomization resource {res} is missing")
    for gen in kust.get("configMapGenerator", []):
        for f in gen.get("files", []):
            if not os.path.exists(c.path(k8s, f.split("=")[-1])):
                problems.append(f"configMapGenerator file {f} is missing")
    for overlay in ("cpu", "gpu"):
        rel = os.path.join("deploy", "k8s", "overlays", overlay)
        ov = docs.get(os.path.join(rel, "kustomization.yaml"), [{}])[0]
        if ov.get("resources") != ["../../base"]:
            problems.append(f"overlay {overlay} does not build on ../../base")
        for patch in ov.get("patches", []):
            if "path" in patch and not os.path.exists(c.path(rel, patch["path"])):
                problems.append(f"overlay {overlay}: patch {patch['path']} is missing")
    c.expect("deploy/k8s kustomizations name existing files", problems)

    sts = objects.get(("StatefulSet", "kvq"))
    if sts is None:
        c.fail("deploy/k8s StatefulSet kvq", "not found")
        return
    pod = sts["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    flags = {}
    for line in c.read(k8s, "kvq.flags").splitlines():
        m = re.fullmatch(r"--(\w+)(?:=(\S*))?", line.strip())
        if m:
            flags[m.group(1)] = m.group(2) if m.group(2) is not None else "true"
    problems = []
    ports = {p["name"]: p["containerPort"] for p in ctr.get("ports", [])}
    docker = c.read("deploy", "Dockerfile")
    for name, flag in (("grpc", "address"), ("metrics", "metrics_address")):
        m = re.search(rf'"--{flag}=[^"]*:(\d+)"', docker)
        if not m or ports.get(name) != int(m.group(1)):
            problems.append(f"container port {name} does not match the image's --{flag}")
    for probe in ("readinessProbe", "livenessProbe"):
        if ctr.get(probe, {}).get("grpc", {}).get("port") != ports.get("grpc"):
            problems.append(f"{probe} is not a gRPC probe on the gRPC port")
    svc = objects.get(("Service", "kvq"), {})
    svc_ports = {p["name"]: p for p in svc.get("spec", {}).get("ports", [])}
    for name in ports:
        if name not in svc_ports or svc_ports[name].get("targetPort") not in (name, ports[name]):
            problems.append(f"Service kvq does not expose container port {name}")
    if sts["spec"].get("serviceName") != svc.get("metadata", {}).get("name"):
        problems.append("StatefulSet serviceName is not the Service")
    sel = sts["spec"]["selector"]["matchLabels"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in sel.items()):
        problems.append("StatefulSet selector does not match its pod labels")
    for kind in ("PodDisruptionBudget", "Service"):
        o = objects.get((kind, "kvq"), {})
        s = o.get("spec", {}).get("selector", {})
        s = s.get("matchLabels", s)
        if any(labels.get(k) != v for k, v in s.items()):
            problems.append(f"{kind} kvq does not select the pods")
    np_ = objects.get(("NetworkPolicy", "kvq"), {}).get("spec", {})
    np_ports = {p.get("port") for r in np_.get("ingress", []) for p in r.get("ports", [])}
    if not set(ports.values()) <= np_ports:
        problems.append("NetworkPolicy does not admit both container ports")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    gen_names = {g["name"] for g in kust.get("configMapGenerator", [])}
    for vm in ctr.get("volumeMounts", []):
        cm = volumes.get(vm["name"], {}).get("configMap", {}).get("name")
        if cm and cm not in gen_names:
            problems.append(f"volume {vm['name']} uses ConfigMap {cm}, which kustomize does not generate")
    if "--flagfile=/etc/kvq/kvq.flags" in ctr.get("args", []):
        if not any(vm["mountPath"] == "/etc/kvq" for vm in ctr.get("volumeMounts", [])):
            problems.append("--flagfile points to /etc/kvq but nothing is mounted there")
    c.expect("deploy/k8s manifests agree with each other and with the image", problems)

    problems = []
    grace = pod.get("terminationGracePeriodSeconds", 30)
    pre = ctr.get("lifecycle", {}).get("preStop", {})
    pre_s = int(pre.get("sleep", {}).get("seconds", 0))
    cmd = pre.get("exec", {}).get("command", [])
    if len(cmd) == 2 and cmd[0].endswith("sleep"):
        pre_s = int(cmd[1])
    shutdown = int(flags.get("shutdown_grace_seconds", 10))
    if not grace > pre_s + shutdown:
        problems.append(f"terminationGracePeriodSeconds {grace} <= preStop {pre_s} s + "
                        f"--shutdown_grace_seconds {shutdown}")
    if pre_s <= 0:
        problems.append("no preStop delay to let endpoints drain")
    c.expect("shutdown: grace period covers preStop and --shutdown_grace_seconds", problems)

    problems = []
    res = ctr.get("resources", {})
    capacity = int(flags.get("capacity_bytes", "0"))
    if capacity <= 0:
        problems.append("kvq.flags must set --capacity_bytes (the fraction reads the node's memory)")
    limit = quantity_bytes(res.get("limits", {}).get("memory", "0"))
    request = quantity_bytes(res.get("requests", {}).get("memory", "0"))
    if limit < capacity + 2**30:
        problems.append(f"memory limit {limit} is below --capacity_bytes {capacity} + 1 GiB")
    if request != limit:
        problems.append("memory request != limit (not Guaranteed QoS)")
    sc = ctr.get("securityContext", {})
    if not (sc.get("readOnlyRootFilesystem") and sc.get("allowPrivilegeEscalation") is False):
        problems.append("container is not read-only / no-privilege-escalation")
    if not pod.get("securityContext", {}).get("runAsNonRoot"):
        problems.append("pod does not require a non-root user")
    c.expect("resources and security: memory covers the pool, non-root, read-only", problems)

    # The PrometheusRule wrapping that docs/DEPLOY.md shows (indent the rule
    # file under spec:) must give back the same groups.
    rules_rel = os.path.join("deploy", "prometheus", "kvq-rules.yaml")
    rules_text = c.read(rules_rel)
    wrapped = ("apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\n"
               "metadata:\n  name: kvq\nspec:\n" +
               "".join("  " + ln if ln.strip() else ln for ln in rules_text.splitlines(True)))
    same = yaml.safe_load(wrapped)["spec"] == yaml.safe_load(rules_text)
    c.expect("kvq-rules.yaml wraps into a PrometheusRule unchanged", [] if same else ["differs"])

    problems = []
    sm = docs.get(os.path.join("deploy", "prometheus", "servicemonitor.yaml"), [{}])[0]
    for ep in sm.get("spec", {}).get("endpoints", []):
        if ep.get("port") not in svc_ports:
            problems.append(f"ServiceMonitor port {ep.get('port')} is not a Service port")
    sm_sel = sm.get("spec", {}).get("selector", {}).get("matchLabels", {})
    if any(svc.get("metadata", {}).get("labels", {}).get(k) != v for k, v in sm_sel.items()):
        problems.append("ServiceMonitor does not select Service kvq")
    c.expect("ServiceMonitor selects the Service's metrics port", problems)


def check_promtool(c):
    promtool = shutil.which("promtool")
    if promtool is None:
        c.skip("promtool check rules / test rules", "promtool is not installed")
        return
    d = c.path("deploy", "prometheus")
    for args in (["check", "rules", "kvq-rules.yaml"], ["test", "rules", "kvq-rules.test.yaml"]):
        r = subprocess.run([promtool] + args, cwd=d, capture_output=True, text=True, timeout=120)
        name = "promtool " + " ".join(args)
        if r.returncode == 0:
            c.ok(name)
        else:
            c.fail(name, (r.stdout + r.stderr).strip().replace("\n", " | ")[-2000:])


def check_prometheus_config(c):
    """promtool check config on the example prometheus.yml. Debian's
    Prometheus is built without Kubernetes service discovery, so there the
    file is checked without its kubernetes_sd_configs job."""
    promtool = shutil.which("promtool")
    name = "promtool check config deploy/prometheus/prometheus.yml"
    if promtool is None or yaml is None:
        c.skip(name, "promtool or PyYAML is not installed")
        return
    d = c.path("deploy", "prometheus")

    def check(dir_, file):
        return subprocess.run([promtool, "check", "config", file], cwd=dir_, capture_output=True,
                              text=True, timeout=120)

    r = check(d, "prometheus.yml")
    if r.returncode != 0 and "field kubernetes_sd_configs not found" in r.stdout + r.stderr:
        config = yaml.safe_load(c.read("deploy", "prometheus", "prometheus.yml"))
        config["scrape_configs"] = [s for s in config["scrape_configs"]
                                    if "kubernetes_sd_configs" not in s]
        config["rule_files"] = [os.path.join(d, f) for f in config.get("rule_files", [])]
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "prometheus.yml"), "w", encoding="utf-8") as f:
                yaml.safe_dump(config, f)
            r = check(tmp, "prometheus.yml")
        name += " (without the kubernetes_sd_configs job: this promtool lacks Kubernetes discovery)"
    if r.returncode == 0:
        c.ok(name)
    else:
        c.fail(name, (r.stdout + r.stderr).strip().replace("\n", " | ")[-2000:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    root = os.path.abspath(ap.parse_args().root)
    c = Checker(root)
    names, labels = metric_facts(c)
    if not names or not all(labels.values()):
        c.fail("read metric names and label values from service/", f"{len(names)} names, {labels}")
    check_json(c)
    check_dashboard(c)
    check_metric_names(c, names, labels)
    check_flags(c, server_flags(c))
    check_dockerfile(c)
    check_yaml(c)
    check_promtool(c)
    check_prometheus_config(c)
    print(f"{c.passed} passed, {c.failed} failed, {c.skipped} skipped")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
