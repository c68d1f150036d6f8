"""kvq.calibrate (the crq schemes' calibration from a transformers model)
computes what `kvq-eval --write_calibration` computes with kvq's C++ forward
pass: on SmolLM2-135M (the GGUF kvq-eval uses, loaded by transformers' GGUF
loader) and the same 2048 tokens of the calibration text, every scale
within 1e-3 in log ratio and every head's key and value means within 2e-3
relative L2 (measured: 6e-5 and 3e-4; the two forward passes differ by the
C++ pass's fp16 cache). The key statistics are compared channel for
channel after undoing the GGUF's adjacent-pair permutation of Q/K rows
(transformers' loader restores half-split pairs).

Needs torch and transformers (KVQ_WITH_TORCH=1 scripts/install_deps.sh;
skipped otherwise), the eval data (scripts/fetch_eval_data.sh) and
KVQ_EVAL_BIN (CTest sets it)."""

import os
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
# A transformers API this file calls that becomes deprecated fails here, as in
# test_hf_eval.py and test_hf_cache.py.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning", "error::DeprecationWarning")

import kvq  # noqa: E402
from kvq.calibrate import calibrate, key_scales, value_scales  # noqa: E402
from test_tokenizer_parity import eval_data_dir, eval_model_path  # noqa: E402

CALIB_TOKENS = 2048


def gguf_to_half_split(x):
    """Key statistics [..., d] in GGUF channel order (RoPE pair p on channels
    2p, 2p + 1) in transformers' order (pair p on p, p + d/2)."""
    d = x.shape[-1]
    out = np.empty_like(x)
    out[..., [(c % 2) * (d // 2) + c // 2 for c in range(d)]] = x
    return out


def test_scales_are_quartic_roots_at_geometric_mean_one():
    key_var = np.array([4.0, 1.0, 4.0, 1.0])
    query_sq = np.array([1.0, 1.0, 1.0, 1.0])
    s = key_scales(key_var, query_sq)
    # Pairs (0, 2) and (1, 3): (8/2)^(1/4) = sqrt(2) and (2/2)^(1/4) = 1,
    # then divided by their geometric mean 2^(1/4).
    np.testing.assert_allclose(s, [2 ** 0.25, 2 ** -0.25, 2 ** 0.25, 2 ** -0.25], rtol=1e-6)
    v = value_scales(np.array([16.0, 1.0]), np.array([1.0, 1.0]))
    np.testing.assert_allclose(v, [2 ** 0.5, 2 ** -0.5], rtol=1e-6)
    # A dead channel gets a finite scale.
    assert np.isfinite(value_scales(np.array([0.0, 1.0]), np.array([1.0, 1.0]))).all()


def test_first_layer_statistics_are_its_projections():
    """On a small random Llama, layer 0's key and value means are those of
    its k_proj and v_proj outputs: the keys are taken before RoPE (RoPE
    undone exactly), whatever the chunking."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16)
    model = LlamaForCausalLM(config).eval()
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 100, 300)]
    cal = calibrate(model, ids, "tiny", chunk=64)
    assert (cal.num_layers, cal.num_kv_heads, cal.head_dim) == (2, 2, 16)
    arrays = cal.arrays()
    layer = model.model.layers[0]
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(torch.tensor([ids])))
        k = layer.self_attn.k_proj(x)[0].reshape(300, 2, 16).numpy()
        v = layer.self_attn.v_proj(x)[0].reshape(300, 2, 16).numpy()
    np.testing.assert_allclose(arrays["key_mean"][0], k.mean(axis=0), atol=1e-5)
    np.testing.assert_allclose(arrays["value_mean"][0], v.mean(axis=0), atol=1e-5)
    one_chunk = calibrate(model, ids, "tiny", chunk=300).arrays()
    for name in arrays:
        np.testing.assert_allclose(arrays[name], one_chunk[name], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not os.access(os.environ.get("KVQ_EVAL_BIN", ""), os.X_OK),
                    reason="KVQ_EVAL_BIN does not name a kvq-eval binary")
def test_python_calibration_agrees_with_kvq_eval(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = eval_model_path()
    if not model_path.exists():
        pytest.skip(f"{model_path} missing: run scripts/fetch_eval_data.sh")
    cpp_path = tmp_path / "cpp.kvqcal"
    proc = subprocess.run([os.environ["KVQ_EVAL_BIN"], f"--write_calibration={cpp_path}",
                           f"--calib_tokens={CALIB_TOKENS}", "--progress=false"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    cpp = kvq.Calibration.load(str(cpp_path)).arrays()

    torch.set_num_threads(1)
    kwargs = {"gguf_file": model_path.name}
    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), dtype=torch.float32,
                                                 **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent), **kwargs)
    # kvq-eval's calibration tokens: the first MiB of the text, tokenized,
    # the first --calib_tokens of them.
    raw = (eval_data_dir() / "corpora" / "calibration.txt").read_bytes()[:1 << 20]
    ids = tokenizer(raw.decode("utf-8", "ignore"), add_special_tokens=False)["input_ids"]
    cal = calibrate(model, ids[:CALIB_TOKENS], "smollm2", chunk=512)
    path = tmp_path / "py.kvqcal"
    cal.write(str(path))
    py = kvq.Calibration.load(str(path)).arrays()

    assert py["key_mean"].shape == cpp["key_mean"].shape == (30, 3, 64)
    for name in ("key_scale", "value_scale"):
        want = gguf_to_half_split(cpp[name]) if name.startswith("key") else cpp[name]
        assert np.abs(np.log(py[name] / want)).max() < 1e-3, name
    for name in ("key_mean", "value_mean"):
        want = gguf_to_half_split(cpp[name]) if name.startswith("key") else cpp[name]
        rel = np.linalg.norm(py[name] - want, axis=-1) / np.linalg.norm(want, axis=-1)
        assert rel.max() < 2e-3, name
