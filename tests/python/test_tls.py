"""The Python client's TLS options against the real kvq-server with mutual
TLS. Certificates come from the openssl tool at test time
(tests/integration/make_test_certs.sh).

Needs the server binary: $KVQ_SERVER_BIN (ctest sets it), else the test is
skipped."""

import os
import shutil
import subprocess
import tempfile

import grpc
import numpy as np
import pytest

from kvq_client import KvqClient, KvqError, ModelLayout, RetryPolicy
from live_server import needs_server, running_server

MAKE_CERTS = os.path.join(os.path.dirname(__file__), "..", "integration", "make_test_certs.sh")

pytestmark = [
    needs_server,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl tool"),
]


@pytest.fixture(scope="module")
def certs():
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([MAKE_CERTS, tmp], check=True)
        yield tmp


@pytest.fixture(scope="module")
def address(certs):
    with running_server("--metrics_address=", "--capacity_bytes=67108864", "--backend=cpu",
                        f"--tls_cert={certs}/server.pem", f"--tls_key={certs}/server.key",
                        f"--tls_client_ca={certs}/ca.pem") as addr:
        yield addr


def client(address, **tls):
    return KvqClient(address, namespace="pytls", deadline=20.0,
                     retry=RetryPolicy(max_attempts=1), **tls)


def test_client_certificate_of_the_ca_stores_and_reads(address, certs):
    with client(address, tls_ca=f"{certs}/ca.pem", tls_cert=f"{certs}/client.pem",
                tls_key=f"{certs}/client.key", tls_server_name="localhost") as c:
        assert c.info().backend == "cpu"
        c.create_sequence(ModelLayout(1, 2, 2, 64), scheme="kivi4", sequence_id="t")
        k = np.random.default_rng(0).standard_normal((1, 2, 40, 64)).astype(np.float32)
        assert c.append_prompt("t", k, k).num_tokens == 40
        K, _ = c.fetch("t", dtype="fp32")
        assert K.shape == (1, 2, 40, 64)
        assert (K == k.astype(np.float16)).all()  # 40 tokens: all in the fp16 window.


@pytest.mark.parametrize("tls", [
    {},  # Plaintext.
    {"tls_ca": "ca.pem"},  # No client certificate.
    {"tls_ca": "ca.pem", "tls_cert": "other_client.pem", "tls_key": "other_client.key"},
    {"tls_ca": "other_ca.pem", "tls_cert": "client.pem", "tls_key": "client.key"},
])
def test_refused_clients_get_unavailable(address, certs, tls):
    files = {k: f"{certs}/{v}" for k, v in tls.items()}
    with client(address, **files) as c:
        with pytest.raises(KvqError) as e:
            c.info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_bad_tls_options_raise_value_error_naming_the_option(certs):
    with pytest.raises(ValueError, match=r"^tls_ca=/nonexistent/ca.pem: cannot read \(No such file"):
        KvqClient("127.0.0.1:1", tls_ca="/nonexistent/ca.pem")
    with open(f"{certs}/not_pem", "w") as f:
        f.write("not a certificate\n")
    with pytest.raises(ValueError, match=r"^tls_ca=.*/not_pem: no PEM block in the file$"):
        KvqClient("127.0.0.1:1", tls_ca=f"{certs}/not_pem")
    with pytest.raises(ValueError, match="^tls_cert and tls_key go together"):
        KvqClient("127.0.0.1:1", tls_cert=f"{certs}/client.pem")
    with pytest.raises(ValueError, match="^tls_server_name is set without TLS"):
        KvqClient("127.0.0.1:1", tls_server_name="localhost")
