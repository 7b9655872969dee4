// ptxjit, part A: the kernel; calls a device function defined in part B (linked by cuLink*).
extern "C" __device__ float scale(float x);
extern "C" __global__ void ptxjit_kernel(float *data, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] = scale(data[i]) + i;
}
