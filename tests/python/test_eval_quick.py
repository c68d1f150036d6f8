"""kvq-eval --quick, the CI slice of the quality evaluation (docs/QUALITY.md).

Checks that the C++ forward pass is the model's own (its fp16-cache
perplexity on the slice is within 1% of what llama.cpp computes for the same
GGUF and tokens with an f16 cache, recorded in docs/quality/quick_reference.json),
that kivi4 stays within its bound, and that two runs print identical numbers.
The kvq-eval binary comes from CTest (KVQ_EVAL_BIN).
"""

import json
import os
import pathlib
import subprocess

import pytest

SOURCE = pathlib.Path(os.environ.get("KVQ_SOURCE_DIR", pathlib.Path(__file__).parents[2]))
REFERENCE = SOURCE / "docs" / "quality" / "quick_reference.json"
# Fields that are timings or process figures, not results.
VOLATILE = {"prefill_ms", "decode_ms_per_token", "decode_tokens_per_s", "scoring_ms"}


def run_quick(tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [os.environ["KVQ_EVAL_BIN"], "--quick", "--json", "--progress=false", f"--out={out}",
         *flags], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads(out.read_text())
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    return run_quick(tmp, "a"), run_quick(tmp, "b")


def row(result, scheme, corpus="all", metric="prefill"):
    rows = [r for r in result["rows"]
            if r["scheme"] == scheme and r["corpus"] == corpus and r["metric"] == metric]
    assert len(rows) == 1, (scheme, corpus, metric, result["rows"])
    return rows[0]


def test_every_row_names_its_metric(runs):
    assert {r["metric"] for r in runs[0]["rows"]} == {"decode", "prefill"}
    for scheme in ("fp16", "kivi4", "kivi4:pre_rope:sink=4"):
        decode = row(runs[0], scheme, metric="decode")
        prefill = row(runs[0], scheme)
        assert decode["tokens_scored"] == prefill["tokens_scored"]
        assert decode["kv_bytes"] == prefill["kv_bytes"]


def test_decode_metric_of_fp16_is_the_model(runs):
    # An fp16 cache holds the same values however it is filled: the two
    # metrics differ by float rounding only.
    decode = row(runs[0], "fp16", metric="decode")
    prefill = row(runs[0], "fp16")
    assert abs(decode["ppl"] / prefill["ppl"] - 1) < 1e-3, (decode, prefill)
    assert decode["delta_ppl_pct"] == 0 and decode["kl_mean"] == 0


def test_fp16_matches_llamacpp_f16_cache(runs):
    reference = json.loads(REFERENCE.read_text())
    fp16 = row(runs[0], "fp16", reference["corpus"])
    assert fp16["context"] == reference["context"]
    assert fp16["tokens_scored"] == reference["tokens_scored"]
    ratio = fp16["ppl"] / reference["llamacpp_f16_ppl"]
    assert abs(ratio - 1) <= 0.01, (fp16["ppl"], reference)


def test_kivi4_within_its_bound(runs):
    # The picked 4-bit configuration (docs/QUALITY.md). On 511 scored tokens
    # ΔPPL moves by about ±0.5% from rounding alone (llama.cpp's own q8_0
    # cache gives −0.48% on this slice; a last-bit change in one layer's
    # attention flips codes of the next layers' K/V): the kernels of each
    # SIMD target give 0.30% (SCALAR), 0.74% (AVX2), 0.78% (AVX3) and, on
    # AVX3_DL's integer value dot products, 1.21% and then 1.51% after the
    # zero-point sum was merely reordered, all with KL 0.0067..0.0078. So CI
    # bounds ΔPPL at 2% as a sanity check and relies on the KL bound, which
    # is steadier; the 0.5% target is checked at 2048 and 8192 tokens by
    # bench/eval/run_quality.sh.
    kivi4 = row(runs[0], "kivi4:pre_rope:sink=4")
    assert kivi4["delta_ppl_pct"] <= 2.0, kivi4
    assert kivi4["kl_mean"] < 0.01, kivi4
    assert kivi4["top1_agree"] >= 0.9, kivi4
    # Every byte counted: fewer bytes than fp16, and the split adds up.
    fp16 = row(runs[0], "fp16")
    assert kivi4["kv_bytes"] < fp16["kv_bytes"]
    assert sum(kivi4["kv_bytes_by_component"].values()) == kivi4["kv_bytes"]
    # Plain KIVI-4 is lossier (no pre-RoPE keys, no sink) but close.
    plain = row(runs[0], "kivi4")
    assert 0 < plain["kl_mean"] < 0.05, plain
    assert plain["delta_ppl_pct"] <= 2.0, plain


def test_fp16_reference_is_exact_against_itself(runs):
    fp16 = row(runs[0], "fp16")
    assert fp16["delta_ppl_pct"] == 0
    assert fp16["kl_mean"] == 0
    assert fp16["top1_agree"] == 1
    # 512 tokens of K and V in fp16: 30 layers x 3 KV heads x 64 channels.
    assert fp16["kv_bytes"] == 512 * 2 * 30 * 3 * 64 * 2
    assert fp16["bits_per_element"] == 16


def test_two_runs_print_identical_numbers(runs):
    a, b = ([{k: v for k, v in r.items() if k not in VOLATILE} for r in run["rows"]]
            for run in runs)
    assert a == b
    # The file written after each window is marked partial; the last is not.
    assert "partial" not in runs[0]
    assert runs[0]["blas_core"]


def test_decode_metric_alone_gives_the_same_decode_rows(runs, tmp_path):
    # --metrics=decode skips the chunked prefill, the generation and their
    # metric (the long frontier runs use it): the decode rows must not move.
    alone = run_quick(tmp_path, "decode", "--metrics=decode")
    assert {r["metric"] for r in alone["rows"]} == {"decode"}
    both = [{k: v for k, v in r.items() if k not in VOLATILE}
            for r in runs[0]["rows"] if r["metric"] == "decode"]
    assert [{k: v for k, v in r.items() if k not in VOLATILE} for r in alone["rows"]] == both


def test_nothing_to_run_is_a_clear_error():
    proc = subprocess.run([os.environ["KVQ_EVAL_BIN"], "--contexts=", "--passkey_contexts="],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr == ("kvq-eval: nothing to run: --contexts and --passkey_contexts "
                           "are empty\n")


def test_per_window_scores_pool_to_the_rows_figures(runs):
    # The per-window scores another engine pairs with (compare_forward.py)
    # are the ones the row was pooled from: pooling.py's arithmetic gives
    # the row's ΔPPL and KL.
    import sys
    sys.path.insert(0, str(SOURCE / "bench" / "eval"))
    from pooling import pool
    scored_rows = [r for r in runs[0]["rows"] if "tokens_scored" in r]
    assert scored_rows
    for r in scored_rows:
        windows = r["per_window"]
        assert len(windows) == r["windows"]
        assert [w["window"] for w in windows] == ["austen/0"] * r["windows"]
        assert sum(w["tokens"] for w in windows) == r["tokens_scored"]
        assert abs(sum(w["nll"] for w in windows) / r["tokens_scored"] - r["nll"]) < 1e-7
        pooled = pool(windows)
        assert abs(pooled["delta_ppl_pct"] - r["delta_ppl_pct"]) <= 1e-5 * max(
            1.0, abs(r["delta_ppl_pct"])), r
        assert abs(pooled["kl_mean"] - r["kl_mean"]) <= 1e-8 * max(1.0, r["kl_mean"]), r
