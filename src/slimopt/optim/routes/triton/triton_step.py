"""The element-wise step of a set of tensors as one Triton kernel launch: the GPU's counterpart of ``native.py``.

The eager window step launches a dozen kernels per tensor on a GPU, each a full pass over memory; this kernel
reads the gradient, the weight and each coded moment once and writes the weight and the moments once.

Details: docs/modules.md, ``slimopt.optim.routes.triton.triton_step``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from slimopt.optim.algorithm.codecs import Bf16Codec, BlockCodec, FactoredCodec, Fp32Codec, TernaryCodec
from slimopt.optim.algorithm.noise import CounterStream
from slimopt.optim.routes import abi
from slimopt.optim.routes.cpu import native

__all__ = ["available", "declines", "applies", "prepare", "run", "failed", "fallbacks"]

_K = abi.K_CODECS  # a moment's storage: K_* of the kernels
_K_FP32, _K_BF16, _K_INT8, _K_INT4, _K_BF16_SR = _K["fp32"], _K["bf16"], _K["int8"], _K["int4"], _K["bf16_sr"]
_K_TERNARY, _K_FACTORED = _K["ternary"], _K["factored"]
_BLOCK_KINDS = (_K_INT8, _K_INT4)
_DENSE_KINDS = (_K_FP32, _K_BF16, _K_BF16_SR)  # stored element by element: any layout writes them
_L_FLAT, _L_ROWS = 0, 1
# the kernels' ids and tables: routes/abi.py
_SCALES, _RULES, _FREE_RULES, _MOMENT_KEYS = abi.SCALES, abi.RULES, abi.FREE_RULES, abi.MOMENT_KEYS
# a projected step's write with FRUGAL's residual (``lift_applies``): the rule's name in a launch's settings
_LIFT_RULES = {"lift " + name: i for name, i in abi.LIFT_RULES.items()}
_DTYPES = tuple(abi.DTYPES)
_ROUNDINGS = abi.ROUNDINGS  # W_* of the kernel: how a bf16 weight is written
_TILE = 256  # elements a program: a power of two holding whole int8 (256) and int4 (128) blocks
_RB, _CB, _MAX_ITERS = 16, 64, 8  # the rows layout: a program steps 16 x 64 elements, down at most 8 x 16 rows
_SCRATCH_BYTES = 64 << 20  # what one launch may allocate (the rows layout's sums): windowed.WINDOW_BYTES
# Every launch's compile options: no contraction of a product and a sum into one fma but where the kernel writes
# tl.fma (as torch's CPU kernels and the C kernel compute), so that a GPU computes what the interpreter's tests
# check; the kernels are memory-bound, so the separate roundings cost nothing measurable.
_OPTIONS = {"enable_fp_fusion": False}

_state: dict[str, Any] = {}
_failed: dict[tuple, str] = {}  # kernel settings -> why their launch failed


def _triton():
    """The triton module, or None where it is not installed (imported once)."""
    if "triton" not in _state:
        try:
            import triton  # noqa: F401

            from slimopt.optim.routes.triton import triton_kernels
            _state["triton"] = triton_kernels
        except Exception as exc:  # ImportError, or a triton too old for the kernels' language
            _state["triton"] = None
            _state["why"] = f"{type(exc).__name__}: {exc}"
    return _state["triton"]


def available() -> bool:
    """Whether the Triton kernels can be used in this process: triton importable, and not turned off by
    ``SLIMOPT_TRITON=0`` (read at each ask, so a process can switch)."""
    return os.environ.get("SLIMOPT_TRITON", "1") != "0" and _triton() is not None


def failed(settings: tuple) -> bool:
    """Whether the kernel of these settings (a ``Launch.key``'s second entry) failed in this process."""
    return settings in _failed


def fallbacks() -> dict[tuple, str]:
    """Kernel settings whose compile or launch failed in this process, with the reason: they run eagerly."""
    return dict(_failed)


@functools.lru_cache(maxsize=None)
def _kind(codec: Any) -> int | None:
    """The kernel's K_* for a moment codec, or None where it has none; asked several times a tensor a step, so
    kept per codec instance (codecs hold no data: one shared instance a spec)."""
    return _find_kind(codec)


def _find_kind(codec: Any) -> int | None:
    if isinstance(codec, Fp32Codec):
        return _K_FP32 if codec.dtype == torch.float32 else None
    if isinstance(codec, Bf16Codec):
        return _K_BF16_SR if codec.stochastic else _K_BF16
    if isinstance(codec, BlockCodec) and _TILE % codec.block_size == 0:
        if native.map_tables(codec.map_name)[2] is None:  # a map with two decision points in one range
            return None
        return _K_INT8 if codec.bits == 8 else _K_INT4
    if isinstance(codec, TernaryCodec):
        # the byte layout: a program steps B bytes (five blocks of B trits), B a power of two
        b = codec.block_size
        return _K_TERNARY if b & (b - 1) == 0 and 8 <= b <= 1024 else None
    if isinstance(codec, FactoredCodec):
        return _K_FACTORED  # of a 2-D moment; any other shape is stored fp32 (``_kinds``)
    return None


def _kinds(codecs: list[tuple[str, Any]], shape: torch.Size) -> tuple[int, ...]:
    """The kernel's K_* of each moment of a `shape` moment: a factored codec stores a moment that is not 2-D in
    fp32."""
    return tuple(_K_FP32 if k == _K_FACTORED and len(shape) != 2 else k for k in (_kind(c) for _, c in codecs))


def _layout(kinds: tuple[int, ...]) -> tuple[int, bool]:
    """(the main pass's layout, whether it leaves the first moment to the moment pass): the rows layout for a
    factored v; a ternary m always (its bytes want tiles of five blocks), block codes in the rows layout."""
    rows = len(kinds) > 1 and kinds[1] == _K_FACTORED
    defer = bool(kinds) and (kinds[0] == _K_TERNARY or (rows and kinds[0] in _BLOCK_KINDS))
    return (_L_ROWS if rows else _L_FLAT), defer


def _device_ok(t: Tensor) -> bool:
    if t.is_cuda:
        return True
    # CPU tensors run the kernels only under the interpreter, for the tests
    return (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
            and os.environ.get("SLIMOPT_TRITON_CPU") == "1")


@functools.lru_cache(maxsize=None)
def _rule_ok(rule: str, codecs: tuple[tuple[str, Any], ...]) -> bool:
    """Whether the kernel has `rule` on these (key, codec) moments (asked for every tensor of every step)."""
    if rule not in _RULES or [k for k, _ in codecs] != _MOMENT_KEYS[rule]:
        return False
    kinds = [_kind(c) for _, c in codecs]
    # a ternary moment is only ever a first one, a factored one a second one (codecs.M_SPECS, V_SPECS)
    return (None not in kinds and _K_FACTORED not in kinds[:1] and _K_TERNARY not in kinds[1:])


_PLAIN = (Tensor, torch.nn.Parameter)  # no tensor subclass (a DTensor, a quantized weight): its data is not flat


def declines(group: dict[str, Any], p: Tensor, grad: Tensor, codecs: list[tuple[str, Any]]) -> str | None:
    """Why p's element-wise step with these moment codecs does not run as one Triton launch, or None where it
    does (see the module docstring): a fused group, a CUDA weight (or a CPU one under the interpreter hook), a
    supported rule, codecs, dtypes and write, triton installed, and no earlier failure of this kernel's settings.
    No codecs: the state-free update (``free_rule`` sign or sgd)."""
    if not group["fused"]:
        return "fused=False"
    if not _device_ok(p):
        return f"a {p.device.type} weight"
    if p.dtype not in _DTYPES or grad.dtype not in _DTYPES:
        return f"a {p.dtype} weight with a {grad.dtype} gradient"
    if group["param_rounding"] not in _ROUNDINGS:
        return f"param_rounding {group['param_rounding']!r}"
    if not (type(p) in _PLAIN and type(grad) in _PLAIN):
        return f"a {type(p).__name__} weight"
    if not (p.is_contiguous() and grad.is_contiguous()):
        return "not contiguous"
    rule = group["rule"]
    if not codecs:
        if group["free_rule"] not in _FREE_RULES:
            return f"free_rule {group['free_rule']!r}"
    elif not _rule_ok(rule, tuple(codecs)):
        return f"rule {rule!r} with moments {[c.name for _, c in codecs]}"
    elif rule in ("adamw", "taco") and group["eps_placement"] not in ("torch", "galore"):
        return f"eps_placement {group['eps_placement']!r}"
    elif any(c.name == "factored" and getattr(c, "rows", None) is not None for _, c in codecs):
        return "a row shard's factored moment (its column means in chunks over the ranks)"
    if not available():
        return "triton is not installed" if _triton() is None else "SLIMOPT_TRITON=0"
    if _failed and _settings(group, p, grad, codecs) in _failed:
        return "this kernel failed earlier in this process: " + _failed[_settings(group, p, grad, codecs)]
    return None


def applies(group: dict[str, Any], p: Tensor, grad: Tensor, codecs: list[tuple[str, Any]]) -> bool:
    return declines(group, p, grad, codecs) is None


def lift_applies(group: dict[str, Any], p: Tensor, grad: Tensor, full_dtype: torch.dtype) -> bool:
    """Whether a projected step's write with FRUGAL's residual runs as one launch (``prepare``'s `lift`): p's
    state-free write would (``applies`` with no codecs), under a sign or SGD free rule, with a contiguous fp32 or
    bf16 gradient of p's size and a lifted direction of `full_dtype` (fp32 or bf16)."""
    return (full_dtype in _DTYPES and grad.numel() == p.numel() and applies(group, p, grad, [])
            and not (_failed and _lift_settings(group, p, full_dtype, grad) in _failed))


def _lift_settings(group, p, full_dtype, grad) -> tuple:
    """``_settings`` of a write with a residual: the gradient's kind where the first moment's would be."""
    return ("lift " + group["free_rule"], p.dtype, full_dtype, (_K_BF16 if grad.dtype == torch.bfloat16 else _K_FP32,
            _K_FP32), group["eps_placement"], p.device.type, _rounding(group, p))


def _settings(group, p, grad, codecs) -> tuple:
    """What selects one compiled specialization of the kernel."""
    rule = group["rule"] if codecs else group["free_rule"]
    return (rule, p.dtype, grad.dtype, _kinds(codecs, p.shape), group["eps_placement"], p.device.type,
            _rounding(group, p))


def _codec_key(codec: Any) -> tuple:
    """What of a codec selects a specialization beyond its kind: a block codec's map and block, a ternary one's
    block, scale, scale dtype and rounding."""
    if isinstance(codec, TernaryCodec):
        return ("ternary", codec.block_size, codec.scale, codec.scale_dtype, codec.feedback)
    return (getattr(codec, "map_name", None), getattr(codec, "block_size", 1))


def _rounding(group: dict[str, Any], p: Tensor) -> str:
    return group["param_rounding"] if p.dtype == torch.bfloat16 else "nearest"


_TABLES: dict[tuple[str, torch.device], tuple[Tensor, Tensor]] = {}
_PLACEHOLDERS: dict[torch.device, Tensor] = {}


def _placeholder(device: torch.device) -> Tensor:
    """A one-element fp32 tensor on `device` for the kernel's pointers that a specialization never reads (made
    once: no allocation inside a step)."""
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _PLACEHOLDERS[device]


def _tables(map_name: str, device: torch.device) -> tuple[Tensor, Tensor]:
    """(qmap fp32, packed nearest-count table int32 (65536,)) of a map on `device`, built once."""
    key = (map_name, device)
    if key not in _TABLES:
        qmap, _, packed, _, _ = native.map_tables(map_name)
        _TABLES[key] = (qmap.to(device), packed.to(device))
    return _TABLES[key]


def _moment_addresses(kind: int, key: str, state: dict[str, Tensor], dummy: Tensor) -> tuple[int, int, int, int]:
    """(data address, scale address, blocks, residual address) of one moment: a factored one's row means and
    column means; a moment kept element by element has the placeholder for a scale, all but a ternary moment's
    error-feedback form for a residual."""
    data, none = state[key], dummy.data_ptr()
    if kind in _DENSE_KINDS:
        return data.data_ptr(), none, 0, none
    if kind == _K_FACTORED:
        return data.data_ptr(), state[key + "_col"].data_ptr(), 0, none
    scale = state[key + "_scale"]
    err = state.get(key + "_err") if kind == _K_TERNARY else None
    return data.data_ptr(), scale.data_ptr(), scale.numel(), err.data_ptr() if err is not None else none


class Launch:
    """One tensor's part of a launch (``prepare``): the row of addresses the kernel reads it by, what selects
    the launch it can share (``key``: the group, the kernel's settings, the size, the moments' age), and a
    factored v's (row means, column means), which ``run`` writes after the kernel."""

    __slots__ = ("group", "codecs", "age", "direction", "n", "blocks", "row", "key", "device", "factored")

    def __init__(self, group, codecs, age, direction, n, blocks, row, key, device, factored=None):
        self.group, self.codecs, self.age, self.direction = group, codecs, age, direction
        self.n, self.blocks, self.row, self.key, self.device = n, blocks, row, key, device
        self.factored = factored


def prepare(p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any],
            codecs: list[tuple[str, Any]], age: int, direction: bool = False, comp: Tensor | None = None,
            gen: Any = None, streams: list[CounterStream | None] | None = None,
            lift: tuple[Tensor, Tensor] | None = None) -> Launch:
    """p's step from grad against its coded moments (no codecs: the state-free update), ready to launch alone or
    with others of the same ``key`` (``run``); age: the moments' step count, already counted; direction: p is an
    fp32 buffer that receives the rule's direction d instead (``windowed.directions``); a bf16 weight under
    ``param_rounding`` ``kahan`` needs comp (its bf16 compensation), under ``stochastic`` gen (its rounding's
    counter-based stream at element 0); streams: each moment's stream at element 0 where its codec rounds
    stochastically (bf16_sr, ternary), else None. lift: (the gradient g, its part inside the subspace up, fp32),
    with no codecs: a projected step's write with FRUGAL's residual, grad being the lifted direction L and the
    update lift_coef L + free_scale free_rule(-up + g) (``rules.apply_update``; the group's ``lift_coef``)."""
    rounding = "nearest" if direction else _rounding(group, p)
    if rounding == "kahan" and (comp is None or comp.dtype != torch.bfloat16 or not comp.is_contiguous()):
        raise ValueError("param_rounding='kahan' needs the weight's bf16 compensation (rules.comp_of)")
    if rounding == "stochastic" and gen is None:
        raise ValueError("param_rounding='stochastic' needs the weight's random stream")
    streams = list(streams or [None] * len(codecs))
    if any(c.needs_generator and s is None for (_, c), s in zip(codecs, streams)):
        raise ValueError("a stochastically rounded moment needs its random stream (prepare's streams)")
    dummy = _placeholder(p.device)
    kinds = _kinds(codecs, p.shape)
    moments = [_moment_addresses(kind, k, state, dummy) for kind, (k, _) in zip(kinds, codecs)]
    none = dummy.data_ptr()
    m = moments[0] if moments else (none, none, 0, none)
    v = moments[1] if len(moments) > 1 else m

    row = with_streams((p.data_ptr(), grad.data_ptr(), m[0], m[1], v[0], v[1],
                        comp.data_ptr() if rounding == "kahan" else none) + (0,) * 3 + (m[3],) + (0,) * 6,
                       gen, streams)
    factored = None
    if len(kinds) > 1 and kinds[1] == _K_FACTORED:
        vkey = codecs[1][0]  # a whole moment's: a row shard's is declined (its column means are in chunks)
        factored = (state[vkey], state[vkey + "_col"])
    maps = tuple(_codec_key(c) for _, c in codecs)
    shape = tuple(p.shape) if factored is not None else p.numel()  # the rows layout: rows and columns
    settings = _settings(group, p, grad, codecs)
    if lift is not None:  # the gradient and its part inside the subspace where the moments' data would be
        row = row[:2] + (lift[0].data_ptr(), none, lift[1].data_ptr()) + row[5:]
        settings = _lift_settings(group, p, grad.dtype, lift[0])
    key = (id(group), settings, maps, shape, age, direction, rounding)
    return Launch(group, codecs, age, direction, p.numel(), (m[2], v[2]), row, key, p.device, factored)


def _words(s: CounterStream | None) -> tuple[int, int, int]:
    return (*s.key_words, s.offset) if s is not None else (0, 0, 0)


def with_streams(row: tuple, gen: CounterStream | None, streams: list[CounterStream | None]) -> tuple:
    """A launch's row of addresses with this step's random streams in it (keyed by the step): the weight's
    stochastic rounding (gen) and each moment's (streams; None where a codec draws nothing)."""
    m = _words(streams[0]) if streams else (0, 0, 0)
    v = _words(streams[1]) if len(streams) > 1 else (0, 0, 0)
    return row[:7] + _words(gen) + row[10:11] + m + v


_ROWS: "OrderedDict[tuple, tuple[Tensor, Tensor]]" = OrderedDict()  # recent tables (device, host), by contents
_MAX_ROWS = 4096
_CAPTURED: list[Tensor] = []  # host tables copied inside a CUDA-graph capture: a replay copies them again
_COMPILED: set[tuple] = set()  # (settings, size) whose moment pass is compiled and loaded


def _table(launches: list[Launch]) -> Tensor:
    """The (k, COLUMNS) int64 table of addresses of `launches` on their device. The same tensors step after step
    give the same table: it is copied once and kept, so a step copies nothing and a CUDA graph captured after a
    warm-up step reads the kept one; a new one is copied from pinned memory without waiting (a stochastically
    rounded weight's stream keys change every step: its table is new each step). The host copy lives as long as
    the device one, and for the process where a graph captured its copy."""
    rows = tuple(x.row for x in launches)
    kept = _ROWS.get(rows)
    if kept is not None:
        _ROWS.move_to_end(rows)
        return kept[0]
    host = torch.tensor(rows, dtype=torch.int64)
    device = launches[0].device
    if device.type == "cuda":
        host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            _CAPTURED.append(host)
    else:
        table = host
    _ROWS[rows] = (table, host)
    if len(_ROWS) > _MAX_ROWS:
        _ROWS.popitem(last=False)
    return table


def _rows_geometry(shape: tuple[int, int]) -> tuple[int, int, int]:
    """The rows layout of a (rows, cols) moment: (iterations down the rows, column tiles, row tiles)."""
    rows, cols = shape
    iters = min(_MAX_ITERS, _cdiv(rows, _RB))
    return iters, _cdiv(cols, _CB), _cdiv(rows, _RB * iters)


def batch_size(launch: Launch) -> int:
    """How many tensors of `launch`'s key one launch may step: all, but where the rows layout's fp64 sums
    (``run``) of that many would allocate more than WINDOW_BYTES (64 MiB; about 0.19 bytes an element a tensor)."""
    if launch.factored is None:
        return 1 << 30
    rows, cols = launch.key[3]
    _, col_tiles, row_tiles = _rows_geometry((rows, cols))
    return max(1, _SCRATCH_BYTES // (8 * (col_tiles * rows + row_tiles * cols)))


def run(launches: list[Launch]) -> float | None:
    """Step every tensor of `launches` (all of one ``key``) in one kernel launch, two where the first moment is
    left to the moment pass (``_layout``), and write a factored v's means from the kernel's fp64 sums. Returns
    the rule's coefficient c (the update is lr c d), or None (after one warning) where this kernel's settings
    failed to compile or launch: the caller then runs the eager step for each, and so does every later step with
    these settings. The moment pass is compiled (launched on an empty grid) before the first pass writes anything,
    so that a failure of either leaves every tensor as it was."""
    first = launches[0]
    settings = first.key[1]
    if settings in _failed:  # failed already, in a launch queued in the same step: one warning is enough
        return None
    r = _step_scalars(first)
    moments = _Moments(first)
    try:
        table = _table(launches)
        moment = _moment_pass(table, launches, moments, r)
        sums = _main_pass(table, launches, moments, r)
    except Exception as exc:  # a compile or launch failure on a device the kernel was never run on
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _failed[settings] = why
        warnings.warn(f"slimopt: the Triton element-wise step failed for rule {moments.rule!r}, weight "
                      f"{settings[1]}, codecs {[c.name for _, c in first.codecs]} ({why}); these settings run the "
                      "eager step from now on", RuntimeWarning, stacklevel=3)
        return None
    if sums is not None:
        _write_means(launches, *sums)
    if moment is not None:  # compiled and loaded above: what fails now is no compile or load, and is raised
        moment()
    return r.coef


def _step_scalars(first: Launch) -> abi.StepScalars:
    """The launch's step record (``abi.scalars``): the rule's at the moments' age, the state-free update's, or a
    projected step's write with the residual (the lifted direction's scale and free_scale in w1's and w2's
    places: the direction carries both)."""
    group, settings = first.group, first.key[1]
    if settings[0] in _LIFT_RULES:
        r = abi.scalars(group, 0, "lift")
        return dataclasses.replace(r, w1=r.lift_coef, w2=r.free_scale)
    return abi.scalars(group, first.age, "rule" if first.codecs else "free")


class _Moments:
    """What a launch's specialization reads of its moments: the rule's id, each moment's kind, map tables and
    block (the first's standing in for a missing second), the layout, and a ternary first moment's codec."""

    def __init__(self, first: Launch) -> None:
        group, codecs, settings = first.group, first.codecs, first.key[1]
        self.rule = group["rule"] if codecs else group["free_rule"]
        lift = settings[0] in _LIFT_RULES
        dummy = _placeholder(first.device)
        kinds = settings[3]
        coded = [kind in _BLOCK_KINDS or kind == _K_TERNARY for kind in kinds]
        tables = [_tables("ternary" if kind == _K_TERNARY else c.map_name, first.device) if is_coded
                  else (dummy, dummy) for (_, c), kind, is_coded in zip(codecs, kinds, coded)]
        blocks = [getattr(c, "block_size", 1) if is_coded else 1 for (_, c), is_coded in zip(codecs, coded)]
        self.m_kind, self.m_map, self.m_block = ((kinds[0], tables[0], blocks[0]) if codecs
                                                 else (_K_FP32, (dummy, dummy), 1))
        self.v_kind, self.v_map, self.v_block = ((kinds[1], tables[1], blocks[1]) if len(codecs) > 1
                                                 else (self.m_kind, self.m_map, self.m_block))
        if lift:  # the gradient's storage in the first moment's place, its part inside the subspace (fp32) in v's
            self.m_kind, self.v_kind = kinds
        self.ternary = codecs[0][1] if self.m_kind == _K_TERNARY else None
        self.m_scale_bf16 = self.ternary is not None and self.ternary.scale_dtype == torch.bfloat16
        self.layout, self.defer = _layout(kinds)
        self.rule_id = (_RULES[self.rule] if codecs else _LIFT_RULES[settings[0]] if lift
                        else _FREE_RULES[self.rule])
        self.g_bf16 = settings[2] == torch.bfloat16


def _moment_pass(table: Tensor, launches: list[Launch], mo: _Moments, r: abi.StepScalars):
    """The launch of the pass that stores a deferred first moment (None where none is deferred), compiled and
    loaded here (launched on an empty grid: a failure writes nothing), to be called after the main pass."""
    if not mo.defer:
        return None
    kernels, first, k = _triton(), launches[0], len(launches)
    ternary = mo.ternary
    grid = (_cdiv(first.blocks[0], 5) if ternary is not None else _cdiv(first.n, _TILE), k)

    def moment(grid: tuple[int, int] = grid) -> None:
        kernels.moment_step[grid](
            table, *mo.m_map, first.n, first.blocks[0], float(r.w1), float(r.w2), float(r.momentum),
            RULE=mo.rule_id, G_BF16=mo.g_bf16, M_KIND=mo.m_kind, M_BLOCK=mo.m_block,
            M_SCALE=_SCALES[ternary.scale] if ternary is not None else 0, M_SCALE_BF16=mo.m_scale_bf16,
            M_EF=ternary is not None and ternary.feedback, TILE=_TILE, **_OPTIONS)

    _, settings, maps, *_ = first.key
    if (settings, maps, first.n) not in _COMPILED:
        moment((0, k))  # compiled and loaded, nothing run: a failure here writes nothing
        _COMPILED.add((settings, maps, first.n))
    return moment


def _main_pass(table: Tensor, launches: list[Launch], mo: _Moments, r: abi.StepScalars):
    """Launch ``elementwise_step`` over `launches`; returns the rows layout's fp64 (row sums, column sums) of the
    new v, or None in the flat layout."""
    kernels, first, k = _triton(), launches[0], len(launches)
    device, shape = first.device, first.key[3]
    dummy = _placeholder(device)
    cols, denoms, row_sums, col_sums, iters = 1, dummy, dummy, dummy, 1
    if mo.layout == _L_ROWS:
        rows, cols = shape
        iters, col_tiles, row_tiles = _rows_geometry(shape)
        # the mean of v: of the row means
        denoms = torch.stack([x.factored[0].mean() for x in launches]).clamp_min_(torch.finfo(torch.float32).tiny)
        row_sums = torch.empty((k, col_tiles, rows), dtype=torch.float64, device=device)
        col_sums = torch.empty((k, row_tiles, cols), dtype=torch.float64, device=device)
        grid = (row_tiles * col_tiles, k)
    else:
        grid = (_cdiv(first.n, _TILE), k)
    kernels.elementwise_step[grid](
        table, *mo.m_map, *mo.v_map, first.n, first.blocks[0], first.blocks[1], cols, denoms, row_sums, col_sums,
        float(r.decay), float(r.alpha), float(r.w1), float(r.beta2), float(r.w2), float(r.bias2_sqrt), float(r.eps),
        float(r.momentum),
        RULE=mo.rule_id, P_BF16=first.key[1][1] == torch.bfloat16, G_BF16=mo.g_bf16, M_KIND=mo.m_kind,
        V_KIND=mo.v_kind, M_BLOCK=mo.m_block, V_BLOCK=mo.v_block, M_SCALE_BF16=mo.m_scale_bf16,
        HAS_DECAY=r.has_decay, EPS_BEFORE=r.eps_before, DIRECTION=first.direction,
        ROUNDING=_ROUNDINGS[first.key[-1]], LAYOUT=mo.layout, DEFER_M=mo.defer, TILE=_TILE, RB=_RB, CB=_CB,
        ITERS=iters, **_OPTIONS)
    return (row_sums, col_sums) if mo.layout == _L_ROWS else None


def _write_means(launches: list[Launch], row_sums: Tensor, col_sums: Tensor) -> None:
    """codecs.FactoredCodec's means from the rows layout's fp64 sums over the tiles, divided, rounded to fp32."""
    rows, cols = launches[0].key[3]
    torch._foreach_copy_([x.factored[0] for x in launches], list((row_sums.sum(1) / cols).float().unbind(0)))
    torch._foreach_copy_([x.factored[1] for x in launches], list((col_sums.sum(1) / rows).float().unbind(0)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
