#!/usr/bin/env python3
"""Measures llama.cpp's own quantized KV caches on kvq-eval's windows.

The peer of kvq-eval: the same model (SmolLM2-135M-Instruct, GGUF Q4_1), the
same token windows, and llama.cpp's cache types f16, q8_0, q5_0 and q4_0 in
place of kvq's schemes, so ΔPPL and KL divergence can be compared scheme for
scheme.

Input: a windows file written by kvq-eval,
  {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "model_sha256": "...",
   "chunk": 512,
   "windows": [{"corpus": "kjv", "context": 2048, "index": 0,
                "tokens": [int, ...]}, ...]}
Each window is evaluated exactly as given (no BOS is added) with flash
attention on, n_ctx = the window's context, n_batch = n_ubatch = chunk, and
logits for every position. Per window:
  NLL = mean over i = 1..N-1 of -log softmax(logits[i-1])[tokens[i]]
computed in float64 from the logits, and for q8_0/q4_0 the mean over the
same positions of KL(p_f16 || p_quant) of the next-token distributions.

Output (stdout, or --out, rewritten after every window): rows per (cache
type, corpus, context), windows pooled by tokens, ppl = exp(mean NLL):
  {"tool": "llama.cpp", "version": "...", "rows": [{"engine": "llama.cpp",
   "scheme": "q4_0", "metric": "decode", "metrics": ["decode", "prefill"],
   "corpus": "kjv", "context": 2048, "windows": 2,
   "tokens_scored": 4094, "nll": 2.1, "ppl": 8.2, "delta_ppl_pct": 1.3,
   "kl_mean": 0.01, "delta_ppl_pct_ci95": [0.9, 1.7],
   "kl_mean_ci95": [0.008, 0.012], "bits_per_element": 4.5,
   "prefill_ms": 1234.0, "per_window": [...]}]}
prefill_ms is the mean wall time of one window's forward pass (the decode
calls only, not the log-softmax arithmetic done here). The intervals are
95% percentile bootstrap intervals over windows (as kvq-eval's), present
with at least two windows; per_window keeps each window's sums paired with
the f16 run on it ({"window": "corpus/index", "index", "nll", "ref_nll",
"kl", "tokens"}, kvq-eval's format), so --merge and quality_tables.py
--frontier recompute them and compare_forward.py pairs them by "window".

Both metrics at once: llama.cpp writes every token's K/V into its quantized
cache before any query attends (a ubatch is stored, then attended), and
keeps no fp16 window, so chunked prefill and token-by-token decoding give
every query the same cache state (up to float summation order). Each row
says so: "metric" is "decode" and "metrics" lists both.

Run it through scripts/run_llamacpp_peer.sh, which installs llama-cpp-python.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pooling import pool  # noqa: E402

# ggml's block formats: q8_0 is 32 int8 + one fp16 scale per block (34 bytes
# for 32 elements), q5_0 32 nibbles, 32 high bits and one fp16 scale (22
# bytes), q4_0 32 nibbles + one fp16 scale (18 bytes).
CACHE_TYPES = {
    "f16": ("GGML_TYPE_F16", 16.0),
    "q8_0": ("GGML_TYPE_Q8_0", 8.5),
    "q5_0": ("GGML_TYPE_Q5_0", 5.5),
    "q4_0": ("GGML_TYPE_Q4_0", 4.5),
}
REFERENCE = "f16"
# The metrics each row stands for (see the module docstring).
METRICS = ["decode", "prefill"]
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 1


def log(msg: str) -> None:
    """Progress on stderr (stdout may carry the JSON)."""
    print(f"llamacpp_peer: {msg}", file=sys.stderr, flush=True)


def default_data_dir() -> Path:
    """The eval data directory, resolved as scripts/fetch_eval_data.sh does."""
    if os.environ.get("KVQ_EVAL_DATA"):
        return Path(os.environ["KVQ_EVAL_DATA"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "kvq" / "eval"
    return Path.home() / ".cache" / "kvq" / "eval"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_window_order(ap: argparse.ArgumentParser, text: str) -> list[int]:
    """--window-order's indices; a malformed list is a usage error."""
    try:
        order = [int(i) for i in text.split(",") if i]
    except ValueError:
        ap.error(f"--window-order: want comma-separated window indices, got {text[:40]!r}")
    if len(set(order)) != len(order) or any(i < 0 for i in order):
        ap.error("--window-order: each index once, none negative")
    return order


def select_windows(windows: list[dict], max_windows: int | None,
                   max_context: int | None, order: list[int] | None = None) -> list[dict]:
    """At most max_windows per (corpus, context), lowest indices first.

    With `order` (window indices, as kvq-eval's --window_order), each
    (corpus, context) takes its windows in that order (indices not listed
    after it, lowest first), and the windows of one context run rank by
    rank across the corpora: a run stopped early (the result file is
    rewritten after every window) then holds the same windows of every
    corpus, the first ones kvq-eval's frontier runs score.
    """
    def rank(w: dict) -> tuple[int, int]:
        i = w["index"]
        return (order.index(i), 0) if order and i in order else (len(order or []), i)

    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for w in windows:
        if max_context is None or w["context"] <= max_context:
            groups[(w["corpus"], w["context"])].append(w)
    out = []
    for key in sorted(groups, key=lambda k: (k[1], k[0])):
        ws = sorted(groups[key], key=rank)
        out.extend(ws if max_windows is None else ws[:max_windows])
    if order:
        # list.sort is stable: corpora keep their sorted order within a rank.
        out.sort(key=lambda w: (w["context"], rank(w)))
    return out


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    x -= m
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x


def bootstrap(per_window: list[dict], resamples: int = BOOTSTRAP_RESAMPLES,
              seed: int = BOOTSTRAP_SEED):
    """95% percentile intervals of pooled ΔPPL (%) and mean KL over
    resamples of the windows with replacement (kvq-eval's method,
    pooling.pool), or None with fewer than two windows. Each window: nll,
    ref_nll, kl (sums over its scored positions) and tokens."""
    if len(per_window) < 2:
        return None
    pooled = pool(per_window, resamples, seed)
    return pooled["delta_ppl_pct_ci95"], pooled["kl_mean_ci95"]


def window_sums(window: dict, nll: float, ref_nll: float, kl: float) -> dict:
    """One window's entry of a row's per_window, in kvq-eval's format: its
    id "corpus/index" (which pairs it with another engine's run of the same
    windows file), its index, and its sums over the scored positions (all
    but the first token) beside the f16 reference's."""
    return {"window": f"{window['corpus']}/{window['index']}", "index": window["index"],
            "nll": nll, "ref_nll": ref_nll, "kl": kl, "tokens": len(window["tokens"]) - 1}


class Evaluator:
    """One llama.cpp context for one cache type and one context length."""

    def __init__(self, llama_cpp, model: Path, cache_type: str, n_ctx: int,
                 chunk: int, threads: int):
        from llama_cpp import Llama

        self.lc = llama_cpp
        ggml_type = getattr(llama_cpp, CACHE_TYPES[cache_type][0])
        # logits_all stays off: the high-level API would then keep an
        # n_ctx x n_vocab float32 array (1.6 GB at 8k); the logits are read
        # chunk by chunk from the context instead.
        self.llm = Llama(model_path=str(model), n_ctx=n_ctx, n_batch=chunk,
                         n_ubatch=chunk, n_threads=threads,
                         n_threads_batch=threads, flash_attn=True,
                         type_k=ggml_type, type_v=ggml_type, logits_all=False,
                         n_gpu_layers=0, verbose=False)
        self.ctx = self.llm.ctx
        self.n_ctx = n_ctx
        self.chunk = chunk
        self.n_vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(chunk, 0, 1)

    def close(self) -> None:
        """Frees the batch and the context."""
        self.lc.llama_batch_free(self.batch)
        self.llm.close()

    def _clear_cache(self) -> None:
        """Empties the KV cache (the API's name has changed across versions)."""
        lc = self.lc
        if hasattr(lc, "llama_memory_clear"):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        elif hasattr(lc, "llama_kv_self_clear"):
            lc.llama_kv_self_clear(self.ctx)
        else:
            lc.llama_kv_cache_clear(self.ctx)

    def run(self, tokens: list[int]):
        """Yields (start, logits float32 [n, vocab]) chunk by chunk, and
        finally the decode wall time in seconds as ("time", seconds)."""
        if len(tokens) > self.n_ctx:
            raise ValueError(f"window of {len(tokens)} tokens > n_ctx {self.n_ctx}")
        self._clear_cache()
        lc = self.lc
        elapsed = 0.0
        for start in range(0, len(tokens), self.chunk):
            part = tokens[start:start + self.chunk]
            b = self.batch
            b.n_tokens = len(part)
            for i, tok in enumerate(part):
                b.token[i] = tok
                b.pos[i] = start + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = 1
            t0 = time.perf_counter()
            rc = lc.llama_decode(self.ctx, b)
            if hasattr(lc, "llama_synchronize"):
                lc.llama_synchronize(self.ctx)
            elapsed += time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} at {start}")
            ptr = lc.llama_get_logits(self.ctx)
            arr = np.ctypeslib.as_array(
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                shape=(len(part), self.n_vocab))
            yield start, arr
        yield "time", elapsed


def evaluate_window(ev: Evaluator, tokens: list[int],
                    ref_logp: np.ndarray | None, keep_logp: bool):
    """NLL sum, KL sum against ref_logp, decode seconds, and (if keep_logp)
    the float32 log-probs of positions 0..N-2."""
    n = len(tokens)
    targets = np.asarray(tokens, dtype=np.int64)
    nll_sum = 0.0
    kl_sum = 0.0
    seconds = 0.0
    logp_keep = (np.empty((n - 1, ev.n_vocab), dtype=np.float32)
                 if keep_logp else None)
    for start, logits in ev.run(tokens):
        if start == "time":
            seconds = logits
            continue
        # Position i predicts token i+1; the window's last position predicts
        # nothing that is scored.
        rows = min(len(logits), n - 1 - start)
        if rows <= 0:
            continue
        logp = log_softmax64(logits[:rows])
        idx = np.arange(rows)
        nll_sum -= float(logp[idx, targets[start + 1:start + 1 + rows]].sum())
        if logp_keep is not None:
            logp_keep[start:start + rows] = logp
        if ref_logp is not None:
            ref = ref_logp[start:start + rows].astype(np.float64)
            kl_sum += float((np.exp(ref) * (ref - logp)).sum())
    return nll_sum, kl_sum, seconds, logp_keep


def result_rows(acc: dict) -> list[dict]:
    """Rows per (cache type, corpus, context) and pooled over corpora.

    acc maps (cache type, corpus, context) to sums over windows: windows,
    tokens, nll, kl, seconds, and optionally per_window (each window's nll,
    ref_nll, kl and tokens, for the bootstrap intervals). The pooled "all"
    row of a cache type is made only where it covers the same corpora as
    the reference, so its change against the reference compares the same
    tokens.
    """
    acc = dict(acc)
    pooled: dict = {}
    for (c, corpus, context), a in list(acc.items()):
        p = pooled.setdefault((c, "all", context),
                              {"nll": 0.0, "kl": 0.0, "seconds": 0.0, "tokens": 0,
                               "windows": 0, "corpora": set(), "per_window": []})
        for k in ("nll", "kl", "seconds", "tokens", "windows"):
            p[k] += a[k]
        p["per_window"].extend(a.get("per_window", []))
        p["corpora"].add(corpus)
    for (c, _, context), p in pooled.items():
        if p["corpora"] == pooled[(REFERENCE, "all", context)]["corpora"]:
            acc[(c, "all", context)] = p

    rows = []
    for (c, corpus, context), a in sorted(
            acc.items(), key=lambda kv: (list(CACHE_TYPES).index(kv[0][0]),
                                         kv[0][1], kv[0][2])):
        nll = a["nll"] / a["tokens"]
        per_window = a.get("per_window", [])
        # Every window of the row with its sums: the change and its intervals
        # against f16 on the row's own windows (a merged run may cover fewer
        # than the reference), pooled as kvq-eval pools them.
        pooled = (pool(per_window, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)
                  if per_window and len(per_window) == a["windows"] else None)
        if pooled:
            delta = pooled["delta_ppl_pct"]
        else:
            ref = acc[(REFERENCE, corpus, context)]
            delta = (math.exp(nll) / math.exp(ref["nll"] / ref["tokens"]) - 1.0) * 100.0
        row = {
            "engine": "llama.cpp", "scheme": c, "metric": METRICS[0],
            "metrics": METRICS, "corpus": corpus,
            "context": context, "windows": a["windows"],
            "tokens_scored": a["tokens"], "nll": nll, "ppl": math.exp(nll),
            "delta_ppl_pct": delta,
            "kl_mean": a["kl"] / a["tokens"],
            "bits_per_element": CACHE_TYPES[c][1],
            "prefill_ms": a["seconds"] * 1e3 / a["windows"],
        }
        if pooled and "delta_ppl_pct_ci95" in pooled:
            row["delta_ppl_pct_ci95"] = pooled["delta_ppl_pct_ci95"]
            row["kl_mean_ci95"] = pooled["kl_mean_ci95"]
        if corpus != "all" and per_window:
            row["per_window"] = per_window
        rows.append(row)
    return rows


def add_fresh_windows(into: dict, row: dict, fresh: list[dict]) -> None:
    """Adds to `into` the windows `fresh` of `row` (sums as merge_results
    builds them): their own sums, and the row's mean prefill time each, as
    a row keeps no per-window time."""
    into["windows"] += len(fresh)
    into["tokens"] += sum(w["tokens"] for w in fresh)
    into["nll"] += sum(w["nll"] for w in fresh)
    into["kl"] += sum(w["kl"] for w in fresh)
    into["seconds"] += row["seconds"] / row["windows"] * len(fresh)
    into["per_window"] += fresh


def merge_results(paths: list[Path]) -> dict:
    """Combines result files of disjoint windows: one corpus per run, or
    the windows of one corpus split over runs.

    The per-corpus rows carry everything the sums need (mean NLL and KL
    times tokens, mean prefill time times windows); the pooled rows are
    recomputed from them. Two rows of one (cache type, corpus, context) add
    up only when both list their windows (per_window). A window in both
    counts once, and only if both measured it exactly alike: llama.cpp at a
    fixed thread count is deterministic, so a run of one more cache type
    repeats the f16 reference bit for bit; anything else is refused.
    """
    acc: dict = {}
    version = None
    for path in paths:
        result = json.loads(path.read_text())
        if version is not None and result["version"] != version:
            raise ValueError(f"{path}: llama.cpp {result['version']}, an earlier file "
                             f"has {version}")
        version = result["version"]
        for r in result["rows"]:
            if r["corpus"] == "all":
                continue
            key = (r["scheme"], r["corpus"], r["context"])
            sums = {"windows": r["windows"], "tokens": r["tokens_scored"],
                    "nll": r["nll"] * r["tokens_scored"],
                    "kl": r["kl_mean"] * r["tokens_scored"],
                    "seconds": r["prefill_ms"] / 1e3 * r["windows"],
                    "per_window": r.get("per_window", [])}
            if key not in acc:
                acc[key] = sums
                continue
            seen = {w["window"]: w for w in acc[key]["per_window"]}
            if not seen or not sums["per_window"]:
                raise ValueError(f"{path}: {key} is in two files without their windows")
            fresh = []
            for w in sums["per_window"]:
                if w["window"] not in seen:
                    fresh.append(w)
                elif w != seen[w["window"]]:
                    raise ValueError(f"{path}: {key} is in two files with window "
                                     f"{w['window']} in both, measured differently")
            add_fresh_windows(acc[key], sums, fresh)
    return {"tool": "llama.cpp", "version": version, "rows": result_rows(acc)}


def main(argv: list[str]) -> int:
    """Evaluates every selected window under every cache type."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("windows", type=Path, help="windows JSON from kvq-eval")
    ap.add_argument("--out", type=Path, help="result JSON (default: stdout)")
    ap.add_argument("--model", type=Path,
                    help="GGUF model (default: the windows file's model in "
                         "the eval data directory)")
    ap.add_argument("--max-windows", type=int,
                    help="at most N windows per (corpus, context)")
    ap.add_argument("--quick", action="store_true",
                    help="one window per (corpus, context), contexts <= 2048")
    ap.add_argument("--window-order", default="",
                    help="comma-separated window indices: each corpus's windows in "
                         "this order, rank by rank across the corpora (kvq-eval's "
                         "--window_order; run_frontier.sh passes its own)")
    ap.add_argument("--cache-types", default=",".join(CACHE_TYPES),
                    help="comma-separated subset of f16,q8_0,q5_0,q4_0 (f16 "
                         "is always run: it is the reference)")
    ap.add_argument("--threads", type=int,
                    default=len(os.sched_getaffinity(0)))
    ap.add_argument("--merge", type=Path, nargs="+", metavar="RESULT",
                    help="instead of evaluating, combine result files (the "
                         "positional argument is then the first of them); a "
                         "window in two files counts once, and only if both "
                         "measured it alike")
    args = ap.parse_args(argv)

    if args.merge:
        text = json.dumps(merge_results([args.windows] + args.merge), indent=2) + "\n"
        if args.out:
            args.out.write_text(text)
        else:
            sys.stdout.write(text)
        return 0

    import llama_cpp

    spec = json.loads(args.windows.read_text())
    chunk = int(spec["chunk"])
    model = args.model or default_data_dir() / spec["model"]
    if not model.is_file():
        ap.error(f"model {model} not found (scripts/fetch_eval_data.sh)")
    if spec.get("model_sha256"):
        got = sha256_file(model)
        if got != spec["model_sha256"]:
            ap.error(f"{model}: sha256 {got}, windows file says "
                     f"{spec['model_sha256']}")

    cache_types = [c for c in args.cache_types.split(",") if c]
    for c in cache_types:
        if c not in CACHE_TYPES:
            ap.error(f"unknown cache type {c}")
    cache_types = [REFERENCE] + [c for c in cache_types if c != REFERENCE]

    max_windows = 1 if args.quick else args.max_windows
    if args.quick and args.max_windows is not None:
        max_windows = min(1, args.max_windows)
    order = parse_window_order(ap, args.window_order)
    windows = select_windows(spec["windows"], max_windows,
                             2048 if args.quick else None, order)
    if not windows:
        ap.error("no windows selected")
    log(f"llama-cpp-python {llama_cpp.__version__}, {len(windows)} windows, "
        f"cache types {cache_types}, {args.threads} threads, chunk {chunk}")

    # (scheme, corpus, context) -> sums.
    acc: dict[tuple[str, str, int], dict] = defaultdict(
        lambda: {"windows": 0, "tokens": 0, "nll": 0.0, "kl": 0.0,
                 "seconds": 0.0, "per_window": []})
    for context in sorted({w["context"] for w in windows}):
        group = [w for w in windows if w["context"] == context]
        evaluators = {c: Evaluator(llama_cpp, model, c, context, chunk,
                                   args.threads) for c in cache_types}
        try:
            for w in group:
                tokens = [int(t) for t in w["tokens"]]
                if len(tokens) < 2:
                    continue
                bad = [t for t in tokens if not 0 <= t < evaluators[REFERENCE].n_vocab]
                if bad:
                    raise ValueError(f"{w['corpus']}/{context}/{w['index']}: "
                                     f"token {bad[0]} out of range")
                ref_logp = None
                ref_nll = 0.0
                for c in cache_types:
                    nll, kl, secs, logp = evaluate_window(
                        evaluators[c], tokens, ref_logp,
                        keep_logp=(c == REFERENCE and len(cache_types) > 1))
                    if c == REFERENCE:
                        ref_logp = logp
                        ref_nll = nll
                    a = acc[(c, w["corpus"], context)]
                    a["windows"] += 1
                    a["tokens"] += len(tokens) - 1
                    a["nll"] += nll
                    a["kl"] += kl
                    a["seconds"] += secs
                    a["per_window"].append(window_sums(w, nll, ref_nll, kl))
                    log(f"{c:5s} {w['corpus']}/{context}/{w['index']}: "
                        f"ppl {math.exp(nll / (len(tokens) - 1)):.4f} "
                        f"kl {kl / (len(tokens) - 1):.6f} {secs * 1e3:.0f} ms")
                del ref_logp
                if args.out:  # What has run so far, should the run stop.
                    write_result({"tool": "llama.cpp", "version": llama_cpp.__version__,
                                  "rows": result_rows(acc)}, args.out)
        finally:
            for ev in evaluators.values():
                ev.close()

    rows = result_rows(acc)
    write_result({"tool": "llama.cpp", "version": llama_cpp.__version__, "rows": rows},
                 args.out)
    return 0


def write_result(result: dict, out: Path | None) -> None:
    """The result JSON into `out`, or onto stdout."""
    text = json.dumps(result, indent=2) + "\n"
    if out:
        out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
