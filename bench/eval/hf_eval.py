#!/usr/bin/env python3
"""kvq-eval's protocol on any model transformers loads, its KV cache in kvq.

The transformers mode of kvq-eval (docs/QUALITY.md): the model's own forward
pass (transformers), every attention layer's K/V stored in a kvq scheme
measured as kvq-eval measures its C++ forward pass, in two metrics:

  decode (the headline): every position of the window scored with the cache
  state token-by-token decoding gives it, in one forward pass whose
  attention reads each token's fp16 or quantized form as decoding would
  (DecodeFaithfulPass, kvq streams appended token by token);

  prefill, through kvq.hf.KvqCache and kvq's fused attention: per window
  of C tokens, prefill the first C - G tokens in `chunk`-token
  chunks; on a second cache holding the same prefix, decode G tokens one at
  a time (greedy for fp16, teacher-forced on fp16's tokens otherwise: top-1
  agreement, decode ms/token); prefill the rest of the window on the first
  cache; perplexity over the C - 1 next-token predictions, ΔPPL and
  KL(p_fp16 || p_scheme) against the fp16 cache, the allocation by
  component with the whole window stored; then the passkey probe.

The protocol comes from one place, kvq-eval: `kvq-eval --dump_windows=W.json`
writes the windows (token ids), the chunk, the decode length, the metrics,
the bootstrap settings and the passkey prompts, and this reads them (as the llama.cpp peer does), so a SmolLM2 run
here is on exactly the C++ run's windows. For a model with another tokenizer,
--corpora/--contexts select windows by kvq-eval's rule (evenly spaced inside
the corpus, never at its start) with that tokenizer, and the passkey prompts
are built from the texts in W.json; tests/python/test_hf_eval.py checks that
both give kvq-eval's own windows and prompts with SmolLM2's tokenizer.

  kvq-eval --contexts=512 --windows=5 --passkey_contexts= --dump_windows=w.json --dump_only
  python3 bench/eval/hf_eval.py w.json --schemes=fp16,int8,kivi4 --out=hf.json
  python3 bench/eval/hf_eval.py w.json --model=HuggingFaceTB/SmolLM2-360M \\
      --corpora=austen --contexts=2048 --schemes=fp16,kivi4

Needs torch and transformers (KVQ_WITH_TORCH=1 scripts/install_deps.sh) and
the kvq package (pip install .).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_peer import (default_data_dir, parse_window_order,  # noqa: E402
                           select_windows as pick_windows, write_result)
from pooling import pool  # noqa: E402

VOLATILE_NOTE = "prefill_ms and decode_ms_per_token are wall time on this machine"


def log(msg: str) -> None:
    print(f"hf_eval: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------- windows and prompts

def corpus_prefix_bytes(max_context: int, windows: int) -> int:
    """Bytes of a corpus kvq-eval tokenizes for its windows (about 4 bytes a
    token, with room; at least 1 MiB): eval_main.cc."""
    return max(max_context * (windows + 1) * 8, 1 << 20)


def select_windows(tokens: list[int], context: int, count: int) -> list[list[int]]:
    """kvq-eval's MakeWindows: `count` windows evenly spaced inside the
    corpus, the i-th starting at room * (i + 1) // (count + 1)."""
    room = len(tokens) - context
    if room < 0:
        return []
    return [tokens[room * (i + 1) // (count + 1):][:context] for i in range(count)]


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens (a transformers tokenizer,
    or a `tokenizers.Tokenizer` without a post-processor)."""
    if callable(tokenizer):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer.encode(text).ids)


def passkey_prompt(tokenizer, texts: dict, context: int, depth: float, key: str) -> list[int]:
    """kvq-eval's MakePasskeyPrompt with this tokenizer and the key kvq-eval
    drew (texts: the "passkey" object of a windows file)."""
    intro = encode(tokenizer, texts["intro"])
    n = texts["needle"]
    needle = encode(tokenizer, f"{n[0]}{key}{n[1]}{key}{n[2]}")
    question = encode(tokenizer, texts["question"])
    filler = encode(tokenizer, texts["filler"])
    budget = context - (len(intro) + len(needle) + len(question))
    units = max(0, budget // len(filler))
    before = int(math.floor(depth * units + 0.5))  # std::lround for depth >= 0.
    out = list(intro)
    for u in range(units):
        if u == before:
            out += needle
        out += filler
    if before >= units:
        out += needle
    return out + question


# ---------------------------------------------------------------- numerics

# Rows per block of the row-wise numerics: a window's logits over a large
# vocabulary (Gemma 3: 262144) in double would take gigabytes at once.
ROW_BLOCK = 128


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise, double accumulation, float32 out (eval_runner.cc LogSoftmax)."""
    out = np.empty(logits.shape, np.float32)
    for b in range(0, logits.shape[0], ROW_BLOCK):
        x = logits[b:b + ROW_BLOCK].astype(np.float64)
        m = x.max(axis=-1, keepdims=True)
        lse = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
        out[b:b + ROW_BLOCK] = x - lse
    return out


def kl_rows(ref: np.ndarray, lp: np.ndarray) -> float:
    """Sum over rows of max(0, KL(ref || lp)) in double."""
    total = 0.0
    for b in range(0, ref.shape[0], ROW_BLOCK):
        r = ref[b:b + ROW_BLOCK].astype(np.float64)
        kl = (np.exp(r) * (r - lp[b:b + ROW_BLOCK].astype(np.float64))).sum(axis=-1)
        total += float(np.maximum(kl, 0.0).sum())
    return total


# ------------------------------------------------------------------- model

class Runner:
    """A transformers causal LM and kvq caches for it."""

    def __init__(self, model, codebooks=None, calibration=None):
        import torch

        self.torch = torch
        self.model = model
        self.vocab = model.config.get_text_config(decoder=True).vocab_size
        from kvq.calibrate import layer_rope_theta
        from kvq.hf import model_geometry

        self.geometry = model_geometry(model.config)
        # Per layer: models with per-layer-type RoPE (Gemma 3) have no one theta.
        self.rope_thetas = [layer_rope_theta(model.config, layer)
                            for layer in range(self.geometry["num_layers"])]
        # The crq schemes' kvq.Calibration (--calibration_file / computed).
        self.calibration = calibration

    def cache(self, scheme: str):
        from kvq.hf import KvqCache

        return KvqCache(self.model.config, scheme)

    def forward(self, tokens, cache, all_logits: bool) -> tuple[np.ndarray, float]:
        """Logits (float32 [n, vocab], or [1, vocab] for the last token) and
        seconds of the forward pass. cache None: a pass without a cache (the
        decode metric's, whose attention keeps its own kvq streams)."""
        torch = self.torch
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_ids=ids, cache=cache, use_cache=cache is not None,
                             logits_to_keep=0 if all_logits else 1)
        seconds = time.perf_counter() - t0
        return out.logits[0].float().numpy(), seconds


def score_span(runner: Runner, window: list[int], cache, begin: int, end: int, step: int,
               r: dict, reference: dict | None, keep: np.ndarray | None,
               score: bool = True) -> np.ndarray | None:
    """Runs window[begin:end] through `cache` in forward steps of `step`
    tokens; with `score`, adds each position's NLL of the next token (and KL
    against `reference`'s log-probabilities, or keeps them in `keep`) to
    `r`. Returns the log-probabilities after token window[end - 1]."""
    C = len(window)
    last_lp = None
    for pos in range(begin, end, step):
        n = min(step, end - pos)
        logits, s = runner.forward(window[pos:pos + n], cache, all_logits=score)
        if not score:
            continue
        r["prefill_s"] += s
        rows = max(0, min(n, C - 1 - pos))  # Positions with a next token to score.
        r["scored"] += rows
        # A block of rows at a time: the step's log-probabilities are never
        # all held at once (2 GB for 2048 positions of a 262k vocabulary).
        for b in range(0, n, ROW_BLOCK):
            lp = log_softmax(logits[b:b + ROW_BLOCK])
            e = min(b + ROW_BLOCK, rows)
            if e > b:
                k = e - b
                r["nll"] -= float(lp[np.arange(k), np.asarray(window[pos + 1 + b:pos + 1 + e])]
                                  .astype(np.float64).sum())
                if reference:
                    r["kl"] += kl_rows(reference["logprobs"][pos + b:pos + e], lp[:k])
                else:
                    keep[pos + b:pos + e] = lp[:k]
            if b <= end - 1 - pos < b + len(lp):
                last_lp = lp[end - 1 - pos - b].copy()
    return last_lp


def new_result(C: int) -> dict:
    return {"nll": 0.0, "scored": 0, "kl": 0.0, "agree": 0, "generated": 0, "prefill_s": 0.0,
            "decode_s": [], "tokens": C}


DECODE_ATTENTION = "kvq_decode_faithful"
_decode_state = threading.local()


class DecodeFaithfulPass:
    """kvq-eval's decode metric in one forward pass over the window, the
    transformers way: an attention function ("kvq_decode_faithful") that,
    for every layer, appends the window's K/V to a kvq stream one token at a
    time (what decoding does), records after each token which tokens the
    stream holds quantized (sink, flushes of the fp16 tail), and lets each
    query p attend over the keys and values in the form they had once token
    p was in: the token's fp16 tail form until the stream quantized it, its
    quantized form after (a quantized token never changes). Scores and
    softmax are torch's fp32 arithmetic, not kvq's kernel; the stored forms
    are read back from the kvq stream (kvq.KvLayer.read). This is the
    construction of kvq-eval's DecodeFaithfulCache (decode_cache.cc), whose
    test proves it equal to token-by-token decoding."""

    def __init__(self, scheme: str, geometry: dict, chunk: int, calibration=None,
                 rope_thetas: list | None = None):
        from kvq import _native
        from kvq.hf import _InverseRope, _is_pre_rope

        self.native = _native
        self.scheme = scheme
        self.geometry = geometry
        self.chunk = chunk
        self.calibration = calibration
        # Each layer's RoPE base (one for all layers unless the model has
        # per-layer-type RoPE): kvq re-applies it to pre_rope keys.
        self.rope_thetas = rope_thetas or [geometry["rope_theta"]] * geometry["num_layers"]
        self.pre_rope = _is_pre_rope(scheme)
        self.inverse_ropes = {theta: _InverseRope(theta, geometry["head_dim"])
                              for theta in set(self.rope_thetas)
                              if self.pre_rope and theta is not None}
        self.stores: dict = {}

    def attend(self, layer: int, query, key, value, scaling: float,
               sliding_window: int | None = None):
        """query [1, q_heads, n, d], key/value [1, kv_heads, n, d] (post-RoPE,
        positions 0..n-1): attention output [1, n, q_heads, d]. With
        `sliding_window` W (a sliding-window layer), query p sees keys j with
        p - W < j <= p, as transformers masks such a layer
        (masking_utils.sliding_window_overlay); the stream still stores
        every token, as a decode cache holding the window would hold its
        tokens in the same forms."""
        import torch

        g = self.geometry
        theta = self.rope_thetas[layer]
        kwargs = {"backend": "cpu"}
        if theta is not None:
            kwargs["rope_theta"] = theta
        if self.calibration is not None:
            kwargs["calibration"] = self.calibration
            kwargs["calibration_layer"] = layer
        store = self.native.KvLayer(self.scheme, g["num_kv_heads"], g["head_dim"], **kwargs)
        self.stores[layer] = store
        k = key[0].detach().to(torch.float32)
        if self.pre_rope and theta is not None:
            k = self.inverse_ropes[theta](k, 0)
        k = k.contiguous().numpy()
        v = value[0].detach().to(torch.float32).contiguous().numpy()
        n = k.shape[1]
        fresh_k = np.empty(k.shape, np.float32)
        fresh_v = np.empty(v.shape, np.float32)
        q_begin = np.zeros(n, np.int64)  # Tokens [q_begin, q_end) are quantized once p is in.
        q_end = np.zeros(n, np.int64)
        for p in range(n):
            store.append(k[:, p:p + 1], v[:, p:p + 1])
            fk, fv = store.read(p, p + 1)
            fresh_k[:, p:p + 1] = np.asarray(fk)
            fresh_v[:, p:p + 1] = np.asarray(fv)
            q_begin[p] = store.sink_tokens
            q_end[p] = store.sink_tokens + store.quantized_tokens
        final_k, final_v = (torch.from_numpy(np.ascontiguousarray(x))
                            for x in store.read(0, n))
        fresh_k, fresh_v = torch.from_numpy(fresh_k), torch.from_numpy(fresh_v)
        groups = g["num_q_heads"] // g["num_kv_heads"]
        expand = (lambda t: t.repeat_interleave(groups, dim=0))
        fk, fv, dk, dv = expand(fresh_k), expand(fresh_v), expand(final_k), expand(final_v)
        q = query[0].detach().to(torch.float32)
        j = torch.arange(n)
        out = torch.empty_like(q)
        for b in range(0, n, self.chunk):
            e = min(n, b + self.chunk)
            # The keys some query of the chunk sees: [lo, e).
            lo = max(0, b - sliding_window + 1) if sliding_window else 0
            cols = j[lo:e]
            rows = torch.arange(b, e)
            quantized = ((cols[None, :] >= torch.from_numpy(q_begin[b:e])[:, None]) &
                         (cols[None, :] < torch.from_numpy(q_end[b:e])[:, None]))
            # Each form's scores only on the keys some query reads in it:
            # the fresh (fp16 tail) form is a few hundred keys per chunk.
            q_cols = lo + torch.nonzero(quantized.any(dim=0)).flatten()
            f_cols = lo + torch.nonzero(~quantized.all(dim=0)).flatten()
            qb = q[:, b:e]
            scores = torch.empty(qb.shape[0], e - b, e - lo)
            scores[:, :, f_cols - lo] = qb @ fk[:, f_cols].transpose(1, 2)
            if len(q_cols):
                at = q_cols - lo
                scores[:, :, at] = torch.where(quantized[:, at],
                                               qb @ dk[:, q_cols].transpose(1, 2),
                                               scores[:, :, at])
            scores *= scaling
            hidden = cols[None, :] > rows[:, None]
            if sliding_window:
                hidden |= cols[None, :] <= rows[:, None] - sliding_window
            scores = scores.masked_fill(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            zero = torch.zeros((), dtype=probs.dtype)
            out[:, b:e] = (torch.where(quantized, zero, probs)[:, :, f_cols - lo] @ fv[:, f_cols]
                           + torch.where(quantized, probs, zero)[:, :, q_cols - lo]
                           @ dv[:, q_cols])
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype)

    def bytes_by_component(self) -> dict:
        total: dict = {}
        for store in self.stores.values():
            for name, b in dict(store.bytes_by_component()).items():
                total[name] = total.get(name, 0) + b
        return total


def _decode_faithful_attention(module, query, key, value, attention_mask, scaling=None,
                               dropout=0.0, **kwargs):
    state = getattr(_decode_state, "current", None)
    if state is None:
        raise ValueError(f'attn_implementation "{DECODE_ATTENTION}" runs inside '
                         "hf_eval.run_decode_metric")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    sliding_window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    return state.attend(module.layer_idx, query, key, value, scaling, sliding_window), None


def _no_mask(*args, **kwargs):
    return None  # Causal by construction in DecodeFaithfulPass.attend.


def register_decode_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DECODE_ATTENTION, _decode_faithful_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, _no_mask)


def run_decode_metric(runner: Runner, window: list[int], scheme: str, chunk: int,
                      reference: dict | None) -> dict:
    """kvq-eval's decode metric (decode_metric.cc RunScoredWindow on a
    DecodeFaithfulCache): every position scored with the cache state
    token-by-token decoding gives it, teacher-forced on the window, in one
    forward pass (DecodeFaithfulPass). With reference None this is the fp16
    run and the result carries "reference"."""
    C = len(window)
    r = new_result(C)
    keep = None if reference else np.zeros((C - 1, runner.vocab), np.float32)
    state = DecodeFaithfulPass(scheme, runner.geometry, chunk, runner.calibration,
                               runner.rope_thetas)
    model = runner.model
    previous = model.config._attn_implementation
    register_decode_attention()
    model.set_attn_implementation(DECODE_ATTENTION)
    _decode_state.current = state
    try:
        score_span(runner, window, None, 0, C, C, r, reference, keep)
    finally:
        _decode_state.current = None
        model.set_attn_implementation(previous)
    r["bytes"] = state.bytes_by_component()
    if reference is None:
        r["reference"] = {"logprobs": keep}
    return r


def run_decode_metric_stepwise(runner: Runner, window: list[int], scheme: str,
                               reference: dict | None) -> dict:
    """The decode metric literally: the window teacher-forced one token per
    forward step through a KvqCache (kvq's fused attention). What
    run_decode_metric computes in one pass; tests/python/test_hf_eval.py
    checks the two agree."""
    C = len(window)
    r = new_result(C)
    keep = None if reference else np.zeros((C - 1, runner.vocab), np.float32)
    cache = runner.cache(scheme)
    score_span(runner, window, cache, 0, C, 1, r, reference, keep)
    r["bytes"] = cache.bytes_by_component()
    if reference is None:
        r["reference"] = {"logprobs": keep}
    return r


def run_window(runner: Runner, window: list[int], scheme: str, chunk: int, gen_tokens: int,
               reference: dict | None, decode: bool = True) -> dict:
    """kvq-eval's RunWindow (eval_runner.cc) on `runner`: the prefill
    metric. With reference None this is the fp16 run and the result carries
    "reference". decode False leaves out the forked decode (top-1 agreement
    and decode timing): the perplexity, KL and bytes are the same, as the
    decode runs on its own cache."""
    C = len(window)
    G = reference["gen_tokens"] if reference else min(gen_tokens, C // 2)
    prefix = C - G
    r = new_result(C)
    keep = None if reference else np.zeros((C - 1, runner.vocab), np.float32)

    cache = runner.cache(scheme)
    last_lp = score_span(runner, window, cache, 0, prefix, chunk, r, reference, keep)
    # The fork: a second cache with the same prefix (the same chunks, so the
    # same stored bytes) that decodes while the first goes on.
    fork = runner.cache(scheme) if decode else None
    if decode:
        score_span(runner, window, fork, 0, prefix, chunk, r, reference, keep, score=False)
    greedy = []
    step_lp = last_lp
    for s in range(G if decode else 0):
        predicted = int(np.argmax(step_lp))
        if reference:
            nxt = int(reference["greedy"][s])
            r["agree"] += predicted == nxt
        else:
            nxt = predicted
            greedy.append(predicted)
            r["agree"] += 1
        r["generated"] += 1
        if s + 1 == G:
            break
        logits, sec = runner.forward([nxt], fork, all_logits=False)
        r["decode_s"].append(sec)
        step_lp = log_softmax(logits[-1:])[0]
    del fork
    score_span(runner, window, cache, prefix, C, chunk, r, reference, keep)
    r["bytes"] = cache.bytes_by_component()
    if reference is None:
        r["reference"] = {"logprobs": keep, "greedy": greedy, "gen_tokens": G}
    return r


def run_passkey(runner: Runner, tokenizer, tokens: list[int], key: str, scheme: str,
                chunk: int, answer_tokens: int) -> tuple[bool, str]:
    """kvq-eval's RunPasskey: chunked prefill, greedy answer, first digits."""
    cache = runner.cache(scheme)
    logits = None
    for pos in range(0, len(tokens), chunk):
        logits, _ = runner.forward(tokens[pos:pos + chunk], cache, all_logits=False)
    out = []
    for s in range(answer_tokens):
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        if s + 1 < answer_tokens:
            logits, _ = runner.forward([nxt], cache, all_logits=False)
    answer = tokenizer.decode(out)
    digits = ""
    for ch in answer:
        if ch.isdigit():
            digits += ch
        elif digits:
            break
    return digits == key, answer


# ------------------------------------------------------------------ report

def rows_of(acc: dict, passkeys: dict, elems_per_token: float, resamples: int,
            seed: int) -> list[dict]:
    """kvq-eval's JSON rows (eval_main.cc) from per (scheme, corpus, context,
    metric) sums: pooled ΔPPL and KL with their bootstrap intervals and the
    per-window scores they come from."""
    rows = []
    for (scheme, corpus, context, metric), a in sorted(acc.items(), key=lambda kv: kv[0]):
        ppl = math.exp(a["nll"] / a["scored"])
        pooled = pool(a["per_window"], resamples, seed)
        total = a["bytes"].get("total", sum(v for k, v in a["bytes"].items()))
        row = {
            "engine": "kvq", "scheme": scheme, "metric": metric, "corpus": corpus,
            "context": context, "windows": a["windows"], "tokens_scored": a["scored"],
            "nll": a["nll"] / a["scored"], "ppl": ppl, "delta_ppl_pct": pooled["delta_ppl_pct"],
            "kl_mean": pooled["kl_mean"],
            "bits_per_element": 8.0 * total / (elems_per_token * a["tokens"]),
            "kv_bytes": total,
            "kv_bytes_by_component": {k: v for k, v in a["bytes"].items() if k != "total"},
        }
        for k in ("delta_ppl_pct_ci95", "kl_mean_ci95"):
            if k in pooled:
                row[k] = pooled[k]
        row["per_window"] = a["per_window"]
        if metric == "prefill":
            decode = sorted(a["decode_s"])
            decode_ms = 1e3 * decode[len(decode) // 2] if decode else 0.0
            row.update({
                "top1_agree": a["agree"] / a["generated"] if a["generated"] else 0.0,
                "generated": a["generated"],
                "prefill_ms": 1e3 * a["prefill_s"] / a["windows"],
                "decode_ms_per_token": decode_ms,
                "decode_tokens_per_s": 1e3 / decode_ms if decode_ms else 0.0,
            })
        else:
            row["scoring_ms"] = 1e3 * a["prefill_s"] / a["windows"]
        rows.append(row)
    for (scheme, context), (ok, trials) in sorted(passkeys.items()):
        rows.append({"engine": "kvq", "scheme": scheme, "metric": "prefill", "corpus": "passkey",
                     "context": context, "passkey_ok": ok, "passkey_trials": trials,
                     "passkey_acc": ok / trials})
    return rows


def load_model(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    kwargs = {"dtype": torch.float32}
    source = args.model
    if args.gguf_file:
        kwargs["gguf_file"] = args.gguf_file
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()
    if args.attention == "fused":
        from kvq.hf import use_kvq_attention

        use_kvq_attention(model)
    tokenizer = AutoTokenizer.from_pretrained(
        source, **({"gguf_file": args.gguf_file} if args.gguf_file else {}))
    return model, tokenizer


def load_calibration(args, model, tokenizer, data_dir: Path, chunk: int):
    """The crq schemes' kvq.Calibration: --calibration_file's, or computed
    from the calibration text's first --calib_tokens tokens (its first MiB
    tokenized, as kvq-eval takes them) by kvq.calibrate."""
    from kvq import Calibration
    from kvq.calibrate import calibrate

    if args.calibration_file and not args.write_calibration:
        calibration = Calibration.load(str(args.calibration_file))
        log(f'calibration "{calibration.name}" from {args.calibration_file}')
        return calibration
    raw = (data_dir / "corpora" / f"{args.calibration}.txt").read_bytes()[:1 << 20]
    tokens = encode(tokenizer, raw.decode("utf-8", "ignore"))[:args.calib_tokens]
    name = args.calibration_name or (args.write_calibration.stem if args.write_calibration
                                     else args.calibration)
    t0 = time.perf_counter()
    calibration = calibrate(model, tokens, name, chunk=chunk,
                            model_name=Path(args.gguf_file or args.model).name)
    log(f'calibration "{name}" from {len(tokens)} tokens of {args.calibration} in '
        f"{time.perf_counter() - t0:.0f} s")
    return calibration


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("windows", type=Path,
                    help="protocol file from kvq-eval --dump_windows (its windows are used "
                         "as they are unless --corpora is given)")
    ap.add_argument("--model", help="transformers model (hub id or directory; default: the "
                                    "windows file's GGUF in the eval data dir)")
    ap.add_argument("--gguf-file", help="GGUF file inside --model (default with no --model: "
                                        "the windows file's model)")
    ap.add_argument("--schemes", default="fp16,int8,kivi4",
                    help="kvq schemes (fp16 always runs first: the reference)")
    ap.add_argument("--corpora", help="select windows from these corpora of the eval data "
                                      "dir with the model's tokenizer (kvq-eval's rule)")
    ap.add_argument("--contexts", default="", help="with --corpora: window lengths")
    ap.add_argument("--windows-per-corpus", type=int,
                    help="with --corpora: windows per corpus and context (default: the "
                         "windows file's)")
    ap.add_argument("--max-windows", type=int, help="at most N windows per (corpus, context)")
    ap.add_argument("--window-order", "--window_order", dest="window_order", default="",
                    help="comma-separated window indices: each corpus's windows in this "
                         "order (indices not listed after them), rank by rank across the "
                         "corpora, as kvq-eval's --window_order; with --max-windows, the "
                         "first N of that order")
    ap.add_argument("--max-context", type=int, help="only windows of at most N tokens")
    ap.add_argument("--min-context", type=int, default=0,
                    help="only windows (and passkey prompts) of at least N tokens")
    ap.add_argument("--passkey-schemes", default=None,
                    help="schemes that run the windows file's passkey prompts (default: all)")
    ap.add_argument("--metrics", default=None,
                    help="decode (every position scored with the cache state token-by-token "
                         "decoding gives it: one token per forward step) and/or prefill "
                         "(chunked prefill); default: the windows file's, else both")
    ap.add_argument("--skip-generate", action="store_true",
                    help="leave out the prefill metric's generation (top-1 agreement, decode "
                         "ms/token): perplexity, KL and bytes are unchanged, in a fraction of "
                         "the time")
    ap.add_argument("--attention", choices=["fused", "dequantized"], default="fused",
                    help="kvq's fused attention (as kvq-eval's C++ forward pass attends), or "
                         "the model's own attention over dequantized K/V")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (a fixed count keeps results identical across machines)")
    ap.add_argument("--calibration", default="calibration",
                    help="corpus of the eval data dir the crq calibration is learned from "
                         "(never an evaluation corpus), as kvq-eval's --calibration")
    ap.add_argument("--calib-tokens", "--calib_tokens", dest="calib_tokens", type=int,
                    default=2048, help="calibration tokens (the text's first N)")
    ap.add_argument("--calibration-file", "--calibration_file", dest="calibration_file",
                    type=Path, help="crq schemes: read the calibration from this .kvqcal "
                                    "file instead of computing it")
    ap.add_argument("--write-calibration", "--write_calibration", dest="write_calibration",
                    type=Path, help="compute the crq calibration of --model from "
                                    "--calibration (kvq.calibrate) and write it to this "
                                    ".kvqcal file, then exit")
    ap.add_argument("--calibration-name", "--calibration_name", dest="calibration_name",
                    help="name written into --write_calibration's file (default: its file "
                         "name without .kvqcal)")
    ap.add_argument("--checkpoint", action="store_true",
                    help="with --out: rewrite it after every window (the rows so far, "
                         "\"partial\": true), so a run stopped early keeps what it measured; "
                         "windows then run index by index across the corpora")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, help="JSON rows (default: stdout)")
    args = ap.parse_args(argv)

    spec = json.loads(args.windows.read_text())
    data_dir = args.data_dir or default_data_dir()
    if not args.model:
        args.model = str(data_dir)
        args.gguf_file = args.gguf_file or spec["model"]
    schemes = ["fp16"] + [s for s in args.schemes.split(",") if s and s != "fp16"]
    chunk = int(spec["chunk"])
    gen_tokens = int(spec.get("gen_tokens", 256))
    if args.corpora and args.calibration in args.corpora.split(","):
        ap.error(f"--corpora: {args.calibration} is the calibration corpus (--calibration)")
    model, tokenizer = load_model(args)
    calibration = None
    if args.write_calibration or any(s.startswith("crq") for s in schemes):
        calibration = load_calibration(args, model, tokenizer, data_dir, chunk)
        if args.write_calibration:
            calibration.write(str(args.write_calibration))
            log(f'calibration "{calibration.name}" ({calibration.num_layers} layers x '
                f"{calibration.num_kv_heads} KV heads x head_dim {calibration.head_dim}, "
                f"from {args.calibration}) written to {args.write_calibration}")
            return 0
    runner = Runner(model, calibration=calibration)
    from kvq.hf import model_geometry

    geometry = model_geometry(model.config)
    log(f"{args.model} {args.gguf_file or ''}: {geometry}")

    if args.corpora:
        contexts = [int(c) for c in args.contexts.split(",") if c]
        per = args.windows_per_corpus or int(spec.get("windows_per_corpus", 1))
        windows = []
        for corpus in args.corpora.split(","):
            raw = (data_dir / "corpora" / f"{corpus}.txt").read_bytes()
            text = raw[:corpus_prefix_bytes(max(contexts), per)].decode("utf-8", "ignore")
            tokens = encode(tokenizer, text)
            for c in contexts:
                for i, w in enumerate(select_windows(tokens, c, per)):
                    windows.append({"corpus": corpus, "context": c, "index": i, "tokens": w})
        prompts = [dict(p, tokens=passkey_prompt(tokenizer, spec["passkey"], p["context"],
                                                  p["depth"], p["key"]))
                   for p in spec.get("passkey", {}).get("prompts", [])]
    else:
        windows = spec["windows"]
        prompts = spec.get("passkey", {}).get("prompts", [])
    order = parse_window_order(ap, args.window_order)
    windows = pick_windows([w for w in windows if w["context"] >= args.min_context],
                           args.max_windows, args.max_context, order)
    prompts = [p for p in prompts if p["context"] >= args.min_context]
    if args.checkpoint and not order:
        # Window 0 of every corpus first, then window 1, ...: a run stopped
        # early has measured every corpus.
        windows.sort(key=lambda w: (w["context"], w["index"], w["corpus"]))
    if args.max_context is not None:
        prompts = [p for p in prompts if p["context"] <= args.max_context]

    metrics = [m for m in (args.metrics or ",".join(spec.get("metrics", ["decode", "prefill"])))
               .split(",") if m]
    for m in metrics:
        if m not in ("decode", "prefill"):
            ap.error(f"--metrics: {m!r} is not decode or prefill")
    boot = spec.get("bootstrap", {})
    resamples = int(boot.get("resamples", 1000))
    seed = int(boot.get("seed", 1))

    acc: dict = {}
    reference_bytes = 0
    kv_max = 0
    for w in windows:
        # One metric at a time, so one fp16 reference is held at once (as
        # kvq-eval runs them).
        for metric in metrics:
            reference = None
            ref_nll = 0.0
            for scheme in schemes:
                tokens = [int(t) for t in w["tokens"]]
                if metric == "decode":
                    r = run_decode_metric(runner, tokens, scheme, chunk, reference)
                else:
                    r = run_window(runner, tokens, scheme, chunk, gen_tokens, reference,
                                   decode=not args.skip_generate)
                if scheme == "fp16":
                    reference = r.pop("reference")
                    ref_nll = r["nll"]
                    reference_bytes = max(reference_bytes, reference["logprobs"].nbytes)
                kv_max = max(kv_max, r["bytes"].get("total", 0))
                for corpus in (w["corpus"], "all"):
                    a = acc.setdefault((scheme, corpus, w["context"], metric), {
                        "windows": 0, "nll": 0.0, "scored": 0, "kl": 0.0, "agree": 0,
                        "generated": 0, "prefill_s": 0.0, "decode_s": [], "bytes": {},
                        "tokens": 0, "per_window": []})
                    a["windows"] += 1
                    for k in ("nll", "scored", "kl", "agree", "generated", "prefill_s"):
                        a[k] += r[k]
                    a["decode_s"] += r["decode_s"]
                    a["bytes"] = r["bytes"]
                    a["tokens"] = r["tokens"]
                    a["per_window"].append({"window": f"{w['corpus']}/{w['index']}",
                                            "index": w["index"], "nll": r["nll"],
                                            "ref_nll": ref_nll, "kl": r["kl"],
                                            "tokens": r["scored"]})
                log(f"{metric} {scheme} {w['corpus']}/{w['context']}/{w['index']}: "
                    f"ppl {math.exp(r['nll'] / r['scored']):.4f} "
                    f"kl {r['kl'] / r['scored']:.5f} top1 {r['agree']}/{r['generated']}")
            del reference
        if args.checkpoint and args.out:
            # The rows so far: a run stopped early keeps what it measured.
            elems_so_far = (2.0 * geometry["num_layers"] * geometry["num_kv_heads"]
                            * geometry["head_dim"])
            write_result({"tool": "kvq-eval", "forward": "transformers",
                          "model": args.gguf_file or args.model, "partial": True,
                          "chunk": chunk,
                          "calibration": calibration and {"name": calibration.name,
                                                          "checksum": calibration.checksum},
                          "rows": rows_of(acc, {}, elems_so_far, resamples, seed)}, args.out)

    passkey_schemes = schemes if args.passkey_schemes is None else [
        s for s in args.passkey_schemes.split(",") if s]
    passkeys: dict = {}
    answer_tokens = int(spec.get("passkey", {}).get("answer_tokens", 8))
    for scheme in passkey_schemes:
        for p in prompts:
            ok, answer = run_passkey(runner, tokenizer, p["tokens"], p["key"], scheme, chunk,
                                     answer_tokens)
            k = passkeys.setdefault((scheme, p["context"]), [0, 0])
            k[0] += ok
            k[1] += 1
            log(f"passkey {scheme} {p['context']}@{p['depth']}: {ok} ({answer!r})")

    elems = 2.0 * geometry["num_layers"] * geometry["num_kv_heads"] * geometry["head_dim"]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {
        "tool": "kvq-eval", "forward": "transformers", "model": args.gguf_file or args.model,
        "mode": "in-process", "attention": args.attention, "chunk": chunk, "bootstrap": {"resamples": resamples, "seed": seed, "interval": 0.95},
        "rows": rows_of(acc, passkeys, elems, resamples, seed),
        "memory": {"weights_bytes": weights, "kv_bytes_max": kv_max,
                   "reference_logprobs_bytes": reference_bytes, "reserved_pool_bytes": 0,
                   "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
        "note": VOLATILE_NOTE,
    }
    if calibration is not None:
        result["calibration"] = {"name": calibration.name, "checksum": calibration.checksum,
                                 "source": str(args.calibration_file or args.calibration)}
        if not args.calibration_file:
            result["calibration"]["tokens"] = args.calib_tokens
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
