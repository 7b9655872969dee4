/* C floor for the memory benchmarks: alloc/free (sync, stream-ordered) and copy bandwidth.
 * Build: cc -O2 -o c_floor_memory c_floor_memory.c -ldl     Prints one JSON object. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult; typedef unsigned long long CUdeviceptr; typedef void *CUcontext; typedef void *CUstream;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define SYM(T, name) T name = (T)dlsym(h, #name "" )
int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  CUresult (*cuInit)(unsigned) = dlsym(h, "cuInit");
  CUresult (*cuDeviceGet)(int *, int) = dlsym(h, "cuDeviceGet");
  CUresult (*retain)(CUcontext *, int) = dlsym(h, "cuDevicePrimaryCtxRetain");
  CUresult (*setcur)(CUcontext) = dlsym(h, "cuCtxSetCurrent");
  CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(h, "cuMemAlloc_v2");
  CUresult (*mfree)(CUdeviceptr) = dlsym(h, "cuMemFree_v2");
  CUresult (*alloc_async)(CUdeviceptr *, size_t, CUstream) = dlsym(h, "cuMemAllocAsync");
  CUresult (*free_async)(CUdeviceptr, CUstream) = dlsym(h, "cuMemFreeAsync");
  CUresult (*sync)(CUstream) = dlsym(h, "cuStreamSynchronize");
  CUresult (*streamcreate)(CUstream *, unsigned) = dlsym(h, "cuStreamCreate");
  CUresult (*hostalloc)(void **, size_t) = dlsym(h, "cuMemAllocHost_v2");
  CUresult (*htod)(CUdeviceptr, const void *, size_t) = dlsym(h, "cuMemcpyHtoD_v2");
  CUresult (*dtoh)(void *, CUdeviceptr, size_t) = dlsym(h, "cuMemcpyDtoH_v2");
  int dev; CUcontext ctx; CUstream s;
  cuInit(0); cuDeviceGet(&dev, 0); retain(&ctx, dev); setcur(ctx); streamcreate(&s, 1);
  const int N = 2000; const size_t SZ = 1 << 20; CUdeviceptr p;
  double best_sync = 1e9, best_async = 1e9;
  for (int r = 0; r < 5; r++) {
    double a = now(); for (int i = 0; i < N; i++) { alloc(&p, SZ); mfree(p); } double b = now();
    if ((b - a) / N < best_sync) best_sync = (b - a) / N;
    a = now(); for (int i = 0; i < N; i++) { alloc_async(&p, SZ, s); free_async(p, s); } sync(s); b = now();
    if ((b - a) / N < best_async) best_async = (b - a) / N;
  }
  const size_t BW = 256u << 20; CUdeviceptr d; alloc(&d, BW);
  void *pinned; hostalloc(&pinned, BW); memset(pinned, 1, BW);
  char *pageable = malloc(BW); memset(pageable, 1, BW);
  double bw[4] = {0, 0, 0, 0};
  for (int r = 0; r < 10; r++) {
    double a, t;
    a = now(); htod(d, pinned, BW); t = BW / (now() - a) / 1e9; if (t > bw[0]) bw[0] = t;
    a = now(); dtoh(pinned, d, BW); t = BW / (now() - a) / 1e9; if (t > bw[1]) bw[1] = t;
    a = now(); htod(d, pageable, BW); t = BW / (now() - a) / 1e9; if (t > bw[2]) bw[2] = t;
    a = now(); dtoh(pageable, d, BW); t = BW / (now() - a) / 1e9; if (t > bw[3]) bw[3] = t;
  }
  printf("{\"alloc_free_us\": %.3f, \"alloc_free_async_us\": %.3f, \"htod_pinned_GBps\": %.2f, "
         "\"dtoh_pinned_GBps\": %.2f, \"htod_pageable_GBps\": %.2f, \"dtoh_pageable_GBps\": %.2f}\n",
         best_sync * 1e6, best_async * 1e6, bw[0], bw[1], bw[2], bw[3]);
  return 0;
}
