"""A real Prometheus scraping kvq-server's metrics port over HTTPS
(--metrics_tls_cert, --metrics_tls_key), with the `scheme: https` +
`tls_config` job that docs/RELIABILITY.md shows.

Makes throwaway certificates (tests/integration/make_test_certs.sh), starts
kvq-server ($KVQ_SERVER_BIN, set by ctest) and Debian's `prometheus` on free
loopback ports, and checks through Prometheus' HTTP API that the job which
trusts the server's CA is up and has kvq_used_bytes, while a job that
trusts another CA is down. Every wait is bounded; about 5 s.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
MAKE_CERTS = os.path.join(ROOT, "tests", "integration", "make_test_certs.sh")
SERVER_BIN = os.environ.get("KVQ_SERVER_BIN", "")
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

if not os.access(SERVER_BIN, os.X_OK):
    pytest.skip("KVQ_SERVER_BIN does not name a kvq-server binary", allow_module_level=True)
if PROMETHEUS is None or PROMTOOL is None or shutil.which("openssl") is None:
    pytest.skip("prometheus/promtool/openssl are not installed (scripts/install_deps.sh "
                "installs them)", allow_module_level=True)

START_S = 30  # Start-up and scrape bounds, not timing assertions.


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, probe, limit_s=START_S):
    give_up = time.monotonic() + limit_s
    while time.monotonic() < give_up:
        got = probe()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what} within {limit_s} s")


def query(base, q):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.loads(r.read().decode())
    assert body.get("status") == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_the_https_metrics_port_trusting_only_its_ca():
    with tempfile.TemporaryDirectory(prefix="kvq-prom-https-") as tmp:
        subprocess.run([MAKE_CERTS, tmp], check=True, capture_output=True, timeout=60)
        procs = []
        try:
            out_path = os.path.join(tmp, "server.out")
            with open(out_path, "w") as out:
                procs.append(subprocess.Popen(
                    [SERVER_BIN, "--address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                     "--capacity_bytes=16777216", "--backend=cpu",
                     f"--metrics_tls_cert={tmp}/server.pem",
                     f"--metrics_tls_key={tmp}/server.key"],
                    stdout=out, stderr=subprocess.STDOUT))

            def metrics_address():
                m = re.search(r"metrics at https://([\d.]+:\d+)/metrics", open(out_path).read())
                return m and m.group(1)

            target = wait_for("kvq-server announces its https metrics address", metrics_address)

            def job(name, ca_file):
                return {"job_name": name, "scheme": "https",
                        "tls_config": {"ca_file": ca_file},
                        "static_configs": [{"targets": [target]}]}

            config = os.path.join(tmp, "prometheus.yml")
            with open(config, "w") as f:
                yaml.safe_dump({
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                    "scrape_configs": [job("kvq", f"{tmp}/ca.pem"),
                                       job("kvq-other-ca", f"{tmp}/other_ca.pem")],
                }, f)
            check = subprocess.run([PROMTOOL, "check", "config", config],
                                   capture_output=True, text=True, timeout=60)
            assert check.returncode == 0, check.stdout + check.stderr
            prom_port = free_port()
            procs.append(subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}",
                 f"--storage.tsdb.path={os.path.join(tmp, 'tsdb')}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "prom.log"), "w")))
            base = f"http://127.0.0.1:{prom_port}"

            def scraped(q):
                def probe():
                    if procs[-1].poll() is not None:
                        raise AssertionError("prometheus exited: " +
                                             open(os.path.join(tmp, "prom.log")).read()[-2000:])
                    try:  # 503 until Prometheus is ready.
                        return query(base, q)
                    except (OSError, ValueError, AssertionError):
                        return None
                return probe

            wait_for("the job trusting the CA is up", scraped('up{job="kvq"} == 1'))
            used = wait_for("kvq_used_bytes scraped over https",
                            scraped('kvq_used_bytes{job="kvq",tier="host"}'))
            assert used[0]["value"][1] == "0"
            wait_for("the job trusting another CA is scraped and down",
                     scraped('up{job="kvq-other-ca"} == 0'))
            assert query(base, 'kvq_used_bytes{job="kvq-other-ca"}') == []
        finally:
            for p in reversed(procs):
                p.send_signal(signal.SIGTERM)
            for p in reversed(procs):
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
