"""The GPU GEMM: cuBLASLt through NVIDIA's generated bindings (``nvmath.bindings.cublasLt``).

Row-major ``D[M, N] = a[M, K] · b[N, K]ᵀ`` is column-major ``Dᵀ[N, M] = b · aᵀ``: cuBLASLt's "TN" form with
b as its A (transposed, K x N, ld K) and a as its B (K x M, ld K), the only FP8 layout Hopper and Ada
support, so nothing is transposed at call time. Scales, out_scale and the output amax are device pointers.
Everything is launched on the caller's stream, and allocated by the caller's allocator; cuda.gemm runs this
inside its device guard.

Plans: per (thread, device, spec, alignment, workspace size) the matmul descriptor, the four layouts and the
heuristic's algorithm; each call only rewrites the pointer attributes. A bounded LRU per thread (M varies from
call to call), destroyed when the thread ends.

Handles, as torch keeps them: a thread takes one per device from the device's pool at its first GEMM there, and
gives it back when the thread ends (its thread-local lease is collected), so a thread pool's turnover reuses
handles instead of creating one per thread that ever ran a GEMM.

Workspaces (with a scratch in their last bytes: the AMAX_D word and the staged scales) follow one rule: **a workspace is never used by two
GEMMs that can run at once, and there are at most** ``_WORKSPACES_PER_DEVICE`` **per device.**
- Outside a capture, each stream has its own (the per-thread default stream, one handle for every thread, has one
  per thread), so GEMMs on different streams run concurrently. A stream with none when the device has its bound
  takes over the least recently used one. Every GEMM makes its stream wait (cudaStreamWaitEvent, no host sync)
  for the event recorded after the last GEMM that used the workspace, on whatever stream it ran: a stream that
  takes one over, a new stream given the handle of a destroyed one, or a thread given a dead thread's id waits for
  the previous user instead of racing it. Host-side, a workspace's wait, matmul and record are one critical
  section, so the event waited for is always the last use's.
- During a graph capture (cudaStreamIsCapturing on the launch stream) the pool is not used: graphs captured on
  one stream and replayed on several would share a pooled workspace. A torch caller's GEMM takes a workspace of
  its own from torch's allocator, which keeps it in the graph's private pool as long as the graph (a block freed
  during the capture serves the capture's later GEMMs, in stream order). Under CuPy's capture a temporary would be
  freed while the graph still reads it (see cuda_call.capture_outlives), so the GEMM runs with no workspace (cuBLASLt
  then picks an algorithm that needs none) and an ``out_amax`` or a scale off a 16-byte boundary, which need the
scratch, are refused by name.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._caches import cached
from .._views import Tensor, storage_dtype
from ..extras import install_hint
from ..formats import E2M1, ENCODINGS
from ..layouts import Layout
from .cuda_blocks import layout_for_cublaslt
from .cuda_call import empty, merge_amax

_CUDA_R = {"float32": 0, "float16": 2, "bfloat16": 14,
           **{row.dtype_name: row.cuda_data_type for row in (*ENCODINGS.values(), E2M1)}}
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_WORKSPACE_SM90 = 32 << 20  # Hopper and newer pick faster split-K/stream-K kernels with room to spare
_WORKSPACE_OLDER = 4 << 20
MIN_COMPUTE_CAPABILITY = 89
_SCRATCH = 256  # bytes at the workspace's end, kept from cuBLASLt for the amax word and the staged scales
# cuBLASLt answered CUBLAS_STATUS_NOT_SUPPORTED for a scale pointer 4 bytes past a 16-byte boundary (H200, cuBLAS
# 13.1: torch.compile passed a view of a state's second scale_inv). Such a scale is copied, on the caller's stream,
# into a 16-byte slot of the scratch: slot 0 holds the amax word, slots 1-3 a_scale_inv, b_scale_inv, out_scale.
_SLOT = 16
_MEMCPY_DEVICE_TO_DEVICE = 3

_PLANS_PER_THREAD = 64      # LRU bound of the plan cache
_WORKSPACES_PER_DEVICE = 8  # 256 MiB at most on Hopper and newer
_PER_THREAD_STREAM = 2      # cudaStreamPerThread: one handle, a different stream in every thread
_EVENT_DISABLE_TIMING = 2   # cudaEventDisableTiming

_local = threading.local()
_lock = threading.Lock()
_handle_pool: dict[int, list[int]] = {}  # device -> handles no live thread holds
# Reentrant: a lease is given back by whichever thread drops the dead thread's storage, maybe one inside _handle.
_handle_lock = threading.RLock()


def lt_bindings() -> Any:
    try:
        from nvmath.bindings import cublasLt
    except ImportError as e:
        raise ImportError("fp8core.gemm on a GPU calls cuBLASLt through nvmath-python; install it with "
                          + install_hint("gemm")) from e
    return cublasLt


def _runtime() -> Any:
    from cupy_backends.cuda.api import runtime

    return runtime


@cached("cublaslt.compute_capability")
def compute_capability(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def _check_device(device_id: int) -> None:
    cc = compute_capability(device_id)
    if cc < MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"a: FP8 GEMM needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                         f"cuda:{device_id} is {cc // 10}.{cc % 10}")


class _Lease:
    """This thread's handles (device -> handle) and plans, given back by :func:`_give_back` when the thread ends
    to the pool they came from and destroyed by the bindings that made them (both bound when the lease is made:
    a lease that outlives a swap of either, as a test's stand-in, must not hand its handles to the other)."""

    __slots__ = ("handles", "plans", "pool", "bindings", "__weakref__")

    def __init__(self, pool: dict[int, list[int]], bindings: Any) -> None:
        self.handles: dict[int, int] = {}
        self.plans: OrderedDict = OrderedDict()
        self.pool, self.bindings = pool, bindings


def _give_back(handles: dict[int, int], plans: OrderedDict, pool: dict[int, list[int]], bindings: Any) -> None:
    with _handle_lock:
        for device_id, handle in handles.items():
            pool.setdefault(device_id, []).append(handle)
    if plans:
        lt = bindings()
        while plans:
            _destroy(lt, plans.popitem()[1])


def _lease() -> _Lease:
    lease = getattr(_local, "lease", None)
    if lease is None:
        lease = _local.lease = _Lease(_handle_pool, lt_bindings)
        # Runs when the thread's local storage goes (the thread ended); not at interpreter exit, when cuBLASLt
        # may be unloaded already.
        weakref.finalize(lease, _give_back, lease.handles, lease.plans, lease.pool, lease.bindings).atexit = False
    return lease


def _handle(device_id: int) -> int:
    """This thread's handle on device_id (inside the device guard): from the lease's pool, else a new one."""
    lease = _lease()
    handle = lease.handles.get(device_id)
    if handle is None:
        with _handle_lock:
            pool = lease.pool.get(device_id)
            handle = pool.pop() if pool else None
        if handle is None:
            handle = lease.bindings().create()
        lease.handles[device_id] = handle
    return handle


def _workspace_size(device_id: int) -> int:
    return _WORKSPACE_SM90 if compute_capability(device_id) >= 90 else _WORKSPACE_OLDER


class _Workspace:
    """A pooled workspace, the event recorded after the last GEMM that used it, and the lock that makes a GEMM's
    wait, matmul and record one step (see the module's rule)."""

    __slots__ = ("array", "event", "lock")

    def __init__(self, array: Any, event: int) -> None:
        self.array, self.event, self.lock = array, event, threading.Lock()


_workspaces: dict[int, OrderedDict] = {}  # device -> stream key -> _Workspace, least recently used first


def _workspace(device_id: int, stream: int, t: Tensor) -> _Workspace:
    """The workspace of ``stream`` on device_id outside a capture (module docstring); its last _SCRATCH bytes are
    kept for the AMAX_D word and the staged scales. Allocated by the caller's allocator, at most
    _WORKSPACES_PER_DEVICE per device."""
    key = (stream, threading.get_ident() if stream == _PER_THREAD_STREAM else 0)
    with _lock:
        table = _workspaces.setdefault(device_id, OrderedDict())
        ws = table.get(key)
        if ws is not None:
            table.move_to_end(key)
            return ws
        if len(table) >= _WORKSPACES_PER_DEVICE:
            ws = table.popitem(last=False)[1]  # taken over: the GEMM waits for its last use
        else:
            ws = _Workspace(empty((_workspace_size(device_id),), np.uint8, t),
                            _runtime().eventCreateWithFlags(_EVENT_DISABLE_TIMING))
        table[key] = ws
        return ws


def _set(setter: Any, dtype_of: Any, obj: int, attr: Any, value: Any) -> None:
    buf = np.array(value, dtype=dtype_of(attr))
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


@dataclass
class _Plan:
    desc: int
    layouts: tuple[int, int, int, int]   # A (= b), B (= a), C, D
    algo: Any                             # MatmulHeuristicResult, kept alive for its pointer
    fp8_out: bool
    device_alpha: bool = False            # alpha and beta are read from the device (NVFP4's alpha)


def _alignment(ptrs: list[int]) -> int:
    """The largest of 256 and 16 that every pointer meets: the heuristic's promise is cached with the plan."""
    return 256 if all(p % 256 == 0 for p in ptrs) else 16


def _set_pointers(lt: Any, plan: _Plan, a_s: int, b_s: int, bias: int, out_scale: int, amax: int) -> None:
    A = lt.MatmulDescAttribute
    put = lambda attr, v: _set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, plan.desc, attr, v)  # noqa: E731
    put(A.A_SCALE_POINTER, b_s)  # cuBLASLt's A is our b
    put(A.B_SCALE_POINTER, a_s)
    if bias:
        put(A.BIAS_POINTER, bias)
    if plan.fp8_out:
        put(A.D_SCALE_POINTER, out_scale)
        if amax:
            put(A.AMAX_D_POINTER, amax)


def _make_plan(lt: Any, spec: Any, handle: int, workspace_bytes: int, align: int, pointers: tuple) -> _Plan:
    """workspace_bytes: the most the algorithm may use (0 under a CuPy capture, see the module docstring)."""
    desc = lt.matmul_desc_create(_COMPUTE_32F, _CUDA_R["float32"])
    layouts: list[int] = []
    try:
        return _configure(lt, spec, handle, workspace_bytes, align, pointers, desc, layouts)
    except BaseException:  # nothing of a plan that failed outlives it
        for layout in layouts:
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(desc)
        raise


def _configure(lt: Any, spec: Any, handle: int, workspace_bytes: int, align: int, pointers: tuple, desc: int,
               layouts: list[int]) -> _Plan:
    A = lt.MatmulDescAttribute
    put = lambda d, attr, v: _set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, d, attr, v)  # noqa: E731
    put(desc, A.TRANSA, _OP_T)
    put(desc, A.TRANSB, _OP_N)
    put(desc, A.FAST_ACCUM, 1 if spec.fast_accum else 0)
    if spec.a_block is not None:
        _set_block_scale_modes(lt, desc, spec)
    device_alpha = nvfp4(spec)
    if device_alpha:  # alpha = S_dec_a * S_dec_b stays where the amaxes are: no host sync (beta reads from there too)
        put(desc, A.POINTER_MODE, int(lt.PointerMode.DEVICE))
    fp8_out = spec.out_fmt is not None
    if spec.bias_dtype is not None:
        put(desc, A.EPILOGUE, int(lt.Epilogue.BIAS))
        put(desc, A.BIAS_DATA_TYPE, _CUDA_R[spec.bias_dtype])
    # An fp8 output's C type is the bias type (cuBLASLt's FP8 table); C itself is never read (beta = 0).
    c_type = _CUDA_R[spec.bias_dtype or "bfloat16"] if fp8_out else _CUDA_R[spec.out_dtype]
    m, n, k = spec.m, spec.n, spec.k
    for args in ((_CUDA_R[spec.b_fmt.dtype_name], k, n, k), (_CUDA_R[spec.a_fmt.dtype_name], k, m, k),
                 (c_type, n, m, n), (_CUDA_R[spec.out_dtype], n, m, n)):
        layouts.append(lt.matrix_layout_create(*args))
    plan = _Plan(desc, tuple(layouts), lt.MatmulHeuristicResult(1), fp8_out, device_alpha)  # type: ignore[arg-type]
    _set_pointers(lt, plan, *pointers)
    P = lt.MatmulPreferenceAttribute
    pref = lt.matmul_preference_create()
    found = np.zeros(1, dtype=np.int32)
    try:
        pset = lambda attr, v: _set(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype,  # noqa: E731
                                    pref, attr, v)
        pset(P.MAX_WORKSPACE_BYTES, workspace_bytes)
        for attr in (P.MIN_ALIGNMENT_A_BYTES, P.MIN_ALIGNMENT_B_BYTES, P.MIN_ALIGNMENT_C_BYTES,
                     P.MIN_ALIGNMENT_D_BYTES):
            pset(attr, align)
        try:
            lt.matmul_algo_get_heuristic(handle, desc, *layouts, pref, 1, plan.algo.ptr, found.ctypes.data)
        except lt.cuBLASLtError as e:  # NOT_SUPPORTED when no kernel takes these shapes, types and scale modes
            raise RuntimeError(_no_algorithm(spec, e)) from e
    finally:
        lt.matmul_preference_destroy(pref)
    if found[0] == 0:
        raise RuntimeError(_no_algorithm(spec, None))
    return plan


def _no_algorithm(spec: Any, cause: Any) -> str:
    """What the heuristic was asked for, and why it answered none."""
    blocks = f", blocks a {spec.a_block} x b {spec.b_block}" if spec.a_block is not None else ""
    kind = "FP4" if spec.a_fmt is E2M1 else "FP8"
    msg = (f"cuBLASLt found no {kind} GEMM algorithm for M={spec.m}, N={spec.n}, K={spec.k}, a {spec.a_fmt.name} x "
           f"b {spec.b_fmt.name} -> {spec.out_dtype}, bias {spec.bias_dtype}, fast_accum {spec.fast_accum}{blocks}")
    if cause is not None:
        msg += f" ({cause})"
    return msg


_ONE = np.ones(1, dtype=np.float32)
_ZERO = np.zeros(1, dtype=np.float32)


def scalars(plan: _Plan, alpha: Any | None) -> tuple[int, int]:
    """The (alpha, beta) pointers of cublasLtMatmul: the host's 1 and 0, or in the device pointer mode (NVFP4) the
    two floats of ``alpha``, a float32 [2] device array (cuda_fp4.gemm_alpha) that must then be given."""
    if not plan.device_alpha:
        return _ONE.ctypes.data, _ZERO.ctypes.data
    if alpha is None:
        raise ValueError("alpha: an NVFP4 GEMM reads alpha and beta from the device; pass cuda_fp4.gemm_alpha's array")
    return alpha.data.ptr, alpha.data.ptr + alpha.itemsize


def _plans() -> OrderedDict:
    return _lease().plans


def _destroy(lt: Any, plan: _Plan) -> None:
    """cuBLASLt reads the descriptors at call time (and at capture): an evicted plan can go at once."""
    for layout in plan.layouts:
        lt.matrix_layout_destroy(layout)
    lt.matmul_desc_destroy(plan.desc)


def _remember(lt: Any, plans: OrderedDict, key: Any, plan: _Plan) -> _Plan:
    """Insert plan as the most recent; the least recent beyond _PLANS_PER_THREAD are destroyed."""
    plans[key] = plan
    while len(plans) > _PLANS_PER_THREAD:
        _destroy(lt, plans.popitem(last=False)[1])
    return plan


def staged_scales(pointers: tuple[int, ...], scratch: int) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """(pointers, copies): ``pointers`` (a_scale_inv, b_scale_inv, bias, out_scale, amax) with each per-tensor scale
    not 16-byte aligned replaced by its slot in the scratch at ``scratch`` (0: none, as in a CuPy capture, which
    then refuses it), and the 4-byte (source, slot) copies that must run first."""
    staged, copies = list(pointers), []
    for i, slot, arg in ((0, 1, "a_scale_inv"), (1, 2, "b_scale_inv"), (3, 3, "out_scale")):
        if pointers[i] % _SLOT:
            if not scratch:
                raise ValueError(f"{arg}: cuBLASLt needs a 16-byte aligned scale, and inside a CuPy capture fp8core "
                                 "has no scratch to copy it to; pass a fresh 1-element array")
            staged[i] = scratch + slot * _SLOT
            copies.append((pointers[i], staged[i]))
    return tuple(staged), copies


def gemm(spec: Any, a: Tensor, b: Tensor, a_scale_inv: Any, b_scale_inv: Any, bias: Tensor | None,
         out_scale: Any | None, out_amax: Any | None, out: Any | None, stream: int, alpha: Any | None = None) -> Any:
    """stream: the raw handle of the caller's stream. FP4 (``spec.a_fmt`` E2M1): a_scale_inv and b_scale_inv are the
    operands' block scales already in cuBLASLt's layout (cuda_fp4.gemm), and ``alpha`` (NVFP4) a float32 [2] device
    array (alpha, beta), read by cuBLASLt in its device pointer mode."""
    device_id = a.device[1]
    if spec.a_fmt is E2M1:
        check_fp4_device(device_id)
    else:
        _check_device(device_id)
    lt = lt_bindings()
    if spec.m == 0:
        d = out if out is not None else empty((spec.m, spec.n), storage_dtype(spec.out_dtype), a)
        if out_amax is not None:  # amax of an empty D is 0, merged as the CPU merges it (-0.0 becomes 0)
            merge_amax(out_amax, None, device_id, stream)
        return d
    capturing = bool(_runtime().streamIsCapturing(stream))  # CuPy raises on an invalidated capture
    cupy_capture = capturing and not a.caller.graph_safe
    if cupy_capture and out_amax is not None:
        raise ValueError("out_amax: cuBLASLt writes the output's amax to a device scratch word, which a graph "
                         "captured with CuPy would read after it is freed; call this GEMM outside the capture, or "
                         "capture with torch.cuda.graph (whose private pool keeps it)")
    d = out if out is not None else empty((spec.m, spec.n), storage_dtype(spec.out_dtype), a)
    if spec.a_block is not None and spec.a_fmt is not E2M1:
        a_scale_inv, b_scale_inv = _block_scales(spec, device_id, a, a_scale_inv, b_scale_inv, stream)
    pooled = None
    if cupy_capture:
        ws = None
    elif capturing:
        ws = empty((_workspace_size(device_id),), np.uint8, a)  # the graph's own, from its private pool
    else:
        pooled = _workspace(device_id, stream, a)
        ws = pooled.array
    ws_bytes = 0 if ws is None else ws.nbytes - _SCRATCH
    # cuBLASLt overwrites AMAX_D; the contract accumulates, so it writes a scratch word, merged after. The word
    # lives past the end of the workspace cuBLASLt is given.
    scratch = ws[-_SCRATCH:].view(np.float32)[:1] if out_amax is not None else None
    ptr = lambda x: 0 if x is None else int(x.data.ptr)  # noqa: E731
    align = _alignment([ptr(a.data), ptr(b.data), ptr(d)])
    pointers = (ptr(a_scale_inv), ptr(b_scale_inv), ptr(bias.data) if bias is not None else 0, ptr(out_scale),
                ptr(scratch))
    copies = []
    if spec.a_block is None:  # block scales are cuBLASLt-laid-out arrays of their own
        pointers, copies = staged_scales(pointers, 0 if ws is None else ws.data.ptr + ws.nbytes - _SCRATCH)
    handle = _handle(device_id)
    plans = _plans()
    key = (device_id, spec, align, out_amax is not None, ws_bytes)
    plan = plans.get(key)
    if plan is None:
        plan = _remember(lt, plans, key, _make_plan(lt, spec, handle, ws_bytes, align, pointers))
    else:
        plans.move_to_end(key)
        _set_pointers(lt, plan, *pointers)
    c_ptr = 0 if plan.fp8_out else ptr(d)
    alpha_ptr, beta_ptr = scalars(plan, alpha)

    def run() -> None:
        for src, dst in copies:
            _runtime().memcpyAsync(dst, src, 4, _MEMCPY_DEVICE_TO_DEVICE, stream)
        lt.matmul(handle, plan.desc, alpha_ptr, ptr(b.data), plan.layouts[0], ptr(a.data), plan.layouts[1],
                  beta_ptr, c_ptr, plan.layouts[2], ptr(d), plan.layouts[3], plan.algo.ptr, ptr(ws), ws_bytes, stream)
        if scratch is not None:
            merge_amax(out_amax, scratch, device_id, stream)  # max(out_amax, |amax(D)|); NaN propagates

    if pooled is None:
        run()
    else:
        with pooled.lock:
            _runtime().streamWaitEvent(stream, pooled.event, 0)  # after the workspace's last GEMM, any stream
            run()
            _runtime().eventRecord(pooled.event, stream)
    return d


# ---- block scaling (fp8core.blocks): the scale modes and the scale layouts cuBLASLt reads ------------------
# Kept apart from the plan cache and workspace above: a plan of a block-scaled spec differs only by the two
# scale-mode attributes, and its scale "pointers" are the operands' block scales rearranged for cuBLASLt.

MIN_BLOCK_VERSION = 120900  # cuBLAS 12.9: VEC128_32F, BLK128x128_32F and OUTER_VEC_32F


def _scale_mode(lt: Any, layout: Layout) -> int:
    """NVFP4's 16x16 weight tiles are read as 1x16 blocks: cuda_fp4.gemm_scale repeats each tile's scale on its 16
    rows (as Transformer Engine does), since cuBLASLt has no 2D mode for FP4."""
    M = lt.MatmulMatrixScale
    return int({Layout.MX_ROWWISE: M.VEC32_UE8M0, Layout.BLOCK_1X128: M.VEC128_32F,
                Layout.BLOCK_128X128: M.BLK128x128_32F, Layout.NVFP4_1X16: M.VEC16_UE4M3,
                Layout.NVFP4_16X16: M.VEC16_UE4M3, Layout.ROWWISE: M.OUTER_VEC_32F}[layout])


def nvfp4(spec: Any) -> bool:
    """Whether spec is an NVFP4 GEMM (E4M3 block scales and a per-tensor alpha from the global amaxes)."""
    return spec.a_fmt is E2M1 and spec.a_block in (Layout.NVFP4_1X16, Layout.NVFP4_16X16)


# cuBLASLt's block-scaled FP4 GEMM (CUDA_R_4F_E2M1 with VEC16_UE4M3 or VEC32_UE8M0 scales): cuBLAS 12.8 on the
# tensor cores of Blackwell's families, sm_100/sm_103 (10.x), Thor (11.0) and sm_120/sm_121 (12.x); none before.
MIN_FP4_VERSION = 120800
FP4_MAJORS = (10, 11, 12)


def check_fp4_device(device_id: int) -> None:
    """A clear ValueError where cuda:device_id has no FP4 GEMM: its compute capability, or cuBLAS before 12.8."""
    cc = compute_capability(device_id)
    if cc // 10 not in FP4_MAJORS:
        raise ValueError(f"a: an FP4 GEMM (NVFP4, MXFP4) needs a GPU of compute capability 10.x, 11.x or 12.x "
                         f"(Blackwell), whose cuBLASLt has block-scaled FP4; cuda:{device_id} is "
                         f"{cc // 10}.{cc % 10}: move the operands to the CPU (the exact emulation), or dequantize "
                         f"them and use a high-precision GEMM")
    version = int(lt_bindings().get_version())
    if version < MIN_FP4_VERSION:
        raise ValueError(f"a: an FP4 GEMM needs cuBLAS 12.8 or newer, found {version}")


def _set_block_scale_modes(lt: Any, desc: int, spec: Any) -> None:
    A = lt.MatmulDescAttribute
    put = lambda attr, v: _set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc, attr, v)  # noqa: E731
    put(A.A_SCALE_MODE, _scale_mode(lt, spec.b_block))  # cuBLASLt's A is our b
    put(A.B_SCALE_MODE, _scale_mode(lt, spec.a_block))


def _block_scales(spec: Any, device_id: int, a: Tensor, a_scale: Any, b_scale: Any, stream: int) -> tuple[Any, Any]:
    """The operands' block scales rearranged for cuBLASLt on ``stream`` (a raw handle), inside cuda.gemm's guard."""
    cc = compute_capability(device_id)
    mx = spec.a_block == Layout.MX_ROWWISE
    if mx and cc < 100:
        raise ValueError(f"a: an MXFP8 GEMM needs a GPU of compute capability 10.0 or newer (Blackwell); "
                         f"cuda:{device_id} is {cc // 10}.{cc % 10}")
    if spec.a_block == Layout.ROWWISE:
        # OUTER_VEC_32F is an sm_90 mode (NVIDIA/CUDALibrarySamples#270; PyTorch's rowwise _scaled_mm leaves
        # cuBLASLt for CUTLASS on sm_100/sm_120, PRs #160693 and #161236). The vectors are read as they are.
        if cc != 90:
            raise ValueError(f"a: a rowwise-scaled GEMM (one scale per row) needs a GPU of compute capability 9.0 "
                             f"(Hopper), where cuBLASLt has its outer-vector scale mode; cuda:{device_id} is "
                             f"{cc // 10}.{cc % 10}")
        version = int(lt_bindings().get_version())
        if version < MIN_BLOCK_VERSION:
            raise ValueError(f"a: a rowwise-scaled GEMM needs cuBLAS 12.9 or newer, found {version}")
        for arg, vector in (("a.scale_inv", a_scale), ("b.scale_inv", b_scale)):
            if vector.data.ptr % 16:  # cuBLASLt reads the vectors in place: its 16-byte rule for scale arrays
                raise ValueError(f"{arg}: its data pointer must be 16-byte aligned (cuBLASLt reads the scale "
                                 "vector in place); pass a fresh contiguous copy")
        return a_scale, b_scale
    if not mx:
        # cuBLASLt has the VEC128_32F/BLK128x128_32F scale modes on sm_90 only (torch's tests xfail them elsewhere,
        # PR #188996; Transformer Engine emulates its blockwise recipe through MXFP8 on Blackwell).
        if cc != 90:
            hint = "; on Blackwell use MXFP8 blocks (fp8core.blocks.quantize_mxfp8)" if cc >= 100 else ""
            raise ValueError(f"a: a 1x128/128x128 block GEMM needs a GPU of compute capability 9.0 (Hopper), where "
                             f"cuBLASLt has these scale modes; cuda:{device_id} is {cc // 10}.{cc % 10}{hint}")
        version = int(lt_bindings().get_version())
        if version < MIN_BLOCK_VERSION:
            raise ValueError(f"a: a 1x128/128x128 block GEMM needs cuBLAS 12.9 or newer, found {version}")
    return (layout_for_cublaslt(a_scale, spec.a_block, a, stream),
            layout_for_cublaslt(b_scale, spec.b_block, a, stream))
