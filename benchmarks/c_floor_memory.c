/* C floor for the memory benchmarks, as a shared library called from bench_memory.py in the same
 * process, on the same context (the one current on the calling thread) and the same memory as the
 * Python rows:  cc -O2 -shared -fPIC -o libc_floor_memory.so c_floor_memory.c -ldl
 *
 * c_alloc_free(count, size):                 seconds per cuMemAlloc + cuMemFree pair
 * c_alloc_free_async(count, size, stream):   seconds per cuMemAllocAsync + cuMemFreeAsync pair,
 *                                            the stream synchronized at the end (inside the timing)
 * c_copy(direction, device, host, bytes):    seconds for one cuMemcpyHtoD (0) / cuMemcpyDtoH (1)
 *                                            followed by cuCtxSynchronize: a copy timed to completion
 * Each returns -1 when the driver or a symbol is missing, -2 when a call fails. */
#include <dlfcn.h>
#include <stddef.h>
#include <time.h>

typedef int CUresult; typedef unsigned long long CUdeviceptr; typedef void *CUstream;
static CUresult (*alloc)(CUdeviceptr *, size_t);
static CUresult (*mfree)(CUdeviceptr);
static CUresult (*alloc_async)(CUdeviceptr *, size_t, CUstream);
static CUresult (*free_async)(CUdeviceptr, CUstream);
static CUresult (*stream_sync)(CUstream);
static CUresult (*ctx_sync)(void);
static CUresult (*htod)(CUdeviceptr, const void *, size_t);
static CUresult (*dtoh)(void *, CUdeviceptr, size_t);

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static int bind(void) {
  if (alloc) return 1;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);   /* the instance the process already has */
  if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) return 0;
  mfree = dlsym(h, "cuMemFree_v2"); alloc_async = dlsym(h, "cuMemAllocAsync"); free_async = dlsym(h, "cuMemFreeAsync");
  stream_sync = dlsym(h, "cuStreamSynchronize"); ctx_sync = dlsym(h, "cuCtxSynchronize");
  htod = dlsym(h, "cuMemcpyHtoD_v2"); dtoh = dlsym(h, "cuMemcpyDtoH_v2");
  alloc = dlsym(h, "cuMemAlloc_v2");
  return alloc && mfree && alloc_async && free_async && stream_sync && ctx_sync && htod && dtoh;
}

double c_alloc_free(int count, unsigned long long size) {
  if (!bind()) return -1;
  CUdeviceptr p;
  double a = now();
  for (int i = 0; i < count; i++) {
    if (alloc(&p, size) || mfree(p)) return -2;
  }
  return (now() - a) / count;
}

double c_alloc_free_async(int count, unsigned long long size, void *stream) {
  if (!bind()) return -1;
  CUdeviceptr p;
  double a = now();
  for (int i = 0; i < count; i++) {
    if (alloc_async(&p, size, stream) || free_async(p, stream)) return -2;
  }
  if (stream_sync(stream)) return -2;
  return (now() - a) / count;
}

double c_copy(int direction, unsigned long long device, void *host, unsigned long long bytes) {
  if (!bind()) return -1;
  double a = now();
  if ((direction == 0 ? htod(device, host, bytes) : dtoh(host, device, bytes)) || ctx_sync()) return -2;
  return now() - a;
}
