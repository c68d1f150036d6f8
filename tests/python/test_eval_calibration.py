"""kvq-eval --write_calibration end to end: it writes a calibration file of
the model's shape under the name asked for, from the calibration corpus,
and a real kvq-server loads it from its --calibration_dir. The binaries
come from CTest (KVQ_EVAL_BIN, KVQ_SERVER_BIN)."""

import os
import struct
import subprocess

import pytest

from kvq_client import KvqClient
from live_server import needs_server, running_server

pytestmark = needs_server


def header(data):
    """(version, name, model, layers, kv_heads, head_dim) of a .kvqcal."""
    assert data[:8] == b"KVQCAL\0\0"
    version, name_len = struct.unpack_from("<II", data, 8)
    at = 16 + name_len
    name = data[16:at].decode()
    (model_len,) = struct.unpack_from("<I", data, at)
    model = data[at + 4:at + 4 + model_len].decode()
    layers, heads, dim = struct.unpack_from("<iii", data, at + 4 + model_len)
    payload = len(data) - (at + 4 + model_len + 12) - 8
    assert payload == layers * heads * 4 * dim * 4
    return version, name, model, layers, heads, dim


def test_kvq_eval_writes_a_calibration_the_server_loads(tmp_path):
    path = tmp_path / "smollm2.kvqcal"
    proc = subprocess.run(
        [os.environ["KVQ_EVAL_BIN"], f"--write_calibration={path}", "--calib_tokens=64",
         "--progress=false"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert ("calibration \"smollm2\" (30 layers x 3 KV heads x head_dim 64, from calibration) "
            f"written to {path}") in proc.stdout
    version, name, model, layers, heads, dim = header(path.read_bytes())
    assert (version, name, layers, heads, dim) == (1, "smollm2", 30, 3, 64)
    assert model.endswith(" layers=30 kv_heads=3 q_heads=9 head_dim=64 rope=adjacent/64/100000")
    with running_server("--capacity_bytes=268435456", "--backend=cpu",
                        f"--calibration_dir={tmp_path}") as address:
        with KvqClient(address) as client:
            assert list(client.info().calibrations) == ["smollm2"]


def test_an_evaluation_corpus_never_calibrates(tmp_path):
    proc = subprocess.run(
        [os.environ["KVQ_EVAL_BIN"], "--corpora=austen,calibration", "--quick",
         "--progress=false"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "--corpora: calibration is the calibration corpus (--calibration)" in proc.stderr
