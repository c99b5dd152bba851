"""Compile, for an H200 (sm_90, without one), every Triton kernel specialization that slimopt's steps launch.

The interpreter (tests/triton_worker.py) runs the kernels' arithmetic, not their compilation: a kernel that reads a
module-level value that is not a tl.constexpr, or an operation the code generator lacks, passes there and fails on
the GPU. triton_worker.py records every launch of its steps (argument types, constexprs, compile options); this
reads that list from standard input and compiles each specialization with triton.compile for the target, ptxas
included (triton's wheel ships it), in a process without TRITON_INTERPRET (triton fixes its own functions to one
mode when it is imported). Prints what compiled and what failed as JSON. Run by tests/test_triton.py;
SLIMOPT_COMPILE_ARCH picks another target (80: an A100).
"""

import json
import os
import sys


def compile_all():
    assert os.environ.get("TRITON_INTERPRET") != "1"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from slimopt.optim.routes.triton import triton_step

    kernels = triton_step._triton()
    target = GPUTarget("cuda", int(os.environ.get("SLIMOPT_COMPILE_ARCH", "90")), 32)
    report = {"target": f"sm_{target.arch}", "triton": triton.__version__, "compiled": {}, "failed": {}}
    for spec in json.load(sys.stdin):
        label = f"{spec['kernel']}({', '.join(f'{k}={v}' for k, v in spec['constexprs'].items())})"
        try:
            compiled = triton.compile(ASTSource(fn=getattr(kernels, spec["kernel"]), signature=spec["signature"],
                                                constexprs=spec["constexprs"]),
                                      target=target, options=spec["options"])
            report["compiled"][label] = len(compiled.asm["cubin"])
        except Exception as exc:  # what a GPU would have raised at the first launch
            while exc.__cause__ is not None:  # a CompilationError wraps its reason once per nested call
                exc = exc.__cause__
            report["failed"][label] = f"{type(exc).__name__}: {str(exc)[-700:]}"
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    compile_all()
