"""A real Prometheus scraping kvq-server's metrics port over HTTPS
(--metrics_tls_cert, --metrics_tls_key), with the `scheme: https` +
`tls_config` job that docs/SECURITY.md shows.

Makes throwaway certificates (tests/integration/make_test_certs.sh), starts
kvq-server ($KVQ_SERVER_BIN, set by ctest) and Debian's `prometheus` on free
loopback ports, and checks through Prometheus' HTTP API that the job which
trusts the server's CA is up and has kvq_used_bytes, while a job that
trusts another CA is down. Every wait is bounded; about 5 s.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

from prometheus_process import (PROMETHEUS, PROMTOOL, start_prometheus,  # noqa: E402
                                stopped_on_exit, wait_for)

MAKE_CERTS = os.path.join(ROOT, "tests", "integration", "make_test_certs.sh")
SERVER_BIN = os.environ.get("KVQ_SERVER_BIN", "")

if not os.access(SERVER_BIN, os.X_OK):
    pytest.skip("KVQ_SERVER_BIN does not name a kvq-server binary", allow_module_level=True)
if PROMETHEUS is None or PROMTOOL is None or shutil.which("openssl") is None:
    pytest.skip("prometheus/promtool/openssl are not installed (scripts/install_deps.sh "
                "installs them)", allow_module_level=True)


def test_prometheus_scrapes_the_https_metrics_port_trusting_only_its_ca():
    with tempfile.TemporaryDirectory(prefix="kvq-prom-https-") as tmp:
        subprocess.run([MAKE_CERTS, tmp], check=True, capture_output=True, timeout=60)
        with stopped_on_exit() as procs:
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

            prom = start_prometheus(procs, tmp, {
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                "scrape_configs": [job("kvq", f"{tmp}/ca.pem"),
                                   job("kvq-other-ca", f"{tmp}/other_ca.pem")],
            })
            wait_for("the job trusting the CA is up", prom.result_probe('up{job="kvq"} == 1'))
            used = wait_for("kvq_used_bytes scraped over https",
                            prom.result_probe('kvq_used_bytes{job="kvq",tier="host"}'))
            assert used[0]["value"][1] == "0"
            wait_for("the job trusting another CA is scraped and down",
                     prom.result_probe('up{job="kvq-other-ca"} == 0'))
            assert prom.query('kvq_used_bytes{job="kvq-other-ca"}')["result"] == []
