"""A real Prometheus (Debian's `prometheus`, checked by `promtool`) on a free
loopback port, for the deploy tests that let it scrape a live kvq-server;
bounded waits, and the teardown of the processes a test starts."""
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import yaml

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

START_S = 30  # Start-up and scrape bound, not a timing assertion.


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, probe, limit_s=START_S):
    """The first truthy answer of probe(), asked every 0.1 s for limit_s."""
    give_up = time.monotonic() + limit_s
    while time.monotonic() < give_up:
        got = probe()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what} within {limit_s} s")


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@contextlib.contextmanager
def stopped_on_exit():
    """A list for the processes a test starts; after the `with` each gets
    SIGTERM (the last started first) and 20 s to exit before SIGKILL."""
    procs = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Prometheus:
    """Prometheus' HTTP API at `base` (http://host:port)."""

    def __init__(self, base, proc=None, log_path=None):
        self.base = base
        self.proc = proc
        self.log_path = log_path

    def api(self, path, **params):
        url = f"{self.base}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
        try:
            body = json.loads(http_get(url))
        except urllib.error.HTTPError as e:
            body = json.loads(e.read().decode())
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, q):
        return self.api("query", query=q)

    def result_probe(self, q):
        """For wait_for: the result of query `q`, or None while Prometheus
        is not ready yet; raises at once if it has exited."""
        def probe():
            if self.proc.poll() is not None:
                raise AssertionError("prometheus exited: " + open(self.log_path).read()[-2000:])
            try:  # 503 until Prometheus is ready.
                return self.query(q)["result"]
            except (OSError, ValueError, AssertionError):
                return None
        return probe


def start_prometheus(procs, tmp, config):
    """Writes `config` (a dict) to tmp/prometheus.yml, checks it with
    `promtool check config`, and starts Prometheus with its storage and log
    in tmp on a free loopback port; appends it to `procs`."""
    config_path = os.path.join(tmp, "prometheus.yml")
    with open(config_path, "w") as f:
        yaml.safe_dump(config, f)
    check = subprocess.run([PROMTOOL, "check", "config", config_path],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log_path = os.path.join(tmp, "prom.log")
    procs.append(subprocess.Popen(
        [PROMETHEUS, f"--config.file={config_path}",
         f"--storage.tsdb.path={os.path.join(tmp, 'tsdb')}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(log_path, "w")))
    return Prometheus(f"http://127.0.0.1:{port}", procs[-1], log_path)
