"""Starts the real kvq-server ($KVQ_SERVER_BIN, ctest sets it) on a free
loopback port for the Python tests that talk to one, and stops it.

The server picks its own port (--address=127.0.0.1:0) and writes it to
--port_file; the tests read it from there, so parallel ctest runs never
collide on a port.

A test module that needs one server for all its tests declares it:

    address = server_fixture(*CPU_SERVER, "--evict")
    client = client_fixture("my-namespace")   # A KvqClient on it, per test."""

import contextlib
import os
import subprocess
import tempfile
import time

import pytest

SERVER_BIN = os.environ.get("KVQ_SERVER_BIN", "")

# For a test module's pytestmark: without the binary its tests are skipped.
needs_server = pytest.mark.skipif(not os.access(SERVER_BIN, os.X_OK),
                                  reason="KVQ_SERVER_BIN does not name a kvq-server binary")

START_S = 60  # Start-up bound, not a timing assertion.

# The flags most tests run the server with: the CPU backend, a 256 MiB pool,
# metrics on a free port.
CPU_SERVER = ("--metrics_address=127.0.0.1:0", "--capacity_bytes=268435456", "--backend=cpu")


def start_server(port_file, *flags):
    """Starts kvq-server with --address=127.0.0.1:0, --port_file=port_file
    and `flags`; returns (process, "127.0.0.1:<port>") once it has written
    its port. If it exits first or writes none within START_S, kills it and
    fails the test."""
    proc = subprocess.Popen([SERVER_BIN, "--address=127.0.0.1:0", f"--port_file={port_file}",
                             *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    give_up = time.monotonic() + START_S
    while time.monotonic() < give_up and proc.poll() is None:
        try:
            with open(port_file) as f:
                port = int(f.read().strip() or 0)
            if port > 0:
                return proc, f"127.0.0.1:{port}"
        except (OSError, ValueError):  # Not written yet, or half written.
            pass
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    pytest.fail("kvq-server did not start")


@contextlib.contextmanager
def running_server(*flags):
    """The address of a kvq-server started with `flags` (see start_server)
    for the body of the `with`; terminated (SIGTERM) and reaped after it."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_server(os.path.join(tmp, "port"), *flags)
        try:
            yield address
        finally:
            proc.terminate()
            proc.wait()


def server_fixture(*flags):
    """A module-scoped fixture yielding the address of one kvq-server
    started with `flags` for the module's tests; they are skipped without
    the binary (modules whose every test needs it also set
    pytestmark = needs_server)."""

    @pytest.fixture(scope="module")
    def address():
        if not os.access(SERVER_BIN, os.X_OK):
            pytest.skip("KVQ_SERVER_BIN does not name a kvq-server binary")
        with running_server(*flags) as a:
            yield a
    return address


def client_fixture(namespace):
    """A fixture yielding a KvqClient in `namespace` on the module's
    `address`, closed after each test."""

    @pytest.fixture
    def client(address):
        from kvq_client import KvqClient
        with KvqClient(address, namespace=namespace) as c:
            yield c
    return client
