#!/usr/bin/env python3
"""The figures of docs/PYTHON.md: kvq from Python, measured on this machine.

1. Append and read throughput of one sequence in SmolLM2-135M's layout
   (30 layers, 3 KV heads, head_dim 64), in-process (kvq.KvLayer) and over
   gRPC (kvq_client against a kvq-server this starts): the median of
   --repeats runs, in MB/s of the fp16 K/V the sequence holds.
2. A --tokens-token SmolLM2 cache through transformers (the model from the
   eval data dir's GGUF): DynamicCache and KvqCache fp16 / kivi4, each in a
   fresh process: the K/V bytes the cache allocates, the process's peak RSS
   from the loaded model on (the peak is reset after the GGUF conversion) and
   its growth over the loaded model, and generate() tokens/s for
   --new-tokens tokens after that context.

    python3 bench/python_bench.py --server-bin=build/service/kvq-server

Needs the kvq package (pip install .), and for part 2 torch and
transformers (KVQ_WITH_TORCH=1 scripts/install_deps.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, Q_HEADS, THETA = 30, 3, 64, 9, 100000.0
MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNK = 512


def data_dir() -> Path:
    if os.environ.get("KVQ_EVAL_DATA"):
        return Path(os.environ["KVQ_EVAL_DATA"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "kvq" / "eval"
    return Path.home() / ".cache" / "kvq" / "eval"


def peak_rss() -> int:
    """The process's peak resident set (VmHWM) since start or since
    reset_peak_rss()."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    """Sets the peak to the current resident set (Linux: clear_refs 5), so
    the peak measured next is the cache's, not the model conversion's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ----------------------------------------------------------- 1. throughput

def throughput(scheme: str, tokens: int, repeats: int, client) -> dict:
    import kvq

    rng = np.random.default_rng(0)
    k = rng.standard_normal((LAYERS, KV_HEADS, tokens, HEAD_DIM), dtype=np.float32)
    v = rng.standard_normal((LAYERS, KV_HEADS, tokens, HEAD_DIM), dtype=np.float32)
    fp16_mb = k.size * 2 * 2 / 1e6
    times = {"local_append": [], "local_read": [], "grpc_append": [], "grpc_read": []}
    for _ in range(repeats):
        layers = [kvq.KvLayer(scheme, KV_HEADS, HEAD_DIM, rope_theta=THETA)
                  for _ in range(LAYERS)]
        t0 = time.perf_counter()
        for i, layer in enumerate(layers):
            layer.append(k[i], v[i])
        times["local_append"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for layer in layers:
            layer.read()
        times["local_read"].append(time.perf_counter() - t0)
        if client is None:
            continue
        from kvq_client import ModelLayout, RopeParams

        layout = ModelLayout(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, RopeParams(theta=THETA))
        sid = client.create_sequence(layout, scheme=scheme).sequence_id
        t0 = time.perf_counter()
        sent = client.append_prompt(sid, k, v)
        times["grpc_append"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        client.fetch(sid, dtype="fp32")
        times["grpc_read"].append(time.perf_counter() - t0)
        client.release(sid)
    row = {"scheme": scheme, "tokens": tokens, "fp16_mb": fp16_mb}
    for name, ts in times.items():
        if ts:
            row[name + "_mb_s"] = fp16_mb / statistics.median(ts)
    if client is not None:
        row["grpc_wire_mb"] = sent.wire_bytes / 1e6
    return row


# ------------------------------------------------- 2. a cache in transformers

def cache_child(cache: str, tokens: int, new_tokens: int, threads: int) -> dict:
    """One cache in this (fresh) process: prefill `tokens` in CHUNK-token
    chunks, then generate() `new_tokens` greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    torch.set_num_threads(threads)
    # A GGUF-loaded model cannot be saved for the children to share: each
    # converts it.
    model = AutoModelForCausalLM.from_pretrained(str(data_dir()), gguf_file=MODEL_FILE_NAME,
                                                 dtype=torch.float32).eval()
    text = (data_dir() / "corpora" / "austen.txt").read_text()[300_000:]
    tokenizer = AutoTokenizer.from_pretrained(str(data_dir()), gguf_file=MODEL_FILE_NAME)
    ids = tokenizer(text[:tokens * 8], return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids[:, :tokens]
    if cache == "DynamicCache":
        past = DynamicCache(config=model.config)
    else:
        from kvq.hf import KvqCache, use_kvq_attention

        scheme, attention = cache.split("/")
        if attention == "fused":
            use_kvq_attention(model)
        past = KvqCache(model.config, scheme)
    import gc

    gc.collect()
    reset_peak_rss()
    base_rss = peak_rss()
    with torch.inference_mode():
        t0 = time.perf_counter()
        for pos in range(0, tokens - 1, CHUNK):
            model(ids[:, pos:min(pos + CHUNK, tokens - 1)], cache=past, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        if cache == "DynamicCache":
            kv_bytes = sum(t.numel() * t.element_size() for layer in past.layers
                           for t in (layer.keys, layer.values))
        else:
            kv_bytes = past.bytes_by_component()["total"]
        t0 = time.perf_counter()
        out = model.generate(ids, cache=past, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
        gen_s = time.perf_counter() - t0
    assert out.shape[1] == tokens + new_tokens
    return {"cache": cache, "tokens": tokens, "kv_bytes": kv_bytes, "peak_rss": peak_rss(),
            "rss_growth": peak_rss() - base_rss, "prefill_s": prefill_s,
            "generate_tokens_per_s": new_tokens / gen_s}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-bin", help="kvq-server binary for the gRPC rows")
    ap.add_argument("--throughput-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096, help="context of part 2")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--caches", default="DynamicCache,fp16/fused,kivi4/fused,kivi4/dequantized")
    ap.add_argument("--skip", choices=["throughput", "transformers"], action="append",
                    default=[])
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--child", metavar="CACHE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(cache_child(args.child, args.tokens, args.new_tokens, args.threads)))
        return 0

    result = {"throughput": [], "transformers": []}
    if "throughput" not in args.skip:
        server = None
        client = None
        tmp = tempfile.TemporaryDirectory()
        if args.server_bin:
            port_file = Path(tmp.name) / "port"
            server = subprocess.Popen([args.server_bin, "--address=127.0.0.1:0",
                                       f"--port_file={port_file}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while not (port_file.exists() and port_file.read_text().strip()):
                if server.poll() is not None:
                    raise SystemExit("kvq-server exited at start")
                time.sleep(0.05)
            from kvq_client import KvqClient

            client = KvqClient(f"127.0.0.1:{port_file.read_text().strip()}", deadline=300)
        try:
            print(f"Append and read, SmolLM2-135M layout, {args.throughput_tokens} tokens "
                  f"(MB/s of fp16 K/V, median of {args.repeats}):")
            print(f"{'scheme':8} {'in-process append':>18} {'in-process read':>16} "
                  f"{'gRPC append':>12} {'gRPC read':>10} {'wire MB':>8}")
            for scheme in ("fp16", "kivi4"):
                row = throughput(scheme, args.throughput_tokens, args.repeats, client)
                result["throughput"].append(row)
                print(f"{scheme:8} {row['local_append_mb_s']:18.0f} {row['local_read_mb_s']:16.0f} "
                      f"{row.get('grpc_append_mb_s', float('nan')):12.0f} "
                      f"{row.get('grpc_read_mb_s', float('nan')):10.0f} "
                      f"{row.get('grpc_wire_mb', float('nan')):8.1f}", flush=True)
        finally:
            if client is not None:
                client.close()
            if server is not None:
                server.terminate()
                server.wait()
            tmp.cleanup()

    if "transformers" not in args.skip:
        print(f"\nSmolLM2-135M, {args.tokens}-token context through transformers "
              f"({args.threads} threads, each cache in a fresh process):")
        print(f"{'cache':22} {'KV MiB':>8} {'peak RSS MiB':>13} {'RSS growth MiB':>15} "
              f"{'prefill s':>10} {'generate tok/s':>15}")
        for cache in args.caches.split(","):
            proc = subprocess.run([sys.executable, __file__, "--child", cache,
                                   f"--tokens={args.tokens}", f"--new-tokens={args.new_tokens}",
                                   f"--threads={args.threads}"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{cache}: {proc.stderr[-2000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            result["transformers"].append(row)
            print(f"{cache:22} {row['kv_bytes'] / 2**20:8.1f} {row['peak_rss'] / 2**20:13.0f} "
                  f"{row['rss_growth'] / 2**20:15.0f} {row['prefill_s']:10.1f} "
                  f"{row['generate_tokens_per_s']:15.2f}", flush=True)
    result["load_average"] = os.getloadavg()
    print(f"\nload average at the end: {result['load_average'][0]:.1f} "
          f"on {os.cpu_count()} cores")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
