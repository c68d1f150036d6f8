"""Pooled ΔPPL and KL over evaluation windows with percentile bootstrap
intervals: kvq-eval's Pool (bench/eval/bootstrap.cc) for the engines that run
its protocol in Python (hf_eval.py) and for comparing two engines on the same
windows (compare_forward.py).

The definition is bootstrap.cc's: windows resampled with replacement, each
resample pooled by tokens (ΔPPL = expm1 of the summed NLL difference over the
summed scored positions), 95% percentile interval with linear interpolation
between ranks. The random stream is numpy's, not std::mt19937_64, so an
interval can differ from kvq-eval's in its last digits; the pooled values are
the same arithmetic.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def _quantile(sorted_values: np.ndarray, q: float) -> float:
    at = q * (len(sorted_values) - 1)
    lo = int(math.floor(at))
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (at - lo) * (sorted_values[hi] - sorted_values[lo]))


def pool(windows: Sequence[dict], resamples: int = 1000, seed: int = 1) -> dict:
    """windows: {"nll", "ref_nll", "kl", "tokens"} per window (sums over the
    window's scored positions). Returns delta_ppl_pct and kl_mean, and with
    at least two windows their 95% intervals (delta_ppl_pct_ci95,
    kl_mean_ci95)."""
    dnll = np.array([w["nll"] - w["ref_nll"] for w in windows], np.float64)
    kl = np.array([w["kl"] for w in windows], np.float64)
    scored = np.array([w["tokens"] for w in windows], np.float64)
    total = scored.sum()
    out = {"delta_ppl_pct": 100.0 * math.expm1(dnll.sum() / total) if total else 0.0,
           "kl_mean": kl.sum() / total if total else 0.0}
    if len(windows) < 2 or resamples < 1:
        return out
    pick = np.random.default_rng(seed).integers(0, len(windows), (resamples, len(windows)))
    n = scored[pick].sum(axis=1)
    dppl = np.sort(100.0 * np.expm1(dnll[pick].sum(axis=1) / n))
    kls = np.sort(kl[pick].sum(axis=1) / n)
    out["delta_ppl_pct_ci95"] = [_quantile(dppl, 0.025), _quantile(dppl, 0.975)]
    out["kl_mean_ci95"] = [_quantile(kls, 0.025), _quantile(kls, 0.975)]
    return out


def paired_difference(a: Sequence[dict], b: Sequence[dict], resamples: int = 1000,
                      seed: int = 1) -> dict:
    """Pooled ΔPPL of engine a minus that of engine b on the same windows
    (a[i] and b[i] are one window), with the 95% interval of the difference
    over window resamples taken jointly from both (each resample keeps the
    pairs): how far apart two engines are beyond their shared window noise."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference: {len(a)} windows against {len(b)}")

    def dppl(ws, pick):
        dnll = np.array([w["nll"] - w["ref_nll"] for w in ws], np.float64)
        scored = np.array([w["tokens"] for w in ws], np.float64)
        return 100.0 * np.expm1(dnll[pick].sum(axis=-1) / scored[pick].sum(axis=-1))

    everything = np.arange(len(a))
    out = {"difference": float(dppl(a, everything) - dppl(b, everything))}
    if len(a) >= 2 and resamples >= 1:
        pick = np.random.default_rng(seed).integers(0, len(a), (resamples, len(a)))
        diffs = np.sort(dppl(a, pick) - dppl(b, pick))
        out["ci95"] = [_quantile(diffs, 0.025), _quantile(diffs, 0.975)]
    return out
