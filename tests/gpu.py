"""Why the GPU tests of this run skip (None when a CUDA device is usable), shared by the CUDA test
files."""
import pytest

from gyges.runtime.worker import cuda_device_unavailable

GPU_SKIP_REASON = cuda_device_unavailable()
needs_gpu = pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")
