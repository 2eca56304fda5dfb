"""ctypes declarations of the DLPack ABI, for tests that hand-make capsules (tests/ops: test_interop and the
device tests)."""
import ctypes


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor)]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_NAME = ctypes.c_char_p(b"dltensor_versioned")  # capsule names must outlive the capsule


# ---- emulated device tensors ----------------------------------------------------------------------------------
# For the emulated build (HETEROSPEC_CUDA=emu: the device tests of tests/ops, tests/fuzz/fuzz_ops.py): a NumPy array's
# memory exported through DLPack as if it lived on cuda:0.

_CODES = {"f": 2, "i": 0, "u": 1, "b": 6, "c": 5}
_NOOP = _DELETER(lambda _p: None)
_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


class EmuCuda:
    """An array 'on cuda:0' for the emulated build (its memory is the NumPy array's).  A non-C-contiguous array
    is exported with its strides (in elements; a byte stride that is no multiple of the item size cannot be
    said in DLPack and raises here); ``readonly`` sets DLPack's read-only flag."""

    def __init__(self, arr, bf16=False, device_id=0, readonly=False):
        self.arr = arr
        self.bf16 = bf16
        self.device_id = device_id
        self.streams = []
        self.ndim, self.shape = arr.ndim, arr.shape
        self._shape = (ctypes.c_int64 * max(arr.ndim, 1))(*arr.shape)
        self.m = _ManagedVersioned()
        self.m.version = _Version(1, 0)
        self.m.deleter = _NOOP
        self.m.flags = _READ_ONLY if readonly else 0
        t = self.m.dl_tensor
        t.data = arr.ctypes.data
        t.device = _Device(2, device_id)
        t.ndim = arr.ndim
        t.dtype = _DType(4, 16, 1) if bf16 else _DType(_CODES[arr.dtype.kind], arr.dtype.itemsize * 8, 1)
        t.shape = self._shape
        if not arr.flags.c_contiguous:
            if any(s % arr.itemsize for s in arr.strides):
                raise ValueError(f"EmuCuda: byte strides {arr.strides} are not whole elements of {arr.itemsize} bytes")
            self._strides = (ctypes.c_int64 * max(arr.ndim, 1))(*(s // arr.itemsize for s in arr.strides))
            t.strides = self._strides

    def __dlpack_device__(self):
        return (2, self.device_id)

    def __dlpack__(self, stream=None, max_version=None):
        self.streams.append(stream)
        return _PyCapsule_New(ctypes.addressof(self.m), _NAME.value, None)

    def __getitem__(self, idx):
        return EmuCuda(self.arr[idx]) if isinstance(idx, slice) and self.arr[idx].flags.c_contiguous else self.arr[idx]

    def __len__(self):
        return len(self.arr)


def _register_emu_allocator():
    import numpy as np

    from heterospec import ops

    ops._ALLOCATORS[EmuCuda] = lambda like: (lambda shape, dtype: EmuCuda(np.empty(shape, dtype=dtype)))


_register_emu_allocator()
