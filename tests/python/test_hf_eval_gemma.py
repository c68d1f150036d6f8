"""hf_eval's decode metric on a second architecture, Gemma 3 270M (head_dim
256, one KV head, QK-norm, sliding-window layers, per-layer-type RoPE):
with the fp16 scheme, kvq's decode-faithful attention gives transformers'
own log-probabilities on a short window, with the sliding window shrunk
to 16 tokens so that the window's edge is inside it (and ignoring the
window would be seen: the same check against a model without it fails by
far more than the bound). A crq scheme runs under a calibration
kvq.calibrate computed from the calibration text.

Opt-in: needs torch and transformers (KVQ_WITH_TORCH=1
scripts/install_deps.sh) and the model (KVQ_WITH_GEMMA=1
scripts/fetch_eval_data.sh); skipped otherwise."""

import os
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
# A transformers API this file calls that becomes deprecated fails here, as in
# test_hf_eval.py and test_hf_cache.py.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning", "error::DeprecationWarning")

from test_tokenizer_parity import eval_data_dir  # noqa: E402

SOURCE = pathlib.Path(os.environ.get("KVQ_SOURCE_DIR", pathlib.Path(__file__).parents[2]))
sys.path.insert(0, str(SOURCE / "bench" / "eval"))
import hf_eval  # noqa: E402

GEMMA = "gemma-3-270m-q4_k_m.gguf"
WINDOW = 16  # The sliding window the test gives the model's sliding layers.


def set_sliding_window(model, window):
    model.config.sliding_window = window
    for layer in model.model.layers:
        if layer.self_attn.sliding_window:
            layer.self_attn.sliding_window = window


@pytest.fixture(scope="module")
def gemma():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = eval_data_dir() / GEMMA
    if not path.exists():
        pytest.skip(f"{path} missing: KVQ_WITH_GEMMA=1 scripts/fetch_eval_data.sh")
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=GEMMA,
                                                 dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=GEMMA)
    text = (eval_data_dir() / "corpora" / "austen.txt").read_bytes()[:100000]
    tokens = hf_eval.encode(tokenizer, text.decode("utf-8", "ignore"))
    return model, tokenizer, tokens


def transformers_logprobs(model, window):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([window]), use_cache=False).logits[0]
    return hf_eval.log_softmax(logits.float().numpy())[:-1]


def test_geometry_and_per_layer_rope(gemma):
    model, _, _ = gemma
    runner = hf_eval.Runner(model)
    g = runner.geometry
    assert (g["num_kv_heads"], g["num_q_heads"], g["head_dim"]) == (1, 4, 256)
    types = model.config.layer_types
    assert runner.rope_thetas == [1e6 if t == "full_attention" else 1e4 for t in types]


def test_fp16_decode_metric_is_transformers_with_its_sliding_window(gemma):
    model, _, tokens = gemma
    window = tokens[1000:1064]
    set_sliding_window(model, WINDOW)
    try:
        want = transformers_logprobs(model, window)
        got = hf_eval.run_decode_metric(hf_eval.Runner(model), window, "fp16", 512,
                                        None)["reference"]["logprobs"]
        set_sliding_window(model, 4096)
        unwindowed = transformers_logprobs(model, window)
    finally:
        set_sliding_window(model, 512)
    # fp16 storage of K/V is the only difference.
    assert np.abs(got - want).max() < 0.1  # Measured: 0.04.
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95
    assert np.abs(got - unwindowed).max() > 1.0


def test_crq_runs_under_a_python_calibration(gemma):
    import kvq
    from kvq.calibrate import calibrate

    model, tokenizer, tokens = gemma
    text = (eval_data_dir() / "corpora" / "calibration.txt").read_bytes()[:100000]
    ids = hf_eval.encode(tokenizer, text.decode("utf-8", "ignore"))[:256]
    cal = calibrate(model, ids, "gemma3-270m", chunk=128)
    assert (cal.num_layers, cal.num_kv_heads, cal.head_dim) == (18, 1, 256)
    runner = hf_eval.Runner(model, calibration=cal)
    window = tokens[2000:2128]
    ref = hf_eval.run_decode_metric(runner, window, "fp16", 512, None)
    kl = {}
    for scheme in ("crq4:r0:pre_rope:sink=4", "crq2:r0:pre_rope:sink=4"):
        r = hf_eval.run_decode_metric(runner, window, scheme, 512, ref["reference"])
        kl[scheme] = r["kl"] / r["scored"]
    # crq4 stays near fp16's distribution (measured 0.10 nat on this
    # 128-token window, every token after the sink quantized), and more
    # bits are closer: what a working calibration and RoPE base give.
    assert kl["crq4:r0:pre_rope:sink=4"] < 0.3
    assert kl["crq4:r0:pre_rope:sink=4"] < kl["crq2:r0:pre_rope:sink=4"]
    with pytest.raises(ValueError, match="needs a calibration"):
        hf_eval.run_decode_metric(hf_eval.Runner(model), window, "crq4:r0:pre_rope", 512,
                                  ref["reference"])
    assert isinstance(cal, kvq.Calibration)
