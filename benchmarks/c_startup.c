/* The C floor of the startup benchmark: a fresh process to "device usable" -- the driver opened,
 * cuInit, device 0's primary context retained and current, a first 256-byte allocation.
 * Build: cc -O2 -o c_startup c_startup.c -ldl    (bench_startup.py times the whole process) */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>

typedef int CUresult; typedef void *CUcontext; typedef unsigned long long CUdeviceptr;
int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  CUresult (*init)(unsigned) = dlsym(h, "cuInit");
  CUresult (*device_get)(int *, int) = dlsym(h, "cuDeviceGet");
  CUresult (*retain)(CUcontext *, int) = dlsym(h, "cuDevicePrimaryCtxRetain");
  CUresult (*set_current)(CUcontext) = dlsym(h, "cuCtxSetCurrent");
  CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(h, "cuMemAlloc_v2");
  int dev; CUcontext ctx; CUdeviceptr p;
  if (init(0) || device_get(&dev, 0) || retain(&ctx, dev) || set_current(ctx) || alloc(&p, 256)) return 2;
  return 0;
}
