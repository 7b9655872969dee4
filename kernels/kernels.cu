// Test and example kernels for cuproc. Rebuild the checked-in artifacts with tools/build_kernels.sh.
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

// vectorAddDrv (CUDA programming guide / samples): C = A + B.
extern "C" __global__ void VecAdd_kernel(const float *A, const float *B, float *C, int N) {
  int i = blockDim.x * blockIdx.x + threadIdx.x;
  if (i < N) C[i] = A[i] + B[i];
}

// The launch benchmark's kernel: does nothing with (float*, int, float).
extern "C" __global__ void empty(float *p, int n, float x) {}

// The programming guide's "Kernel Execution" alignment example: int, float4, char, float, CUdeviceptr, float2.
// Writes what it received so the host can check every offset.
extern "C" __global__ void guide_args(int i, float4 f4, char c, float f, float *out, float2 f2) {
  out[0] = (float)i; out[1] = f4.x; out[2] = f4.y; out[3] = f4.z; out[4] = f4.w;
  out[5] = (float)c; out[6] = f; out[7] = f2.x; out[8] = f2.y;
}

struct Particle { double mass; int id; float pos[3]; };
extern "C" __global__ void struct_arg(Particle p, double *out) {
  out[0] = p.mass; out[1] = p.id; out[2] = p.pos[0]; out[3] = p.pos[1]; out[4] = p.pos[2];
}

// Sixteen mixed arguments, summed into out[0] (as double) for a host-side check.
extern "C" __global__ void mixed16(char a, short b, int c, long long d, float e, double f, unsigned char g,
                                   unsigned short h, unsigned int i, unsigned long long j, float2 k, float4 l,
                                   int m, double n, char o, double *out) {
  out[0] = a + b + c + (double)d + e + f + g + h + i + (double)j + k.x + k.y + l.x + l.y + l.z + l.w + m + n + o;
}

// A cooperative kernel: every block writes, the grid synchronizes, then block 0 sums.
extern "C" __global__ void coop_sum(int *data, int *out) {
  cg::grid_group grid = cg::this_grid();
  if (threadIdx.x == 0) data[blockIdx.x] = blockIdx.x + 1;
  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    int s = 0;
    for (unsigned b = 0; b < gridDim.x; b++) s += data[b];
    *out = s;
  }
}

// Cluster launch check (Hopper): each block writes its cluster rank.
extern "C" __global__ void cluster_rank(int *out) {
#if __CUDA_ARCH__ >= 900
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) out[blockIdx.x] = (int)cluster.block_rank();
#else
  if (threadIdx.x == 0) out[blockIdx.x] = -1;   // no clusters before sm_90
#endif
}

// A global for cuModuleGetGlobal / cuLibraryGetGlobal.
extern "C" __device__ int counter = 42;
extern "C" __global__ void bump(int by) { counter += by; }

// Thread-safety witness: each launch stores its two arguments in its own slot.  A launch whose
// arguments were mixed with another thread's shows up as a slot where b != 3 * a + 1.
extern "C" __global__ void record_pair(long long *log, int slot, long long a, long long b) {
  if (threadIdx.x == 0 && blockIdx.x == 0) { log[2 * slot] = a; log[2 * slot + 1] = b; }
}

// What a launch's configuration reached the kernel: block (0,0,0)'s thread (0,0,0) writes the grid,
// the block, the dynamic shared memory size (%dynamic_smem_size: the launch's sharedMemBytes) and
// slot + 1 into out[10 * slot ...]; every block's first thread, then every thread, count themselves
// into out[10 * slot + 8] and out[10 * slot + 9] (gx*gy*gz blocks, that many times bx*by*bz threads).
extern "C" __global__ void launch_shape(unsigned long long *out, int slot) {
  unsigned long long *rec = out + 10 * (long long)slot;
  bool first_thread = threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
  if (first_thread && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    unsigned dynamic_smem;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    rec[0] = gridDim.x; rec[1] = gridDim.y; rec[2] = gridDim.z;
    rec[3] = blockDim.x; rec[4] = blockDim.y; rec[5] = blockDim.z;
    rec[6] = dynamic_smem; rec[7] = slot + 1;
  }
  if (first_thread) atomicAdd(&rec[8], 1ULL);
  atomicAdd(&rec[9], 1ULL);
}
