"""Keep the peers' load-time chatter out of the user's terminal.

transformers imports torchao whenever it is installed, and torchao logs a warning for each of its native libraries
built for another CUDA or Python ("Failed to load .../_C_mxfp8...so: Could not load this library"), after which
torch logs a deprecation notice for each Enum torchao registers. bitsandbytes, on CPUs with AVX512-BF16, logs that
an optional kernel package from a model hub cannot be fetched. None of it concerns a slimopt run, and it arrives
before the run prints anything. ``hush()`` puts a filter on exactly those loggers that drops exactly those
messages; anything else they log still shows.
"""

from __future__ import annotations

import logging

__all__ = ["hush", "CHATTER"]

# logger name -> the starts or fragments of the messages that are load chatter
CHATTER: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}


class _DropChatter(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot be formatted is not ours to judge
            return True
        return not any(f in message for f in self.fragments)


def hush() -> None:
    """Install the filters (once; later calls do nothing). Cheap: imports no peer."""
    for name, fragments in CHATTER.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropChatter) for f in logger.filters):
            logger.addFilter(_DropChatter(fragments))
