"""Where a result came from, written beside it: the git revision of the mlsm source tree, the
command typed, and one line naming the machine. A leaf: it imports nothing of mlsm.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_revision() -> str:
    """The git revision of the mlsm source tree, or 'unknown' outside a checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def invocation() -> str:
    """The mlsm command this process runs, as typed (`mlsm demo --out runs/demo`), so a report can
    say which command made it; '' when mlsm was not started as its command (the Python API)."""
    import shlex
    import sys

    start = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if start.name != "mlsm" and not (start.name == "__main__.py" and start.parent.name == "mlsm"):
        return ""
    return shlex.join(["mlsm", *sys.argv[1:]])


def machine_description() -> str:
    """One line naming the machine results came from: CPU model, cores, RAM, torch, GPU."""
    import contextlib
    import os
    import platform

    import torch

    cpu = platform.processor()
    try:  # platform.processor() is empty on most Linux systems; /proc/cpuinfo names the model
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"{platform.machine()} {cpu}".strip(), f"{os.cpu_count()} CPUs"]
    with contextlib.suppress(ValueError, OSError, AttributeError):  # sysconf is POSIX-only
        parts.append(f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    parts += [gpu, f"torch {torch.__version__}", f"Python {platform.python_version()}"]
    return ", ".join(parts)
