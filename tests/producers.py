"""A DLPack producer fp8core does not know: the tests' way to reach its DLPack reader with the same memory its
own readers (NumPy, torch, JAX) see."""

import numpy as np

from fp8core._dlpack import CPU, Exporter


class DLPackOnly:
    """``array``'s ``__dlpack__`` and ``__dlpack_device__`` and nothing else."""

    def __init__(self, array):
        if isinstance(array, np.ndarray):  # NumPy exports none of ml_dtypes' types (bf16, fp8): fp8core's exporter
            assert array.dtype.isnative
            array = Exporter(array.ctypes.data if array.size else 0, array.shape, array.dtype.name, CPU, 0,
                             owner=array, strides=tuple(s // array.itemsize for s in array.strides))
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()
