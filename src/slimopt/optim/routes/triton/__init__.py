"""The GPU's routes as Triton launches: the element-wise step (``triton_step``), TACO's step (``triton_taco``)
and their kernels (``triton_kernels``, imported only where triton is installed).

The package's name does not hide the ``triton`` library: its modules import it absolutely.
Details: docs/modules.md, ``slimopt.optim.routes.triton.triton_step``.
"""
