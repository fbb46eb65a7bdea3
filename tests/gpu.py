"""Why the GPU tests of this run skip (None when a CUDA device is usable), shared by the CUDA test
files."""
import pytest

from gyges import _C


def _gpu_skip_reason():
    if not _C.WITH_CUDA:
        return "gyges was built without CUDA (nvcc was not found at build time)"
    if _C.cuda_device_count() == 0:
        return "no CUDA driver or device on this machine"
    return None


GPU_SKIP_REASON = _gpu_skip_reason()
needs_gpu = pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")
