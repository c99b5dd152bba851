"""Routes made of torch's own kernels: fused multi-tensor AdamW and the step's queue (``multi_tensor``), a
torch.compile'd AdamW (``compiled``) and Muon's batched iteration (``muon_batch``).

The package's name does not hide the ``torch`` library: its modules import it absolutely.
Details: docs/modules.md, ``slimopt.optim.routes.torch.multi_tensor``.
"""
