"""kvq.hf.KvqCache in transformers' generate() on a real model, with kvq's
fused attention ("fused": the model's attention implementation is "kvq")
and with the model's own attention over dequantized K/V ("dequantized").

SmolLM2-135M from the eval data dir's GGUF (scripts/fetch_eval_data.sh),
loaded by transformers' GGUF loader in fp32. Opt-in like the vLLM tests:
they run where torch, transformers and the kvq package import
(KVQ_WITH_TORCH=1 scripts/install_deps.sh; pip install .) and skip
otherwise; the remote case also needs KVQ_SERVER_BIN (ctest sets it).
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (KVQ_WITH_TORCH=1)")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (KVQ_WITH_TORCH=1)")
pytest.importorskip("kvq._native", reason="the kvq package is not installed (pip install .)")

# A deprecated transformers call (its FutureWarning) or any other
# deprecation these tests run into fails them: kvq.hf and the tests use the
# current API, and a rename in transformers is noticed here, not by users.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning", "error::DeprecationWarning")

from kvq.hf import KvqCache, model_geometry, use_kvq_attention  # noqa: E402
from live_server import SERVER_BIN, running_server  # noqa: E402
from test_tokenizer_parity import MODEL_FILE_NAME, eval_data_dir  # noqa: E402

PROMPT_TOKENS = 300   # More than kivi's 128-token fp16 window: quantized tokens are attended.
NEW_TOKENS = 64
# KL(p_DynamicCache || p_kvq) of the next-token distributions, mean over the
# prompt's last 64 positions and 63 teacher-forced decode steps (the tests
# print it). Measured with the fused attention: int8 0.00033, kivi4 0.0089,
# kivi4:pre_rope:sink=4 0.0043; the bounds leave about 3x.
KL_BOUNDS = {"int8": 0.001, "kivi4": 0.025, "kivi4:pre_rope:sink=4": 0.012}


@pytest.fixture(scope="module")
def model():
    d = eval_data_dir()
    if not (d / MODEL_FILE_NAME).is_file():
        pytest.fail(f"eval model {d / MODEL_FILE_NAME} is missing: run scripts/fetch_eval_data.sh")
    # One thread: on a loaded machine a team of OpenMP threads spins at each
    # matmul for a member the scheduler has not run (12x the CPU of one
    # thread for the same forward passes, measured with a load of 13 on 2 cores).
    torch.set_num_threads(1)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(d), gguf_file=MODEL_FILE_NAME, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(model):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(eval_data_dir()),
                                                           gguf_file=MODEL_FILE_NAME)
    text = (eval_data_dir() / "corpora" / "austen.txt").read_text()[200_000:204_000]
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    assert ids.shape[1] >= PROMPT_TOKENS
    return ids[:, :PROMPT_TOKENS]


ATTENTION = ["fused", "dequantized"]


def attend_by(model, attention):
    """Makes `model` attend with kvq's fused kernel or with sdpa."""
    if attention == "fused":
        use_kvq_attention(model)
    else:
        model.set_attn_implementation("sdpa")


def generate(model, prompt, cache):
    out = model.generate(prompt, cache=cache, max_new_tokens=NEW_TOKENS,
                         do_sample=False, return_dict_in_generate=True, output_scores=True)
    return out.sequences[0, prompt.shape[1]:], torch.stack(out.scores)[:, 0]


@pytest.fixture(scope="module")
def reference(model, prompt):
    """DynamicCache's greedy tokens and their teacher-forced log-probs."""
    attend_by(model, "dequantized")
    tokens, _ = generate(model, prompt, transformers.DynamicCache(config=model.config))
    return tokens, teacher_forced(model, prompt, tokens, transformers.DynamicCache(
        config=model.config))


def teacher_forced(model, prompt, tokens, cache):
    """Log-probs [64 + 63, vocab] (float64): the prompt's last 64 positions
    (prefilled at once) and each of `tokens` but the last decoded one at a
    time."""
    with torch.inference_mode():
        rows = [model(prompt, cache=cache).logits[0, -NEW_TOKENS:]]
        for t in tokens[:-1]:
            rows.append(model(t.view(1, 1), cache=cache).logits[0])
    return torch.log_softmax(torch.cat(rows).double(), dim=-1)


def mean_kl(p, q):
    return float((p.exp() * (p - q)).sum(-1).clamp(min=0).mean())


@pytest.mark.parametrize("attention", ATTENTION)
def test_fp16_cache_generates_dynamic_caches_tokens(model, prompt, reference, attention):
    attend_by(model, attention)
    cache = KvqCache(model.config, "fp16")
    tokens, _ = generate(model, prompt, cache)
    assert tokens.tolist() == reference[0].tolist()
    assert cache.get_seq_length() == PROMPT_TOKENS + NEW_TOKENS - 1
    geometry = model_geometry(model.config)
    elements = 2 * geometry["num_layers"] * geometry["num_kv_heads"] * geometry["head_dim"]
    bytes_ = cache.bytes_by_component()
    # fp16: two bytes of codes per element stored (whole pages: padding apart).
    assert bytes_["codes"] == 2 * elements * cache.get_seq_length()
    assert sum(v for k, v in bytes_.items() if k != "total") == bytes_["total"]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("scheme", sorted(KL_BOUNDS))
def test_quantized_cache_within_kl_bound(model, prompt, reference, scheme, attention):
    attend_by(model, attention)
    tokens, ref_lp = reference
    cache = KvqCache(model.config, scheme)
    lp = teacher_forced(model, prompt, tokens, cache)
    kl = mean_kl(ref_lp, lp)
    print(f"{scheme} ({attention}): mean KL {kl:.5f} over {lp.shape[0]} positions")
    assert 0 < kl < KL_BOUNDS[scheme], kl
    geometry = model_geometry(model.config)
    fp16_bytes = (2 * 2 * geometry["num_layers"] * geometry["num_kv_heads"] *
                  geometry["head_dim"] * cache.get_seq_length())
    assert cache.bytes_by_component()["total"] < fp16_bytes


def test_pre_rope_keys_come_back_after_rope(model, prompt):
    attend_by(model, "dequantized")
    # The sink's 4 tokens are stored in fp16: after the cache undoes the
    # model's RoPE and kvq applies its own, they read back as the post-RoPE
    # keys DynamicCache holds, to fp16 precision. A wrong pairing or angle
    # would move them by O(1).
    dynamic = transformers.DynamicCache(config=model.config)
    kvq_cache = KvqCache(model.config, "kivi4:pre_rope:sink=4")
    with torch.inference_mode():
        model(prompt[:, :8], cache=dynamic)
        model(prompt[:, :8], cache=kvq_cache)
    for layer in (0, 15, 29):
        want = dynamic.layers[layer].keys[:, :, :4]
        got = kvq_cache.layers[layer].keys[:, :, :4]
        assert torch.allclose(got, want, rtol=2e-3, atol=2e-3), (layer, (got - want).abs().max())


def test_fused_attention_needs_a_kvq_cache(model, prompt):
    use_kvq_attention(model)
    with pytest.raises(ValueError, match="attends over a KvqCache"):
        with torch.inference_mode():
            model(prompt[:, :4], cache=transformers.DynamicCache(config=model.config))


def test_pre_rope_refused_for_rope_kvq_does_not_apply(model):
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match='rope_type "llama3"'):
        KvqCache(config, "kivi4:pre_rope")
    KvqCache(config, "kivi4")  # Keys stored after RoPE: any RoPE works.


@pytest.mark.skipif(not os.access(SERVER_BIN, os.X_OK),
                    reason="KVQ_SERVER_BIN does not name a kvq-server binary")
@pytest.mark.parametrize("attention", ATTENTION)
def test_remote_cache_gives_in_process_results(model, prompt, attention):
    # Fused: the server's Attend RPC; dequantized: its FetchDequant.
    from kvq_client import KvqClient

    attend_by(model, attention)
    scheme = "kivi4:pre_rope:sink=4"

    local = KvqCache(model.config, scheme)
    local_tokens, local_scores = generate(model, prompt, local)
    with running_server() as address, KvqClient(address) as client:
        with KvqCache(model.config, scheme, client=client) as remote:
            tokens, scores = generate(model, prompt, remote)
            stored = remote.bytes_by_component()
            stats = client.stats(remote.sequence_ids[0])
        assert stats.num_tokens == PROMPT_TOKENS + NEW_TOKENS - 1
        assert client.stats().sequences == 0  # Released on leaving the `with`.
    assert tokens.tolist() == local_tokens.tolist()
    np.testing.assert_array_equal(scores.numpy(), local_scores.numpy())
    assert stored["total"] == local.bytes_by_component()["total"]
