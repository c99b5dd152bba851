"""The CPU's one-pass element-wise step: ``kernels/elementwise_step.c``, compiled on first use, called per window.

The eager window step (``windowed.py``) runs a rule on codec-stored moments as a dozen whole-window passes:
decode, the rule op by op, encode, write. For quantized moments that costs 20-60 times torch's fused AdamW on a
CPU. The C kernel does the same arithmetic in one pass, a few hundred elements (whole codec blocks) at a time in
stack buffers; its results equal the eager step's (tests/test_native.py: bit for bit on the cases tested, the
quantized codes exactly where the fp32 moments agree).

Details: docs/modules.md, ``slimopt.optim.routes.cpu.native``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from slimopt.atomic import atomic_path
from slimopt.cache import cache_root
from slimopt.optim.algorithm import int8_weight
from slimopt.optim.algorithm import quant as Q
from slimopt.optim.algorithm.codecs import Bf16Codec, BlockCodec, FactoredCodec, FactoredRows, Fp32Codec, TernaryCodec
from slimopt.optim.algorithm.noise import CounterStream
from slimopt.optim.routes import abi

__all__ = ["library", "in_kernel", "scratch_per_element", "kernel_declines", "kernel_applies", "declines", "applies",
           "window_step",
           "column_best_applies", "column_best", "quantize_int8", "Int8Sink"]

SOURCE = Path(__file__).parent / "kernels" / "elementwise_step.c"
# -ffp-contract=off: only the fma() calls fuse, as torch's kernels do; -fno-math-errno lets sqrtf vectorize
FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-math-errno"]
NATIVE_FLAGS = ["-march=native", "-mprefer-vector-width=512"]  # dropped when the compiler does not know it
# where dropping them costs the kernel's own vector paths (AVX2, AVX-512), which a build then says once; elsewhere
# (arm64, whose compilers refuse the x86 width flag) the kernel has no paths of its own to lose
_VECTOR_PATHS = platform.machine().lower() in ("x86_64", "amd64")
OPENMP_FLAGS = ["-fopenmp"]  # a window split over the OpenMP pool torch's CPU wheels run on (else pthreads)

# the kernel's ids and tables: routes/abi.py
_RULES, _MOMENT_KEYS, _FREE_RULES, _LIFT_RULES = abi.RULES, abi.MOMENT_KEYS, abi.FREE_RULES, abi.LIFT_RULES
_DTYPES, _ROUNDINGS, _SCALES, _SCALE_DTYPES = abi.DTYPES, abi.ROUNDINGS, abi.SCALES, abi.SCALE_DTYPES
_C = abi.C_CODECS
_C_FP32, _C_BF16, _C_BLOCK8, _C_BLOCK4 = _C["fp32"], _C["bf16"], _C["block8"], _C["block4"]
_C_TERNARY_SR, _C_TERNARY_EF, _C_FACTORED = _C["ternary_sr"], _C["ternary_ef"], _C["factored"]
_MAX_TILE = 4096


class _CountTable(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("points", ctypes.c_void_p), ("extra", ctypes.c_int32),
                ("packed", ctypes.c_void_p), ("n_points", ctypes.c_int32)]


class _Codec(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("block", ctypes.c_int32), ("data", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("err", ctypes.c_void_p), ("qmap", ctypes.c_void_p),
                ("qmap_n", ctypes.c_int32), ("nearest", _CountTable), ("bracket", _CountTable),
                ("key0", ctypes.c_uint32), ("key1", ctypes.c_uint32), ("counter", ctypes.c_int64),
                ("scale_kind", ctypes.c_int32), ("scale_bf16", ctypes.c_int32),
                ("row", ctypes.c_void_p), ("col", ctypes.c_void_p), ("col_sum", ctypes.c_void_p),
                ("cols", ctypes.c_int64), ("denom", ctypes.c_float), ("row_acc", ctypes.c_double),
                ("pairs", ctypes.c_void_p)]


class _Taco(ctypes.Structure):
    p = ctypes.c_void_p
    _fields_ = [("m", ctypes.c_int64), ("n", ctypes.c_int64), ("g", p), ("g_dtype", ctypes.c_int32),
                ("rows", p), ("rows_bytes", ctypes.c_int32), ("codes", p), ("fp8", ctypes.c_int32),
                ("fp8_values", p), ("absmax", p), ("scale_bf16", ctypes.c_int32), ("top", ctypes.c_float),
                ("beta", ctypes.c_float), ("w", ctypes.c_float), ("param", p), ("param_dtype", ctypes.c_int32),
                ("has_decay", ctypes.c_int32), ("decay", ctypes.c_float), ("alpha", ctypes.c_float),
                ("out_rows", p), ("out_values", p), ("out_signs", p), ("hidden", p), ("cand_rows", p),
                ("cand_abs", p), ("keys", p), ("row0", ctypes.c_int64), ("shard_keys", p)]
    del p


class _Int8Q(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("group", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("w_dtype", ctypes.c_int32), ("codes", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("stochastic", ctypes.c_int32), ("key0", ctypes.c_uint32),
                ("key1", ctypes.c_uint32), ("counter", ctypes.c_int64), ("threads", ctypes.c_int32)]


class _Step(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int64), ("param", ctypes.c_void_p), ("param_dtype", ctypes.c_int32),
                ("grad", ctypes.c_void_p), ("grad_dtype", ctypes.c_int32), ("rule", ctypes.c_int32),
                ("has_decay", ctypes.c_int32), ("decay", ctypes.c_float), ("alpha", ctypes.c_float),
                ("w1", ctypes.c_float), ("beta2", ctypes.c_float), ("w2", ctypes.c_float),
                ("bias2_sqrt", ctypes.c_float), ("eps", ctypes.c_float), ("eps_before", ctypes.c_int32),
                ("momentum", ctypes.c_float), ("n_codecs", ctypes.c_int32), ("direction_only", ctypes.c_int32),
                ("rounding", ctypes.c_int32), ("comp", ctypes.c_void_p), ("wkey0", ctypes.c_uint32),
                ("wkey1", ctypes.c_uint32), ("wcounter", ctypes.c_int64), ("codecs", _Codec * 2),
                ("g", ctypes.c_void_p), ("g_dtype", ctypes.c_int32), ("up", ctypes.c_void_p),
                ("lift_coef", ctypes.c_float), ("free_scale", ctypes.c_float), ("threads", ctypes.c_int32),
                ("int8", ctypes.c_void_p), ("int8_written", ctypes.c_int32)]


_lock = threading.Lock()
_local = threading.local()  # .sink: the Int8Sink a step on this thread writes into, or None
_state: dict[str, Any] = {}  # "lib": the loaded library or None once a build failed


def _machine() -> str:
    """What a -march=native build depends on: the architecture and the CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


class _BuildFailed(Exception):
    pass


def _build(native_flags: list[str] | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(library, note) or (None, why). native_flags (NATIVE_FLAGS where None): what targets this machine (without
    them if the compiler refuses them), with OpenMP where the compiler has it; tests build the kernel with fewer
    instruction sets too, to run each of its code paths. note: "" where the library was built with native_flags,
    else which flags were dropped and the compiler's reason (a build without them runs, slower; kept beside the
    library for later processes)."""
    native_flags = NATIVE_FLAGS if native_flags is None else native_flags
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None, "no C compiler found (set CC, or install gcc or clang)"
    source = b"".join(path.read_bytes() for path in sorted(SOURCE.parent.iterdir()) if path.suffix in (".c", ".h"))
    flags = " ".join([cc, *FLAGS, *native_flags, *OPENMP_FLAGS, _machine()])
    key = hashlib.sha256(source + flags.encode()).hexdigest()[:16]
    target = cache_root() / "native" / f"elementwise_step-{key}.so"
    note_file = target.with_suffix(".note")
    if not target.exists():
        try:
            # atomic: a concurrent build or a crash never leaves half a library
            with atomic_path(target, suffix=".so") as tmp:
                errors = []
                for extra in (native_flags + OPENMP_FLAGS, native_flags, OPENMP_FLAGS, []):
                    proc = subprocess.run([cc, *FLAGS, *extra, "-o", str(tmp), str(SOURCE), "-lm"],
                                          capture_output=True, text=True)
                    if proc.returncode == 0:
                        break
                    last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
                    errors.append(f"{cc} failed: {last[0]}")
                else:
                    raise _BuildFailed(errors[-1])  # leaving the block by an exception removes the temporary file
                if native_flags and not set(native_flags) <= set(extra):  # the first failure says why
                    with atomic_path(note_file) as note_tmp:
                        note_tmp.write_text(f"without {' '.join(native_flags)} ({errors[0]})")
                elif note_file.exists():
                    note_file.unlink()
        except _BuildFailed as failed:
            return None, str(failed)
    note = note_file.read_text() if note_file.exists() else ""
    lib = ctypes.CDLL(str(target))
    lib.slimopt_elementwise_step.argtypes = [ctypes.POINTER(_Step)]
    lib.slimopt_elementwise_step.restype = ctypes.c_int
    p = ctypes.c_void_p
    lib.slimopt_column_best.argtypes = [p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, p, p, p, p]
    lib.slimopt_column_best.restype = ctypes.c_int
    lib.slimopt_quantize_int8.argtypes = [ctypes.POINTER(_Int8Q)]
    lib.slimopt_quantize_int8.restype = ctypes.c_int
    for name in ("slimopt_taco_one", "slimopt_taco_shard_keys", "slimopt_taco_shard_step"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_Taco)]
        getattr(lib, name).restype = ctypes.c_int
    return lib, note


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first call; None (after one warning) where it cannot be built, or when
    SLIMOPT_NATIVE=0 at that first call."""
    if "lib" in _state:  # every step asks: no lock, no environment look-up once decided
        return _state["lib"]
    with _lock:
        if "lib" not in _state and os.environ.get("SLIMOPT_NATIVE", "1") == "0":
            _state["lib"], _state["why"] = None, "SLIMOPT_NATIVE=0"
        if "lib" not in _state:
            try:
                lib, why = _build()
            except OSError as exc:
                lib, why = None, f"{type(exc).__name__}: {exc}"
            if lib is None:
                warnings.warn(f"slimopt: the one-pass CPU step could not be built ({why}); quantized and "
                              "other element-wise steps run on the eager path (same results, slower)",
                              RuntimeWarning, stacklevel=3)
            elif why and _VECTOR_PATHS:
                warnings.warn(f"slimopt: the one-pass CPU step was built {why}: it runs without the vector paths "
                              "this processor has (same results, slower)", RuntimeWarning, stacklevel=3)
            _state["lib"], _state["why"] = lib, why
        return _state["lib"]


def in_kernel(codec: Any) -> bool:
    """Whether the kernel reads and writes this codec's stored form itself; any other codec's window is decoded
    to an fp32 buffer before the kernel and encoded after it by the codec's own (eager) code."""
    if isinstance(codec, Fp32Codec):
        return codec.dtype == torch.float32
    if isinstance(codec, Bf16Codec):
        return not codec.stochastic
    if isinstance(codec, BlockCodec):
        return codec.block_size % 2 == 0 and codec.block_size <= _MAX_TILE // 4
    if isinstance(codec, TernaryCodec):
        return (codec.rounding in ("sr", "ef") and codec.scale in _SCALES and codec.scale_dtype in _SCALE_DTYPES
                and codec.block_size * 5 <= _MAX_TILE // 2)
    # a row shard's factored moment too: its window (sharded.ShardFactoredRows) all-reduces the column sums the
    # kernel adds up when it closes
    return isinstance(codec, FactoredCodec)


# Bytes per element of a window that a moment stepped through an fp32 buffer allocates (the buffer, its decode's
# and encode's temporaries), measured with torch's MemTracker on CPU (a 2048 x 2048 weight); a moment the kernel
# stores itself allocates nothing (stochastic ones draw their noise in the kernel).
BUFFER_SCRATCH = {"bf16_sr": 18}


def scratch_per_element(codecs: list[tuple[str, Any]]) -> int | None:
    """What the one-pass step allocates per element of a window with these moment codecs, or None for a buffered
    codec not measured here (the eager step's figure bounds it)."""
    total = 0
    for _, codec in codecs:
        if in_kernel(codec):
            continue
        if codec.name in BUFFER_SCRATCH:
            total += BUFFER_SCRATCH[codec.name]
        else:
            return None
    return total


def kernel_declines(group: dict[str, Any], dtype: torch.dtype, device_type: str,
                    codecs: list[tuple[str, Any]]) -> str | None:
    """Why a `dtype` weight's element-wise steps on `device_type` with these moment codecs do not run through the
    kernel (see the module docstring), or None where they do, building it on first ask; no codecs: the state-free
    update of the group's ``free_rule``. (The planner asks this for weights it only describes.)"""
    rule = group["rule"]
    if not group["fused"]:
        return "fused=False"
    if device_type != "cpu":
        return f"a {device_type} weight"
    if dtype not in _DTYPES:
        return f"{dtype} weights"
    if group["param_rounding"] not in _ROUNDINGS:
        return f"param_rounding {group['param_rounding']!r}"
    if not codecs:
        if group["free_rule"] not in _FREE_RULES:
            return f"free_rule {group['free_rule']!r}"
    else:
        if rule not in _RULES:
            return f"rule {rule!r}"
        if rule in ("adamw", "taco") and group["eps_placement"] not in ("torch", "galore"):
            return f"eps_placement {group['eps_placement']!r}"
        if [k for k, _ in codecs] != _MOMENT_KEYS[rule]:
            return "moments the kernel does not know"
    if library() is None:
        return "the C kernel did not build (" + (_state.get("why") or "see the warning") + ")"
    return None


def kernel_applies(group: dict[str, Any], dtype: torch.dtype, device_type: str,
                   codecs: list[tuple[str, Any]]) -> bool:
    """``kernel_declines`` is None."""
    return kernel_declines(group, dtype, device_type, codecs) is None


def declines(group: dict[str, Any], p: Tensor, grad: Tensor, codecs: list[tuple[str, Any]]) -> str | None:
    """``kernel_declines`` for this weight and gradient (fp32 or bf16, contiguous, plain tensors)."""
    if grad.dtype not in _DTYPES:
        return f"a {grad.dtype} gradient"
    if not (p.is_contiguous() and grad.is_contiguous()):
        return "not contiguous"
    if type(p.data) is not Tensor:
        return f"a {type(p.data).__name__} weight"
    return kernel_declines(group, p.dtype, p.device.type, codecs)


def applies(group: dict[str, Any], p: Tensor, grad: Tensor, codecs: list[tuple[str, Any]]) -> bool:
    return declines(group, p, grad, codecs) is None


def _packed(table: Any) -> Tensor | None:
    """quant's count table of at most one point per range as one int32 look-up (see count_table_t in the C
    source): (base + 1) << 16 minus the low 16 bits of the order key of the range's point (65536 for none), so
    that the count is (entry + low16(key)) >> 16."""
    if table.extra > 1:
        return None
    n = table.padded.numel() - table.extra
    base = table.base.long()
    candidate = table.padded[base.clamp(max=max(0, n - 1))]
    inside = (base < n) & (Q._CountTable.range_of(candidate).long() == torch.arange(65536))
    low = torch.where(inside, Q._order_key(candidate).long() & 0xFFFF, torch.full_like(base, 65536))
    return (((base + 1) << 16) - low).to(torch.int32)


_TABLES: dict[str, tuple[Tensor, ...]] = {}


def map_tables(map_name: str) -> tuple[Tensor, Any, Tensor | None, Any, Tensor | None]:
    """A map, quant's two count tables of it (so that codes are quant's) and their packed forms, built once and
    kept alive for the kernel's pointers: (qmap, nearest, nearest packed, bracket, bracket packed)."""
    entry = _TABLES.get(map_name)
    if entry is None:
        qmap = Q.get_map(map_name, "cpu")
        tables = Q._tables(qmap)
        entry = _TABLES[map_name] = (qmap, tables.nearest, _packed(tables.nearest), tables.bracket,
                                     _packed(tables.bracket))
    return entry


_STRUCTS: dict[str, tuple[int, int, _CountTable, _CountTable]] = {}


def _map_structs(map_name: str) -> tuple[int, int, _CountTable, _CountTable]:
    """A map's pointer, its size and its two count tables as the kernel reads them, made once a map (the tensors
    stay alive in map_tables' cache): (qmap, n, nearest, bracket)."""
    entry = _STRUCTS.get(map_name)
    if entry is None:
        qmap, nearest, nearest_packed, bracket, bracket_packed = map_tables(map_name)
        entry = _STRUCTS[map_name] = (qmap.data_ptr(), qmap.numel(), _table(nearest, nearest_packed),
                                      _table(bracket, bracket_packed))
    return entry


def _table(table: Any, packed: Tensor | None) -> _CountTable:
    return _CountTable(table.base.data_ptr(), table.padded.data_ptr(), table.extra,
                       packed.data_ptr() if packed is not None else None, table.padded.numel() - table.extra)


def fill_factored(c: _Codec, window: Any, start: int) -> None:
    """A factored second moment's window of whole rows (codecs.FactoredRows): its row means from the window's
    first row, the column means, the pass's fp64 column sums."""
    c.kind, c.block = _C_FACTORED, 1
    c.row = window.state[window.key][start // window.cols:].data_ptr()
    c.col = window.col.data_ptr()
    c.col_sum, c.cols, c.denom = window.col_sum.data_ptr(), window.cols, float(window.denom)


def _fill_codec(c: _Codec, codec: Any, key: str, part: dict[str, Tensor], noise: CounterStream | None) -> None:
    c.data = part[key].data_ptr()
    if noise is not None:
        set_noise(c, noise)
    if isinstance(codec, (Fp32Codec, FactoredCodec)):  # a factored moment that is not 2-D is stored fp32
        c.kind, c.block = _C_FP32, 1
        return
    if isinstance(codec, Bf16Codec):
        c.kind, c.block = _C_BF16, 1
        return
    if isinstance(codec, BlockCodec):
        c.kind = _C_BLOCK8 if codec.bits == 8 else _C_BLOCK4
        map_name = codec.map_name
    else:
        c.kind = _C_TERNARY_EF if codec.feedback else _C_TERNARY_SR
        c.scale_kind, c.scale_bf16 = _SCALES[codec.scale], _SCALE_DTYPES[codec.scale_dtype]
        map_name = "ternary"
        if codec.feedback:
            c.err = part[key + "_err"].data_ptr()
    c.block = codec.block_size
    c.scale = part[key + "_scale"].data_ptr()
    c.qmap, c.qmap_n, c.nearest, c.bracket = _map_structs(map_name)


def set_noise(c: _Codec, noise: CounterStream) -> None:
    """A stochastic codec's random stream at the window (its key and the counter of its first element)."""
    (c.key0, c.key1), c.counter = noise.key_words, noise.offset


def set_weight_noise(s: _Step, gen: CounterStream) -> None:
    """The stream of a bf16 weight's stochastic rounding at the window."""
    (s.wkey0, s.wkey1), s.wcounter = gen.key_words, gen.offset


def _set_write(s: _Step, p: Tensor, group: dict[str, Any], direction: bool, comp: Tensor | None,
               gen: CounterStream | None) -> None:
    """How the kernel writes the weight p: its rounding, and the compensation or the stream that needs."""
    rounding = "nearest" if direction or p.dtype == torch.float32 else group["param_rounding"]
    s.rounding = _ROUNDINGS[rounding]
    if rounding == "kahan":
        if comp is None or comp.dtype != torch.bfloat16 or not comp.is_contiguous():
            raise ValueError("param_rounding='kahan' needs the window's bf16 compensation (rules.comp_of)")
        s.comp = comp.data_ptr()
    elif rounding == "stochastic":
        if gen is None:
            raise ValueError("param_rounding='stochastic' needs the window's random stream")
        set_weight_noise(s, gen)


def add_applies(group: dict[str, Any], p: Tensor, d: Tensor) -> bool:
    """Whether ``add_update`` takes p (a contiguous CPU fp32 or bf16 weight or window of one) and d (contiguous
    fp32 or bf16 of p's size; a bf16 d is read as the fp32 of its values)."""
    return (d.dtype in (torch.float32, torch.bfloat16) and d.is_contiguous() and d.numel() == p.numel()
            and kernel_applies(add_group(group, 1.0), p.dtype, p.device.type, [])
            and p.is_contiguous() and type(p.data) is Tensor)


def add_update(p: Tensor, d: Tensor, group: dict[str, Any], coef: float, comp: Tensor | None = None,
               gen: CounterStream | None = None) -> None:
    """``rules.apply_update(p, d, coef, None, group, comp, gen)`` in one pass: p decayed, p -= lr coef d, written
    as the group's ``param_rounding`` says (comp: the compensation's window; gen: the rounding's stream). It is
    the state-free SGD step with d for the gradient and coef for its scale (``add_group``)."""
    free_step(p, d, add_group(group, coef), comp, gen)


def lift_applies(group: dict[str, Any], p: Tensor, grad: Tensor, full_dtype: torch.dtype) -> bool:
    """Whether ``lift_update`` takes p (a contiguous CPU fp32 or bf16 weight or window of one), its gradient grad
    (fp32 or bf16, contiguous) and a lifted direction of `full_dtype` (fp32 or bf16) under a sign or SGD free
    rule."""
    return (group["free_rule"] in _LIFT_RULES and full_dtype in (torch.float32, torch.bfloat16)
            and grad.dtype in (torch.float32, torch.bfloat16) and grad.is_contiguous() and grad.numel() == p.numel()
            and kernel_applies(add_group(group, 1.0), p.dtype, p.device.type, [])
            and p.is_contiguous() and type(p.data) is Tensor)


def lift_update(p: Tensor, full: Tensor, grad: Tensor, up: Tensor, group: dict[str, Any], coef: float,
                comp: Tensor | None = None, gen: CounterStream | None = None) -> None:
    """``rules.apply_update(p, full, coef, -up + grad, group, comp, gen)`` in one pass: a projected step's write
    with FRUGAL's residual (``windowed._lift``; for the coordinate projectors -up + g is the gradient with the
    chosen coordinates zeroed wherever it is finite), p decayed, p -= lr (coef full + free_scale free_rule(grad - up)),
    written as the group's ``param_rounding`` says, where the eager write makes the residual, its sign and the sum
    as tensors of their own. The state-free step's write with the direction formed in the kernel. full: the
    lifted direction (``lift_applies``' dtype, p's size, contiguous); up: the gradient's part inside the subspace,
    fp32, contiguous."""
    s, keep, _ = prepare(p.view(-1), full.view(-1), {}, [], 0, _no_stream, group, comp=comp, gen=gen)
    r = abi.scalars({**group, "lift_coef": coef}, 0, "lift")  # alpha = -lr: the direction carries both scales
    write_scalars(s, r)
    s.rule = _LIFT_RULES[group["free_rule"]]
    s.g, s.g_dtype = grad.data_ptr(), _DTYPES[grad.dtype]
    s.up, s.lift_coef, s.free_scale = up.data_ptr(), r.lift_coef, r.free_scale
    run(s, group, [])
    del keep


def add_group(group: dict[str, Any], coef: float) -> dict[str, Any]:
    """The settings under which the state-free step is ``add_update``'s: SGD of the update, scaled by coef."""
    return {**group, "free_rule": "sgd", "free_scale": coef}


def _no_stream(i: int, start: int) -> CounterStream:
    raise AssertionError("a step without moments draws no moment's random numbers")


def free_step(p: Tensor, grad: Tensor, group: dict[str, Any], comp: Tensor | None = None,
              gen: CounterStream | None = None) -> None:
    """The state-free update of the group's ``free_rule`` on all of p in one pass (``kernel_applies`` with no
    codecs): decay, p -= lr free_scale free_rule(grad), the weight's rounding (comp, gen as ``window_step``)."""
    window_step(p.view(-1), grad.view(-1), {}, group, [], 0, 0, _no_stream, comp=comp, gen=gen)


def window_step(p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any], windows: list,
                start: int, age: int, stream: Callable[[int, int], CounterStream], direction: bool = False,
                comp: Tensor | None = None, gen: CounterStream | None = None) -> float:
    """Elements [start, start + p.numel()) of a parameter stepped in one pass: p, grad are that window's flat
    views; state the whole parameter's state; windows the rule's moments as ``windowed.in_windows`` opened them
    ((index, key, codec, codecs.Window) each; none: the state-free update); age the moments' step count;
    stream(i, start) the random stream of moment i for this window (stochastic codecs draw from it exactly what
    the eager encode draws). direction: p is an fp32 buffer that receives the rule's direction d instead
    (``windowed.directions``). A bf16 weight under ``param_rounding`` ``kahan`` needs comp (its compensation's
    window, bf16), under ``stochastic`` gen (its rounding's stream at the window). Returns the rule's coefficient
    c (the update is lr c d)."""
    s, keep, buffers = prepare(p, grad, state, windows, start, stream, group, direction, comp, gen)
    coef = set_scalars(s, group, age, bool(windows))
    run(s, group, windows)
    for i, window, buf in buffers:
        window.encode(start, start + p.numel(), buf, stream(i, start) if window.codec.needs_generator else None)
    del keep
    return coef


def prepare(p: Tensor, grad: Tensor, state: dict[str, Tensor], windows: list, start: int,
            stream: Callable[[int, int], CounterStream], group: dict[str, Any], direction: bool = False,
            comp: Tensor | None = None, gen: CounterStream | None = None) -> tuple[_Step, list[Tensor], list]:
    """``window_step``'s kernel arguments but the scalars (``set_scalars``): the addresses, dtypes, rule, the
    weight's rounding and each moment's storage. Returns (the struct, the tensors its addresses point into, to be
    kept alive until the kernel returns, and the moments stepped through an fp32 buffer: (index, window, buffer)
    each, to be encoded after it)."""
    s = _Step()
    s.n = p.numel()
    s.param, s.param_dtype = p.data_ptr(), _DTYPES[p.dtype]
    s.grad, s.grad_dtype = grad.data_ptr(), _DTYPES[grad.dtype]
    s.rule = _RULES[group["rule"]] if windows else _FREE_RULES[group["free_rule"]]
    s.n_codecs = len(windows)
    s.direction_only = int(direction)
    _set_write(s, p, group, direction, comp, gen)
    keep: list[Tensor] = []
    buffers: list[tuple[int, Any, Tensor]] = []
    for i, key, codec, window in windows:
        c = s.codecs[i]
        if not in_kernel(codec):
            buf = window.decode(start, start + s.n).contiguous()
            buffers.append((i, window, buf))
            keep.append(buf)
            c.kind, c.block, c.data = _C_FP32, 1, buf.data_ptr()
            continue
        if isinstance(window, FactoredRows):
            fill_factored(c, window, start)
            continue
        part = codec.part(key, state, start, start + s.n)
        keep += part.values()
        _fill_codec(c, codec, key, part, stream(i, start) if codec.needs_generator else None)
    return s, keep, buffers


def set_scalars(s: _Step, group: dict[str, Any], age: int, stateful: bool) -> float:
    """The kernel arguments that change from step to step (``abi.scalars`` at the moments' age; not `stateful`:
    the state-free update, weight -= lr free_scale free_rule(grad)). Returns the rule's coefficient c (the update
    is lr c d)."""
    return write_scalars(s, abi.scalars(group, age, "rule" if stateful else "free"))


def write_scalars(s: _Step, r: abi.StepScalars) -> float:
    """The step record's fields into the kernel's struct; returns the rule's coefficient."""
    s.threads = torch.get_num_threads()  # the kernel splits a large window over them, same bits at any count
    s.has_decay, s.decay, s.alpha = int(r.has_decay), r.decay, r.alpha
    s.w1, s.beta2, s.w2, s.bias2_sqrt = r.w1, r.beta2, r.w2, r.bias2_sqrt
    s.eps, s.eps_before, s.momentum = r.eps, int(r.eps_before), r.momentum
    return r.coef


def run(s: _Step, group: dict[str, Any], windows: list) -> None:
    """Call the kernel on prepared arguments (a call that steps the whole weight of an open ``Int8Sink`` writes
    its codes too)."""
    sink = getattr(_local, "sink", None)
    s.int8 = sink.address if sink is not None and sink.covers(s) else None
    rc = library().slimopt_elementwise_step(ctypes.byref(s))
    if s.int8 and s.int8_written:
        sink.landed()
    if rc != 0:
        raise RuntimeError(f"slimopt: the native element-wise step refused its arguments (rule "
                           f"{group['rule']!r}, codecs {[w[2].name for w in windows]}); run this group with "
                           "fused=False and report it")


def column_best_applies(group: dict[str, Any], dtype: torch.dtype, device_type: str) -> bool:
    """Whether TACO's one-candidate search of a `dtype` gradient on `device_type` runs through the kernel (a
    fused group, a CPU fp32 or bf16 gradient), building it on first ask."""
    return bool(group["fused"]) and device_type == "cpu" and dtype in _DTYPES and library() is not None


def column_best(g: Tensor, hidden: Tensor | None) -> tuple[Tensor, Tensor]:
    """The row of largest |g| in each column of the 2-D contiguous CPU g (fp32 or bf16), leaving out row
    hidden[c] of column c (hidden: (n,) int64, -1 for none; None: no row), the smaller row on ties: (rows (1, n)
    int64, |g| there (1, n) fp32, -1 where no candidate is valid), as ``taco._window_candidates`` at kc = 1.
    Allocates 16 bytes a column."""
    m, n = g.shape
    rows = torch.empty((1, n), dtype=torch.int64)
    absval = torch.empty((1, n), dtype=torch.float32)
    keys = torch.empty(n, dtype=torch.int32)
    h = hidden.contiguous() if hidden is not None else None
    rc = library().slimopt_column_best(g.data_ptr(), _DTYPES[g.dtype], m, n, h.data_ptr() if h is not None else None,
                                       rows.data_ptr(), absval.data_ptr(), keys.data_ptr())
    if rc != 0:
        raise RuntimeError(f"slimopt: the native column search refused a {tuple(g.shape)} {g.dtype} gradient")
    return rows, absval


def _int8_args(w: Tensor, group: int, codes: Tensor, scales: Tensor) -> _Int8Q | None:
    """The writer's arguments for w (rows, cols) fp32 or bf16 into codes (rows, cols) int8 and scales (rows,
    groups) fp32, nearest rounding on one thread; None unless all three are contiguous CPU tensors of those dtypes
    and shapes."""
    if w.dim() != 2 or w.dtype not in _DTYPES:
        return None
    rows, cols = w.shape
    for t, dtype, shape in ((w, w.dtype, (rows, cols)), (codes, torch.int8, (rows, cols)),
                            (scales, torch.float32, (rows, int8_weight.group_count(cols, group)))):
        if t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            return None
    return _Int8Q(rows=rows, cols=cols, group=group, w=w.data_ptr(), w_dtype=_DTYPES[w.dtype],
                  codes=codes.data_ptr(), scales=scales.data_ptr(), stochastic=0, threads=1)


def quantize_int8(w: Tensor, group: int, noise: CounterStream | None, codes: Tensor, scales: Tensor) -> bool:
    """``int8_weight.quantize(w, group, noise=noise)`` written into `codes` (rows, cols) int8 and `scales`
    (rows, groups) fp32 by the kernel, the rows split over torch's threads: True; False where the kernel does not
    take it (no library, a tensor not a contiguous CPU one of those dtypes and shapes, a NaN or an infinity in w),
    for the caller to run the reference."""
    lib = library()
    q = _int8_args(w, group, codes, scales) if lib is not None else None
    if q is None:
        return False
    q.threads = torch.get_num_threads()
    if noise is not None:
        q.stochastic, (q.key0, q.key1), q.counter = 1, noise.key_words, noise.offset
    return lib.slimopt_quantize_int8(ctypes.byref(q)) == 0


class Int8Sink:
    """The int8 codes and scales of a weight written by its step's own pass (``kernels/int8_weight.h``; the bytes
    of ``quantize_int8``), each row as soon as it is stepped, while it is in cache: the separate write read the
    whole weight from memory again. A context manager: a kernel call on this thread that steps all of `w` (a
    contiguous (rows, cols) fp32 or bf16 CPU tensor) writes `codes` (rows, cols) int8 and `scales` (rows, groups)
    fp32, CPU, contiguous, nearest rounding. After it, ``written`` says whether they hold the rounding of w's
    final value; where not (another route, a window, a NaN, w changed after), the caller writes them.

        with native.Int8Sink(master, group, codes, scales) as sink:
            optimizer.step_param(master, grad)
        if not sink.written:
            native.quantize_int8(master, group, None, codes, scales)
    """

    def __init__(self, w: Tensor, group: int, codes: Tensor, scales: Tensor) -> None:
        q = _int8_args(w, group, codes, scales)
        if q is None:
            raise ValueError(f"Int8Sink needs contiguous CPU tensors: w (rows, cols) fp32 or bf16, codes (rows, cols)"
                             f" int8, scales (rows, groups) fp32 for int8_group={group}; got w {w.dtype} "
                             f"{tuple(w.shape)}, codes {codes.dtype} {tuple(codes.shape)}, scales {scales.dtype} "
                             f"{tuple(scales.shape)}")
        self.w, self._ptr, self._dtype, self._q = w, q.w, q.w_dtype, q
        self.address = ctypes.addressof(q)
        self._keep = (codes, scales)
        self._version: int | None = None  # w's version when the kernel last wrote the codes

    def covers(self, s: _Step) -> bool:
        """Whether the kernel call `s` steps all of the weight (not a window of it, not a direction buffer)."""
        return (s.param == self._ptr and s.n == self.w.numel() and s.param_dtype == self._dtype
                and not s.direction_only)

    def landed(self) -> None:
        self._version = self.w._version

    @property
    def written(self) -> bool:
        """Whether codes and scales hold the rounding of w as it is now (written by its last kernel call, with no
        change to w since)."""
        return self._version == self.w._version and self.w.data_ptr() == self._ptr

    def __enter__(self) -> Int8Sink:
        if getattr(_local, "sink", None) is not None:
            raise RuntimeError("one Int8Sink at a time on a thread")
        self._version, _local.sink = None, self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.sink = None


def taco_kernel_declines(group: dict[str, Any], dtype: torch.dtype, device_type: str) -> str | None:
    """Why TACO's whole one-component step of a `dtype` weight on `device_type` does not run through the kernel
    (``taco_one``), or None where it does: a fused group at taco_k 1, a CPU fp32 or bf16 weight written to
    nearest."""
    if not group["fused"]:
        return "fused=False"
    if group["taco_k"] != 1:
        return f"taco_k {group['taco_k']}"
    if device_type != "cpu":
        return f"a {device_type} weight"
    if dtype not in _DTYPES:
        return f"{dtype} weights"
    if group["param_rounding"] != "nearest" and dtype != torch.float32:
        return f"param_rounding {group['param_rounding']!r}"
    if library() is None:
        return "the C kernel did not build (" + (_state.get("why") or "see the warning") + ")"
    return None


def taco_kernel_applies(group: dict[str, Any], dtype: torch.dtype, device_type: str) -> bool:
    return taco_kernel_declines(group, dtype, device_type) is None


def taco_declines(group: dict[str, Any], p: Tensor, grad: Tensor) -> str | None:
    """``taco_kernel_declines`` for this 2-D weight and its gradient (fp32 or bf16, contiguous, plain tensors)."""
    if p.dim() != 2 or grad.shape != p.shape:
        return "not a 2-D weight with its gradient"
    if grad.dtype not in _DTYPES:
        return f"a {grad.dtype} gradient"
    if not (p.is_contiguous() and grad.is_contiguous() and type(p.data) is Tensor):
        return "not contiguous plain tensors"
    return taco_kernel_declines(group, p.dtype, p.device.type)


def taco_applies(group: dict[str, Any], p: Tensor, grad: Tensor) -> bool:
    """``taco_declines`` is None."""
    return taco_declines(group, p, grad) is None


TACO_COLUMN_SCRATCH = 40  # what taco_one allocates a column: its (2, n) int64, (4, n) fp32 and (n,) int64
_FP8_VALUES: list[Tensor] = []


def _fp8_values() -> Tensor:
    """(256,) fp32: the value of every float8_e4m3fn code, as torch decodes it."""
    if not _FP8_VALUES:
        _FP8_VALUES.append(torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float())
    return _FP8_VALUES[0]


def _taco(p: Tensor, grad: Tensor, state: dict[str, Tensor], beta: float, lr: float, weight_decay: float,
          coef: float) -> tuple[_Taco, Tensor, Tensor]:
    """The kernel's arguments of p's TACO step (its rows, its gradient's, its stored component's), and the scratch
    they point into: (struct, kept rows and hidden rows (2, n) int64, kept values, signs, |g|, keys (4, n) fp32)."""
    m, n = p.shape
    rows, codes, absmax = state["taco_rows"], state["taco_values"], state["taco_absmax"]
    out = torch.empty((3, n), dtype=torch.int64)  # the kept rows; the stored rows hidden; the candidates
    work = torch.empty((4, n), dtype=torch.float32)  # kept values, signs, candidates' |g|, the search's keys
    t = _Taco()
    t.m, t.n = m, n
    t.g, t.g_dtype = grad.data_ptr(), _DTYPES[grad.dtype]
    t.rows, t.rows_bytes = rows.data_ptr(), rows.element_size()
    t.fp8 = int(codes.dtype == torch.float8_e4m3fn)
    t.codes, t.fp8_values = codes.data_ptr(), _fp8_values().data_ptr()
    t.absmax, t.scale_bf16 = absmax.data_ptr(), int(absmax.dtype == torch.bfloat16)
    t.top = 448.0 if t.fp8 else 127.0
    t.beta, t.w = beta, 1.0 - beta
    t.param, t.param_dtype = p.data_ptr(), _DTYPES[p.dtype]
    t.has_decay, t.decay, t.alpha = int(weight_decay != 0.0), 1.0 - lr * weight_decay, -lr * coef
    t.out_rows, t.hidden, t.cand_rows = out[0].data_ptr(), out[1].data_ptr(), out[2].data_ptr()
    t.out_values, t.out_signs, t.cand_abs, t.keys = (work[i].data_ptr() for i in range(4))
    return t, out, work


def taco_one(p: Tensor, grad: Tensor, state: dict[str, Tensor], beta: float, lr: float, weight_decay: float,
             coef: float) -> tuple[Tensor, Tensor] | None:
    """TACO's step at taco_k 1 on p (``taco.sparse_update`` then ``taco.apply_sparse`` at nearest rounding), the
    state's three tensors updated in place. Returns None when done; where a kept value is NaN nothing is written
    and it returns (kept rows (1, n) int64, kept values (1, n) fp32) for the caller to encode and apply eagerly.
    Allocates ``TACO_COLUMN_SCRATCH`` bytes a column."""
    t, out, work = _taco(p, grad, state, beta, lr, weight_decay, coef)
    rc = library().slimopt_taco_one(ctypes.byref(t))
    if rc == 1:
        return out[:1], work[:1]
    if rc != 0:
        raise RuntimeError(f"slimopt: the native TACO step refused a {tuple(p.shape)} {p.dtype} weight")
    return None


class TacoShard:
    """A row shard's TACO step at taco_k 1 in the kernel (``sharded_taco.local_keys``, then ``finish_k1`` and
    ``apply_local`` from the keys MAX-reduced over the ranks), its arguments prepared for one step: p and its
    gradient hold rows [row0, row0 + m) of the weight (m may be 0); `whole` is every column's stored component
    (``sharded_taco.record``), its rows global."""

    def __init__(self, p: Tensor, grad: Tensor, whole: dict[str, Tensor], row0: int) -> None:
        self.t, self.out, self.work = _taco(p, grad, whole, 0.0, 0.0, 0.0, 0.0)
        self.keys_out = torch.empty((2, p.shape[1]), dtype=torch.int64)
        self.t.row0, self.t.shard_keys = row0, self.keys_out.data_ptr()
        self.shape = p.shape

    def keys(self, grad: Tensor) -> Tensor:
        """The (2, n) keys this shard sends, as float64 (``sharded_taco.local_keys``'; a buffer the next call
        writes again)."""
        self.t.g = grad.data_ptr()
        self.t.shard_keys = self.keys_out.data_ptr()
        if library().slimopt_taco_shard_keys(ctypes.byref(self.t)) != 0:
            raise RuntimeError(f"slimopt: the native TACO step refused a {tuple(self.shape)} shard")
        return self.keys_out.view(torch.float64)

    def step(self, keys: Tensor, beta: float, lr: float, weight_decay: float,
             coef: float) -> tuple[Tensor, Tensor] | None:
        """The rest of the step from `keys` MAX-reduced over the ranks, at nearest rounding: the kept component
        stored (the same on every rank), p's rows decayed and moved where it holds the kept row. Returns None when
        done; where a kept value is NaN nothing is written and it returns (kept rows (1, n), global, kept values
        (1, n)) for the caller."""
        t = self.t
        keys = keys.contiguous().view(torch.int64)
        t.shard_keys = keys.data_ptr()
        t.beta, t.w = beta, 1.0 - beta
        t.has_decay, t.decay, t.alpha = int(weight_decay != 0.0), 1.0 - lr * weight_decay, -lr * coef
        rc = library().slimopt_taco_shard_step(ctypes.byref(t))
        if rc == 1:
            return self.out[:1], self.work[:1]
        if rc != 0:
            raise RuntimeError(f"slimopt: the native TACO step refused a {tuple(self.shape)} shard")
        return None
