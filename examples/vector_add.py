"""vectorAddDrv from the CUDA samples, in cuproc: allocate, copy in, load the module, launch, copy out.

Run it: ``python examples/vector_add.py``. The test suite runs it and checks the result.  Needs a GPU of
compute capability 7.5 or newer and a CUDA 13.0 driver (580+): kernels/kernels.fatbin holds SASS for
sm_75 to sm_121 and PTX for newer GPUs, built with nvcc 13.0 (tools/build_kernels.sh).
"""
from pathlib import Path

import numpy as np

import cuproc
from cuproc import memory as mem

N = 50_000
KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def main() -> np.ndarray:
    primary = cuproc.use_device(0)                        # cuInit + retain device 0's primary context
    rng = np.random.default_rng(0)
    h_a, h_b = rng.random(N, dtype=np.float32), rng.random(N, dtype=np.float32)
    h_c = np.zeros(N, np.float32)
    with cuproc.Module.load(KERNELS / "kernels.fatbin") as module, \
            cuproc.DeviceBuffer(h_a.nbytes) as d_a, cuproc.DeviceBuffer(h_b.nbytes) as d_b, \
            cuproc.DeviceBuffer(h_c.nbytes) as d_c:
        mem.copy(d_a, h_a)                               # cuMemcpyHtoD
        mem.copy(d_b, h_b)
        vec_add = module.get_function("VecAdd_kernel")   # cuModuleGetFunction
        threads = 256
        blocks = (N + threads - 1) // threads
        vec_add.launch(blocks, threads, (d_a, d_b, d_c, np.int32(N)))  # cuLaunchKernel
        mem.copy(h_c, d_c)                               # cuMemcpyDtoH (synchronizes)
    cuproc.driver.cuCtxSetCurrent(cuproc.ffi.NULL)
    primary.release()
    if not np.allclose(h_c, h_a + h_b):
        raise SystemExit("Result = FAIL")
    print("Result = PASS")
    return h_c


if __name__ == "__main__":
    main()
