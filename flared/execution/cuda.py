"""Thin wrappers over CuPy's CUDA runtime calls: streams, events, pinned host memory, async copies, graph launch.

Every call checks its status and raises ``ExecutionError`` (kind DEVICE)
naming the CUDA operation and the status code, so a failure on the model
thread says what failed rather than surfacing a bare CuPy exception.

Rules:
- Streams are created by torch and handed to CuPy by pointer: a pinned
  buffer used on a CuPy-created stream wrapped by torch crashed the process
  when freed (measured on the lent H200), so CuPy never owns a stream here.
- Pinned host memory comes from ``cudaHostAlloc`` through CuPy and is
  released only by ``PinnedBuffer.free``, which the owner calls after both
  streams have drained; a buffer whose drain failed is kept (leaked) on
  purpose, since the device may still write into it.
- These wrappers are the only place that imports cupy; importing this
  module on a machine without CUDA raises ImportError, which callers treat
  as "no GPU backend".
"""

from __future__ import annotations

import ctypes

import cupy
import numpy as np
from cupy.cuda import runtime as _rt

from flared.errors import ErrorKind, ExecutionError

_MEMCPY_H2D = _rt.memcpyHostToDevice
_MEMCPY_D2H = _rt.memcpyDeviceToHost
# cudaEventDisableTiming is cheaper but these events time launches; cudaEventDefault keeps timing.
_EVENT_DEFAULT = 0x0
_EVENT_DISABLE_TIMING = 0x2
_EVENT_BLOCKING_SYNC = 0x1
_NOT_READY = 600  # cudaErrorNotReady


def _fail(operation: str, exc: Exception) -> ExecutionError:
    status = getattr(exc, "status", None)
    return ExecutionError(f"CUDA {operation} failed (status {status}): {exc}", ErrorKind.DEVICE)


def check(operation: str, fn, *args):
    """Call a CuPy runtime function; raise ExecutionError(operation, status) on failure."""
    try:
        return fn(*args)
    except _rt.CUDARuntimeError as exc:
        raise _fail(operation, exc) from exc


# -- events ------------------------------------------------------------------------------------------


class Event:
    """A CUDA event (timing enabled unless ``timing=False``: an ordering-only event, cheaper to record and wait
    on). ``query`` never blocks."""

    __slots__ = ("ptr",)

    def __init__(self, timing: bool = True):
        flags = _EVENT_DEFAULT if timing else _EVENT_DISABLE_TIMING
        self.ptr = check("cudaEventCreateWithFlags", _rt.eventCreateWithFlags, flags)

    def record(self, stream_ptr: int) -> None:
        check("cudaEventRecord", _rt.eventRecord, self.ptr, stream_ptr)

    def query(self) -> bool:
        """True once every recorded work is done; False while pending."""
        try:
            _rt.eventQuery(self.ptr)
            return True
        except _rt.CUDARuntimeError as exc:
            if exc.status == _NOT_READY:
                return False
            raise _fail("cudaEventQuery", exc) from exc

    def synchronize(self) -> None:
        check("cudaEventSynchronize", _rt.eventSynchronize, self.ptr)

    def elapsed_ns(self, start: Event) -> int:
        return int(check("cudaEventElapsedTime", _rt.eventElapsedTime, start.ptr, self.ptr) * 1e6)

    def destroy(self) -> None:
        if self.ptr:
            check("cudaEventDestroy", _rt.eventDestroy, self.ptr)
            self.ptr = 0


def stream_wait_event(stream_ptr: int, event: Event) -> None:
    check("cudaStreamWaitEvent", _rt.streamWaitEvent, stream_ptr, event.ptr, 0)


def stream_synchronize(stream_ptr: int) -> None:
    check("cudaStreamSynchronize", _rt.streamSynchronize, stream_ptr)


# -- memory ------------------------------------------------------------------------------------------


class PinnedBuffer:
    """Page-locked host bytes with a numpy view. Freed only by ``free()`` (see rules)."""

    __slots__ = ("ptr", "nbytes", "array")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = check("cudaHostAlloc", _rt.hostAlloc, nbytes, 0)
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))

    def free(self) -> None:
        if self.ptr:
            self.array = None
            check("cudaFreeHost", _rt.freeHost, self.ptr)
            self.ptr = 0


def copy_h2d_async(dst_device_ptr: int, src_host_ptr: int, nbytes: int, stream_ptr: int) -> None:
    check("cudaMemcpyAsync(host->device)", _rt.memcpyAsync, dst_device_ptr, src_host_ptr, nbytes, _MEMCPY_H2D,
          stream_ptr)


def copy_d2h_async(dst_host_ptr: int, src_device_ptr: int, nbytes: int, stream_ptr: int) -> None:
    check("cudaMemcpyAsync(device->host)", _rt.memcpyAsync, dst_host_ptr, src_device_ptr, nbytes, _MEMCPY_D2H,
          stream_ptr)


# -- graphs ------------------------------------------------------------------------------------------


def graph_launch(graph_exec: int, stream_ptr: int) -> None:
    """Launch a ``cudaGraphExec_t`` (torch's ``CUDAGraph.raw_cuda_graph_exec()``) on a stream."""
    check("cudaGraphLaunch", _rt.graphLaunch, graph_exec, stream_ptr)


# -- kernels -----------------------------------------------------------------------------------------


def launch_kernel(function: int, blocks: int, threads: int, shared_bytes: int, stream_ptr: int, args,
                  pdl: bool = False) -> None:
    """Launch a loaded kernel (a ``CUfunction``) as ``blocks`` x ``threads`` with ``shared_bytes`` of dynamic shared
    memory on a stream (torch's capturing stream records it into the graph); ``args``: the host address of each
    argument's value, in order (a ctypes object's ``ctypes.addressof``, a tensor map's bytes). With ``pdl`` it is
    a programmatic dependent launch (``cuLaunchKernelEx``): its blocks may start before the kernel ahead of it on
    the stream has finished, and must wait for it (``griddepcontrol.wait``) before reading its results."""
    params = (ctypes.c_void_p * len(args))(*args)
    if pdl:
        attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1  # programmaticStreamSerializationAllowed (the union's first int)
        config = _LaunchConfig(blocks, 1, 1, threads, 1, 1, shared_bytes, stream_ptr, ctypes.pointer(attr), 1)
        status = _driver().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(function), params, None)
        if status != 0:
            raise ExecutionError(f"CUDA cuLaunchKernelEx failed (status {status})", ErrorKind.DEVICE)
        return
    try:
        cupy.cuda.driver.launchKernel(function, blocks, 1, 1, threads, 1, 1, shared_bytes, stream_ptr,
                                      ctypes.addressof(params), 0)
    except cupy.cuda.driver.CUDADriverError as exc:
        raise _fail("cuLaunchKernel", exc) from exc


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding, then a 64-byte value union (8-byte aligned)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_libcuda = None


def _driver():
    """The CUDA driver library through ctypes, for the calls CuPy does not wrap (cuLaunchKernelEx)."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _libcuda = lib
    return _libcuda


def set_device(ordinal: int) -> None:
    """Make the device's primary context current on the calling thread (a worker thread needs it)."""
    check("cudaSetDevice", _rt.setDevice, ordinal)


def device_synchronize() -> None:
    check("cudaDeviceSynchronize", _rt.deviceSynchronize)


__all__ = ["Event", "PinnedBuffer", "check", "copy_d2h_async", "copy_h2d_async", "cupy", "device_synchronize",
           "launch_kernel",
           "graph_launch", "set_device", "stream_synchronize", "stream_wait_event"]
