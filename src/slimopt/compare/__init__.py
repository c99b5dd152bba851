"""Comparing optimizers honestly: the protocol `slimopt compare` and `slimopt finetune` share, and `slimopt compare`.

Details: docs/modules.md, ``slimopt.compare`` and ``slimopt.compare.protocol``.
"""
