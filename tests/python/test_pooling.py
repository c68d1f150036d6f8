"""bench/eval/pooling.py: kvq-eval's pooled ΔPPL and KL with bootstrap
intervals over windows (bootstrap.cc's definition), and the paired
difference of two engines on the same windows (compare_forward.py)."""

import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench" / "eval"))
from pooling import paired_difference, pool  # noqa: E402


def window(dnll_per_token, kl_per_token, scored=100, ref=2.0):
    return {"nll": (ref + dnll_per_token) * scored, "ref_nll": ref * scored,
            "kl": kl_per_token * scored, "tokens": scored}


def test_pooled_by_tokens_not_by_windows():
    # 300 tokens at +0.03 nat and 100 at -0.01: (9 - 1) / 400 nat per token.
    ws = [window(0.03, 0.02, 300), window(-0.01, 0.01, 100)]
    p = pool(ws)
    assert p["delta_ppl_pct"] == pytest.approx(100 * math.expm1(8 / 400), rel=1e-12)
    assert p["kl_mean"] == pytest.approx((6 + 1) / 400, rel=1e-12)


def test_interval_needs_two_windows_and_brackets_the_spread():
    assert "delta_ppl_pct_ci95" not in pool([window(0.01, 0.01)])
    ws = [window(d, 0.01 + d) for d in (0.00, 0.01, 0.02, 0.03, 0.04)]
    p = pool(ws, resamples=2000, seed=3)
    lo, hi = p["delta_ppl_pct_ci95"]
    assert 100 * math.expm1(0.0) <= lo < p["delta_ppl_pct"] < hi <= 100 * math.expm1(0.04)
    klo, khi = p["kl_mean_ci95"]
    assert 0.01 <= klo < p["kl_mean"] < khi <= 0.05
    assert pool(ws, resamples=2000, seed=3) == p  # Deterministic for a seed.


def test_identical_windows_have_a_point_interval():
    p = pool([window(0.02, 0.01)] * 4)
    assert p["delta_ppl_pct_ci95"] == pytest.approx([p["delta_ppl_pct"]] * 2, rel=1e-12)


def test_paired_difference_cancels_shared_window_noise():
    # Two engines that differ by exactly +0.01 nat per token on windows
    # whose own ΔPPL spreads widely: the difference's interval is narrow.
    base = [window(d, 0.01) for d in (0.0, 0.05, 0.10, 0.15, 0.20)]
    shifted = [window(d + 0.01, 0.01) for d in (0.0, 0.05, 0.10, 0.15, 0.20)]
    d = paired_difference(shifted, base)
    assert d["difference"] == pytest.approx(
        pool(shifted)["delta_ppl_pct"] - pool(base)["delta_ppl_pct"], rel=1e-12)
    lo, hi = d["ci95"]
    assert lo <= d["difference"] <= hi
    assert hi - lo < 0.15 * (pool(base)["delta_ppl_pct_ci95"][1] -
                             pool(base)["delta_ppl_pct_ci95"][0])
    same = paired_difference(base, base)
    assert same["difference"] == 0 and same["ci95"] == [0.0, 0.0]


def test_paired_difference_refuses_unpaired_runs():
    with pytest.raises(ValueError, match="3 windows against 2"):
        paired_difference([window(0, 0)] * 3, [window(0, 0)] * 2)


def test_compare_forward_pairs_the_floor_run_like_the_candidate(tmp_path):
    # compare_forward.py: the candidate and each floor run are paired with
    # the base window by window, the floor with its own interval.
    import json

    from compare_forward import compare

    def run(name, shifts):
        per_window = [dict(window(0.02 + s, 0.01), window=f"austen/{i}", index=i)
                      for i, s in enumerate(shifts)]
        path = tmp_path / name
        path.write_text(json.dumps({"rows": [
            {"scheme": "kivi4", "metric": "decode", "context": 512, "corpus": "all",
             "per_window": per_window}]}))
        return path, per_window

    base, bw = run("base.json", [0.0, 0.01, 0.02, 0.03])
    candidate, cw = run("candidate.json", [0.001, 0.011, 0.021, 0.031])
    floor, fw = run("floor.json", [0.002, 0.008, 0.022, 0.028])
    (row,) = compare(base, candidate, [floor], "all", 200, 1)
    assert row["difference"] == paired_difference(cw, bw, 200, 1)
    (f,) = row["floor"]
    assert f["run"] == "floor.json"
    assert f["difference"] == pytest.approx(paired_difference(fw, bw, 200, 1)["difference"])
    assert f["ci95"] == pytest.approx(paired_difference(fw, bw, 200, 1)["ci95"])
    assert row["floor_spread"] == pytest.approx(abs(f["difference"]))
