"""The generated protobuf and gRPC modules of proto/kvq/v1/kvq.proto.

They live in ``kvq_client/_gen`` (not in git). The package's build
(``pip install .`` at the repository root) generates them with grpcio-tools
and installs them; in a source checkout ``generate.sh`` writes them, and the
first import writes them too when grpcio-tools is installed. Run as a script
(``python3 kvq_client/_proto.py [--force] [--out DIR]``) to regenerate, into
DIR instead of the package when given (the build does).
"""

import hashlib
import importlib
import os
import shutil
import sys
import tempfile
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
GEN_DIR = os.path.join(_PACKAGE_DIR, "_gen")


def proto_root():
    """The directory holding kvq/v1/kvq.proto ($KVQ_PROTO_DIR or the checkout's proto/)."""
    root = os.environ.get("KVQ_PROTO_DIR") or os.path.join(_PACKAGE_DIR, "..", "..", "..", "proto")
    return os.path.normpath(root)


_STAMP = "PROTO_SHA256"  # In _gen: the hash of the kvq.proto it was generated from.


def _proto_hash(proto):
    with open(proto, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _up_to_date(proto):
    """Whether _gen exists and, when the .proto is at hand, was made from it."""
    if not os.path.isdir(GEN_DIR):
        return False
    if not os.path.isfile(proto):
        return True  # An installed package without the .proto: use what it has.
    try:
        with open(os.path.join(GEN_DIR, _STAMP)) as f:
            return f.read().strip() == _proto_hash(proto)
    except OSError:
        return False


def _write_modules(proto, dest):
    """Runs protoc on `proto` into `dest` (an existing directory) and makes
    the output a package: __init__ files, the stamp, and the grpc module's
    absolute import of kvq_pb2 made relative."""
    from grpc_tools import protoc
    rc = protoc.main(["grpc_tools.protoc", f"-I{proto_root()}", f"--python_out={dest}",
                      f"--grpc_python_out={dest}", "kvq/v1/kvq.proto"])
    if rc != 0:
        raise ImportError(f"kvq_client: protoc failed on {proto} (exit {rc})")
    for sub in ("", "kvq", os.path.join("kvq", "v1")):
        open(os.path.join(dest, sub, "__init__.py"), "a").close()
    with open(os.path.join(dest, _STAMP), "w") as f:
        f.write(_proto_hash(proto) + "\n")
    grpc_module = os.path.join(dest, "kvq", "v1", "kvq_pb2_grpc.py")
    with open(grpc_module) as f:
        text = f.read()
    text = text.replace("from kvq.v1 import kvq_pb2 as", "from . import kvq_pb2 as")
    with open(grpc_module, "w") as f:
        f.write(text)


def generate(force=False):
    """Writes kvq_pb2.py and kvq_pb2_grpc.py under _gen/kvq/v1.

    Regenerates when kvq.proto changed since (a stamp in _gen holds its
    hash), so a checkout never runs stale stubs after a proto change. The
    grpc module's absolute import of kvq_pb2 becomes a relative one, so the
    modules live inside this package. Generation goes to a temporary
    directory that is renamed into place, so concurrent first imports are
    safe.
    """
    proto = os.path.join(proto_root(), "kvq", "v1", "kvq.proto")
    if not force and _up_to_date(proto):
        return GEN_DIR
    force = force or os.path.isdir(GEN_DIR)
    if not os.path.isfile(proto):
        raise ImportError(
            f"kvq_client: the generated modules are missing and {proto} was not found; "
            "run client/python/generate.sh from a kvq checkout (or set KVQ_PROTO_DIR)")
    try:  # Checked here for an error that says what to install.
        import grpc_tools.protoc  # noqa: F401
    except ImportError as e:
        raise ImportError("kvq_client: generating the gRPC modules needs grpcio-tools "
                          "(scripts/install_deps.sh installs it)") from e
    tmp = tempfile.mkdtemp(prefix="_gen.", dir=_PACKAGE_DIR)
    try:
        _write_modules(proto, tmp)
        if force and os.path.isdir(GEN_DIR):
            shutil.rmtree(GEN_DIR)
        try:
            os.rename(tmp, GEN_DIR)
        except OSError:
            if not os.path.isdir(GEN_DIR):  # Lost a race: someone else's copy is in place.
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    importlib.invalidate_caches()
    return GEN_DIR


def modules():
    """(kvq_pb2, kvq_pb2_grpc), generating them first when missing or older
    than kvq.proto."""
    try:
        generate()
    except ImportError as e:
        if not os.path.isdir(GEN_DIR):
            raise
        warnings.warn(f"kvq_client: using generated modules that may predate kvq.proto ({e})")
    pb2 = importlib.import_module("kvq_client._gen.kvq.v1.kvq_pb2")
    grpc_pb2 = importlib.import_module("kvq_client._gen.kvq.v1.kvq_pb2_grpc")
    return pb2, grpc_pb2


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" in args:
        out = args[args.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        _write_modules(os.path.join(proto_root(), "kvq", "v1", "kvq.proto"), out)
        print(out)
    else:
        print(generate(force="--force" in args))
