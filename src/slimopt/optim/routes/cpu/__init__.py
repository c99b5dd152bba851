"""The CPU's route: the one-pass C kernel (``native``, ``kernels/elementwise_step.c``).

Details: docs/modules.md, ``slimopt.optim.routes.cpu.native``.
"""
