"""A real Prometheus scraping a live kvq-server: every Grafana panel query,
every recording and alerting rule expression must find data.

Starts kvq-server ($KVQ_SERVER_BIN, set by ctest) and Debian's `prometheus`
on free loopback ports with a temporary storage directory and a generated
configuration that scrapes the server every second and loads
deploy/prometheus/kvq-rules.yaml. A short, bounded load through the Python
client exercises every RPC and the error paths (RESOURCE_EXHAUSTED,
eviction, expiry, prefix reuse, client errors), then every expression goes
through Prometheus' HTTP API (/api/v1/query). Which queries an expression
must back with data is decided by tests/deploy/promql_data.py (conditions
and filters are taken apart there). Also runs `promtool check metrics` on a
live /metrics scrape. Everything is stopped on exit; the whole test takes
about 15 s.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, HERE)

from kvq_client import AttendQuery, DecodeItem, KvqClient, KvqError, ModelLayout, RopeParams  # noqa: E402
from prometheus_process import (PROMETHEUS, PROMTOOL, http_get, start_prometheus,  # noqa: E402
                                stopped_on_exit, wait_for)

SERVER_BIN = os.environ.get("KVQ_SERVER_BIN", "")
RULES = os.path.join(ROOT, "deploy", "prometheus", "kvq-rules.yaml")
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "kvq-dashboard.json")

if not os.access(SERVER_BIN, os.X_OK):
    pytest.skip("KVQ_SERVER_BIN does not name a kvq-server binary", allow_module_level=True)
if PROMETHEUS is None or PROMTOOL is None:
    pytest.skip("prometheus/promtool are not installed (Debian package prometheus; "
                "scripts/install_deps.sh installs it)", allow_module_level=True)
promql_data = pytest.importorskip(
    "promql_data", reason="promql-parser is not installed (scripts/install_deps.sh installs it)")

# Every wait below is bounded (prometheus_process.START_S); this is the
# scrape interval.
SCRAPE_S = 1
POOL_BYTES = 16 << 20  # Small, so that the load can fill it.
LAYOUT = ModelLayout(2, 2, 4, 64, RopeParams(theta=500000.0))
# Grafana's $__rate_interval is max(4 x scrape interval, $__interval +
# scrape interval); for a dashboard over the last hours that is a minute or
# more, which covers this whole test.
DASHBOARD_VARS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h", "job": "kvq"}


def kvq_load(address):
    """A bounded load over every RPC, with the error paths the rules watch."""
    rng = np.random.default_rng(7)
    kv = lambda n, dt=np.float16: (rng.standard_normal((2, 2, n, 64)).astype(dt),
                                   rng.standard_normal((2, 2, n, 64)).astype(dt))
    with KvqClient(address, namespace="live") as c:
        c.info()
        # RESOURCE_EXHAUSTED: a prompt bigger than the whole pool (nothing
        # to evict yet); the failed append stores nothing.
        c.create_sequence(LAYOUT, scheme="fp16", sequence_id="huge")
        with pytest.raises(KvqError) as e:
            c.append_prompt("huge", *kv(20000))
        assert e.value.code.name == "RESOURCE_EXHAUSTED", e.value
        c.release("huge")
        # Evictions: idle fillers make way for a big sequence (--evict).
        for i in range(3):
            c.create_sequence(LAYOUT, scheme="fp16", sequence_id=f"filler{i}")
            c.append_prompt(f"filler{i}", *kv(4000))
        c.create_sequence(LAYOUT, scheme="fp16", sequence_id="big")
        c.append_prompt("big", *kv(12000))
        c.release("big")
        # Expiry: a one-second lease, reaped once a second.
        c.create_sequence(LAYOUT, scheme="int8", sequence_id="short", ttl_seconds=1)
        # The working set: a kivi2 prompt with token ids (prefix blocks), a
        # fork, a second sequence that reuses the prefix.
        ids = list(range(1000, 1300))
        c.create_sequence(LAYOUT, scheme="kivi2:sink=4", sequence_id="a", ttl_seconds=300)
        c.append_prompt("a", *kv(300, np.float32), token_ids=ids)
        c.fetch("a", dtype="fp32")
        fork_id, _ = c.fork("a", new_sequence_id="a-fork")
        reuse = c.create_sequence(LAYOUT, scheme="kivi2:sink=4", sequence_id="b",
                                  ttl_seconds=300, prompt_token_ids=ids)
        # Two whole 128-token blocks (and the 4 sink tokens) come from "a".
        assert reuse.num_tokens >= 256, reuse
        c.append_prompt("b", *(x[:, :, reuse.num_tokens:] for x in kv(300, np.float32)))
        # Client errors.
        for bad in (lambda: c.create_sequence(LAYOUT, scheme="fp16", sequence_id="a"),
                    lambda: c.create_sequence(LAYOUT, scheme="no-such-scheme", sequence_id="x"),
                    lambda: c.fetch("missing")):
            with pytest.raises(KvqError):
                bad()
        # Decode: attend, append+attend, a decode stream; spread over a few
        # scrapes so that the rates have more than one sample.
        q = lambda n: rng.standard_normal((n, 4, 64)).astype(np.float32)
        for _ in range(4):
            c.attend(1, [AttendQuery("a", q(1)), AttendQuery("b", q(1))])
            c.attend_batch(0, ["a", fork_id], q(2))
            k1, v1 = (rng.standard_normal((2, 1, 64)).astype(np.float32) for _ in range(2))
            for layer in range(2):
                c.append_attend(layer, [DecodeItem(fork_id, k1, v1, q(1))])
            with c.decode_session(deadline=30) as s:
                for layer in range(2):
                    s.step(layer, [DecodeItem("b", k1, v1, q(1))])
            c.stats("a")
            c.stats()
            time.sleep(SCRAPE_S)
        c.release(fork_id)
        c.release("a")  # Kept as prefix cache (--evict): kvq_sequences{state="cached"}.


@pytest.fixture(scope="module")
def stack():
    with tempfile.TemporaryDirectory(prefix="kvq-prom-") as tmp:
        with stopped_on_exit() as procs:
            out_path = os.path.join(tmp, "server.out")
            port_file = os.path.join(tmp, "port")
            with open(out_path, "w") as out:
                procs.append(subprocess.Popen(
                    [SERVER_BIN, "--address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                     f"--port_file={port_file}", f"--capacity_bytes={POOL_BYTES}",
                     "--backend=cpu", "--evict"],
                    stdout=out, stderr=subprocess.STDOUT))

            def metrics_address():
                m = re.search(r"metrics at http://([\d.]+:\d+)/metrics", open(out_path).read())
                return m and m.group(1)

            metrics = wait_for("kvq-server announces its metrics address", metrics_address)
            grpc_port = int(open(port_file).read())
            prom = start_prometheus(procs, tmp, {
                "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                           "evaluation_interval": f"{SCRAPE_S}s"},
                "rule_files": [RULES],
                "scrape_configs": [{"job_name": "kvq",
                                    "static_configs": [{"targets": [metrics]}]}],
            })
            wait_for("Prometheus scrapes kvq-server", prom.result_probe('up{job="kvq"} == 1'))
            kvq_load(f"127.0.0.1:{grpc_port}")
            time.sleep(3 * SCRAPE_S)  # A few scrapes after the load.
            yield prom, metrics


def require_data(prom, where, expr):
    """Each data query of `expr` returns at least one sample, and at least one
    of them is a number (not NaN: a ratio of two idle rates)."""
    problems = []
    for q in promql_data.data_queries(expr):
        result = prom.query(q)["result"]
        values = [float(r["value"][1]) for r in result]
        if not values:
            problems.append(f"{where}: no data for {q}")
        elif all(v != v for v in values):
            problems.append(f"{where}: only NaN for {q}")
    return problems


def dashboard_expr(expr, instance):
    # The instance as it is, not regex-escaped: promql-parser prints string
    # matchers without re-escaping backslashes, and a dot matching itself is
    # all that is needed here.
    values = dict(DASHBOARD_VARS, instance=instance)
    out = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                 lambda m: values.get(m.group(1) or m.group(2), m.group(0)), expr)
    assert "$" not in out, f"a dashboard variable the test does not know: {expr}"
    return out


def test_every_dashboard_query_has_data(stack):
    prom, instance = stack
    dash = json.load(open(DASHBOARD))
    problems = []
    checked = 0
    # The variables' own queries: label_values(selector, label).
    for var in dash["templating"]["list"]:
        if var.get("type") != "query":
            continue
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"])
        assert m, var
        series = prom.api("series", **{"match[]": dashboard_expr(m.group(1), instance)})
        found = {s.get(m.group(2)) for s in series}
        expect = {"job": "kvq", "instance": instance}[var["name"]]
        if expect not in found:
            problems.append(f"variable {var['name']}: {found} lacks {expect}")
        checked += 1
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            problems += require_data(prom, f"panel {panel['title']!r}",
                                     dashboard_expr(target["expr"], instance))
            checked += 1
    print(f"{checked} dashboard queries checked")
    assert not problems, "\n".join(problems)
    assert checked >= 20


def test_every_rule_expression_has_data(stack):
    prom, _ = stack
    problems = []
    rules = [r for g in yaml.safe_load(open(RULES))["groups"] for r in g["rules"]]
    for r in rules:
        problems += require_data(prom, r.get("alert") or r.get("record"), r["expr"])
    assert not problems, "\n".join(problems)
    # Prometheus itself loaded every rule of the file.
    loaded = [r["name"] for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert sorted(loaded) == sorted(r.get("alert") or r.get("record") for r in rules)


def test_promtool_check_metrics_on_a_live_scrape(stack):
    _, instance = stack
    text = http_get(f"http://{instance}/metrics")
    assert "kvq_rpc_requests_total" in text
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
