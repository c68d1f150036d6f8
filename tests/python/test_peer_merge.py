"""bench/eval/llamacpp_peer.py --merge: combining peer runs of disjoint windows.

A run over two corpora and the merge of two one-corpus runs must give the
same rows: per-corpus rows unchanged, pooled rows recomputed by tokens, and
no pooled row for a cache type that covers fewer corpora than f16; so must
the merge of runs that split one corpus's windows.
"""

import importlib.util
import json
import math
import pathlib

import pytest

SOURCE = pathlib.Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("llamacpp_peer",
                                              SOURCE / "bench" / "eval" / "llamacpp_peer.py")
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)


def sums(windows, tokens, nll_mean, kl_mean, ms):
    return {"windows": windows, "tokens": tokens, "nll": nll_mean * tokens,
            "kl": kl_mean * tokens, "seconds": ms / 1e3 * windows}


ACC = {
    ("f16", "austen", 8192): sums(1, 8191, 3.41, 0.0, 1000.0),
    ("q4_0", "austen", 8192): sums(1, 8191, 3.45, 0.04, 3000.0),
    ("f16", "code", 8192): sums(1, 8191, 1.63, 0.0, 2000.0),
    ("q4_0", "code", 8192): sums(1, 8191, 1.70, 0.05, 5000.0),
    ("q8_0", "austen", 8192): sums(1, 8191, 3.415, 0.004, 9000.0),
}


def write(tmp_path, name, keys):
    return write_acc(tmp_path, name, {k: ACC[k] for k in keys})


def by_key(rows):
    return {(r["scheme"], r["corpus"], r["context"]): r for r in rows}


def test_merge_of_one_corpus_runs_equals_one_run(tmp_path):
    austen = write(tmp_path, "austen.json", [k for k in ACC if k[1] == "austen"])
    code = write(tmp_path, "code.json", [k for k in ACC if k[1] == "code"])
    merged = by_key(peer.merge_results([austen, code])["rows"])
    whole = by_key(peer.result_rows(ACC))
    assert merged.keys() == whole.keys()
    for key, row in whole.items():
        for field, value in row.items():
            if isinstance(value, float):
                assert merged[key][field] == pytest.approx(value, rel=1e-12), (key, field)
            else:
                assert merged[key][field] == value, (key, field)
    # Pooled by tokens; q8_0 ran on austen only, so it has no pooled row.
    pooled = merged[("q4_0", "all", 8192)]
    assert pooled["tokens_scored"] == 2 * 8191
    assert pooled["nll"] == pytest.approx((3.45 + 1.70) / 2)
    ref = math.exp((3.41 + 1.63) / 2)
    assert pooled["delta_ppl_pct"] == pytest.approx((math.exp((3.45 + 1.70) / 2) / ref - 1) * 100)
    assert ("q8_0", "all", 8192) not in merged
    assert ("q8_0", "austen", 8192) in merged


def test_merge_refuses_overlapping_runs(tmp_path):
    austen = write(tmp_path, "austen.json", [k for k in ACC if k[1] == "austen"])
    with pytest.raises(ValueError, match="is in two files"):
        peer.merge_results([austen, austen])


def window_acc(measured, tokens=2048):
    """(cache type, corpus, context) -> sums over `measured`'s windows,
    built as evaluate() builds them: {(corpus, index): (f16 NLL, q4_0 NLL,
    q4_0 KL)}, mean per token."""
    acc = {}
    for (corpus, index), (ref, q4, kl) in measured.items():
        window = {"corpus": corpus, "index": index, "tokens": list(range(tokens))}
        scored = tokens - 1
        for scheme, nll, kl_mean in (("f16", ref, 0.0), ("q4_0", q4, kl)):
            a = acc.setdefault((scheme, corpus, tokens), {"windows": 0, "tokens": 0, "nll": 0.0,
                                                        "kl": 0.0, "seconds": 0.0,
                                                        "per_window": []})
            a["windows"] += 1
            a["tokens"] += scored
            a["nll"] += nll * scored
            a["kl"] += kl_mean * scored
            a["seconds"] += 1.5
            a["per_window"].append(peer.window_sums(window, nll * scored, ref * scored,
                                                    kl_mean * scored))
    return acc


def write_acc(tmp_path, name, acc):
    path = tmp_path / name
    path.write_text(json.dumps({"tool": "llama.cpp", "version": "0.3.36",
                                "rows": peer.result_rows(acc)}))
    return path


def assert_same_rows(merged, whole):
    """Rows by key: the same windows, values within rounding."""
    assert merged.keys() == whole.keys()
    for key, row in whole.items():
        for field, value in row.items():
            if field == "per_window":
                assert (sorted(w["window"] for w in merged[key][field])
                        == sorted(w["window"] for w in value)), key
            elif isinstance(value, float) or field.endswith("_ci95"):
                assert merged[key][field] == pytest.approx(value, rel=1e-9), (key, field)
            else:
                assert merged[key][field] == value, (key, field)


# (corpus, index) -> (f16 mean NLL, q4_0 mean NLL, q4_0 mean KL)
FIVE = {("austen", 2): (3.40, 3.42, 0.02), ("austen", 0): (3.50, 3.56, 0.03),
        ("austen", 4): (3.30, 3.35, 0.04), ("code", 2): (1.60, 1.61, 0.01),
        ("code", 4): (1.70, 1.74, 0.04)}


def test_merge_of_one_corpus_split_over_runs_equals_one_run(tmp_path):
    # The first run scored windows 2 and 0 of each corpus, a later one the
    # rest: merged, every row (per_window, interval) is the one-run row.
    first = {k: v for k, v in FIVE.items() if k[1] in (2, 0)}
    rest = {k: v for k, v in FIVE.items() if k[1] not in (2, 0)}
    merged = by_key(peer.merge_results([write_acc(tmp_path, "first.json", window_acc(first)),
                                        write_acc(tmp_path, "rest.json", window_acc(rest))])
                    ["rows"])
    whole = by_key(peer.result_rows(window_acc(FIVE)))
    assert_same_rows(merged, whole)
    assert merged[("q4_0", "austen", 2048)]["windows"] == 3


def test_merge_refuses_a_window_measured_differently_in_two_runs(tmp_path):
    first = {k: v for k, v in FIVE.items() if k[1] in (2, 0)}
    again = {k: v for k, v in FIVE.items() if k[1] in (0, 4)}
    again[("austen", 0)] = (3.50, 3.57, 0.03)  # q4_0 differs; f16 does not.
    with pytest.raises(ValueError, match=r"\('q4_0', 'austen', 2048\) is in two files with "
                                         "window austen/0 in both, measured differently"):
        peer.merge_results([write_acc(tmp_path, "first.json", window_acc(first)),
                            write_acc(tmp_path, "again.json", window_acc(again))])


def renamed(acc, old, new):
    return {(new if k[0] == old else k[0],) + k[1:]: v for k, v in acc.items()}


def test_merge_counts_a_window_measured_alike_in_two_runs_once(tmp_path):
    # A later run of one more cache type repeats the f16 reference bit for
    # bit, here on one window more: merged, f16 has every window once, and
    # every row is the row of one run over the windows it covers.
    first = window_acc({k: v for k, v in FIVE.items() if k != ("code", 4)})
    later = renamed(window_acc(FIVE), "q4_0", "q5_0")
    merged = by_key(peer.merge_results([write_acc(tmp_path, "first.json", first),
                                        write_acc(tmp_path, "later.json", later)])["rows"])
    whole = by_key(peer.result_rows({**first, **later}))
    assert_same_rows(merged, whole)
    assert merged[("f16", "code", 2048)]["windows"] == 2
    assert merged[("q4_0", "code", 2048)]["windows"] == 1
    assert merged[("q5_0", "all", 2048)]["windows"] == 5


def test_a_row_of_fewer_windows_than_f16_is_measured_on_its_own(tmp_path):
    # q5_0 measured on three of f16's five windows: its change is against
    # f16 on those three, as a run of those three alone gives it.
    three = {k: v for k, v in FIVE.items() if k in (("austen", 2), ("austen", 0), ("code", 2))}
    merged = by_key(peer.merge_results([
        write_acc(tmp_path, "first.json", window_acc(FIVE)),
        write_acc(tmp_path, "later.json", renamed(window_acc(three), "q4_0", "q5_0"))])["rows"])
    alone = by_key(peer.result_rows(window_acc(three)))
    for corpus in ("austen", "code"):
        assert merged[("q5_0", corpus, 2048)]["delta_ppl_pct"] == pytest.approx(
            alone[("q4_0", corpus, 2048)]["delta_ppl_pct"], rel=1e-9)
    # austen's three: f16 3.50, 3.40 against q5_0 3.56, 3.42 per token.
    assert merged[("q5_0", "austen", 2048)]["delta_ppl_pct"] == pytest.approx(
        math.expm1((0.06 + 0.02) / 2) * 100, rel=1e-9)


def test_rows_carry_both_metrics_and_bootstrap_intervals(tmp_path):
    # Three windows of one corpus: the interval brackets the pooled value
    # and is the same after a merge, which recomputes it from per_window.
    windows = [(3.40, 3.41, 0.01), (3.50, 3.55, 0.03), (3.30, 3.31, 0.02)]
    tokens = 2047
    acc = {("f16", "austen", 2048): {
               "windows": 3, "tokens": 3 * tokens, "nll": sum(w[0] for w in windows) * tokens,
               "kl": 0.0, "seconds": 3.0,
               "per_window": [{"nll": w[0] * tokens, "ref_nll": w[0] * tokens, "kl": 0.0,
                               "tokens": tokens} for w in windows]},
           ("q4_0", "austen", 2048): {
               "windows": 3, "tokens": 3 * tokens, "nll": sum(w[1] for w in windows) * tokens,
               "kl": sum(w[2] for w in windows) * tokens, "seconds": 6.0,
               "per_window": [{"nll": w[1] * tokens, "ref_nll": w[0] * tokens,
                               "kl": w[2] * tokens, "tokens": tokens} for w in windows]}}
    rows = by_key(peer.result_rows(acc))
    q4 = rows[("q4_0", "all", 2048)]
    assert q4["metric"] == "decode" and q4["metrics"] == ["decode", "prefill"]
    lo, hi = q4["delta_ppl_pct_ci95"]
    assert lo < q4["delta_ppl_pct"] < hi
    assert lo >= 100 * math.expm1(0.01) - 1e-9 and hi <= 100 * math.expm1(0.05) + 1e-9
    assert q4["kl_mean_ci95"][0] <= q4["kl_mean"] <= q4["kl_mean_ci95"][1]
    assert rows[("f16", "all", 2048)]["delta_ppl_pct_ci95"] == [0.0, 0.0]
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"tool": "llama.cpp", "version": "0.3.36",
                                "rows": list(rows.values())}))
    merged = by_key(peer.merge_results([path])["rows"])
    assert merged[("q4_0", "all", 2048)]["delta_ppl_pct_ci95"] == pytest.approx([lo, hi])


def test_frontier_table_pools_peer_rows_as_the_peer_does(tmp_path):
    # The peer's per-corpus rows carry kvq-eval's per_window entries, so
    # quality_tables.py --frontier pools them (with the bootstrap interval)
    # to the same "all" row the peer computes itself.
    tables_spec = importlib.util.spec_from_file_location(
        "quality_tables", SOURCE / "bench" / "eval" / "quality_tables.py")
    tables = importlib.util.module_from_spec(tables_spec)
    tables_spec.loader.exec_module(tables)

    tokens = 2048
    measured = {k: v for k, v in FIVE.items() if k != ("austen", 4)}
    rows = peer.result_rows(window_acc(measured, tokens))
    own = by_key(rows)[("q4_0", "all", 2048)]
    austen = by_key(rows)[("q4_0", "austen", 2048)]
    assert [w["window"] for w in austen["per_window"]] == ["austen/2", "austen/0"]
    assert austen["per_window"][0]["tokens"] == tokens - 1

    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"tool": "llama.cpp", "version": "0.3.36", "rows": rows}))
    pooled = by_key(r for r in tables.pool_corpora(tables.load([path], "decode"))
                    if r["engine"] == "llama.cpp")
    q4 = pooled[("q4_0", "all", 2048)]
    assert q4["corpora"] == ["austen", "code"] and q4["windows"] == 4
    assert q4["delta_ppl_pct"] == pytest.approx(
        100 * math.expm1(sum(q - r for r, q, _ in measured.values()) / 4))
    assert q4["delta_ppl_pct"] == pytest.approx(own["delta_ppl_pct"], rel=1e-9)
    assert q4["kl_mean"] == pytest.approx(own["kl_mean"], rel=1e-12)
    assert q4["delta_ppl_pct_ci95"] == pytest.approx(own["delta_ppl_pct_ci95"])
    assert q4["kl_mean_ci95"] == pytest.approx(own["kl_mean_ci95"])
    text = "\n".join(tables.frontier_table(
        list(pooled.values()) + [r for r in rows if r["corpus"] != "all"], [2048]))
    assert "| llama.cpp | `q4_0` |" in text and "| 4.50 | 4 |" in text


def test_window_order_runs_rank_by_rank_across_corpora():
    # kvq-eval's frontier order (2,0,4,1,3): a peer run stopped early holds
    # the same windows of every corpus, the first ones kvq-eval scored.
    windows = [{"corpus": c, "context": ctx, "index": i, "tokens": [1, 2]}
               for c in ("kjv", "austen") for ctx in (8192, 2048) for i in range(5)]
    picked = peer.select_windows(windows, None, None, [2, 0, 4, 1, 3])
    assert [(w["context"], w["corpus"], w["index"]) for w in picked[:6]] == [
        (2048, "austen", 2), (2048, "kjv", 2), (2048, "austen", 0), (2048, "kjv", 0),
        (2048, "austen", 4), (2048, "kjv", 4)]
    assert len(picked) == 20 and picked[10]["context"] == 8192
    two = peer.select_windows(windows, 2, 2048, [2, 0, 4, 1, 3])
    assert [(w["corpus"], w["index"]) for w in two] == [
        ("austen", 2), ("kjv", 2), ("austen", 0), ("kjv", 0)]
    # Indices the order leaves out follow it, lowest first; without an
    # order, each corpus's windows run lowest index first.
    assert [w["index"] for w in peer.select_windows(windows, None, 2048, [3])][::2] == [
        3, 0, 1, 2, 4]
    assert [(w["corpus"], w["index"]) for w in peer.select_windows(windows, 2, 2048)] == [
        ("austen", 0), ("austen", 1), ("kjv", 0), ("kjv", 1)]
