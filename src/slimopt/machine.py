"""The machine a result was measured on, in one line, for the reports that record figures (``compare``,
``finetune``): timings mean little without the processor, its cores and the versions."""

from __future__ import annotations

import os
import platform

__all__ = ["describe"]


def _cpu() -> str:
    """The processor's model name (/proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """'<cpu>, <n> CPU cores, <gpu or no GPU>, <t> torch threads; Python x.y.z, torch v, <OS> <release>'."""
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{_cpu()}, {os.cpu_count()} CPU cores, {gpu}, {torch.get_num_threads()} torch threads; "
            f"Python {platform.python_version()}, torch {torch.__version__}, {platform.system()} {platform.release()}")
