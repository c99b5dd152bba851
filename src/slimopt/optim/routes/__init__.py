"""How a parameter's step runs: the route chosen for it in one place (``choice``) and run (``paramstep``).

The eager reference (``reference/``, and the eager windows of ``windowed``) is the arithmetic every faster route is
held to; the faster ones are grouped by backend: torch's own kernels (``torch/``: multi-tensor fused AdamW, a
torch.compile'd AdamW, Muon's queued iteration), the one-pass C kernel (``cpu/``), Triton launches (``triton/``).
Beside them: the kernels' contract (``abi``: ids, tables, a step's scalars), TACO's sparse write
(``taco_routes``), the projected step in windows (``windowed.projected``, with its subspace refreshed by
``subspace``) and replayed kernel arguments (``kernel_plan``).
"""
