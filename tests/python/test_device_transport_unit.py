"""The Python client's transport= option without a server or a GPU: the
checks that refuse what cannot work, with messages naming the option."""

import numpy as np
import pytest

from kvq_client import KvqClient


@pytest.fixture
def client():
    c = KvqClient("127.0.0.1:1")  # Never reached: every case fails before a call.
    yield c
    c.close()


def test_unknown_transport_names_the_accepted_ones(client):
    k = np.zeros((1, 1, 1, 16), np.float16)
    with pytest.raises(ValueError, match=r'transport = "rdma" must be "grpc", "cuda_ipc" or "nccl"'):
        client.append_prompt("s", k, k, transport="rdma")


def test_nccl_points_at_the_cpp_client(client):
    k = np.zeros((1, 1, 1, 16), np.float16)
    with pytest.raises(ValueError, match=r"C\+\+ client \(NcclPeer\) only"):
        client.append_prompt("s", k, k, transport="nccl")


def test_cuda_ipc_needs_cuda_tensors(client):
    k = np.zeros((1, 1, 1, 16), np.float16)
    with pytest.raises(ValueError, match=r'"cuda_ipc" needs CUDA torch tensors; k is ndarray'):
        client.append_prompt("s", k, k, transport="cuda_ipc")
    with pytest.raises(ValueError, match=r'"cuda_ipc" needs CUDA torch tensors; k is ndarray'):
        client.fetch_device("s", k, k)
