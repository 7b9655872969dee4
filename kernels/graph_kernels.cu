// Kernels of the CUDA graph tests (issue 36), with every kernel of kernels.cu: one module for a graph test.
// Kept apart from kernels.cu because cudaGraphSetConditional (CUDA 12.3+) is resolved by the driver at load,
// which kernels.ptx (loaded by JIT in tests/test_gpu_launch.py) must not depend on.  Built by tools/build_kernels.sh.
#include "kernels.cu"

// CUDA graphs (issue 36).  A value that reaches the kernel: p[i] = x for i < n (a kernel-argument update on an
// executable graph changes p, n or x).
extern "C" __global__ void fill_value(float *p, int n, float x) {
  int i = blockDim.x * blockIdx.x + threadIdx.x;
  if (i < n) p[i] = x;
}

// Conditional nodes: a kernel sets a conditional handle's value (cudaGraphSetConditional, CUDA 12.3+).
// set_condition runs before a WHILE (or IF) node: the condition is *counter > 0.
extern "C" __global__ void set_condition(unsigned long long handle, const int *counter) {
  if (threadIdx.x == 0 && blockIdx.x == 0)
    cudaGraphSetConditional((cudaGraphConditionalHandle)handle, *counter > 0 ? 1u : 0u);
}

// A WHILE node's body: one more iteration, one less to go, and go on while some are left.
extern "C" __global__ void countdown(unsigned long long handle, int *counter, int *iterations) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    *iterations += 1;
    *counter -= 1;
    cudaGraphSetConditional((cudaGraphConditionalHandle)handle, *counter > 0 ? 1u : 0u);
  }
}
