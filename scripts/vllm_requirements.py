"""Prints the requirements of the installed vllm distribution that apply
here, one per line, leaving out the ones scripts/install_deps.sh cannot
install from PyPI (vllm 0.34.0 pins flashinfer-python==0.7.3, which PyPI
does not have; vLLM imports flashinfer only for its GPU kernels, which the
connector's tests do not run). Usage: python3 scripts/vllm_requirements.py"""

import importlib.metadata

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it.
    from pip._vendor.packaging.requirements import Requirement

NOT_ON_PYPI = {"flashinfer-python"}

for line in importlib.metadata.requires("vllm") or []:
    req = Requirement(line)
    if req.name in NOT_ON_PYPI:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # Another platform's, or an extra's.
    req.marker = None
    print(req)
