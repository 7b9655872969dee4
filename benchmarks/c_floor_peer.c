/* C floor for the peer-copy benchmark, as a shared library called from bench_peer.py in the same
 * process, on the same contexts, buffers and stream as the Python rows:
 *   cc -O2 -shared -fPIC -o libc_floor_peer.so c_floor_peer.c -ldl
 *
 * c_peer(count, dst, dst_ctx, src, src_ctx, bytes):
 *     seconds for `count` cuMemcpyPeer calls followed by one cuCtxSynchronize of the calling thread's
 *     current context (the caller makes the destination's current, as memory.copy does for a
 *     synchronous peer copy): the copies timed to completion.
 * c_peer_async(count, dst, dst_ctx, src, src_ctx, bytes, stream):
 *     seconds for `count` cuMemcpyPeerAsync calls on `stream` followed by one cuStreamSynchronize.
 * Each returns -1 when the driver or a symbol is missing, -2 when a call fails; c_last_error() then
 * gives the CUresult of the call that failed (0 when none did). */
#include <dlfcn.h>
#include <stddef.h>
#include <time.h>

typedef int CUresult; typedef unsigned long long CUdeviceptr; typedef void *CUstream; typedef void *CUcontext;
static CUresult (*peer)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t);
static CUresult (*peer_async)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
static CUresult (*stream_sync)(CUstream);
static CUresult (*ctx_sync)(void);
static CUresult last_error;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static int bind(void) {
  if (peer) return 1;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);   /* the instance the process already has */
  if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) return 0;
  /* the legacy-default-stream entry points, as cuproc's and cuda.bindings' rows call them */
  peer_async = dlsym(h, "cuMemcpyPeerAsync"); stream_sync = dlsym(h, "cuStreamSynchronize");
  ctx_sync = dlsym(h, "cuCtxSynchronize");   /* the exported name keeps the void ABI (13.0 adds _v2) */
  peer = dlsym(h, "cuMemcpyPeer");
  return peer && peer_async && stream_sync && ctx_sync;
}

static int failed(CUresult rc) { last_error = rc; return rc != 0; }

int c_last_error(void) { return last_error; }

double c_peer(int count, CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
              unsigned long long bytes) {
  if (!bind()) return -1;
  last_error = 0;
  double a = now();
  for (int i = 0; i < count; i++) {
    if (failed(peer(dst, dctx, src, sctx, bytes))) return -2;
  }
  if (failed(ctx_sync())) return -2;
  return now() - a;
}

double c_peer_async(int count, CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
                    unsigned long long bytes, CUstream stream) {
  if (!bind()) return -1;
  last_error = 0;
  double a = now();
  for (int i = 0; i < count; i++) {
    if (failed(peer_async(dst, dctx, src, sctx, bytes, stream))) return -2;
  }
  if (failed(stream_sync(stream))) return -2;
  return now() - a;
}
