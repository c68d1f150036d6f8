"""kvq._native's calibrations (kvq.Calibration) and crq in-process: a
.kvqcal file written and read through kernels/calibration_file, a KvLayer
taking one layer of it, the C++ refusals as Python exceptions with the C++
message, and a crq layer's read-back equal, value for value, to what a
real kvq-server (the C++ streams behind the RPCs) stores for the same input
under the same calibration file.

The server test needs $KVQ_SERVER_BIN (ctest sets it), else it is skipped."""

import os

import numpy as np
import pytest

import kvq

LAYERS, HEADS, DIM = 2, 2, 64
THETA = 10000.0


def statistics(seed):
    """key_mean, key_scale, value_mean, value_scale [LAYERS, HEADS, DIM]:
    key scales equal within each half-split RoPE pair (c, c + DIM / 2)."""
    rng = np.random.default_rng(seed)
    half = rng.uniform(0.5, 2.0, (LAYERS, HEADS, DIM // 2)).astype(np.float32)
    return (rng.normal(0, 0.5, (LAYERS, HEADS, DIM)).astype(np.float32),
            np.concatenate([half, half], axis=-1),
            rng.normal(0, 0.5, (LAYERS, HEADS, DIM)).astype(np.float32),
            rng.uniform(0.5, 2.0, (LAYERS, HEADS, DIM)).astype(np.float32))


def kv(seed, tokens):
    rng = np.random.default_rng(seed)
    k = rng.normal(0, 1, (HEADS, tokens, DIM)).astype(np.float32)
    v = rng.normal(0, 1, (HEADS, tokens, DIM)).astype(np.float32)
    return k, v


@pytest.fixture
def calibration(tmp_path):
    c = kvq.Calibration.from_arrays("test-cal", *statistics(1), model="test model")
    c.write(str(tmp_path / "test-cal.kvqcal"))
    return kvq.Calibration.load(str(tmp_path / "test-cal.kvqcal"))


def test_a_file_round_trips_through_the_native_writer(calibration):
    assert (calibration.name, calibration.model) == ("test-cal", "test model")
    assert (calibration.num_layers, calibration.num_kv_heads, calibration.head_dim) == (
        LAYERS, HEADS, DIM)
    arrays = calibration.arrays()
    for name, want in zip(("key_mean", "key_scale", "value_mean", "value_scale"), statistics(1)):
        np.testing.assert_array_equal(arrays[name], want)
    again = kvq.Calibration.from_arrays("test-cal", *statistics(1), model="test model")
    assert again.checksum == calibration.checksum


def test_crq_needs_a_calibration():
    with pytest.raises(ValueError) as e:
        kvq.KvLayer("crq3:pre_rope", HEADS, DIM, rope_theta=THETA)
    assert str(e.value) == ("scheme crq3:r128:pre_rope needs a calibration (the "
                            "HeadCalibration of this stream's layer and KV head)")


def test_a_calibration_of_another_shape_is_refused(calibration):
    with pytest.raises(ValueError) as e:
        kvq.KvLayer("crq3:pre_rope", 1, DIM, rope_theta=THETA, calibration=calibration)
    assert str(e.value) == ('calibration "test-cal" is for 2 layers x 2 KV heads x head_dim 64; '
                            "the layout is 2 layers x 1 KV heads x head_dim 64")
    with pytest.raises(ValueError) as e:
        kvq.KvLayer("crq3:pre_rope", HEADS, DIM, rope_theta=THETA, calibration=calibration,
                    calibration_layer=2)
    assert str(e.value) == 'calibration_layer 2 is not a layer of calibration "test-cal" (0 to 1)'


def test_bad_statistics_are_refused_with_the_file_formats_message():
    km, ks, vm, vs = statistics(1)
    ks = ks.copy()
    ks[1, 0, 5] = 0.0
    with pytest.raises(ValueError) as e:
        kvq.Calibration.from_arrays("x", km, ks, vm, vs)
    assert "key_scale" in str(e.value) and "channel 5" in str(e.value)
    with pytest.raises(ValueError) as e:
        kvq.Calibration.from_arrays("x", km, ks[:, :, :32], vm, vs)
    assert str(e.value) == "key_scale is [2, 2, 32], key_mean [2, 2, 64]"
    with pytest.raises(ValueError) as e:
        kvq.Calibration.from_arrays("bad name", *statistics(1))
    assert "may hold only letters, digits and - _ . :" in str(e.value)


def test_a_missing_file_is_not_found(tmp_path):
    with pytest.raises(RuntimeError) as e:
        kvq.Calibration.load(str(tmp_path / "none.kvqcal"))
    assert str(e.value).startswith(str(tmp_path / "none.kvqcal"))


def test_each_layer_uses_its_own_statistics(calibration):
    """A calibration centers and scales before coding: two layers of one
    calibration store the same K/V differently, and the stored form is
    close to the input (crq4 on unit-variance data)."""
    k, v = kv(2, 256)
    reads = []
    for layer in range(LAYERS):
        store = kvq.KvLayer("crq4:r0:pre_rope", HEADS, DIM, rope_theta=THETA,
                            calibration=calibration, calibration_layer=layer)
        store.append(k, v)
        reads.append(store.read())
    assert not np.array_equal(reads[0][1], reads[1][1])
    for _, v_hat in reads:
        rel = np.linalg.norm(v_hat - v) / np.linalg.norm(v)
        assert rel < 0.15


needs_server = pytest.mark.skipif(not os.access(os.environ.get("KVQ_SERVER_BIN", ""), os.X_OK),
                                  reason="KVQ_SERVER_BIN does not name a kvq-server binary")


@needs_server
@pytest.mark.parametrize("scheme", ["crq3:r16:pre_rope:sink=4", "crq2:r0:pre_rope"])
def test_crq_reads_back_what_the_server_stores(calibration, tmp_path, scheme):
    from kvq_client import KvqClient, ModelLayout, RopeParams
    from live_server import running_server

    (tmp_path / "cal").mkdir()
    calibration.write(str(tmp_path / "cal" / "test-cal.kvqcal"))
    tokens = 200
    ks, vs = zip(*(kv(10 + layer, tokens) for layer in range(LAYERS)))
    layout = ModelLayout(LAYERS, HEADS, 2 * HEADS, DIM, RopeParams(theta=THETA,
                                                                   pairing="half_split"))
    with running_server("--capacity_bytes=268435456", "--backend=cpu",
                        f"--calibration_dir={tmp_path / 'cal'}") as address:
        with KvqClient(address, namespace="cal") as client:
            seq = client.create_sequence(layout, scheme=scheme,
                                         calibration="test-cal").sequence_id
            client.append_prompt(seq, np.stack(ks), np.stack(vs), quantize=False)
            server_k, server_v = client.fetch(seq, dtype="fp32", apply_rope=True)
    for layer in range(LAYERS):
        local = kvq.KvLayer(scheme, HEADS, DIM, rope_theta=THETA, rope_pairing="half_split",
                            calibration=calibration, calibration_layer=layer)
        local.append(ks[layer], vs[layer])
        k_hat, v_hat = local.read()
        np.testing.assert_array_equal(k_hat, server_k[layer])
        np.testing.assert_array_equal(v_hat, server_v[layer])
