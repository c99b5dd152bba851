"""How a parameter's step runs: the route chosen for it in one place (``choice``) and run (``paramstep``).

The eager reference (``reference``, and the eager windows of ``windowed``) is the arithmetic every faster route is
held to: torch's multi-tensor fused AdamW (``multi_tensor``), the one-pass C kernel (``native``, ``kernels/``),
Triton launches (``triton_step``, ``triton_taco``, ``triton_kernels``), a torch.compile'd AdamW (``compiled``),
TACO's sparse write (``taco_routes``), the projected step in windows (``windowed.projected``, with its subspace
refreshed by ``subspace``), and replayed kernel arguments (``kernel_plan``).
"""
