"""bench/eval/quality_tables.py: a row measured again in a later file (the
fp16 reference of a second kvq-eval run) replaces the earlier one instead
of appearing twice, and the targets table picks within the bit budgets and
by the mean code width of keys and values."""

import importlib.util
import json
import math
import pathlib

import pytest

SOURCE = pathlib.Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("quality_tables",
                                              SOURCE / "bench" / "eval" / "quality_tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


def row(scheme, bits, dppl, ppl=12.0):
    return {"engine": "kvq", "scheme": scheme, "corpus": "all", "context": 8192,
            "bits_per_element": bits, "delta_ppl_pct": dppl, "ppl": ppl, "kv_bytes": 1 << 20}


def write(path, rows):
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_later_file_replaces_a_repeated_row(tmp_path):
    a = write(tmp_path / "a.json", [row("fp16", 16.0, 0.0, ppl=12.5), row("kivi4", 5.25, 1.3)])
    b = write(tmp_path / "b.json", [row("fp16", 16.0, 0.0, ppl=12.4),
                                    row("kivi3:g64:r64:p8", 3.42, 4.0)])
    rows = tables.load([a, b])
    assert sorted(r["scheme"] for r in rows) == ["fp16", "kivi3:g64:r64:p8", "kivi4"]
    assert [r["ppl"] for r in rows if r["scheme"] == "fp16"] == [12.4]
    text = "\n".join(tables.tables(rows, "all"))
    assert text.count("`fp16`") == 1


def test_targets_pick_within_the_budget(tmp_path):
    rows = [row("fp16", 16.0, 0.0), row("kivi3:pre_rope", 4.69, 3.4),
            row("kivi3:g64:r64:p8", 3.42, 4.0), row("kivi3:g16", 5.3, 1.5)]
    lines = tables.targets(rows, "all")
    three = next(line for line in lines if "≈3-bit" in line)
    assert "`kivi3:g64:r64:p8`" in three
    assert "| 3.42 | +4.00 | missed: +2.00 pts over |" in three


def test_mixed_bits_compete_by_their_mean_code_width():
    assert tables.mean_code_bits("kivi4:v2:g64:r64:p8") == 3.0
    assert tables.mean_code_bits("kivi3:g64") == 3.0
    assert tables.mean_code_bits("kivi4:v3") == 3.5
    assert tables.mean_code_bits("int8") is None
    rows = [row("fp16", 16.0, 0.0), row("kivi4:g16", 6.2, 0.4),
            row("kivi4:v2:g64:r64:p8", 3.42, 1.8), row("kivi3:g64:r64:p8", 3.42, 6.3),
            row("kivi2:v3:g64:r64:p8", 2.9, 20.0), row("kivi2:g64:r64:p8", 2.43, 80.0),
            row("kivi4:v3:g64:r64:p8", 3.92, 0.1)]
    lines = tables.targets(rows, "all")
    four = next(line for line in lines if "4-bit kivi" in line)
    three = next(line for line in lines if "≈3-bit" in line)
    two = next(line for line in lines if "≈2-bit" in line)
    assert "`kivi4:g16`" in four, "kivi4:v2 is not a 4-bit configuration"
    assert "`kivi4:v2:g64:r64:p8` | 3.42 | +1.80 | met |" in three
    assert "`kivi2:g64:r64:p8` | 2.43 | +80.00 | missed: +74.00 pts over |" in two, \
        "kivi2:v3 (2.5 bits on average) is not a 2-bit configuration"
    assert "kivi4:v3" not in four + three, "3.5 bits on average: in no family"


def test_metric_selects_rows_and_keeps_both(tmp_path):
    # kvq-eval writes a decode and a prefill row per scheme; files without
    # the field (older runs, the llama.cpp peer) are prefill.
    decode = dict(row("kivi4", 4.5, 0.4), metric="decode")
    prefill = dict(row("kivi4", 4.5, 1.0), metric="prefill")
    old = dict(row("kivi2", 2.5, 40.0))
    a = tmp_path / "a.json"
    write(a, [decode, prefill, old])
    assert len(tables.load([a])) == 3
    assert [r["delta_ppl_pct"] for r in tables.load([a], "decode")] == [0.4]
    assert sorted(r["delta_ppl_pct"] for r in tables.load([a], "prefill")) == [1.0, 40.0]


def frontier_row(scheme, bits, dppl, corpus="all", context=2048, engine="kvq", ci=None):
    r = dict(row(scheme, bits, dppl), corpus=corpus, context=context, engine=engine,
             metric="decode")
    if ci:
        r["delta_ppl_pct_ci95"] = ci
    return r


def test_peer_rows_stand_for_both_metrics(tmp_path):
    # The llama.cpp peer's cache gives prefill and decode the same state.
    peer = dict(frontier_row("q4_0", 4.5, 3.0, engine="llama.cpp"),
                metrics=["decode", "prefill"])
    a = write(tmp_path / "a.json", [peer])
    assert [r["scheme"] for r in tables.load([a], "decode")] == ["q4_0"]
    assert [r["scheme"] for r in tables.load([a], "prefill")] == ["q4_0"]


def test_frontier_goals_met_not_met_and_not_measured():
    rows = [frontier_row("fp16", 16.0, 0.0)]
    for corpus in ("austen", "code", "kjv"):
        rows += [dict(frontier_row(scheme, 0.0, 0.0, corpus=corpus), windows=windows)
                 for scheme, windows in (("kivi4:v3", 5), ("kivi3", 5), ("kivi4", 5),
                                         ("crq3:r24", 1))]
    rows += [frontier_row("kivi4:v3", 4.23, 0.4, ci=[0.2, 0.6]),
             frontier_row("kivi3", 3.4, 3.1, ci=[2.6, 3.7]),
             frontier_row("kivi4", 4.7, 0.1),
             frontier_row("crq3:r24", 3.45, 2.0),  # Screened on one window per corpus.
             frontier_row("crq2", 2.4, 8.0),  # Screened: no per-corpus rows.
             frontier_row("q4_0", 4.5, 0.05, engine="llama.cpp")]
    lines = tables.goals(rows)
    at = {(line.split("|")[1].strip(), line.split("|")[2].strip()): line for line in lines[2:]}
    four = at[("≤ 4.3 bits, ΔPPL ≤ 0.5%", "2048")]
    assert "`kivi4:v3`" in four and "met (the interval reaches +0.60)" in four, \
        "kivi4 is over the budget and llama.cpp rows are not kvq formats"
    three = at[("≤ 3.5 bits, ΔPPL ≤ 2.5%", "2048")]
    assert "`kivi3`" in three and "not met: best +3.10%, interval from +2.60" in three, \
        "a format screened on fewer than 5 windows per corpus is never the pick"
    assert three.endswith("; screened on 1 windows: `crq3:r24` 3.45 bits +2.00% |")
    assert at[("≤ 2.6 bits, ΔPPL ≤ 10.0%", "2048")].endswith(
        "screened: `crq2` | 2.40 | +8.00 (1 windows) | not measured |")
    assert at[("≤ 4.3 bits, ΔPPL ≤ 0.5%", "8192")].endswith("not measured |")


def test_passkey_goal_needs_twenty_trials_and_fp16s_score():
    def passkey(scheme, ok, trials):
        return {"engine": "kvq", "scheme": scheme, "corpus": "passkey", "context": 2048,
                "passkey_ok": ok, "passkey_trials": trials}
    base = [frontier_row("kivi3", 3.7, 3.0), frontier_row("kivi2", 2.7, 9.0)]
    few = tables.passkey_goal(base + [passkey("fp16", 3, 3), passkey("kivi3", 3, 3)])
    assert few[0].endswith("not measured (3 trials < 20) |")
    worse = tables.passkey_goal(base + [passkey("fp16", 20, 20), passkey("kivi3", 19, 20),
                                        passkey("kivi2", 0, 20)])
    assert worse[0].endswith("not met: `kivi3` 19 |"), "kivi2 is under 3 bits: not a goal"
    met = tables.passkey_goal(base + [passkey("fp16", 18, 20), passkey("kivi3", 19, 20)])
    assert met[0].endswith("| met |")
    # Every format of at least 3 bits needs its trials before the goal is met.
    untried = tables.passkey_goal(base + [frontier_row("crq3", 3.4, 2.0), passkey("fp16", 18, 20),
                                          passkey("kivi3", 19, 20)])
    assert untried[0].endswith("not measured for 1 of 2 formats ≥ 3 bits |")
    assert untried[1].startswith("| passkey equal to fp16 (≥ 3 bits, ≥ 20 trials) | 8192 |") \
        and untried[1].endswith("not measured |")


def test_runs_of_one_corpus_each_pool_by_tokens_with_an_interval():
    # kvq-eval run once per corpus: each file's "all" row is that corpus
    # alone; the frontier pools their per-window sums instead.
    def corpus_row(corpus, windows):
        r = frontier_row("kivi3", 3.74, 0.0, corpus=corpus)
        r["per_window"] = [{"index": i, "nll": n * 100, "ref_nll": ref * 100, "kl": kl * 100,
                            "tokens": 100} for i, (n, ref, kl) in enumerate(windows)]
        return r
    austen = corpus_row("austen", [(3.0, 2.9, 0.05), (3.2, 3.1, 0.04)])
    code = corpus_row("code", [(1.5, 1.45, 0.03)])
    stale = frontier_row("kivi3", 3.74, 99.0)  # The last file's one-corpus "all" row.
    rows = tables.pool_corpora([austen, code, stale])
    pooled = [r for r in rows if r["corpus"] == "all"]
    assert len(pooled) == 1 and pooled[0]["corpora"] == ["austen", "code"]
    assert pooled[0]["windows"] == 3 and pooled[0]["tokens_scored"] == 300
    assert pooled[0]["delta_ppl_pct"] == pytest.approx(100 * math.expm1((10 + 10 + 5) / 300))
    assert pooled[0]["kl_mean"] == pytest.approx(0.04)
    lo, hi = pooled[0]["delta_ppl_pct_ci95"]
    assert lo < pooled[0]["delta_ppl_pct"] < hi


def test_runs_of_other_windows_of_one_corpus_merge_into_one_row(tmp_path):
    # A stopped run and a later run of the remaining windows (and a rerun of
    # one window) add up to one row per corpus, pooled by tokens.
    def windows_row(windows, dppl):
        r = frontier_row("kivi3", 3.74, dppl, corpus="austen")
        r["per_window"] = [{"index": i, "nll": n * 100, "ref_nll": ref * 100, "kl": kl * 100,
                            "tokens": 100} for i, n, ref, kl in windows]
        r["delta_ppl_pct_ci95"] = [dppl, dppl]
        return r
    first = write(tmp_path / "first.json",
                  [windows_row([(2, 3.0, 2.9, 0.05), (0, 3.2, 3.1, 0.04)], 10.0)])
    rest = write(tmp_path / "rest.json",
                 [windows_row([(0, 3.3, 3.1, 0.08), (3, 2.0, 2.0, 0.0)], 20.0)])
    [merged] = tables.load([first, rest], "decode")
    assert sorted(w["index"] for w in merged["per_window"]) == [0, 2, 3]
    assert merged["windows"] == 3 and merged["tokens_scored"] == 300
    # Window 0 keeps the later run's sums (nll - ref = 0.2 per token).
    assert merged["delta_ppl_pct"] == pytest.approx(100 * math.expm1((10 + 20 + 0) / 300))
    assert merged["kl_mean"] == pytest.approx((5 + 8 + 0) / 300)
    assert merged["nll"] == pytest.approx((300 + 330 + 200) / 300)
    lo, hi = merged["delta_ppl_pct_ci95"]
    assert lo < merged["delta_ppl_pct"] < hi, "the interval is the union's, not a file's"
    # Rows without per-window sums (older files) are replaced, not merged.
    old = write(tmp_path / "old.json", [frontier_row("kivi3", 3.74, 7.0, corpus="austen")])
    [replaced] = tables.load([first, old], "decode")
    assert replaced["delta_ppl_pct"] == 7.0 and "per_window" not in replaced


def test_the_frontier_plot_merges_windows_as_the_table_does(tmp_path):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location(
        "plot_quality", SOURCE / "bench" / "eval" / "plot_quality.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)

    def one_window(index, dppl_per_token):
        r = frontier_row("kivi3", 3.74, 0.0, corpus="code")
        r["per_window"] = [{"index": index, "nll": 300.0 + 100 * dppl_per_token,
                            "ref_nll": 300.0, "kl": 1.0, "tokens": 100}]
        return r
    a = write(tmp_path / "a.json", [one_window(2, 0.01)])
    b = write(tmp_path / "b.json", [one_window(3, 0.03)])
    [r] = plot.load_rows([pathlib.Path(a), pathlib.Path(b)], "decode")
    assert r["windows"] == 2
    assert r["delta_ppl_pct"] == pytest.approx(100 * math.expm1(0.02))


def test_frontier_row_pooled_over_fewer_corpora_says_which():
    # A peer run stopped after austen pools austen alone; the table, whose
    # header names every corpus of the context, says so in its windows cell.
    def part(engine, scheme, corpus):
        r = frontier_row(scheme, 4.5, 1.0, corpus=corpus, engine=engine)
        r["per_window"] = [{"window": f"{corpus}/2", "index": 2, "nll": 310.0,
                            "ref_nll": 300.0, "kl": 1.0, "tokens": 100}]
        return r
    rows = tables.pool_corpora([part("kvq", "kivi4", "austen"), part("kvq", "kivi4", "code"),
                                part("llama.cpp", "q4_0", "austen")])
    text = "\n".join(tables.frontier_table(rows, [2048]))
    assert "| llama.cpp | `q4_0` | llama.cpp cache | 4.50 | 1 (austen only) |" in text
    assert "| kvq | `kivi4` | KIVI | 4.50 | 2 |" in text
