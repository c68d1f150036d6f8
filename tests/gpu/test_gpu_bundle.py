"""The GPU bundle (scripts/gpu_bundle.sh) and its device check (scripts/gpu_check.sh).

test_bundle_*: packs the binaries of a built CUDA tree (KVQ_BUILD_DIR), unpacks
the archive into an empty directory and checks that it is self-contained
(every library resolves from the bundle except glibc's, the C++ runtime's,
the driver's libcuda and NCCL) and that its check, run without a GPU, reports
every step SKIPPED (no device) and exits non-zero.

test_statuses_*: gpu_check.sh against stub binaries that print gtest output,
so its reading of that output is checked without a device: a binary that ran
0 cases FAILS, one whose cases all skipped is SKIPPED, never PASS.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tarfile
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("KVQ_ROOT", Path(__file__).resolve().parents[2]))
BUILD = os.environ.get("KVQ_BUILD_DIR", "")
MAX_BYTES = 40 << 20
SYSTEM = re.compile(
    r"^(linux-vdso|ld-linux-x86-64|libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|"
    r"libanl|libnsl|libstdc\+\+|libgcc_s)\.so")
# Found at run time where the machine has them (the driver; python3's NCCL).
ALLOWED_MISSING = re.compile(r"^(libcuda|libnccl)\.so")
SMOKE_STEPS = ["device_page_pool", "quantize_vs_reference", "attention_vs_reference",
               "memcheck_quantize", "memcheck_attention", "crq_vs_cuda_host", "crq_vs_reference",
               "memcheck_crq"]
FULL_STEPS = ["bench", "kv_stream_test", "attention_test", "attention_contract_test",
              "raw_pages_test", "fork_test", "accounting_test", "integration_cuda", "cuda_ipc",
              "nccl_two_ranks", "racecheck_attention"]


def table_rows(text: str) -> list[list[str]]:
    """The rows of gpu_check's table: [stage, step, status, time, detail]."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| stage "):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    if not BUILD:
        pytest.skip("KVQ_BUILD_DIR is not set (ctest sets it to a CUDA build tree)")
    work = tmp_path_factory.mktemp("bundle")
    archive = work / "kvq-gpu-bundle.tar.xz"
    run = subprocess.run(
        [str(ROOT / "scripts" / "gpu_bundle.sh"), "--build-dir", BUILD, "--no-build", "--out",
         str(archive)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert archive.stat().st_size <= MAX_BYTES
    unpacked = work / "unpacked"
    unpacked.mkdir()
    assert not any(unpacked.iterdir())
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="tar")
    return unpacked / "kvq-gpu-bundle"


def test_bundle_holds_the_check_and_every_binary(bundle):
    assert (bundle / "gpu_check.sh").stat().st_mode & stat.S_IXUSR
    names = sorted(p.name for p in (bundle / "bin").iterdir())
    assert names == sorted([
        "kvq-server", "kvq", "kvq-bench", "device_page_pool_test", "cuda_quantize_test",
        "cuda_attention_test", "transport_gpu_test", "client_server_test", "kv_stream_test",
        "attention_test", "attention_contract_test", "raw_pages_test", "fork_test",
        "accounting_test", "crq_test", "cuda_crq_test"])
    manifest = (bundle / "MANIFEST").read_text()
    assert "libraries: " in manifest and "libcudart" in manifest  # Carried, not static.


def test_bundle_libraries_resolve_from_the_bundle(bundle):
    files = sorted((bundle / "bin").iterdir()) + sorted((bundle / "lib").iterdir())
    assert len(files) > 14
    for f in files:
        runpath = subprocess.run(["readelf", "-d", str(f)], capture_output=True, text=True).stdout
        assert re.search(r"\(RUNPATH\)\s+Library runpath: \[\$ORIGIN(/\.\./lib)?\]", runpath), (
            f"{f.name}: {runpath}")
        ldd = subprocess.run(["ldd", str(f)], capture_output=True, text=True).stdout
        for line in ldd.splitlines():
            m = re.match(r"\s*(\S+) => (.*)", line)
            if not m:
                continue
            name, where = m.groups()
            if where.startswith("not found"):
                assert ALLOWED_MISSING.match(name), f"{f.name} needs {name}, not in the bundle"
            elif not SYSTEM.match(name) and not ALLOWED_MISSING.match(name):
                path = Path(where.split(" (")[0]).resolve()
                assert path.is_relative_to(bundle.resolve()), (
                    f"{f.name}: {name} resolves outside the bundle, to {path}")


def test_bundle_server_starts_and_serves_metrics_with_an_empty_environment(bundle, tmp_path):
    """The bundle's kvq-server, with nothing but the bundle's libraries, answers a scrape."""
    port_file = tmp_path / "port"
    server = subprocess.Popen(
        [str(bundle / "bin" / "kvq-server"), "--backend=cpu", "--address=127.0.0.1:0",
         "--metrics_address=127.0.0.1:0", "--capacity_bytes=67108864",
         f"--port_file={port_file}"],
        env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = None
        for line in server.stdout:
            m = re.search(r"metrics at (http://127\.0\.0\.1:\d+)", line)
            if m:
                metrics = m.group(1)
                break
        assert metrics, "kvq-server printed no metrics address"
        with urllib.request.urlopen(f"{metrics}/metrics", timeout=30) as r:
            assert r.status == 200
            assert "kvq_" in r.read().decode()
        assert server.poll() is None, "kvq-server exited after the scrape"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_bundle_server_static_tls_leaves_the_metrics_workers_their_stack(bundle):
    """glibc takes a thread's static TLS out of its stack, and Debian's civetweb
    (the metrics endpoint) runs its workers on fixed stacks of about 100 KiB:
    with 45 KiB of kvq's TLS plus NCCL's and the CUDA runtime's, the first
    scrape overflowed one. kvq-server keeps its own under 16 KiB."""
    headers = subprocess.run(["readelf", "-lW", str(bundle / "bin" / "kvq-server")],
                             capture_output=True, text=True, check=True).stdout
    tls = [line.split() for line in headers.splitlines() if line.split()[:1] == ["TLS"]]
    assert len(tls) == 1, headers
    memsz = int(tls[0][5], 16)
    assert memsz <= 16 << 10, f"kvq-server's static TLS is {memsz} bytes"


def test_bundle_check_without_a_device_skips_every_step(bundle, tmp_path):
    probe = subprocess.run([str(bundle / "bin" / "kvq-bench"), "device", "--probe"],
                           capture_output=True, text=True)
    if probe.returncode == 0:
        pytest.skip(f"this machine has a CUDA device ({probe.stdout.strip()})")
    out = tmp_path / "out"
    run = subprocess.run([str(bundle / "gpu_check.sh"), "smoke", "full"], cwd=tmp_path,
                         env={**os.environ, "OUT": str(out)}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    rows = table_rows(run.stdout)
    assert [r[1] for r in rows] == SMOKE_STEPS + FULL_STEPS
    for r in rows:
        assert r[2].startswith("SKIPPED (no device: "), r
    assert (out / "gpu_check.md").read_text().strip() == run.stdout.strip()
    assert (out / "gpu_check_logs.tar.gz").exists()


# --- gpu_check.sh's statuses, against stub binaries. ---

STUB = r"""#!/usr/bin/env bash
# A stand-in for a bundle binary: prints what its name says to.
name="$(basename "$0")"
if [[ $name == kvq-bench ]]; then
  if [[ $1 == device && $2 == --probe ]]; then echo "Stub GPU, 80.0 GiB, sm_90, 132 SMs"; exit 0; fi
  for a in "$@"; do [[ $a == --json_out=* ]] && json="${a#--json_out=}"; done
  cat >"$json" <<'EOF'
{"rows": [], "checks": [
  {"name": "fp16 decode attention >= 0.80 of copy bandwidth", "outcome": "PASS", "detail": "0.85"},
  {"name": "kivi2 decode attention >= 4.5x faster than fp16", "outcome": "FAIL", "detail": "2.00x"}]}
EOF
  exit 0
fi
if [[ $1 == --gtest_list_tests ]]; then printf 'Suite/Case.\n  Run/kivi2_x\n  Run/kivi4_x\n'; exit 0; fi
summary() { echo "[==========] $1 tests from 1 test suite ran. (1 ms total)"; }
case "$name" in
  cuda_quantize_test | kv_stream_test)  # Filtered down to nothing.
    summary 0; echo "[  PASSED  ] 0 tests." ;;
  cuda_attention_test)  # Every case skipped itself.
    summary 2; echo "[  PASSED  ] 0 tests."
    echo "x.cc:1: Skipped"; echo "no CUDA device: the attention kernels are not run"
    echo "[  SKIPPED ] 2 tests, listed below:" ;;
  attention_test)  # A failure.
    summary 3; echo "[  PASSED  ] 2 tests."; echo "[  FAILED  ] 1 test, listed below:"
    echo "[  FAILED  ] Suite.Case"; exit 1 ;;
  fork_test)  # Crashed before its summary.
    echo "Segmentation fault"; exit 139 ;;
  *) summary 4; echo "[  PASSED  ] 4 tests." ;;
esac
"""


def stub_bundle(tmp_path: Path) -> Path:
    """A bundle directory of gpu_check.sh and stub binaries."""
    bundle = tmp_path / "bundle"
    (bundle / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_check.sh", bundle / "gpu_check.sh")
    for name in ["kvq-server", "kvq", "kvq-bench", "device_page_pool_test", "cuda_quantize_test",
                 "cuda_attention_test", "transport_gpu_test", "client_server_test",
                 "kv_stream_test", "attention_test", "attention_contract_test", "raw_pages_test",
                 "fork_test", "accounting_test", "crq_test", "cuda_crq_test"]:
        path = bundle / "bin" / name
        path.write_text(STUB)
        path.chmod(0o755)
    return bundle


def stub_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVQ_NCCL_LIB_DIR", "PYTHONPATH")}
    return {**env, "OUT": str(tmp_path / "out"), "CUDA_HOME": str(tmp_path / "no-cuda"),
            "PATH": "/usr/bin:/bin", **extra}


def test_statuses_find_nccl_in_pythons_site_packages(tmp_path):
    bundle = stub_bundle(tmp_path)
    site = tmp_path / "site"
    lib = site / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    found = subprocess.run(["bash", str(bundle / "gpu_check.sh"), "smoke"],
                           env=stub_env(tmp_path, PYTHONPATH=str(site)), capture_output=True,
                           text=True, timeout=120)
    assert f"NCCL: {lib}/libnccl.so.2;" in found.stdout
    absent = subprocess.run(["bash", str(bundle / "gpu_check.sh"), "smoke"],
                            env=stub_env(tmp_path), capture_output=True, text=True, timeout=120)
    if "NCCL: not found" not in absent.stdout:
        pytest.skip("this machine's python3 has an NCCL wheel: its absence is not checkable")
    assert "NCCL: not found: no nvidia-nccl-cu13 wheel" in absent.stdout


def test_statuses_never_pass_a_step_that_ran_nothing(tmp_path):
    bundle = stub_bundle(tmp_path)
    env = stub_env(tmp_path, KVQ_NCCL_LIB_DIR=str(tmp_path / "no-nccl"))
    run = subprocess.run(["bash", str(bundle / "gpu_check.sh"), "smoke", "full"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    status = {r[1]: r[2] for r in table_rows(run.stdout)}
    assert status["device_page_pool"] == "PASS"
    assert status["quantize_vs_reference"] == "FAIL (0 cases ran)"
    assert status["attention_vs_reference"] == (
        "SKIPPED (no CUDA device: the attention kernels are not run)")
    assert status["memcheck_quantize"].startswith("SKIPPED (compute-sanitizer not found")
    assert status["kv_stream_test"] == "FAIL (0 cuda cases ran)"
    assert status["attention_test"] == "FAIL (exit 1)"
    assert status["fork_test"] == "FAIL (exit 139, no gtest summary)"
    assert status["accounting_test"] == "PASS"
    assert status["crq_vs_cuda_host"] == "PASS"
    assert status["crq_vs_reference"] == "PASS"
    assert status["memcheck_crq"].startswith("SKIPPED (compute-sanitizer not found")
    assert status["bench"] == "PASS"
    assert status["target: fp16 decode attention >= 0.80 of copy bandwidth"] == "PASS"
    assert status["target: kivi2 decode attention >= 4.5x faster than fp16"] == "FAIL"
    assert status["integration_cuda"] == "PASS"
