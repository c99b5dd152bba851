"""Run logs: JSON lines (always), TensorBoard scalars (when installed), and memory probes for the progress bar.

`metrics.jsonl` holds one JSON object per line: a `config` record first, then `train` records (step, tokens,
loss, lr, tokens/s, memory) and `eval` records (val_loss, val_ppl), then a `final` summary. On resume the file is
cut back to the checkpoint's step, so a resumed run's log reads like the log of a run that was never stopped.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path

import torch

from slimopt.atomic import atomic_file

__all__ = ["RunLogger", "read_jsonl", "MemoryProbe"]

LOG_NAME = "metrics.jsonl"


def _clean(v):
    # JSON has no NaN/Inf; write them as strings so a diverged run still logs readably.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, torch.Tensor):
        return _clean(v.item()) if v.numel() == 1 else v.tolist()
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every complete record of a JSON-lines file (a torn last line from a killed run is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class RunLogger:
    """Writes records to `out_dir/metrics.jsonl` and, if `tensorboard` is importable, to `out_dir/tb/`.

    A logger with `enabled=False` (ranks other than 0, or no output folder) accepts records and drops them.
    """

    def __init__(self, out_dir: str | os.PathLike | None, enabled: bool = True, tensorboard: bool = True,
                 truncate_after_step: int | None = None):
        self.enabled = enabled and out_dir is not None
        self.path = Path(out_dir) / LOG_NAME if out_dir is not None else None
        self._f = None
        self._tb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_after_step is not None and self.path.exists():
            self._truncate(truncate_after_step)
        elif truncate_after_step is None and self.path.exists():
            self.path.unlink()  # a fresh run replaces an old log
        self._f = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tb"))
            except Exception:  # tensorboard not installed: JSON lines alone
                self._tb = None

    def _truncate(self, step: int) -> None:
        # Keep the records a run that was never stopped would have at this step (config, and events up to `step`).
        keep = [r for r in read_jsonl(self.path)
                if r.get("event") not in ("final",) and r.get("step", 0) <= step]
        with atomic_file(self.path, "w") as f:
            for r in keep:
                f.write(json.dumps(r) + "\n")

    def log(self, event: str, **fields) -> None:
        if not self.enabled:
            return
        rec = {"event": event, **_clean(fields)}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        if self._tb is not None and "step" in fields:
            for k, v in fields.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{event}/{k}", v, fields["step"])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class MemoryProbe:
    """Peak memory of the training part of a run.

    GPU: `torch.cuda.max_memory_allocated` since `start()` (tensors only, what the papers report).
    CPU: the growth of the process's peak resident set size (VmHWM) over the resident size at `start()`. On Linux
    `start()` resets the peak through /proc/self/clear_refs, so only what the run itself touches counts; where that
    is not allowed the lifetime peak (`ru_maxrss`) is used and `kind` says so. RSS includes allocator slack and the
    framework's own buffers: an upper bound on tensor memory, not an exact count.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.base = 0
        self.kind = ""

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.kind = "cuda max_memory_allocated"
            return
        self.base = current_rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5 = reset the peak RSS counter (Linux >= 4.0)
            self.kind = "CPU peak RSS growth (VmHWM reset at start)"
        except OSError:
            self.kind = "CPU peak RSS growth (process lifetime ru_maxrss)"

    def peak_total(self) -> int:
        """Peak bytes in use since start (GPU: allocated; CPU: resident)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss()

    def peak_delta(self) -> int:
        """Peak bytes added by the run since `start()`."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return max(0, peak_rss() - self.base)

    def now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return current_rss()


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    return peak_rss()


def peak_rss() -> int:
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux
