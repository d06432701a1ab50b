"""Device state a candidate could leave behind to speed up its next timed call, reset
before every timed sample (issue 47): the persisting-L2 set-aside
(``cudaLimitPersistingL2CacheSize``), the lines already marked persisting
(``cuCtxResetPersistingL2Cache``) and an access-policy window on the timing stream.

A kernel that marks its input persisting keeps it in L2 across calls, past the flush
kf writes between samples; llm.c #851 read 3,530 GB/s so on a card whose memory peaks at
864. With the set-aside at 0 no line can persist, so a window on any other stream the
candidate made does nothing either.

The driver's functions (``libcuda.so.1``: the primary context torch made is current on
the runner's thread) are bound when the CUDA backend is made, before any candidate code
is imported, so a candidate cannot replace them by name.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["DeviceState", "PolicyWindow"]

_CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1


class PolicyWindow(ctypes.Structure):
    """``CUaccessPolicyWindow``."""

    _fields_ = [
        ("base_ptr", ctypes.c_void_p),
        ("num_bytes", ctypes.c_size_t),
        ("hitRatio", ctypes.c_float),
        ("hitProp", ctypes.c_int),
        ("missProp", ctypes.c_int),
    ]


class _AttributeValue(ctypes.Union):
    """``CUlaunchAttributeValue`` (64 bytes; the window is the member kf uses)."""

    _fields_ = [("accessPolicyWindow", PolicyWindow), ("pad", ctypes.c_char * 64)]


class DeviceState:
    """The persisting-L2 state of the current CUDA context and of one stream (the
    stream torch times on: ``stream`` is its ``cudaStream_t`` as an int, 0 for the
    legacy default stream). ``driver``: a loaded ``libcuda`` (tests pass their own)."""

    def __init__(self, stream: int, driver: Any = None) -> None:
        lib = driver if driver is not None else ctypes.CDLL("libcuda.so.1")
        self._get_limit, self._set_limit = lib.cuCtxGetLimit, lib.cuCtxSetLimit
        self._set_limit.argtypes = [ctypes.c_int, ctypes.c_size_t]
        self._reset_lines = lib.cuCtxResetPersistingL2Cache
        self._get_attr, self._set_attr = lib.cuStreamGetAttribute, lib.cuStreamSetAttribute
        self._stream = ctypes.c_void_p(stream)
        self._byref, self._size_t = ctypes.byref, ctypes.c_size_t

    def set_aside(self) -> int:
        """The persisting-L2 set-aside in bytes now (-1: the driver would not say)."""
        value = self._size_t()
        rc = self._get_limit(self._byref(value), _CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
        return int(value.value) if rc == 0 else -1

    def window_bytes(self) -> int:
        """The bytes the stream's access-policy window covers (0: none; -1: unknown)."""
        value = _AttributeValue()
        attr = _CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW
        rc = self._get_attr(self._stream, attr, self._byref(value))
        return int(value.accessPolicyWindow.num_bytes) if rc == 0 else -1

    def reset(self) -> str:
        """Reset the state; what was found set (empty: nothing), for the timing's record."""
        found = []
        aside = self.set_aside()
        if aside != 0:
            self._set_limit(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0)
            found.append(f"a persisting-L2 set-aside of {aside} bytes")
        window = self.window_bytes()
        if window > 0:
            cleared = _AttributeValue()  # num_bytes 0: no window
            attr = _CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW
            self._set_attr(self._stream, attr, self._byref(cleared))
            found.append(f"an access-policy window of {window} bytes on the timing stream")
        self._reset_lines()  # lines marked persisting before the set-aside went to 0
        return "; ".join(found)
