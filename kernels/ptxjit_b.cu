// ptxjit, part B: the device function part A calls.
extern "C" __device__ float scale(float x) { return 3.0f * x; }
