/*
 * A stateful fake CUDA driver for CI tests of cuproc's object layer (no GPU needed).
 *
 * Built and loaded by tests/fakedriver.py, which also writes fakedriver_tables.h (the
 * cuGetProcAddress table and the CUresult names) from headers/.  Every entry point here has
 * exactly the C signature cuproc selects at CUDA 13.0: a static function is named after that
 * entry point (cuCtxCreate_v4, cuMemAlloc_v2, ...) and fakedriver.py refuses to build when
 * headers/ select a different one.
 *
 * What it is for: on a real driver a use-after-free of a handle or device pointer is a crash
 * (or silent corruption) at an unpredictable place; here it is a *record*:
 *
 *   stale uses      a destroyed, unknown or wrong-kind handle, or a device pointer outside
 *                   every live allocation.  Returns the real error code and counts it.
 *   binding errors  an operation while no context (or a destroyed one) is current (a peer copy
 *                   too), a launch of a function of another context than its stream's, or an
 *                   event record of an event of another context than the stream's -- the default
 *                   stream being the current context's (the real driver answers the last two
 *                   with CUDA_ERROR_INVALID_HANDLE, measured on driver 580).  An
 *                   operation on an object of another context that names its stream (or needs
 *                   none: unload, destroy, query) is carried out, as the real driver does.
 *   misrouted       an operation on memory of one context that runs in whichever context is
 *                   current -- a synchronous copy or memset, or an asynchronous one on the
 *                   default stream -- while another context is current.  The real driver carries
 *                   it out, on the current context's default stream (measured on driver 580): it
 *                   is not ordered with the memory's own context's work, and a free there may
 *                   run before it (seen on an H200 as CUDA_ERROR_LAUNCH_FAILED after a memset of
 *                   a created context's buffer made while the primary context was current).
 *                   Done here too (on the current context's streams), and recorded.
 *   launches        the packed argument bytes of every launch, plus a race detector.
 *   unordered frees a cuMemFreeAsync of memory that asynchronous work on another stream may still
 *                   use: that work is not ordered before the free (same stream, a synchronize, an
 *                   event waited for or on, the legacy stream's implicit ordering).  On a GPU the
 *                   pool may hand the memory out again or release it while that work runs; seen
 *                   on an H200 as CUDA_ERROR_ILLEGAL_ADDRESS in the other stream's memset (a
 *                   sticky error).  Here all work is done at once, so it is only a record.
 *   fork            any call in a child forked after cuInit.
 *
 * Tests assert that the stale, misrouted and unordered counters stay 0.
 *
 * Model (strict on purpose, see fakedriver.py for the list of choices):
 *   - one mutex guards all state; per-thread context stacks are __thread arrays;
 *   - handles are 0x1000 + 16*n, n an index in a chunked object table.  Values are handed out
 *     again as the real driver does (the default; fake_set_reuse(0) or FAKEDRIVER_REUSE=0 turns
 *     it off for the tests that need every stale handle caught): a destroyed stream, event,
 *     module, function, library, kernel, pool or context gives its handle to the next object
 *     made, most recently freed first, and a device's primary context has the same handle on
 *     every activation.  A stale handle then names a live object, as on a GPU: only cuproc's
 *     own identity rules can tell the two apart, which is what the reuse is for;
 *   - device addresses come back the same way: a range freed by cuMemFreeAsync goes back to its
 *     pool, and the next allocation from that same pool (cuMemAllocAsync from the device's
 *     current pool, cuMemAllocFromPoolAsync) that fits takes the most recently freed one
 *     (fake_async_reuses counts it), in both modes.  With reuse on, cuMemAlloc likewise takes the
 *     most recently freed range of cuMemAlloc memory (freed by cuMemFree or with its context)
 *     that fits (fake_sync_reuses), on any device (one unified address space, as on a GPU).  Pool
 *     ranges never move across pools or devices, and never stream-ordered memory
 *     freed by cuMemFree, context destroy/reset or pool destroy.  Addresses are
 *     carved from a reserved PROT_NONE window (hint: the 1 TiB below 0x7f0000000000) so no host
 *     allocation can alias them and a host dereference of a device pointer faults as it would on
 *     a GPU; each allocation is backed by calloc'd storage;
 *   - pinned, registered and managed memory is real host memory;
 *   - an ordering model, records only (the work itself is still done at once): every stream, the
 *     legacy (NULL) stream of each context and each thread's per-thread stream has a work counter,
 *     and each asynchronous operation on it (memset, copy, launch, stream-ordered alloc and free,
 *     event record, host function, stream wait) takes the next number.  A device allocation keeps
 *     the last few (stream, number) of the memsets, copies and launches (any 8-byte aligned word
 *     of the argument block pointing into it) that touched it and are not known complete.
 *     Known complete: a stream up to its last number after cuStreamSynchronize or a successful
 *     cuStreamQuery, every stream of a context after cuCtxSynchronize, cuMemFree (it waits for
 *     the device) or the context's end, the recording stream up to the event after
 *     cuEventSynchronize or a successful cuEventQuery, the legacy stream and its blocking
 *     streams after a copy that returns only when done (host memory on one side, no stream).
 *     Ordered: cuStreamWaitEvent makes the waiting stream's later work follow what the event
 *     covers (vector clocks: what the recording stream had itself waited for too); work on the
 *     legacy stream follows all earlier work of the context's blocking streams (created without
 *     CU_STREAM_NON_BLOCKING, and the per-thread stream, which the driver documents as
 *     synchronizing with the legacy stream), and their work follows all earlier legacy work.
 *     Synchronous memsets of device memory and device-to-device copies are recorded as work of
 *     the current context's legacy stream: per CUDA's "API synchronization behavior" they return
 *     before they are done (no host-side synchronization).  A cuMemFreeAsync on
 *     stream S of memory with a recorded touch (T, k), T != S, neither complete nor seen by S,
 *     is an unordered free.  Bounded: 16 streams per clock, 8 touches per allocation; when full,
 *     what is complete goes first, then the oldest (a forgotten touch can hide an unordered free,
 *     a forgotten clock entry invent one: neither happens below 16 streams with pending work).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------ driver types
 * Plain C stand-ins with the same size and passing convention as cuda.h's. */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef void *CUcontext, *CUstream, *CUevent, *CUmodule, *CUfunction, *CUlibrary, *CUkernel,
    *CUmemoryPool, *CUlinkState, *CUgreenCtx;
typedef void (*CUhostFn)(void *userData);
typedef size_t (*CUoccupancyB2DSize)(int blockSize);
typedef uintptr_t handle_t;

typedef struct { char bytes[16]; } CUuuid;

typedef struct { /* CUDA_MEMCPY2D_v2 */
  size_t srcXInBytes, srcY;
  int srcMemoryType;
  const void *srcHost;
  CUdeviceptr srcDevice;
  void *srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  int dstMemoryType;
  void *dstHost;
  CUdeviceptr dstDevice;
  void *dstArray;
  size_t dstPitch;
  size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;

typedef struct { /* CUDA_MEMCPY3D_v2 */
  size_t srcXInBytes, srcY, srcZ, srcLOD;
  int srcMemoryType;
  const void *srcHost;
  CUdeviceptr srcDevice;
  void *srcArray;
  void *reserved0;
  size_t srcPitch, srcHeight;
  size_t dstXInBytes, dstY, dstZ, dstLOD;
  int dstMemoryType;
  void *dstHost;
  CUdeviceptr dstDevice;
  void *dstArray;
  void *reserved1;
  size_t dstPitch, dstHeight;
  size_t WidthInBytes, Height, Depth;
} CUDA_MEMCPY3D;

typedef struct { /* CUlaunchConfig; attributes are ignored */
  unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  CUstream hStream;
  void *attrs;
  unsigned int numAttrs;
} CUlaunchConfig;

typedef struct { /* CUmemPoolProps_v1: only the leading fields are read */
  int allocType, handleTypes;
  int locationType, locationId; /* CUmemLocation */
} CUmemPoolProps;

/* CUresult codes this fake returns. */
enum {
  OK = 0,
  E_INVALID_VALUE = 1,
  E_OUT_OF_MEMORY = 2,
  E_NOT_INITIALIZED = 3,
  E_INVALID_DEVICE = 101,
  E_INVALID_IMAGE = 200,
  E_INVALID_CONTEXT = 201,
  E_UNSUPPORTED_LIMIT = 215,
  E_UNSUPPORTED_PTX_VERSION = 222,
  E_FILE_NOT_FOUND = 301,
  E_INVALID_HANDLE = 400,
  E_NOT_FOUND = 500,
  E_PEER_ACCESS_ALREADY_ENABLED = 704,
  E_PEER_ACCESS_NOT_ENABLED = 705,
  E_CONTEXT_IS_DESTROYED = 709,
  E_TOO_MANY_PEERS = 711,
  E_HOST_MEMORY_ALREADY_REGISTERED = 712,
  E_HOST_MEMORY_NOT_REGISTERED = 713,
  E_NOT_SUPPORTED = 801,
};

#define DRIVER_VERSION 13000
/* The newest PTX ISA the JIT of a CUDA 13.0 driver accepts (cuproc/ptx_isa.py), as major * 10 + minor. */
#define PTX_ISA_LIMIT 90
#define MAX_DEV 16
#define DEVICE_TOTAL_MEM (1ULL << 30)
#define STACK_DEPTH 64
#define MAX_PARAMS 64
#define MAX_ARG_BYTES 32768
#define PARAM_BASE 0x210   /* sm_90: where kernel parameters start in constant bank 0 */
#define N_LIMITS 11
#define N_FUNC_ATTRS 18
#define LEGACY_STREAM ((handle_t)0x1)
#define PER_THREAD_STREAM ((handle_t)0x2)

/* ------------------------------------------------------------------ global state */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static const char *cur_call = "";      /* name of the call holding mu, for the records */
static int initialized;
/* CUDA_MODULE_LOADING as cuInit read it: 1 LAZY (the default from CUDA 12.2), 0 EAGER.  Lazily, a library
 * is JIT-compiled when a kernel or variable of it is first asked for (so CUDA_ERROR_UNSUPPORTED_PTX_VERSION
 * comes from cuLibraryGetKernel, as seen on an H200 with driver 580, or cuKernelGetFunction / cuFuncLoad);
 * eagerly, at cuLibraryLoadData.  A module's PTX is compiled at cuModuleLoadData* in both modes here (what
 * tests/test_gpu_launch.py expects of the driver; tests/test_gpu_modules.py prints where a real one fails).
 * fake_set_lazy_loading() changes it. */
static int lazy_loading = 1;
static pid_t init_pid;                  /* pid that first called cuInit; 0 before */
static long fork_violations;            /* atomic: counted before mu is taken */
static unsigned reset_gen = 1;          /* bumped by fake_reset: empties every thread's stack */
static int ndev = 2;

#define RING 16
struct ring { const char *names[RING]; long total; };
static long stale_count, binding_count, misrouted_count;
static struct ring stale_ring, binding_ring, misrouted_ring;
static struct ring call_ring;       /* every entry point called (fake_calls): what a cuproc call costs in calls */

struct primary { int refcount; unsigned flags; handle_t ctx; handle_t slot; /* its handle, kept across activations */ };
static struct primary prim[MAX_DEV];
static handle_t default_pool[MAX_DEV];  /* created on first use, never destroyed */
static unsigned long long dev_bytes[MAX_DEV];

static unsigned long long event_seq, ctx_ids, buffer_ids;

/* Reuse of handles and addresses (see the model above).  On by default, like the real driver. */
static int reuse_values = 1;
static long handle_reuses, sync_reuses;   /* objects that got a dead one's handle; cuMemAlloc ranges again */
static long launch_count, launch_mismatches;
static char last_name[256];
static unsigned char last_args[MAX_ARG_BYTES];
static size_t last_nargs;
static unsigned last_dims[6];   /* grid x, y, z, block x, y, z of the last launch */
static unsigned last_shared_mem;   /* its dynamic shared memory size */
static CUstream last_stream;

/* The device address window. */
static CUdeviceptr dev_base, dev_next, dev_limit;

/* Per-thread context stack.  tls_gen != reset_gen means "stale since fake_reset": emptied lazily. */
static __thread handle_t tls_stack[STACK_DEPTH];
static __thread int tls_depth;
static __thread unsigned tls_gen;

/* ------------------------------------------------------------------ images (FAKECUBIN) */
struct kinfo {
  char *name;
  int nparams;
  size_t size[MAX_PARAMS], off[MAX_PARAMS], total;
};
struct ginfo { char *name; size_t nbytes; int managed; };
/* ptx: the image is PTX of that ISA (".version 9.9": 99), which the JIT compiles; 0: SASS, nothing to compile */
struct image { int nk, ng, ptx; struct kinfo *k; struct ginfo *g; };

static void free_image(struct image *img) {
  if (!img) return;
  for (int i = 0; i < img->nk; i++) free(img->k[i].name);
  for (int i = 0; i < img->ng; i++) free(img->g[i].name);
  free(img->k);
  free(img->g);
  free(img);
}

static size_t param_align(size_t size) {
  if (size >= 16) return 16;
  if (size >= 8) return 8;
  if (size >= 4) return 4;
  if (size >= 2) return 2;
  return 1;
}

static int is_fakecubin(const char *text, size_t len) {
  return len >= 9 && memcmp(text, "FAKECUBIN", 9) == 0 &&
         (len == 9 || text[9] == '\n' || text[9] == '\r' || text[9] == '\0');
}

/* Parse at most len bytes (stops at a NUL).  Format:
 *   FAKECUBIN
 *   kernel <name> <param size>[@<alignment>] ...
 *   global <name> <nbytes>
 *   managed <name> <nbytes>
 *   .version <major>.<minor>   (PTX of that ISA, as PTX declares it: the JIT refuses one newer than
 *                              PTX_ISA_LIMIT)
 * Blank lines and lines starting with '#' are ignored; anything else is an invalid image. */
static CUresult parse_image(const char *data, size_t len, struct image **out) {
  len = strnlen(data, len);
  if (!is_fakecubin(data, len)) return E_INVALID_IMAGE;
  char *text = strndup(data, len);
  struct image *img = calloc(1, sizeof *img);
  if (!text || !img) { free(text); free(img); return E_OUT_OF_MEMORY; }
  CUresult rc = OK;
  char *save = NULL;
  strtok_r(text, "\n", &save); /* the FAKECUBIN line */
  for (char *line = strtok_r(NULL, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    char *words[MAX_PARAMS + 3];
    int nw = 0;
    char *wsave = NULL;
    for (char *w = strtok_r(line, " \t\r", &wsave); w; w = strtok_r(NULL, " \t\r", &wsave)) {
      if (nw == MAX_PARAMS + 2) { rc = E_INVALID_IMAGE; break; }
      words[nw++] = w;
    }
    if (rc != OK) break;
    if (nw == 0 || words[0][0] == '#') continue;
    if (strcmp(words[0], "kernel") == 0 && nw >= 2) {
      struct kinfo *k = realloc(img->k, (img->nk + 1) * sizeof *k);
      if (!k) { rc = E_OUT_OF_MEMORY; break; }
      img->k = k;
      k = &img->k[img->nk++];
      memset(k, 0, sizeof *k);
      k->name = strdup(words[1]);
      for (int i = 2; i < nw; i++) {
        char *end;
        unsigned long size = strtoul(words[i], &end, 10);
        size_t align = param_align(size);
        if (*end == '@') align = strtoul(end + 1, &end, 10);   /* <size>@<align>: a struct of its own alignment */
        if (*end || size == 0 || align == 0 || (align & (align - 1))) { rc = E_INVALID_IMAGE; break; }
        /* Laid out as the compiler does for sm_90 (this fake's devices): parameters live in constant bank 0
         * from PARAM_BASE, and each is aligned at its address in the bank, not in the parameter buffer (read from
         * NVRTC 13.5's cubins: a 64-aligned struct first, or after an int, at offset 48; 128-aligned at 112).
         * The same as aligning in the buffer up to 16 bytes. */
        k->total = (PARAM_BASE + k->total + align - 1) / align * align - PARAM_BASE;
        k->off[k->nparams] = k->total;
        k->size[k->nparams++] = size;
        k->total += size;
      }
    } else if ((strcmp(words[0], "global") == 0 || strcmp(words[0], "managed") == 0) && nw == 3) {
      char *end;
      unsigned long n = strtoul(words[2], &end, 10);
      if (*end || n == 0) { rc = E_INVALID_IMAGE; break; }
      struct ginfo *g = realloc(img->g, (img->ng + 1) * sizeof *g);
      if (!g) { rc = E_OUT_OF_MEMORY; break; }
      img->g = g;
      g = &img->g[img->ng++];
      g->name = strdup(words[1]);
      g->nbytes = n;
      g->managed = words[0][0] == 'm';
    } else if (strcmp(words[0], ".version") == 0 && nw == 2) {
      unsigned major, minor;
      char tail;
      if (sscanf(words[1], "%u.%u%c", &major, &minor, &tail) != 2 || minor > 9) { rc = E_INVALID_IMAGE; break; }
      img->ptx = (int)(major * 10 + minor);
    } else {
      rc = E_INVALID_IMAGE;
      break;
    }
    if (rc != OK) break;
  }
  free(text);
  if (rc != OK) { free_image(img); return rc; }
  *out = img;
  return OK;
}

static int find_kernel(const struct image *img, const char *name) {
  for (int i = 0; i < img->nk; i++) if (strcmp(img->k[i].name, name) == 0) return i;
  return -1;
}

static int find_global(const struct image *img, const char *name) {
  for (int i = 0; i < img->ng; i++) if (strcmp(img->g[i].name, name) == 0) return i;
  return -1;
}

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap + 1);
  size_t got;
  while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
    n += got;
    if (n == cap) { char *bigger = realloc(buf, 2 * cap + 1); if (!bigger) { free(buf); buf = NULL; break; } buf = bigger; cap *= 2; }
  }
  fclose(f);
  if (buf) { buf[n] = '\0'; *len = n; }
  return buf;
}

/* ------------------------------------------------------------------ ordering: types
 * See "ordering model" below.  A clock maps a stream's ordering state (uid) to a work number. */
#define CLOCK 16
#define TOUCHES 8
struct clock { int n; struct { unsigned uid; unsigned long long k; } e[CLOCK]; };

/* ------------------------------------------------------------------ objects (handles) */
enum kind { K_NONE, K_CTX, K_STREAM, K_EVENT, K_MODULE, K_FUNCTION, K_LIBRARY, K_KERNEL, K_POOL, K_LINK };

struct obj {
  unsigned char kind, alive;
  unsigned char primary;    /* ctx: a device's primary context */
  unsigned char is_default; /* pool: a device's default pool */
  int dev;
  size_t live_idx;          /* position in live[] while alive */
  handle_t h;
  handle_t ctx;             /* owning context; 0 for context-independent objects */
  handle_t parent;          /* function: module or kernel; kernel: library */
  struct image *img;        /* module, library: owned; function, kernel: borrowed from parent */
  int kidx;                 /* function, kernel: index in img->k */
  unsigned flags;
  union {
    /* legacy, uid: the ordering states of a context's NULL stream and of a stream (never reused);
     * clk: what waiting for an event orders after (see the ordering model) */
    struct { size_t limits[N_LIMITS]; int cache; unsigned long long id; unsigned legacy;
             unsigned long long peers[8]; int npeers; } c;   /* peers: ids of contexts it may access */
    struct { int priority; unsigned uid; } s;
    struct { unsigned long long seq; struct clock *clk; } e;
    struct { int attrs[N_FUNC_ATTRS]; int cache; } f;
    struct { unsigned long long used, used_high, reserved_high, threshold; int reuse[4]; } p;
    struct { char *buf; size_t len; char *out; } l;
  } u;
};

#define HANDLE_BASE 0x1000
#define CHUNK 4096
#define MAX_CHUNKS 4096
static struct obj *chunks[MAX_CHUNKS];
static size_t nobjs;
static size_t *live;       /* object indices of live objects, unordered */
static size_t nlive, cap_live;

static struct obj *obj_at(handle_t h) {
  if (h < HANDLE_BASE || (h - HANDLE_BASE) % 16) return NULL;
  size_t n = (h - HANDLE_BASE) / 16;
  if (n >= nobjs) return NULL;
  return &chunks[n / CHUNK][n % CHUNK];
}

static struct obj *live_obj(size_t i) { size_t n = live[i]; return &chunks[n / CHUNK][n % CHUNK]; }

/* Dead objects' slots, the most recently freed last: with reuse on, the next object takes the last. */
static size_t *free_slots;
static size_t nfree, cap_free;

static void keep_slot(size_t n) {
  if (nfree == cap_free) {
    size_t cap = cap_free ? 2 * cap_free : 256;
    size_t *grown = realloc(free_slots, cap * sizeof *grown);
    if (!grown) return; /* the slot is simply never reused */
    free_slots = grown;
    cap_free = cap;
  }
  free_slots[nfree++] = n;
}

/* A new object of kind.  at: the handle it must have (a primary context's next activation), or 0
 * for the next free one (a dead object's, with reuse on; else a never used one). */
static struct obj *new_obj_at(int kind, handle_t ctx, int dev, handle_t at) {
  if (nlive == cap_live) {
    size_t cap = cap_live ? 2 * cap_live : 256;
    size_t *grown = realloc(live, cap * sizeof *grown);
    if (!grown) return NULL;
    live = grown;
    cap_live = cap;
  }
  size_t n;
  if (at) {
    n = (at - HANDLE_BASE) / 16;
  } else if (reuse_values && nfree) {
    n = free_slots[--nfree];
    handle_reuses++;
  } else {
    if (nobjs == (size_t)CHUNK * MAX_CHUNKS) return NULL;
    if (nobjs % CHUNK == 0 && !chunks[nobjs / CHUNK]) {
      chunks[nobjs / CHUNK] = calloc(CHUNK, sizeof(struct obj));
      if (!chunks[nobjs / CHUNK]) return NULL;
    }
    n = nobjs++;
  }
  struct obj *o = &chunks[n / CHUNK][n % CHUNK];
  memset(o, 0, sizeof *o);
  o->kind = kind;
  o->alive = 1;
  o->h = HANDLE_BASE + 16 * n;
  o->ctx = ctx;
  o->dev = dev;
  o->live_idx = nlive;
  live[nlive++] = n;
  return o;
}

static struct obj *new_obj(int kind, handle_t ctx, int dev) { return new_obj_at(kind, ctx, dev, 0); }

static void unlink_obj(struct obj *o) {
  size_t i = o->live_idx;
  live[i] = live[--nlive];
  if (i < nlive) live_obj(i)->live_idx = i;
  o->alive = 0;
  /* A primary context's handle stays its device's (the next activation takes it again). */
  if (!(o->kind == K_CTX && o->primary)) keep_slot((o->h - HANDLE_BASE) / 16);
}

/* ------------------------------------------------------------------ allocations */
enum akind { A_DEVICE, A_ASYNC, A_GLOBAL, A_HOST, A_REGISTERED, A_MANAGED };

struct alloc {
  CUdeviceptr base;
  size_t size;
  int kind, dev;
  int gidx;         /* global: index in the owner's image */
  int bound;        /* operations need ctx current (device memory); 0 for portable host memory */
  handle_t ctx;     /* owning context (0: none) */
  handle_t owner;   /* module or library for globals and library managed variables */
  handle_t pool;    /* async allocations */
  char *store;      /* where the bytes live: calloc'd backing or the host memory itself */
  size_t span;      /* device kinds: the address range taken (size rounded up, plus a gap) */
  unsigned long long id;
  int ntouch;       /* asynchronous work on it not known complete: (stream state, work number) */
  struct { unsigned uid; unsigned long long k; } touch[TOUCHES];
};

/* Ranges freed by cuMemFreeAsync, each tagged with its pool, the most recent last.  A pool hands
 * a range freed into it out again at once (a real one to the next allocation on the same stream,
 * or on another once the free is done; here all work is done at once, so on any stream), so the
 * next allocation from *that pool* takes the most recently freed range of it that it fits in: a late
 * free of the old address then frees the new allocation (caught by its own later free, a stale
 * use).  Nothing else is ever reused: not cuMemAlloc memory, and not stream-ordered memory freed
 * with cuMemFree, by a context's destruction or reset, or by its pool's destruction (a real pool
 * never gets such memory back; the first two stay counted as used by it).  A pool belongs to one
 * device, so a range never moves across devices either. */
#define REUSE 64
#define SYNC_RANGES ((handle_t)0)   /* the "pool" of cuMemAlloc ranges (no pool has handle 0) */
static struct { CUdeviceptr base; size_t span; handle_t pool; } reuse[REUSE];
static int nreuse;
static long reuse_count;    /* stream-ordered allocations that got a freed address back */

/* The most recently freed range of pool of at least *span bytes (0: none); *span becomes its
 * whole span. */
static CUdeviceptr reused_range(handle_t pool, size_t *span) {
  for (int i = nreuse; i > 0;) {
    i--;
    if (reuse[i].pool == pool && reuse[i].span >= *span) {
      CUdeviceptr base = reuse[i].base;
      *span = reuse[i].span;
      memmove(&reuse[i], &reuse[i + 1], (size_t)(nreuse - i - 1) * sizeof reuse[0]);
      nreuse--;
      return base;
    }
  }
  return 0;
}

static void keep_for_reuse(handle_t pool, CUdeviceptr base, size_t span) {
  if (nreuse == REUSE) { /* forget the oldest */
    memmove(&reuse[0], &reuse[1], (REUSE - 1) * sizeof reuse[0]);
    nreuse--;
  }
  reuse[nreuse].base = base;
  reuse[nreuse].span = span;
  reuse[nreuse].pool = pool;
  nreuse++;
}

/* A destroyed pool's freed ranges go with it. */
static void forget_ranges_of(handle_t pool) {
  int kept = 0;
  for (int i = 0; i < nreuse; i++)
    if (reuse[i].pool != pool) reuse[kept++] = reuse[i];
  nreuse = kept;
}

static struct alloc **allocs;
static size_t nallocs, cap_allocs;

static int in_device_window(CUdeviceptr p) { return p >= dev_base && p < dev_limit; }
static int device_kind(int kind) { return kind == A_DEVICE || kind == A_ASYNC || kind == A_GLOBAL; }

/* Host memory is freed late: a pointer freed a moment ago is not handed out again at once, so a
 * double cuMemFreeHost stays recognizable and a stale numpy view does not crash right away. */
#define QUARANTINE 64
static void *quarantine[QUARANTINE];
static unsigned quarantine_next;
static void release_host(void *p) {
  free(quarantine[quarantine_next]);
  quarantine[quarantine_next] = p;
  quarantine_next = (quarantine_next + 1) % QUARANTINE;
}

/* The live allocation containing addr (addr == end counts for zero-length ranges). */
static struct alloc *find_alloc(CUdeviceptr addr, int allow_end) {
  for (size_t i = 0; i < nallocs; i++) {
    struct alloc *a = allocs[i];
    if (addr >= a->base && (addr < a->base + a->size || (allow_end && addr == a->base + a->size)))
      return a;
  }
  return NULL;
}

static struct obj *pool_of(handle_t h) { struct obj *o = obj_at(h); return o && o->kind == K_POOL ? o : NULL; }

/* A new allocation of kind; pool: the pool (handle) of a stream-ordered one, 0 for the others. */
static struct alloc *new_alloc(int kind, size_t size, int dev, handle_t ctx, handle_t pool, CUresult *rc) {
  if (size == 0) { *rc = E_INVALID_VALUE; return NULL; }
  if (device_kind(kind) && dev_bytes[dev] + size > DEVICE_TOTAL_MEM) { *rc = E_OUT_OF_MEMORY; return NULL; }
  struct alloc *a = calloc(1, sizeof *a);
  if (!a) { *rc = E_OUT_OF_MEMORY; return NULL; }
  if (nallocs == cap_allocs) {
    size_t cap = cap_allocs ? 2 * cap_allocs : 256;
    struct alloc **grown = realloc(allocs, cap * sizeof *grown);
    if (!grown) { free(a); *rc = E_OUT_OF_MEMORY; return NULL; }
    allocs = grown;
    cap_allocs = cap;
  }
  if (device_kind(kind)) {
    /* 256-aligned, plus a 256-byte gap so a small overrun never lands in the next allocation */
    size_t span = (size + 255) / 256 * 256 + 256;
    CUdeviceptr base = kind == A_ASYNC ? reused_range(pool, &span)
                     : kind == A_DEVICE && reuse_values ? reused_range(SYNC_RANGES, &span) : 0;
    if (!base && span > dev_limit - dev_next) { free(a); *rc = E_OUT_OF_MEMORY; return NULL; }
    a->store = calloc(1, size);
    if (!a->store) {
      if (base) keep_for_reuse(kind == A_ASYNC ? pool : SYNC_RANGES, base, span);
      free(a);
      *rc = E_OUT_OF_MEMORY;
      return NULL;
    }
    if (base) {
      a->base = base;
      if (kind == A_ASYNC) reuse_count++; else sync_reuses++;
    } else {
      a->base = dev_next;
      dev_next += span;
    }
    a->span = span;
    dev_bytes[dev] += size;
  } else if (kind != A_REGISTERED) {
    void *p = NULL;
    if (posix_memalign(&p, 4096, size)) { free(a); *rc = E_OUT_OF_MEMORY; return NULL; }
    memset(p, 0, size);
    a->store = p;
    a->base = (CUdeviceptr)(uintptr_t)p;
  }
  a->size = size;
  a->kind = kind;
  a->dev = dev;
  a->ctx = ctx;
  a->pool = pool;
  a->bound = kind != A_HOST && kind != A_REGISTERED && ctx != 0;
  a->id = ++buffer_ids;
  allocs[nallocs++] = a;
  return a;
}

/* Release the allocation's memory.  Its pool's accounting is the caller's: only cuMemFreeAsync
 * gives the bytes back to the pool (and the range to its reuse list). */
static void free_alloc(struct alloc *a) {
  for (size_t i = 0; i < nallocs; i++) {
    if (allocs[i] == a) { allocs[i] = allocs[--nallocs]; break; }
  }
  if (device_kind(a->kind)) {
    dev_bytes[a->dev] -= a->size;
    free(a->store);
    if (a->kind == A_DEVICE && reuse_values) keep_for_reuse(SYNC_RANGES, a->base, a->span);
  } else if (a->kind == A_HOST || a->kind == A_MANAGED) {
    release_host(a->store);
  }
  free(a);
}

/* Free every live allocation whose field (ctx, owner or pool) equals key.  Measured on driver 580
 * (H100): destroying or resetting a context frees its live stream-ordered allocations, but their
 * pool keeps counting them as used, for good; free_alloc leaves the count as it is. */
enum afield { BY_CTX, BY_OWNER, BY_POOL };
static void free_allocs_by(enum afield field, handle_t key) {
  for (size_t i = nallocs; i > 0;) {
    i--;
    struct alloc *a = allocs[i];
    handle_t v = field == BY_CTX ? a->ctx : field == BY_OWNER ? a->owner : a->pool;
    if (v == key) free_alloc(a);
    if (i > nallocs) i = nallocs;
  }
}

/* ------------------------------------------------------------------ destruction */
static void kill_obj(struct obj *o);
static void complete_ctx(const struct obj *c);

/* Kill every live object whose ctx (by_ctx) or parent equals key.  Killing edits live[]:
 * walking it downwards stays correct because removal only moves the last (visited) entry. */
static void kill_by(int by_ctx, handle_t key) {
  for (size_t i = nlive; i > 0;) {
    i--;
    struct obj *o = live_obj(i);
    if ((by_ctx ? o->ctx : o->parent) == key && o->h != key) kill_obj(o);
    if (i > nlive) i = nlive;
  }
}

static void kill_obj(struct obj *o) {
  if (!o->alive) return;
  switch (o->kind) {
  case K_CTX:
    complete_ctx(o); /* implicitly synchronizing: its work is done, nothing is counted */
    kill_by(1, o->h);
    free_allocs_by(BY_CTX, o->h);
    if (o->primary && prim[o->dev].ctx == o->h) prim[o->dev].ctx = 0;
    break;
  case K_MODULE:
  case K_LIBRARY:
  case K_KERNEL:
    kill_by(0, o->h);
    free_allocs_by(BY_OWNER, o->h);
    if (o->kind != K_KERNEL) free_image(o->img);
    break;
  case K_POOL:
    free_allocs_by(BY_POOL, o->h);
    forget_ranges_of(o->h);
    break;
  case K_LINK:
    free(o->u.l.buf);
    free(o->u.l.out);
    break;
  case K_EVENT:
    free(o->u.e.clk);
    break;
  }
  o->img = NULL;
  unlink_obj(o);
}

/* ------------------------------------------------------------------ records */
static void ring_push(struct ring *r, const char *name) { r->names[r->total++ % RING] = name; }

/* A use of something dead or unknown: on a real driver, a crash or corruption. */
static CUresult stale(CUresult code) {
  stale_count++;
  ring_push(&stale_ring, cur_call);
  return code;
}

/* The right object, but its context is not current. */
static CUresult binding(void) {
  binding_count++;
  ring_push(&binding_ring, cur_call);
  return E_INVALID_CONTEXT;
}

/* Work on memory of another context put on the current context's streams (see the top). */
static void misrouted(void) {
  misrouted_count++;
  ring_push(&misrouted_ring, cur_call);
}

/* A launch or event record of an object of another context than the stream's (the default stream: the
 * current context's): the real driver answers CUDA_ERROR_INVALID_HANDLE (measured on driver 580). */
static CUresult foreign_handle(void) {
  binding_count++;
  ring_push(&binding_ring, cur_call);
  return E_INVALID_HANDLE;
}

/* The thread's current context was destroyed by someone else (cuCtxDestroy on another thread, the
 * last primary release).  The caller passed no stale handle: per the cuCtxDestroy documentation
 * the driver answers CUDA_ERROR_CONTEXT_IS_DESTROYED.  A binding error, not a stale use. */
static CUresult destroyed_current(void) {
  binding_count++;
  ring_push(&binding_ring, cur_call);
  return E_CONTEXT_IS_DESTROYED;
}

/* ------------------------------------------------------------------ failure injection */
struct inject { char call[64]; CUresult code; int count; };
static struct inject injects[32];

static int injected(const char *name, CUresult *code) {
  for (int i = 0; i < 32; i++) {
    struct inject *in = &injects[i];
    if (in->count != 0 && strcmp(in->call, name) == 0) {
      if (in->count > 0) in->count--;
      *code = in->code;
      return 1;
    }
  }
  return 0;
}

/* ------------------------------------------------------------------ call entry */
static int forked(void) {
  if (init_pid != 0 && getpid() != init_pid) {
    __atomic_add_fetch(&fork_violations, 1, __ATOMIC_RELAXED);
    return 1;
  }
  return 0;
}

/* Take mu for call `name`; 0 (and *rc) when the call must return at once. */
static int enter(const char *name, CUresult *rc) {
  if (forked()) { *rc = E_NOT_INITIALIZED; return 0; }
  pthread_mutex_lock(&mu);
  call_ring.names[call_ring.total++ % RING] = name;
  if (injected(name, rc)) { pthread_mutex_unlock(&mu); return 0; }
  if (!initialized) { pthread_mutex_unlock(&mu); *rc = E_NOT_INITIALIZED; return 0; }
  cur_call = name;
  return 1;
}

static void leave(int *held) { if (*held) pthread_mutex_unlock(&mu); }

/* Every entry point starts with ENTER: mu is held until the function returns (cleanup
 * attribute), unless the function clears held_ after unlocking by hand. */
#define ENTER(name)                                  \
  CUresult enter_rc_;                                \
  if (!enter(name, &enter_rc_)) return enter_rc_;    \
  int held_ __attribute__((cleanup(leave))) = 1;     \
  (void)held_
#define TRY(expr) do { CUresult try_rc_ = (expr); if (try_rc_ != OK) return try_rc_; } while (0)
#define NEED(cond) do { if (!(cond)) return E_INVALID_VALUE; } while (0)

/* ------------------------------------------------------------------ lookups */
/* A live handle of the given kind, else a stale use (709 for a destroyed context). */
static struct obj *get(const void *h, int kind, CUresult *rc) {
  struct obj *o = obj_at((handle_t)h);
  if (o && o->alive && o->kind == kind) return o;
  *rc = stale(kind == K_CTX && o && o->kind == K_CTX ? E_CONTEXT_IS_DESTROYED : E_INVALID_HANDLE);
  return NULL;
}

static void sync_tls(void) {
  if (tls_gen != reset_gen) { tls_depth = 0; tls_gen = reset_gen; }
}

static handle_t top(void) { sync_tls(); return tls_depth ? tls_stack[tls_depth - 1] : 0; }

/* The live current context; none is a binding error, a destroyed one a stale use. */
static CUresult cur_ctx(struct obj **c) {
  handle_t h = top();
  if (!h) return binding();
  struct obj *o = obj_at(h);
  if (!o || !o->alive) return destroyed_current();
  *c = o;
  return OK;
}

/* An explicit ctx argument, NULL meaning the current one. */
static CUresult ctx_arg(CUcontext h, struct obj **c) {
  if (!h) return cur_ctx(c);
  CUresult rc;
  return (*c = get(h, K_CTX, &rc)) ? OK : rc;
}

static int is_default_stream(CUstream h) {
  handle_t v = (handle_t)h;
  return v == 0 || v == LEGACY_STREAM || v == PER_THREAD_STREAM;
}

/* A stream argument of a stream-ordered call.  A default stream is the current context's; a
 * stream names its own context, which need not be current (the real driver routes the work by the
 * stream), but some live context must be (strict: unmeasured with none current). */
static CUresult use_stream(CUstream h, struct obj **ctx, struct obj **stream) {
  struct obj *c, *s = NULL;
  CUresult rc;
  TRY(cur_ctx(&c));
  if (!is_default_stream(h)) {
    if (!(s = get(h, K_STREAM, &rc))) return rc;
    c = obj_at(s->ctx);
  }
  if (ctx) *ctx = c;
  if (stream) *stream = s;
  return OK;
}

/* An operation on an object owned by a context: the real driver carries it out whichever context is
 * current, but some live one must be (strict: unmeasured with none current). */
static CUresult need_current(const struct obj *o) {
  (void)o;
  struct obj *c;
  return cur_ctx(&c);
}

static CUresult check_dev(CUdevice dev) { return dev >= 0 && dev < ndev ? OK : E_INVALID_DEVICE; }

/* [addr, addr+n) as a device pointer argument: inside one live allocation, else stale. */
static CUresult dev_range(CUdeviceptr addr, size_t n, struct alloc **pa, char **p) {
  struct alloc *a = find_alloc(addr, n == 0);
  if (!a || n > a->base + a->size - addr) return stale(E_INVALID_VALUE);
  *pa = a;
  *p = a->store + (addr - a->base);
  return OK;
}

/* A unified (UVA) address: device window -> must be a live allocation; known host memory ->
 * bounds-checked; anything else is pageable host memory, used as is. */
static CUresult uni_range(CUdeviceptr addr, size_t n, struct alloc **pa, char **p) {
  if (in_device_window(addr)) return dev_range(addr, n, pa, p);
  struct alloc *a = find_alloc(addr, n == 0);
  if (a && n > a->base + a->size - addr) return stale(E_INVALID_VALUE);
  *pa = a;
  *p = (char *)(uintptr_t)addr;
  return OK;
}

/* Where an operation goes (below); BY_POINTER: a synchronous call the driver routes by the memory
 * (cuMemFree, measured to work with another context current on driver 580). */
struct queue { unsigned uid; int named; };
static const struct queue BY_POINTER = {0, 1};

static int on_device(const struct alloc *a);

/* A memory operation touching allocations a and b (either may be NULL), on queue q (NULL: a
 * synchronous one).  Some live context must be current.  One that runs in the current context (no
 * stream named) is misrouted -- carried out, recorded -- while neither bound side's context is
 * current, or while a bound side in device memory belongs to another context than the current one
 * (cuMemcpyDtoD between two contexts' buffers: the real driver copies, on the current context's
 * default stream, unordered with the other context's work; cuMemcpyPeer is the call for it).  A
 * bound host side (pinned memory) of another context is not: its ordering is the host's. */
static CUresult bind_mem(const struct alloc *a, const struct alloc *b, const struct queue *q) {
  struct obj *c;
  TRY(cur_ctx(&c));
  handle_t cur = top();
  int need = 0, here = 0, foreign = 0;
  const struct alloc *sides[2] = {a, b};
  for (int i = 0; i < 2; i++) {
    const struct alloc *x = sides[i];
    if (!x || !x->bound) continue;
    need = 1;
    if (x->ctx == cur) here = 1;
    else if (on_device(x)) foreign = 1;
  }
  if (need && !(q && q->named) && (!here || foreign)) misrouted();
  return OK;
}

/* ------------------------------------------------------------------ ordering model
 * Records only: the work is still done at once (see the model at the top).  Each stream's state
 * lives in sst[uid], uid never reused before fake_reset (a destroyed stream's pending work still
 * runs; its handle may name a new stream).  uid 0: not modelled (no memory for it); every
 * function here ignores it. */
enum { ST_BLOCKING, ST_NONBLOCKING, ST_LEGACY };
struct sstate {
  unsigned long long ctx_id;  /* the owning context's u.c.id */
  unsigned long long work;    /* the number of the last operation enqueued */
  unsigned long long done;    /* known complete: 1..done */
  unsigned legacy;            /* its context's legacy stream state */
  int kind, pending;          /* pending: listed in pending_uids[] */
  struct clock seen;          /* its later work runs after T's 1..k (waits, the legacy rule) */
};
static struct sstate *sst;
static unsigned nsst, cap_sst;
static unsigned *pending_uids;   /* states that may have work not known complete */
static size_t npending, cap_pending;
static long unordered_count;
static struct ring unordered_ring;

static unsigned new_state(unsigned long long ctx_id, int kind, unsigned legacy) {
  if (nsst == 0) nsst = 1; /* uid 0: none */
  if (nsst >= cap_sst) {
    unsigned cap = cap_sst ? 2 * cap_sst : 64;
    struct sstate *grown = realloc(sst, cap * sizeof *grown);
    if (!grown) return 0;
    sst = grown;
    cap_sst = cap;
  }
  struct sstate *st = &sst[nsst];
  memset(st, 0, sizeof *st);
  st->ctx_id = ctx_id;
  st->kind = kind;
  st->legacy = kind == ST_LEGACY ? nsst : legacy;
  return nsst++;
}

static unsigned long long clock_get(const struct clock *c, unsigned uid) {
  for (int i = 0; i < c->n; i++) if (c->e[i].uid == uid) return c->e[i].k;
  return 0;
}

/* c learns that T = uid is passed up to k.  What is known complete need not be kept. */
static void clock_set(struct clock *c, unsigned uid, unsigned long long k) {
  if (!uid || k <= sst[uid].done) return;
  for (int i = 0; i < c->n; i++) {
    if (c->e[i].uid == uid) { if (k > c->e[i].k) c->e[i].k = k; return; }
  }
  if (c->n == CLOCK) { /* drop what became complete, else the oldest */
    int kept = 0;
    for (int i = 0; i < c->n; i++) if (c->e[i].k > sst[c->e[i].uid].done) c->e[kept++] = c->e[i];
    c->n = kept;
    if (c->n == CLOCK) { memmove(&c->e[0], &c->e[1], (CLOCK - 1) * sizeof c->e[0]); c->n--; }
  }
  c->e[c->n].uid = uid;
  c->e[c->n].k = k;
  c->n++;
}

static void clock_merge(struct clock *dst, const struct clock *src) {
  for (int i = 0; i < src->n; i++) clock_set(dst, src->e[i].uid, src->e[i].k);
}

static void complete_to(unsigned uid, unsigned long long k) {
  if (uid && k > sst[uid].done) sst[uid].done = k;
}

/* Everything c covers is complete (an event waited for, or a stream's whole clock). */
static void complete_clock(const struct clock *c) {
  for (int i = 0; i < c->n; i++) complete_to(c->e[i].uid, c->e[i].k);
}

/* All of the stream's work so far is complete, and so is what it waited for. */
static void complete_stream(unsigned uid) {
  if (!uid) return;
  complete_to(uid, sst[uid].work);
  complete_clock(&sst[uid].seen);
}

/* Drop the states with nothing pending from pending_uids[]. */
static void compact_pending(void) {
  size_t kept = 0;
  for (size_t i = 0; i < npending; i++) {
    struct sstate *st = &sst[pending_uids[i]];
    if (st->done < st->work) pending_uids[kept++] = pending_uids[i];
    else st->pending = 0;
  }
  npending = kept;
}

/* Every stream of the context, its default streams and destroyed ones included. */
static void complete_ctx(const struct obj *c) {
  for (size_t i = 0; i < npending; i++)
    if (sst[pending_uids[i]].ctx_id == c->u.c.id) complete_stream(pending_uids[i]);
  compact_pending();
}

/* The next operation on stream uid: its number.  First the legacy stream's implicit ordering: an
 * operation on it follows all earlier work of the context's blocking streams, an operation on a
 * blocking stream all earlier work of the legacy stream (and what each had waited for). */
static unsigned long long enqueue(unsigned uid) {
  if (!uid) return 0;
  struct sstate *st = &sst[uid];
  if (st->kind == ST_LEGACY) {
    compact_pending();
    for (size_t i = 0; i < npending; i++) {
      struct sstate *b = &sst[pending_uids[i]];
      if (b == st || b->kind != ST_BLOCKING || b->ctx_id != st->ctx_id) continue;
      clock_set(&st->seen, pending_uids[i], b->work);
      clock_merge(&st->seen, &b->seen);
    }
  } else if (st->kind == ST_BLOCKING && st->legacy) {
    struct sstate *l = &sst[st->legacy];
    if (l->work > l->done) {
      clock_set(&st->seen, st->legacy, l->work);
      clock_merge(&st->seen, &l->seen);
    }
  }
  unsigned long long k = ++st->work;
  if (!st->pending) {
    if (npending == cap_pending) {
      size_t cap = cap_pending ? 2 * cap_pending : 64;
      unsigned *grown = realloc(pending_uids, cap * sizeof *grown);
      if (!grown) return k; /* never listed: a context synchronize will not see it (records only) */
      pending_uids = grown;
      cap_pending = cap;
    }
    pending_uids[npending++] = uid;
    st->pending = 1;
  }
  return k;
}

/* The state of a stream argument that use_stream accepted: c its context, s NULL for a default
 * stream.  The per-thread stream's is made on a thread's first use in that context. */
static __thread struct { unsigned long long ctx_id; unsigned uid; } tls_pts[4];
static __thread unsigned tls_pts_gen, tls_pts_next;
static unsigned state_of(CUstream h, struct obj *c, struct obj *s) {
  if (s) return s->u.s.uid;
  if ((handle_t)h != PER_THREAD_STREAM) return c->u.c.legacy;
  if (tls_pts_gen != reset_gen) { memset(tls_pts, 0, sizeof tls_pts); tls_pts_gen = reset_gen; }
  for (int i = 0; i < 4; i++) if (tls_pts[i].uid && tls_pts[i].ctx_id == c->u.c.id) return tls_pts[i].uid;
  unsigned uid = new_state(c->u.c.id, ST_BLOCKING, c->u.c.legacy);
  if (uid) {
    unsigned slot = tls_pts_next++ % 4;
    tls_pts[slot].ctx_id = c->u.c.id;
    tls_pts[slot].uid = uid;
  }
  return uid;
}

/* Where an operation goes: its stream's state, and whether the call named that stream (not a
 * default stream: the current context's).  Synchronous operations pass no queue. */
static CUresult use_queue(CUstream h, struct queue *q, struct obj **ctx) {
  struct obj *c, *s;
  TRY(use_stream(h, &c, &s));
  q->uid = state_of(h, c, s);
  q->named = s != NULL;
  if (ctx) *ctx = c;
  return OK;
}

static void touch(struct alloc *a, unsigned uid, unsigned long long k) {
  if (!a || !uid || !device_kind(a->kind)) return;
  for (int i = 0; i < a->ntouch; i++) {
    if (a->touch[i].uid == uid) { if (k > a->touch[i].k) a->touch[i].k = k; return; }
  }
  if (a->ntouch == TOUCHES) { /* drop what became complete, else the oldest */
    int kept = 0;
    for (int i = 0; i < a->ntouch; i++)
      if (a->touch[i].k > sst[a->touch[i].uid].done) a->touch[kept++] = a->touch[i];
    a->ntouch = kept;
    if (a->ntouch == TOUCHES) {
      memmove(&a->touch[0], &a->touch[1], (TOUCHES - 1) * sizeof a->touch[0]);
      a->ntouch--;
    }
  }
  a->touch[a->ntouch].uid = uid;
  a->touch[a->ntouch].k = k;
  a->ntouch++;
}

/* A copy that returns only when it is done: it ran on the current context's legacy stream,
 * which first waited for the blocking streams, so all of that is complete now. */
static void host_synchronous(void) {
  struct obj *c = obj_at(top());
  if (!c || !c->alive || c->kind != K_CTX) return;
  enqueue(c->u.c.legacy);
  complete_stream(c->u.c.legacy);
}

/* The current context's legacy stream, for the synchronous calls that return before their work is
 * done (a memset of device memory, a device-to-device copy); 0 without a current context. */
static int legacy_queue(struct queue *q) {
  struct obj *c = obj_at(top());
  if (!c || !c->alive || c->kind != K_CTX) return 0;
  q->uid = c->u.c.legacy;
  q->named = 0;
  return 1;
}

/* A memory operation done: with a queue, a number on its stream and a touch of each device
 * allocation (a, b may be NULL); without, host_sync says whether it returned only when done. */
static void queued(const struct queue *q, struct alloc *a, struct alloc *b, int host_sync) {
  if (!q) { if (host_sync) host_synchronous(); return; }
  unsigned long long k = enqueue(q->uid);
  touch(a, q->uid, k);
  touch(b, q->uid, k);
}

static int on_device(const struct alloc *a) { return a && device_kind(a->kind); }

/* A free on stream uid (already enqueued): counted when some touch is not ordered before it. */
static void check_free(const struct alloc *a, unsigned uid) {
  if (!uid) return;
  for (int i = 0; i < a->ntouch; i++) {
    unsigned t = a->touch[i].uid;
    unsigned long long k = a->touch[i].k;
    if (t == uid || k <= sst[t].done || clock_get(&sst[uid].seen, t) >= k) continue;
    unordered_count++;
    ring_push(&unordered_ring, cur_call);
    return;
  }
}

/* ================================================================== entry points */

/* ------------------------------------------------------------------ init, version */
EXPORT CUresult cuInit(unsigned int flags) {
  if (forked()) return E_NOT_INITIALIZED;
  pthread_mutex_lock(&mu);
  CUresult rc = OK;
  if (!injected("cuInit", &rc)) {
    if (flags != 0) {
      rc = E_INVALID_VALUE;
    } else {
      if (!initialized) {
        const char *mode = getenv("CUDA_MODULE_LOADING");
        lazy_loading = !(mode && strcmp(mode, "EAGER") == 0);
      }
      initialized = 1;
      if (!init_pid) init_pid = getpid();
    }
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
  NEED(version);
  *version = DRIVER_VERSION;
  return OK;
}

/* ------------------------------------------------------------------ devices */
static CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
  ENTER("cuDeviceGet");
  NEED(dev);
  TRY(check_dev(ordinal));
  *dev = ordinal;
  return OK;
}

static CUresult cuDeviceGetCount(int *count) {
  ENTER("cuDeviceGetCount");
  NEED(count);
  *count = ndev;
  return OK;
}

static CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  ENTER("cuDeviceGetName");
  NEED(name && len > 0);
  TRY(check_dev(dev));
  snprintf(name, (size_t)len, "Fake GPU %d", dev);
  return OK;
}

static int device_attribute(int attr, CUdevice dev) {
  switch (attr) {
  case 1: return 1024;          /* MAX_THREADS_PER_BLOCK */
  case 2: case 3: return 1024;  /* MAX_BLOCK_DIM_X, Y */
  case 4: return 64;            /* MAX_BLOCK_DIM_Z */
  case 5: return 2147483647;    /* MAX_GRID_DIM_X */
  case 6: case 7: return 65535; /* MAX_GRID_DIM_Y, Z */
  case 8: return 49152;         /* MAX_SHARED_MEMORY_PER_BLOCK */
  case 9: return 65536;         /* TOTAL_CONSTANT_MEMORY */
  case 10: return 32;           /* WARP_SIZE */
  case 11: return 2147483647;   /* MAX_PITCH */
  case 12: return 65536;        /* MAX_REGISTERS_PER_BLOCK */
  case 13: return 1980000;      /* CLOCK_RATE (kHz) */
  case 14: return 512;          /* TEXTURE_ALIGNMENT */
  case 15: return 1;            /* GPU_OVERLAP */
  case 16: return 132;          /* MULTIPROCESSOR_COUNT */
  case 19: return 1;            /* CAN_MAP_HOST_MEMORY */
  case 31: return 1;            /* CONCURRENT_KERNELS */
  case 33: return 0x10 + dev;   /* PCI_BUS_ID */
  case 36: return 2619000;      /* MEMORY_CLOCK_RATE */
  case 37: return 5120;         /* GLOBAL_MEMORY_BUS_WIDTH */
  case 38: return 52428800;     /* L2_CACHE_SIZE */
  case 39: return 2048;         /* MAX_THREADS_PER_MULTIPROCESSOR */
  case 40: return 3;            /* ASYNC_ENGINE_COUNT */
  case 41: return 1;            /* UNIFIED_ADDRESSING */
  case 75: return 9;            /* COMPUTE_CAPABILITY_MAJOR */
  case 76: return 0;            /* COMPUTE_CAPABILITY_MINOR */
  case 78: return 1;            /* STREAM_PRIORITIES_SUPPORTED */
  case 81: return 233472;       /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
  case 82: return 65536;        /* MAX_REGISTERS_PER_MULTIPROCESSOR */
  case 83: return 1;            /* MANAGED_MEMORY */
  case 89: return 1;            /* CONCURRENT_MANAGED_ACCESS */
  case 95: return 1;            /* COOPERATIVE_LAUNCH */
  case 97: return 232448;       /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
  case 106: return 32;          /* MAX_BLOCKS_PER_MULTIPROCESSOR */
  case 115: return 1;           /* MEMORY_POOLS_SUPPORTED */
  default: return 0;
  }
}

static CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
  ENTER("cuDeviceGetAttribute");
  NEED(pi);
  TRY(check_dev(dev));
  *pi = device_attribute(attrib, dev);
  return OK;
}

static CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
  ENTER("cuDeviceTotalMem");
  NEED(bytes);
  TRY(check_dev(dev));
  *bytes = DEVICE_TOTAL_MEM;
  return OK;
}

static CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
  ENTER("cuDeviceGetUuid");
  NEED(uuid);
  TRY(check_dev(dev));
  memcpy(uuid->bytes, "FAKE-GPU-UUID-\0\0", 16);
  uuid->bytes[15] = (char)dev;
  return OK;
}

static CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice dev) {
  ENTER("cuDeviceGetPCIBusId");
  NEED(bus && len > 0);
  TRY(check_dev(dev));
  snprintf(bus, (size_t)len, "00000000:%02X:00.0", 0x10 + dev);
  return OK;
}

static CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *bus) {
  ENTER("cuDeviceGetByPCIBusId");
  NEED(dev && bus);
  unsigned domain = 0, b = 0, d = 0, f = 0; /* [domain:]bus:device.function, hex */
  if (sscanf(bus, "%x:%x:%x.%x", &domain, &b, &d, &f) != 4) {
    domain = 0;
    if (sscanf(bus, "%x:%x.%x", &b, &d, &f) != 3) return E_INVALID_VALUE;
  }
  int ordinal = (int)b - 0x10;
  if (domain != 0 || d != 0 || f != 0 || check_dev(ordinal) != OK) return E_INVALID_DEVICE;
  *dev = ordinal;
  return OK;
}

static CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
  ENTER("cuDeviceCanAccessPeer");
  NEED(can);
  TRY(check_dev(dev));
  TRY(check_dev(peer));
  *can = dev != peer;   /* a device is not its own peer (the real driver answers 0) */
  return OK;
}

static struct obj *default_pool_of(CUdevice dev) {
  struct obj *p = obj_at(default_pool[dev]);
  if (p) return p;
  p = new_obj(K_POOL, 0, dev);
  if (!p) return NULL;
  p->is_default = 1;
  default_pool[dev] = p->h;
  return p;
}

static CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
  ENTER("cuDeviceGetDefaultMemPool");
  NEED(pool);
  TRY(check_dev(dev));
  struct obj *p = default_pool_of(dev);
  if (!p) return E_OUT_OF_MEMORY;
  *pool = (CUmemoryPool)p->h;
  return OK;
}

/* ------------------------------------------------------------------ contexts */
/* CU_LIMIT_STACK_SIZE, PRINTF_FIFO_SIZE, MALLOC_HEAP_SIZE, DEV_RUNTIME_SYNC_DEPTH, ... */
static const size_t default_limits[N_LIMITS] = {1024, 1048576, 8388608, 2, 2048, 64, 0, 0, 0, 0, 0};

static struct obj *new_ctx(CUdevice dev, unsigned flags, int primary, handle_t at) {
  struct obj *c = new_obj_at(K_CTX, 0, dev, at);
  if (!c) return NULL;
  c->primary = (unsigned char)primary;
  c->flags = flags;
  c->u.c.id = ++ctx_ids;
  c->u.c.legacy = new_state(c->u.c.id, ST_LEGACY, 0);
  memcpy(c->u.c.limits, default_limits, sizeof default_limits);
  return c;
}

static CUresult push(handle_t h) {
  sync_tls();
  if (tls_depth == STACK_DEPTH) return E_INVALID_VALUE;
  tls_stack[tls_depth++] = h;
  return OK;
}

static CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned flags, CUdevice dev) {
  ENTER("cuCtxCreate");
  (void)params; /* execution affinity / CIG parameters are not modelled */
  NEED(pctx);
  TRY(check_dev(dev));
  sync_tls();
  if (tls_depth == STACK_DEPTH) return E_INVALID_VALUE;
  struct obj *c = new_ctx(dev, flags, 0, 0);
  if (!c) return E_OUT_OF_MEMORY;
  push(c->h);
  *pctx = (CUcontext)c->h;
  return OK;
}

static CUresult cuCtxDestroy_v2(CUcontext ctx) {
  ENTER("cuCtxDestroy");
  CUresult rc;
  struct obj *c = get(ctx, K_CTX, &rc);
  if (!c) return rc;
  if (c->primary) return stale(E_INVALID_CONTEXT); /* a primary context is released, not destroyed */
  kill_obj(c);
  /* The calling thread stops using it; other threads keep a stale entry, as with the real driver. */
  if (top() == c->h) tls_depth--;
  return OK;
}

static CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  ENTER("cuCtxPushCurrent");
  CUresult rc;
  struct obj *c = get(ctx, K_CTX, &rc);
  if (!c) return rc;
  return push(c->h);
}

static CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
  ENTER("cuCtxPopCurrent");
  sync_tls();
  if (tls_depth == 0) return E_INVALID_CONTEXT; /* not a binding error: nothing to pop */
  handle_t h = tls_stack[--tls_depth];
  if (pctx) *pctx = (CUcontext)h;
  return OK;
}

static CUresult cuCtxSetCurrent(CUcontext ctx) {
  ENTER("cuCtxSetCurrent");
  sync_tls();
  if (!ctx) { /* NULL pops; a no-op on an empty stack */
    if (tls_depth) tls_depth--;
    return OK;
  }
  CUresult rc;
  struct obj *c = get(ctx, K_CTX, &rc);
  if (!c) return rc;
  if (tls_depth) tls_stack[tls_depth - 1] = c->h;
  else tls_stack[tls_depth++] = c->h;
  return OK;
}

static CUresult cuCtxGetCurrent(CUcontext *pctx) {
  ENTER("cuCtxGetCurrent");
  NEED(pctx);
  *pctx = (CUcontext)top(); /* may be a destroyed context: that is what is current */
  return OK;
}

static CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx) {
  ENTER("cuCtxGetDevice");
  NEED(dev);
  struct obj *c;
  TRY(ctx_arg(ctx, &c));
  *dev = c->dev;
  return OK;
}

static CUresult cuCtxSynchronize_v2(CUcontext ctx) {
  ENTER("cuCtxSynchronize");
  struct obj *c;
  TRY(ctx_arg(ctx, &c));
  complete_ctx(c);
  return OK;
}

static CUresult cuCtxGetFlags(unsigned *flags) {
  ENTER("cuCtxGetFlags");
  NEED(flags);
  struct obj *c;
  TRY(cur_ctx(&c));
  *flags = c->flags;
  return OK;
}

/* Peer access is state of the current context (who may access) and the peer context: kept as the
 * peer's id, so a destroyed peer whose handle comes back is another context.  As the real driver: flags
 * must be 0, a context of the same device is no peer (CUDA_ERROR_INVALID_DEVICE, since
 * cuDeviceCanAccessPeer says 0), twice is CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, at most 8 peers. */
static CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags) {
  ENTER("cuCtxEnablePeerAccess");
  NEED(flags == 0);
  struct obj *c, *p;
  CUresult rc;
  TRY(cur_ctx(&c));
  if (!(p = get(peer, K_CTX, &rc))) return rc;
  if (p->dev == c->dev) return E_INVALID_DEVICE;
  for (int i = 0; i < c->u.c.npeers; i++)
    if (c->u.c.peers[i] == p->u.c.id) return E_PEER_ACCESS_ALREADY_ENABLED;
  if (c->u.c.npeers == 8) return E_TOO_MANY_PEERS;
  c->u.c.peers[c->u.c.npeers++] = p->u.c.id;
  return OK;
}

static CUresult cuCtxDisablePeerAccess(CUcontext peer) {
  ENTER("cuCtxDisablePeerAccess");
  struct obj *c, *p;
  CUresult rc;
  TRY(cur_ctx(&c));
  if (!(p = get(peer, K_CTX, &rc))) return rc;
  for (int i = 0; i < c->u.c.npeers; i++)
    if (c->u.c.peers[i] == p->u.c.id) {
      c->u.c.peers[i] = c->u.c.peers[--c->u.c.npeers];
      return OK;
    }
  return E_PEER_ACCESS_NOT_ENABLED;
}

static CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned *version) {
  ENTER("cuCtxGetApiVersion");
  NEED(version);
  struct obj *c;
  TRY(ctx_arg(ctx, &c));
  *version = 3020; /* the API version contexts have reported since the _v2 context API */
  return OK;
}

static CUresult cuCtxGetLimit(size_t *value, int limit) {
  ENTER("cuCtxGetLimit");
  NEED(value);
  struct obj *c;
  TRY(cur_ctx(&c));
  if (limit < 0 || limit >= N_LIMITS) return E_UNSUPPORTED_LIMIT;
  *value = c->u.c.limits[limit];
  return OK;
}

static int profiling;  /* cuProfilerStart/Stop: collection on (needs a current context, as the real one) */

static CUresult set_profiling(int on) {
  struct obj *c;
  TRY(cur_ctx(&c));
  profiling = on;
  return OK;
}

static CUresult cuProfilerStart(void) { ENTER("cuProfilerStart"); return set_profiling(1); }
static CUresult cuProfilerStop(void) { ENTER("cuProfilerStop"); return set_profiling(0); }

EXPORT int fake_profiling(void) { return profiling; }

static CUresult cuCtxSetLimit(int limit, size_t value) {
  ENTER("cuCtxSetLimit");
  struct obj *c;
  TRY(cur_ctx(&c));
  if (limit < 0 || limit >= N_LIMITS) return E_UNSUPPORTED_LIMIT;
  c->u.c.limits[limit] = value;
  return OK;
}

static CUresult cuCtxGetCacheConfig(int *config) {
  ENTER("cuCtxGetCacheConfig");
  NEED(config);
  struct obj *c;
  TRY(cur_ctx(&c));
  *config = c->u.c.cache;
  return OK;
}

static CUresult cuCtxSetCacheConfig(int config) {
  ENTER("cuCtxSetCacheConfig");
  struct obj *c;
  TRY(cur_ctx(&c));
  NEED(config >= 0 && config <= 3);
  c->u.c.cache = config;
  return OK;
}

static CUresult cuCtxGetSharedMemConfig(int *config) {
  ENTER("cuCtxGetSharedMemConfig");
  NEED(config);
  struct obj *c;
  TRY(cur_ctx(&c));
  *config = 1; /* CU_SHAREDMEM_CONFIG_FOUR_BYTE_BANK_SIZE */
  return OK;
}

static CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
  ENTER("cuCtxGetStreamPriorityRange");
  struct obj *c;
  TRY(cur_ctx(&c));
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return OK;
}

static CUresult cuCtxGetId(CUcontext ctx, unsigned long long *id) {
  ENTER("cuCtxGetId");
  NEED(id);
  struct obj *c;
  TRY(ctx_arg(ctx, &c));
  *id = c->u.c.id;
  return OK;
}

/* ------------------------------------------------------------------ primary contexts */
static CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  ENTER("cuDevicePrimaryCtxRetain");
  NEED(pctx);
  TRY(check_dev(dev));
  struct primary *p = &prim[dev];
  if (!p->ctx) { /* a new activation: with reuse, under the device's one handle (as on a GPU) */
    struct obj *c = new_ctx(dev, p->flags, 1, reuse_values ? p->slot : 0);
    if (!c) return E_OUT_OF_MEMORY;
    p->ctx = p->slot = c->h;
    p->refcount = 0;
  }
  p->refcount++;
  *pctx = (CUcontext)p->ctx;
  return OK;
}

static CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  ENTER("cuDevicePrimaryCtxRelease");
  TRY(check_dev(dev));
  struct primary *p = &prim[dev];
  if (p->refcount == 0 || !p->ctx) return stale(E_INVALID_CONTEXT); /* a release without retain */
  if (--p->refcount == 0) kill_obj(obj_at(p->ctx));
  return OK;
}

static CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned *flags, int *active) {
  ENTER("cuDevicePrimaryCtxGetState");
  NEED(flags && active);
  TRY(check_dev(dev));
  *flags = prim[dev].flags;
  *active = prim[dev].ctx != 0;
  return OK;
}

static CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned flags) {
  ENTER("cuDevicePrimaryCtxSetFlags");
  TRY(check_dev(dev));
  prim[dev].flags = flags;
  struct obj *c = obj_at(prim[dev].ctx);
  if (c) c->flags = flags;
  return OK;
}

/* Reset destroys everything made in the primary context (allocations, streams, events, modules,
 * ...) and its settings, but not the retains: as the driver documents, "resetting the primary
 * context does not release it", holders must still release.  The context (and its handle) so
 * lives on while retained, empty; a reset of an inactive primary context does nothing. */
static CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
  ENTER("cuDevicePrimaryCtxReset");
  TRY(check_dev(dev));
  struct obj *c = obj_at(prim[dev].ctx);
  if (c && c->alive) {
    complete_ctx(c); /* implicitly synchronizing */
    kill_by(1, c->h);
    free_allocs_by(BY_CTX, c->h);
    memcpy(c->u.c.limits, default_limits, sizeof default_limits);
    c->u.c.cache = 0;
  }
  return OK;
}

/* ------------------------------------------------------------------ memory: allocation */
static CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
  ENTER("cuMemAlloc");
  NEED(dptr);
  struct obj *c;
  TRY(cur_ctx(&c));
  CUresult rc;
  struct alloc *a = new_alloc(A_DEVICE, size, c->dev, c->h, 0, &rc);
  if (!a) return rc;
  *dptr = a->base;
  return OK;
}

static CUresult cuMemFree_v2(CUdeviceptr dptr) {
  ENTER("cuMemFree");
  struct alloc *a = find_alloc(dptr, 0);
  /* the start of a cuMemAlloc, stream-ordered or managed allocation; never a module variable */
  int freeable = a && a->base == dptr && !a->owner &&
                 (a->kind == A_DEVICE || a->kind == A_ASYNC || a->kind == A_MANAGED);
  if (!freeable) return stale(E_INVALID_VALUE);
  TRY(bind_mem(a, NULL, &BY_POINTER));
  /* It waits for the device: all work of the memory's context is done, nothing is counted. */
  struct obj *owner = obj_at(a->ctx);
  if (owner && owner->alive && owner->kind == K_CTX) complete_ctx(owner);
  /* Measured on driver 580 (H100): cuMemFree of a stream-ordered allocation succeeds, but the
   * pool's USED_MEM_CURRENT never drops and the memory cannot be trimmed: a leak.  Modelled here
   * (free_alloc leaves the pool's count, and the range is never reused) so that CI sees code that
   * frees stream-ordered memory with cuMemFree. */
  free_alloc(a);
  return OK;
}

static CUresult host_alloc(void **pp, size_t size) {
  NEED(pp);
  struct obj *c;
  TRY(cur_ctx(&c));
  CUresult rc;
  struct alloc *a = new_alloc(A_HOST, size, c->dev, c->h, 0, &rc);
  if (!a) return rc;
  *pp = a->store;
  return OK;
}

static CUresult cuMemAllocHost_v2(void **pp, size_t size) {
  ENTER("cuMemAllocHost");
  return host_alloc(pp, size);
}

static CUresult cuMemHostAlloc(void **pp, size_t size, unsigned flags) {
  ENTER("cuMemHostAlloc");
  NEED((flags & ~7u) == 0); /* PORTABLE | DEVICEMAP | WRITECOMBINED */
  return host_alloc(pp, size);
}

static CUresult cuMemFreeHost(void *p) {
  ENTER("cuMemFreeHost");
  struct alloc *a = find_alloc((CUdeviceptr)(uintptr_t)p, 0);
  if (!a || a->kind != A_HOST || a->store != p) return stale(E_INVALID_VALUE);
  free_alloc(a);
  return OK;
}

static CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned flags) {
  ENTER("cuMemHostGetDevicePointer");
  NEED(pdptr && flags == 0);
  struct alloc *a = find_alloc((CUdeviceptr)(uintptr_t)p, 0);
  if (!a || (a->kind != A_HOST && a->kind != A_REGISTERED)) return stale(E_INVALID_VALUE);
  *pdptr = (CUdeviceptr)(uintptr_t)p; /* the host address doubles as the device address */
  return OK;
}

static CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned flags) {
  ENTER("cuMemHostRegister");
  NEED(p && size && (flags & ~15u) == 0);
  struct obj *c;
  TRY(cur_ctx(&c));
  CUdeviceptr lo = (CUdeviceptr)(uintptr_t)p;
  for (size_t i = 0; i < nallocs; i++) {
    struct alloc *a = allocs[i];
    if (!device_kind(a->kind) && lo < a->base + a->size && a->base < lo + size)
      return E_HOST_MEMORY_ALREADY_REGISTERED;
  }
  CUresult rc;
  struct alloc *a = new_alloc(A_REGISTERED, size, c->dev, c->h, 0, &rc);
  if (!a) return rc;
  a->base = lo;
  a->store = p;
  return OK;
}

static CUresult cuMemHostUnregister(void *p) {
  ENTER("cuMemHostUnregister");
  struct alloc *a = find_alloc((CUdeviceptr)(uintptr_t)p, 0);
  if (!a || a->kind != A_REGISTERED || a->store != p) return stale(E_HOST_MEMORY_NOT_REGISTERED);
  free_alloc(a);
  return OK;
}

static CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned flags) {
  ENTER("cuMemAllocManaged");
  NEED(dptr && (flags == 1 || flags == 2)); /* CU_MEM_ATTACH_GLOBAL or _HOST */
  struct obj *c;
  TRY(cur_ctx(&c));
  CUresult rc;
  struct alloc *a = new_alloc(A_MANAGED, size, c->dev, c->h, 0, &rc);
  if (!a) return rc;
  *dptr = a->base;
  return OK;
}

static CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
  ENTER("cuMemGetInfo");
  struct obj *c;
  TRY(cur_ctx(&c));
  if (free_bytes) *free_bytes = DEVICE_TOTAL_MEM - dev_bytes[c->dev];
  if (total) *total = DEVICE_TOTAL_MEM;
  return OK;
}

/* ------------------------------------------------------------------ memory: copies */
/* The copy and memset helpers take the queue of an asynchronous call, NULL for a synchronous one. */
static CUresult copy_htod(CUdeviceptr dst, const void *src, size_t n, const struct queue *q) {
  struct alloc *a;
  char *d;
  TRY(dev_range(dst, n, &a, &d));
  TRY(bind_mem(a, NULL, q));
  queued(q, a, NULL, 1);
  if (n) memcpy(d, src, n);
  return OK;
}

static CUresult copy_dtoh(void *dst, CUdeviceptr src, size_t n, const struct queue *q) {
  struct alloc *a;
  char *s;
  TRY(dev_range(src, n, &a, &s));
  TRY(bind_mem(a, NULL, q));
  queued(q, a, NULL, 1);
  if (n) memcpy(dst, s, n);
  return OK;
}

static CUresult copy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n, int unified, const struct queue *q) {
  struct alloc *a, *b;
  char *d, *s;
  TRY((unified ? uni_range : dev_range)(dst, n, &a, &d));
  TRY((unified ? uni_range : dev_range)(src, n, &b, &s));
  TRY(bind_mem(a, b, q));
  struct queue legacy;   /* device to device, no stream: the legacy stream's, done after the return */
  if (!q && on_device(a) && on_device(b) && legacy_queue(&legacy)) q = &legacy;
  queued(q, a, b, !on_device(a) || !on_device(b));
  if (n) memmove(d, s, n);
  return OK;
}

static CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  ENTER("cuMemcpyHtoD");
  return copy_htod(dst, src, n, NULL);
}

static CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  ENTER("cuMemcpyDtoH");
  return copy_dtoh(dst, src, n, NULL);
}

static CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  ENTER("cuMemcpyDtoD");
  return copy_dtod(dst, src, n, 0, NULL);
}

static CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  ENTER("cuMemcpy");
  return copy_dtod(dst, src, n, 1, NULL);
}

/* Asynchronous copies happen at once: the stream's context must be current, then as above. */
static CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream stream) {
  ENTER("cuMemcpyHtoDAsync");
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  return copy_htod(dst, src, n, &q);
}

static CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream stream) {
  ENTER("cuMemcpyDtoHAsync");
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  return copy_dtoh(dst, src, n, &q);
}

static CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
  ENTER("cuMemcpyDtoDAsync");
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  return copy_dtod(dst, src, n, 0, &q);
}

static CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
  ENTER("cuMemcpyAsync");
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  return copy_dtod(dst, src, n, 1, &q);
}

/* Peer copies name their contexts, so none has to be current; each pointer must be of its ctx. */
static CUresult copy_peer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n,
                          const struct queue *q) {
  CUresult rc;
  struct obj *dc = get(dctx, K_CTX, &rc);
  if (!dc) return rc;
  struct obj *sc = get(sctx, K_CTX, &rc);
  if (!sc) return rc;
  struct alloc *a, *b;
  char *d, *s;
  TRY(dev_range(dst, n, &a, &d));
  TRY(dev_range(src, n, &b, &s));
  if ((a->bound && a->ctx != dc->h) || (b->bound && b->ctx != sc->h)) {
    binding();
    return E_INVALID_VALUE;
  }
  queued(q, a, b, 0);
  if (n) memmove(d, s, n);
  return OK;
}

static CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n) {
  ENTER("cuMemcpyPeer");
  struct obj *c;
  TRY(cur_ctx(&c));   /* CUDA_ERROR_INVALID_CONTEXT with none current, though both contexts are named (580) */
  return copy_peer(dst, dctx, src, sctx, n, NULL);
}

static CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
                                  size_t n, CUstream stream) {
  ENTER("cuMemcpyPeerAsync");
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  return copy_peer(dst, dctx, src, sctx, n, &q);
}

/* One side of a 2D/3D copy: start address and the extent from it that the copy touches. */
static CUresult copy_side(int type, const void *host, CUdeviceptr device, size_t offset, size_t extent,
                          struct alloc **a, char **p) {
  *a = NULL;
  switch (type) {
  case 1: /* HOST */
    NEED(host);
    *p = (char *)host + offset;
    return OK;
  case 2: /* DEVICE */
    return dev_range(device + offset, extent, a, p);
  case 4: /* UNIFIED */
    return uni_range(device + offset, extent, a, p);
  case 3: /* ARRAY */
    return E_NOT_SUPPORTED;
  default:
    return E_INVALID_VALUE;
  }
}

static CUresult copy_3d(const CUDA_MEMCPY3D *c, const struct queue *q) {
  size_t w = c->WidthInBytes, h = c->Height, depth = c->Depth;
  if (w == 0 || h == 0 || depth == 0) return OK;
  size_t sh = c->srcHeight ? c->srcHeight : h, dh = c->dstHeight ? c->dstHeight : h;
  size_t sp = c->srcPitch ? c->srcPitch : w, dp = c->dstPitch ? c->dstPitch : w;
  NEED(sp >= w && dp >= w && sh >= h && dh >= h);
  size_t soff = (c->srcZ * sh + c->srcY) * sp + c->srcXInBytes;
  size_t doff = (c->dstZ * dh + c->dstY) * dp + c->dstXInBytes;
  size_t sext = ((depth - 1) * sh + (h - 1)) * sp + w;
  size_t dext = ((depth - 1) * dh + (h - 1)) * dp + w;
  struct alloc *a, *b;
  char *s, *d;
  TRY(copy_side(c->srcMemoryType, c->srcHost, c->srcDevice, soff, sext, &a, &s));
  TRY(copy_side(c->dstMemoryType, c->dstHost, c->dstDevice, doff, dext, &b, &d));
  TRY(bind_mem(a, b, q));
  queued(q, a, b, !on_device(a) || !on_device(b));
  for (size_t z = 0; z < depth; z++)
    for (size_t y = 0; y < h; y++)
      memmove(d + (z * dh + y) * dp, s + (z * sh + y) * sp, w);
  return OK;
}

static CUresult copy_2d(const CUDA_MEMCPY2D *c, const struct queue *q) {
  NEED(c);
  CUDA_MEMCPY3D t;
  memset(&t, 0, sizeof t);
  t.srcXInBytes = c->srcXInBytes; t.srcY = c->srcY; t.srcMemoryType = c->srcMemoryType;
  t.srcHost = c->srcHost; t.srcDevice = c->srcDevice; t.srcPitch = c->srcPitch;
  t.dstXInBytes = c->dstXInBytes; t.dstY = c->dstY; t.dstMemoryType = c->dstMemoryType;
  t.dstHost = c->dstHost; t.dstDevice = c->dstDevice; t.dstPitch = c->dstPitch;
  t.WidthInBytes = c->WidthInBytes; t.Height = c->Height; t.Depth = 1;
  if (c->Height > 1) NEED(c->srcPitch >= c->WidthInBytes && c->dstPitch >= c->WidthInBytes);
  return copy_3d(&t, q);
}

static CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *c) {
  ENTER("cuMemcpy2D");
  return copy_2d(c, NULL);
}

static CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *c, CUstream stream) {
  ENTER("cuMemcpy2DAsync");
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  return copy_2d(c, &q);
}

static CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D *c) {
  ENTER("cuMemcpy3D");
  NEED(c);
  return copy_3d(c, NULL);
}

static CUresult cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *c, CUstream stream) {
  ENTER("cuMemcpy3DAsync");
  NEED(c);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  return copy_3d(c, &q);
}

/* ------------------------------------------------------------------ memory: memset */
static CUresult memset_2d(CUdeviceptr dst, size_t pitch, unsigned value, size_t elem, size_t width, size_t height,
                          const struct queue *q) {
  if (dst % elem) return E_INVALID_VALUE;
  if (width == 0 || height == 0) return OK;
  if (height > 1) NEED(pitch >= width * elem);
  size_t extent = (height - 1) * pitch + width * elem;
  struct alloc *a;
  char *d;
  TRY(dev_range(dst, extent, &a, &d));
  TRY(bind_mem(a, NULL, q));
  struct queue legacy;
  if (!q && on_device(a) && legacy_queue(&legacy)) q = &legacy;   /* returns before it is done */
  queued(q, a, NULL, 0);
  for (size_t y = 0; y < height; y++) {
    char *row = d + y * pitch;
    for (size_t x = 0; x < width; x++) {
      if (elem == 1) row[x] = (char)value;
      else if (elem == 2) { unsigned short v = (unsigned short)value; memcpy(row + 2 * x, &v, 2); }
      else memcpy(row + 4 * x, &value, 4);
    }
  }
  return OK;
}

#define MEMSET_1D(NAME, CALL, T, ELEM)                                                      \
  static CUresult NAME(CUdeviceptr dst, T value, size_t n) {                                  \
    ENTER(CALL);                                                                              \
    return memset_2d(dst, 0, value, ELEM, n, 1, NULL);                                        \
  }
#define MEMSET_1D_ASYNC(NAME, CALL, T, ELEM)                                                \
  static CUresult NAME(CUdeviceptr dst, T value, size_t n, CUstream stream) {                 \
    ENTER(CALL);                                                                              \
    struct queue q;                                                                           \
    TRY(use_queue(stream, &q, NULL));                                                         \
    return memset_2d(dst, 0, value, ELEM, n, 1, &q);                                          \
  }
#define MEMSET_2D(NAME, CALL, T, ELEM)                                                      \
  static CUresult NAME(CUdeviceptr dst, size_t pitch, T value, size_t w, size_t h) {          \
    ENTER(CALL);                                                                              \
    return memset_2d(dst, pitch, value, ELEM, w, h, NULL);                                    \
  }
#define MEMSET_2D_ASYNC(NAME, CALL, T, ELEM)                                                \
  static CUresult NAME(CUdeviceptr dst, size_t pitch, T value, size_t w, size_t h, CUstream stream) { \
    ENTER(CALL);                                                                              \
    struct queue q;                                                                           \
    TRY(use_queue(stream, &q, NULL));                                                         \
    return memset_2d(dst, pitch, value, ELEM, w, h, &q);                                      \
  }

MEMSET_1D(cuMemsetD8_v2, "cuMemsetD8", unsigned char, 1)
MEMSET_1D(cuMemsetD16_v2, "cuMemsetD16", unsigned short, 2)
MEMSET_1D(cuMemsetD32_v2, "cuMemsetD32", unsigned int, 4)
MEMSET_1D_ASYNC(cuMemsetD8Async, "cuMemsetD8Async", unsigned char, 1)
MEMSET_1D_ASYNC(cuMemsetD16Async, "cuMemsetD16Async", unsigned short, 2)
MEMSET_1D_ASYNC(cuMemsetD32Async, "cuMemsetD32Async", unsigned int, 4)
MEMSET_2D(cuMemsetD2D8_v2, "cuMemsetD2D8", unsigned char, 1)
MEMSET_2D(cuMemsetD2D16_v2, "cuMemsetD2D16", unsigned short, 2)
MEMSET_2D(cuMemsetD2D32_v2, "cuMemsetD2D32", unsigned int, 4)
MEMSET_2D_ASYNC(cuMemsetD2D8Async, "cuMemsetD2D8Async", unsigned char, 1)
MEMSET_2D_ASYNC(cuMemsetD2D16Async, "cuMemsetD2D16Async", unsigned short, 2)
MEMSET_2D_ASYNC(cuMemsetD2D32Async, "cuMemsetD2D32Async", unsigned int, 4)

/* ------------------------------------------------------------------ memory: queries, hints */
/* A query: an unknown pointer is an answer (INVALID_VALUE), not a stale use. */
static CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr) {
  ENTER("cuPointerGetAttribute");
  NEED(data);
  struct alloc *a = find_alloc(ptr, 0);
  if (!a) return E_INVALID_VALUE;
  int host = a->kind == A_HOST || a->kind == A_REGISTERED;
  switch (attr) {
  case 1: *(CUcontext *)data = (CUcontext)a->ctx; return OK;             /* CONTEXT */
  case 2: *(unsigned *)data = host ? 1 : 2; return OK;                    /* MEMORY_TYPE */
  case 3: *(CUdeviceptr *)data = ptr; return OK;                          /* DEVICE_POINTER */
  case 4:                                                                 /* HOST_POINTER */
    if (device_kind(a->kind)) return E_INVALID_VALUE;
    *(void **)data = (void *)(uintptr_t)ptr;
    return OK;
  case 6: *(int *)data = 0; return OK;                                    /* SYNC_MEMOPS */
  case 7: *(unsigned long long *)data = a->id; return OK;                 /* BUFFER_ID */
  case 8: *(int *)data = a->kind == A_MANAGED; return OK;                 /* IS_MANAGED */
  case 9: *(int *)data = a->dev; return OK;                               /* DEVICE_ORDINAL */
  case 11: *(CUdeviceptr *)data = a->base; return OK;                     /* RANGE_START_ADDR */
  case 12: *(size_t *)data = a->size; return OK;                          /* RANGE_SIZE */
  case 13: *(int *)data = 1; return OK;                                   /* MAPPED */
  case 17: *(CUmemoryPool *)data = (CUmemoryPool)a->pool; return OK;      /* MEMPOOL_HANDLE */
  default: return E_INVALID_VALUE;
  }
}

static CUresult cuMemPrefetchAsync_v2(CUdeviceptr ptr, size_t n, unsigned long long location,
                                      unsigned flags, CUstream stream) {
  ENTER("cuMemPrefetchAsync");
  (void)location;
  (void)flags;
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  struct alloc *a = NULL;
  char *p;
  TRY(uni_range(ptr, n, &a, &p));
  if (!a) return stale(E_INVALID_VALUE); /* prefetching memory the driver never gave out */
  enqueue(q.uid);
  return OK;
}

static CUresult cuMemAdvise_v2(CUdeviceptr ptr, size_t n, int advice, unsigned long long location) {
  ENTER("cuMemAdvise");
  (void)advice;
  (void)location;
  struct alloc *a = NULL;
  char *p;
  TRY(uni_range(ptr, n, &a, &p));
  return a ? OK : stale(E_INVALID_VALUE);
}

/* ------------------------------------------------------------------ memory pools */
static CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
  ENTER("cuMemPoolCreate");
  NEED(pool && props);
  NEED(props->allocType == 1 && props->locationType == 1); /* PINNED on a DEVICE */
  TRY(check_dev(props->locationId));
  struct obj *p = new_obj(K_POOL, 0, props->locationId);
  if (!p) return E_OUT_OF_MEMORY;
  *pool = (CUmemoryPool)p->h;
  return OK;
}

static CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  ENTER("cuMemPoolDestroy");
  CUresult rc;
  struct obj *p = get(pool, K_POOL, &rc);
  if (!p) return rc;
  if (p->is_default) return E_INVALID_VALUE;
  kill_obj(p); /* frees what is still allocated from it, as the real driver does */
  return OK;
}

static CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
  ENTER("cuMemPoolGetAttribute");
  NEED(value);
  CUresult rc;
  struct obj *p = get(pool, K_POOL, &rc);
  if (!p) return rc;
  unsigned long long *u64 = value;
  int *i32 = value;
  switch (attr) {
  case 1: case 2: case 3: *i32 = p->u.p.reuse[attr]; return OK;
  case 4: *u64 = p->u.p.threshold; return OK;
  case 5: case 7: *u64 = p->u.p.used; return OK; /* reserved == used: no caching modelled */
  case 6: *u64 = p->u.p.reserved_high; return OK;
  case 8: *u64 = p->u.p.used_high; return OK;
  case 9: *i32 = 1; return OK;       /* ALLOCATION_TYPE: pinned */
  case 10: *i32 = 0; return OK;      /* EXPORT_HANDLE_TYPES */
  case 11: *i32 = p->dev; return OK; /* LOCATION_ID */
  case 12: *i32 = 1; return OK;      /* LOCATION_TYPE: device */
  case 13: *u64 = 0; return OK;      /* MAX_POOL_SIZE: unlimited */
  default: return E_INVALID_VALUE;
  }
}

static CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
  ENTER("cuMemPoolSetAttribute");
  NEED(value);
  CUresult rc;
  struct obj *p = get(pool, K_POOL, &rc);
  if (!p) return rc;
  /* int attributes are 4 bytes, the others 8: read only what the caller's type holds */
  switch (attr) {
  case 1: case 2: case 3: p->u.p.reuse[attr] = *(int *)value; return OK;
  case 4: p->u.p.threshold = *(unsigned long long *)value; return OK;
  case 6: /* high-water marks can only be reset (to 0, meaning "to the current value") */
    NEED(*(unsigned long long *)value == 0);
    p->u.p.reserved_high = p->u.p.used;
    return OK;
  case 8:
    NEED(*(unsigned long long *)value == 0);
    p->u.p.used_high = p->u.p.used;
    return OK;
  default: return E_INVALID_VALUE;
  }
}

static CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
  ENTER("cuMemPoolTrimTo");
  (void)keep; /* nothing is cached, so nothing to release */
  CUresult rc;
  return get(pool, K_POOL, &rc) ? OK : rc;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t size, struct obj *pool, CUstream stream) {
  NEED(dptr);
  struct obj *c;
  struct queue q;
  TRY(use_queue(stream, &q, &c));
  if (!pool) pool = default_pool_of(c->dev);
  if (!pool) return E_OUT_OF_MEMORY;
  CUresult rc;
  struct alloc *a = new_alloc(A_ASYNC, size, pool->dev, c->h, pool->h, &rc);
  if (!a) return rc;
  pool->u.p.used += size;
  if (pool->u.p.used > pool->u.p.used_high) pool->u.p.used_high = pool->u.p.used;
  if (pool->u.p.used > pool->u.p.reserved_high) pool->u.p.reserved_high = pool->u.p.used;
  enqueue(q.uid);
  *dptr = a->base;
  return OK;
}

static CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream stream) {
  ENTER("cuMemAllocAsync");
  return alloc_async(dptr, size, NULL, stream);
}

static CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream) {
  ENTER("cuMemAllocFromPoolAsync");
  CUresult rc;
  struct obj *p = get(pool, K_POOL, &rc);
  if (!p) return rc;
  return alloc_async(dptr, size, p, stream);
}

static CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
  ENTER("cuMemFreeAsync");
  struct alloc *a = find_alloc(dptr, 0);
  if (!a || a->base != dptr || (a->kind != A_ASYNC && a->kind != A_DEVICE)) return stale(E_INVALID_VALUE);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  TRY(bind_mem(a, NULL, &q));
  enqueue(q.uid);
  check_free(a, q.uid); /* work on another stream that may still use it: an unordered free */
  /* Back to its pool: no longer counted as used, and the next allocation from that pool may get
   * the address again.  (cuMemAlloc memory freed here is freed for good.) */
  struct obj *pool = a->kind == A_ASYNC ? pool_of(a->pool) : NULL;
  if (pool) {
    pool->u.p.used -= a->size;
    keep_for_reuse(pool->h, a->base, a->span);
  }
  free_alloc(a);
  return OK;
}

/* ------------------------------------------------------------------ streams */
static CUresult new_stream(CUstream *ph, unsigned flags, int priority) {
  NEED(ph && (flags & ~1u) == 0); /* CU_STREAM_NON_BLOCKING */
  struct obj *c;
  TRY(cur_ctx(&c));
  struct obj *s = new_obj(K_STREAM, c->h, c->dev);
  if (!s) return E_OUT_OF_MEMORY;
  s->flags = flags;
  s->u.s.priority = priority < -5 ? -5 : priority > 0 ? 0 : priority; /* clamped, like the driver */
  s->u.s.uid = new_state(c->u.c.id, flags & 1 ? ST_NONBLOCKING : ST_BLOCKING, c->u.c.legacy);
  *ph = (CUstream)s->h;
  return OK;
}

static CUresult cuStreamCreate(CUstream *ph, unsigned flags) {
  ENTER("cuStreamCreate");
  return new_stream(ph, flags, 0);
}

static CUresult cuStreamCreateWithPriority(CUstream *ph, unsigned flags, int priority) {
  ENTER("cuStreamCreateWithPriority");
  return new_stream(ph, flags, priority);
}

static CUresult cuStreamDestroy_v2(CUstream stream) {
  ENTER("cuStreamDestroy");
  CUresult rc;
  struct obj *s = get(stream, K_STREAM, &rc);
  if (!s) return rc;
  TRY(need_current(s));
  kill_obj(s);
  return OK;
}

/* The stream's work is complete (the legacy stream's after it waited for the blocking streams). */
static CUresult stream_done(CUstream stream) {
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  if (q.uid && sst[q.uid].kind == ST_LEGACY) enqueue(q.uid);
  complete_stream(q.uid);
  return OK;
}

static CUresult cuStreamSynchronize(CUstream stream) {
  ENTER("cuStreamSynchronize");
  return stream_done(stream);
}

static CUresult cuStreamQuery(CUstream stream) { /* always done here: as a synchronize */
  ENTER("cuStreamQuery");
  return stream_done(stream);
}

static CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned flags) {
  ENTER("cuStreamWaitEvent");
  NEED((flags & ~1u) == 0);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  CUresult rc;
  struct obj *e = get(event, K_EVENT, &rc); /* the event may belong to another context */
  if (!e) return rc;
  enqueue(q.uid);
  if (q.uid && e->u.e.clk) clock_merge(&sst[q.uid].seen, e->u.e.clk); /* later work follows the event */
  return OK;
}

/* Stream queries need no current context for an explicit stream (nor does the real driver). */
static CUresult stream_query(CUstream stream, struct obj **s) {
  *s = NULL;
  if (is_default_stream(stream)) { struct obj *c; return cur_ctx(&c); }
  CUresult rc;
  return (*s = get(stream, K_STREAM, &rc)) ? OK : rc;
}

static CUresult cuStreamGetPriority(CUstream stream, int *priority) {
  ENTER("cuStreamGetPriority");
  NEED(priority);
  struct obj *s;
  TRY(stream_query(stream, &s));
  *priority = s ? s->u.s.priority : 0;
  return OK;
}

static CUresult cuStreamGetFlags(CUstream stream, unsigned *flags) {
  ENTER("cuStreamGetFlags");
  NEED(flags);
  struct obj *s;
  TRY(stream_query(stream, &s));
  *flags = s ? s->flags : 0;
  return OK;
}

static CUresult cuStreamGetCtx_v2(CUstream stream, CUcontext *pctx, CUgreenCtx *pgreen) {
  ENTER("cuStreamGetCtx");
  NEED(pctx);
  struct obj *s;
  TRY(stream_query(stream, &s));
  *pctx = (CUcontext)(s ? s->ctx : top());
  if (pgreen) *pgreen = NULL;
  return OK;
}

/* The callback runs at once on the calling thread, without mu (it may call the driver). */
static CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *data) {
  ENTER("cuLaunchHostFunc");
  NEED(fn);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  enqueue(q.uid);
  pthread_mutex_unlock(&mu);
  held_ = 0;
  fn(data);
  return OK;
}

/* ------------------------------------------------------------------ events */
static CUresult cuEventCreate(CUevent *ph, unsigned flags) {
  ENTER("cuEventCreate");
  NEED(ph && (flags & ~7u) == 0); /* BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS */
  struct obj *c;
  TRY(cur_ctx(&c));
  struct obj *e = new_obj(K_EVENT, c->h, c->dev);
  if (!e) return E_OUT_OF_MEMORY;
  e->flags = flags;
  *ph = (CUevent)e->h;
  return OK;
}

/* An event of the current context (strict, like streams). */
static CUresult use_event(CUevent event, struct obj **e) {
  CUresult rc;
  if (!(*e = get(event, K_EVENT, &rc))) return rc;
  return need_current(*e);
}

static CUresult cuEventDestroy_v2(CUevent event) {
  ENTER("cuEventDestroy");
  struct obj *e;
  TRY(use_event(event, &e));
  kill_obj(e);
  return OK;
}

static CUresult cuEventRecord(CUevent event, CUstream stream) {
  ENTER("cuEventRecord");
  struct obj *e;
  TRY(use_event(event, &e));
  if (is_default_stream(stream) && e->ctx != top()) return foreign_handle();
  struct queue q;
  struct obj *sctx;
  TRY(use_queue(stream, &q, &sctx));
  /* an event of one context recorded on a stream of another: CUDA_ERROR_INVALID_HANDLE (driver 580) */
  if (sctx->h != e->ctx) return foreign_handle();
  e->u.e.seq = ++event_seq;
  /* What waiting for it orders after: the stream up to this record, and what the stream had
   * waited for itself. */
  unsigned long long k = enqueue(q.uid);
  if (!e->u.e.clk) e->u.e.clk = malloc(sizeof *e->u.e.clk);
  if (e->u.e.clk) {
    e->u.e.clk->n = 0;
    if (q.uid) {
      *e->u.e.clk = sst[q.uid].seen;
      clock_set(e->u.e.clk, q.uid, k);
    }
  }
  return OK;
}

/* What the event covers is complete (a successful query says the same as a synchronize). */
static CUresult event_done(CUevent event) {
  struct obj *e;
  TRY(use_event(event, &e));
  if (e->u.e.clk) complete_clock(e->u.e.clk);
  return OK;
}

static CUresult cuEventSynchronize(CUevent event) {
  ENTER("cuEventSynchronize");
  return event_done(event);
}

static CUresult cuEventQuery(CUevent event) {
  ENTER("cuEventQuery");
  return event_done(event);
}

static CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end) {
  ENTER("cuEventElapsedTime");
  NEED(ms);
  struct obj *a, *b;
  TRY(use_event(start, &a));
  TRY(use_event(end, &b));
  /* never recorded, or created without timing: the real driver's answer, not a stale use */
  if (!a->u.e.seq || !b->u.e.seq || (a->flags & 2) || (b->flags & 2)) return E_INVALID_HANDLE;
  *ms = (float)((double)((long long)b->u.e.seq - (long long)a->u.e.seq) * 0.001);
  return OK;
}

/* ------------------------------------------------------------------ modules */
/* The JIT's verdict on an image: PTX of a newer ISA than this driver's is refused. */
static CUresult jit_image(const struct image *img) {
  return img->ptx > PTX_ISA_LIMIT ? E_UNSUPPORTED_PTX_VERSION : OK;
}

/* A module of the current context from a parsed image; its variables are allocated now. */
static CUresult load_module(CUmodule *pmod, const char *data, size_t len) {
  NEED(pmod && data);
  struct obj *c;
  TRY(cur_ctx(&c));
  struct image *img;
  TRY(parse_image(data, len, &img));
  if (jit_image(img) != OK) { free_image(img); return E_UNSUPPORTED_PTX_VERSION; }
  struct obj *m = new_obj(K_MODULE, c->h, c->dev);
  if (!m) { free_image(img); return E_OUT_OF_MEMORY; }
  m->img = img;
  for (int i = 0; i < img->ng; i++) {
    CUresult rc;
    struct alloc *a = new_alloc(img->g[i].managed ? A_MANAGED : A_GLOBAL, img->g[i].nbytes, c->dev, c->h, 0, &rc);
    if (!a) { kill_obj(m); return rc; }
    a->owner = m->h;
    a->gidx = i;
  }
  *pmod = (CUmodule)m->h;
  return OK;
}

static CUresult cuModuleLoadData(CUmodule *pmod, const void *image) {
  ENTER("cuModuleLoadData");
  return load_module(pmod, image, SIZE_MAX);
}

static CUresult cuModuleLoadDataEx(CUmodule *pmod, const void *image, unsigned n, int *options, void **values) {
  ENTER("cuModuleLoadDataEx");
  (void)n, (void)options, (void)values; /* JIT options do not apply to a fake image */
  return load_module(pmod, image, SIZE_MAX);
}

static CUresult cuModuleLoad(CUmodule *pmod, const char *path) {
  ENTER("cuModuleLoad");
  NEED(path);
  size_t len;
  char *text = read_file(path, &len);
  if (!text) return E_FILE_NOT_FOUND;
  CUresult rc = load_module(pmod, text, len);
  free(text);
  return rc;
}

static CUresult use_module(CUmodule mod, struct obj **m) {
  CUresult rc;
  if (!(*m = get(mod, K_MODULE, &rc))) return rc;
  return need_current(*m);
}

static CUresult cuModuleUnload(CUmodule mod) {
  ENTER("cuModuleUnload");
  struct obj *m;
  TRY(use_module(mod, &m));
  kill_obj(m);
  return OK;
}

/* The one function object of (parent, ctx, kernel index), made on first request. */
static struct obj *function_of(struct obj *parent, handle_t ctx, int kidx) {
  for (size_t i = 0; i < nlive; i++) {
    struct obj *o = live_obj(i);
    if (o->kind == K_FUNCTION && o->parent == parent->h && o->ctx == ctx && o->kidx == kidx) return o;
  }
  struct obj *f = new_obj(K_FUNCTION, ctx, parent->dev);
  if (!f) return NULL;
  f->parent = parent->h;
  f->img = parent->img;
  f->kidx = kidx;
  return f;
}

static CUresult cuModuleGetFunction(CUfunction *pf, CUmodule mod, const char *name) {
  ENTER("cuModuleGetFunction");
  NEED(pf && name);
  struct obj *m;
  TRY(use_module(mod, &m));
  int k = find_kernel(m->img, name);
  if (k < 0) return E_NOT_FOUND;
  struct obj *f = function_of(m, m->ctx, k);
  if (!f) return E_OUT_OF_MEMORY;
  *pf = (CUfunction)f->h;
  return OK;
}

static CUresult cuModuleGetFunctionCount(unsigned *count, CUmodule mod) {
  ENTER("cuModuleGetFunctionCount");
  NEED(count);
  struct obj *m;
  TRY(use_module(mod, &m));
  *count = (unsigned)m->img->nk;
  return OK;
}

/* The module's functions, loaded or not (no JIT: cuFuncLoad or a launch compiles them lazily). */
static CUresult cuModuleEnumerateFunctions(CUfunction *functions, unsigned n, CUmodule mod) {
  ENTER("cuModuleEnumerateFunctions");
  NEED(functions);
  struct obj *m;
  TRY(use_module(mod, &m));
  for (int k = 0; k < m->img->nk && (unsigned)k < n; k++) {
    struct obj *f = function_of(m, m->ctx, k);
    if (!f) return E_OUT_OF_MEMORY;
    functions[k] = (CUfunction)f->h;
  }
  return OK;
}

static CUresult cuModuleGetLoadingMode(int *mode) {
  ENTER("cuModuleGetLoadingMode");
  NEED(mode);
  *mode = lazy_loading ? 2 : 1; /* CU_MODULE_LAZY_LOADING, CU_MODULE_EAGER_LOADING */
  return OK;
}

static struct alloc *variable_of(handle_t owner, handle_t ctx, int gidx) {
  for (size_t i = 0; i < nallocs; i++) {
    struct alloc *a = allocs[i];
    if (a->owner == owner && a->gidx == gidx && (a->kind == A_MANAGED || a->ctx == ctx)) return a;
  }
  return NULL;
}

static CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule mod, const char *name) {
  ENTER("cuModuleGetGlobal");
  NEED(name);
  struct obj *m;
  TRY(use_module(mod, &m));
  int g = find_global(m->img, name);
  if (g < 0) return E_NOT_FOUND;
  struct alloc *a = variable_of(m->h, m->ctx, g);
  if (!a) return E_NOT_FOUND;
  if (dptr) *dptr = a->base;
  if (bytes) *bytes = a->size;
  return OK;
}

/* A CUfunction argument; a CUkernel is accepted too (the driver allows the cast). */
static CUresult func_arg(CUfunction func, struct obj **f) {
  struct obj *o = obj_at((handle_t)func);
  if (o && o->alive && (o->kind == K_FUNCTION || o->kind == K_KERNEL)) { *f = o; return OK; }
  return stale(E_INVALID_HANDLE);
}

static CUresult cuFuncGetAttribute(int *pi, int attr, CUfunction func) {
  ENTER("cuFuncGetAttribute");
  NEED(pi);
  struct obj *f;
  TRY(func_arg(func, &f));
  NEED(attr >= 0 && attr < N_FUNC_ATTRS);
  switch (attr) {
  case 0: *pi = 1024; break;              /* MAX_THREADS_PER_BLOCK */
  case 4: *pi = 32; break;                /* NUM_REGS */
  case 5: case 6: *pi = 90; break;        /* PTX_VERSION, BINARY_VERSION */
  default: *pi = f->u.f.attrs[attr]; break;
  }
  return OK;
}

static CUresult cuFuncSetAttribute(CUfunction func, int attr, int value) {
  ENTER("cuFuncSetAttribute");
  struct obj *f;
  TRY(func_arg(func, &f));
  /* the settable ones: dynamic shared size, carveout, cluster dims and policies */
  NEED(attr == 8 || attr == 9 || (attr >= 10 && attr <= 15));
  f->u.f.attrs[attr] = value;
  return OK;
}

static CUresult cuFuncSetCacheConfig(CUfunction func, int config) {
  ENTER("cuFuncSetCacheConfig");
  struct obj *f;
  TRY(func_arg(func, &f));
  NEED(config >= 0 && config <= 3);
  f->u.f.cache = config;
  return OK;
}

static CUresult param_info(const struct obj *f, size_t index, size_t *offset, size_t *size) {
  const struct kinfo *k = &f->img->k[f->kidx];
  if (index >= (size_t)k->nparams) return E_INVALID_VALUE;
  if (offset) *offset = k->off[index];
  if (size) *size = k->size[index];
  return OK;
}

static CUresult cuFuncGetParamInfo(CUfunction func, size_t index, size_t *offset, size_t *size) {
  ENTER("cuFuncGetParamInfo");
  struct obj *f;
  TRY(func_arg(func, &f));
  return param_info(f, index, offset, size);
}

static CUresult cuFuncGetName(const char **name, CUfunction func) {
  ENTER("cuFuncGetName");
  NEED(name);
  struct obj *f;
  TRY(func_arg(func, &f));
  *name = f->img->k[f->kidx].name; /* valid while the module or library is loaded */
  return OK;
}

/* Load a function (or a library's kernel) now; under lazy loading this is where its JIT runs. */
static CUresult cuFuncLoad(CUfunction func) {
  ENTER("cuFuncLoad");
  struct obj *f;
  TRY(func_arg(func, &f));
  return jit_image(f->img);
}

static CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, CUfunction func, int block_size, size_t smem) {
  ENTER("cuOccupancyMaxActiveBlocksPerMultiprocessor");
  (void)smem;
  NEED(blocks && block_size > 0 && block_size <= 1024);
  struct obj *f;
  TRY(func_arg(func, &f));
  *blocks = 2048 / block_size > 32 ? 32 : 2048 / block_size;
  return OK;
}

static CUresult cuOccupancyMaxPotentialBlockSize(int *min_grid, int *block, CUfunction func,
                                                 CUoccupancyB2DSize b2d, size_t smem, int limit) {
  ENTER("cuOccupancyMaxPotentialBlockSize");
  (void)b2d, (void)smem;
  NEED(min_grid && block);
  struct obj *f;
  TRY(func_arg(func, &f));
  int b = limit > 0 && limit < 1024 ? limit : 1024;
  *block = b;
  *min_grid = 132 * (2048 / b > 32 ? 32 : 2048 / b);
  return OK;
}

/* ------------------------------------------------------------------ linker (context independent) */
static CUresult cuLinkCreate_v2(unsigned n, int *options, void **values, CUlinkState *state) {
  ENTER("cuLinkCreate");
  (void)n, (void)options, (void)values;
  NEED(state);
  struct obj *l = new_obj(K_LINK, 0, 0);
  if (!l) return E_OUT_OF_MEMORY;
  *state = (CUlinkState)l->h;
  return OK;
}

/* Append the body (everything after the FAKECUBIN line) of one input. */
static CUresult link_add(struct obj *l, const char *data, size_t size) {
  size = strnlen(data, size);
  struct image *img;
  TRY(parse_image(data, size, &img)); /* reject bad input now, as the real linker does */
  free_image(img);
  const char *body = memchr(data, '\n', size);
  size_t n = body ? size - (size_t)(body + 1 - data) : 0;
  char *grown = realloc(l->u.l.buf, l->u.l.len + n + 2);
  if (!grown) return E_OUT_OF_MEMORY;
  l->u.l.buf = grown;
  if (n) memcpy(grown + l->u.l.len, body + 1, n);
  l->u.l.len += n;
  if (n && grown[l->u.l.len - 1] != '\n') grown[l->u.l.len++] = '\n';
  grown[l->u.l.len] = '\0';
  return OK;
}

static CUresult cuLinkAddData_v2(CUlinkState state, int type, void *data, size_t size, const char *name,
                                 unsigned n, int *options, void **values) {
  ENTER("cuLinkAddData");
  (void)name, (void)n, (void)options, (void)values;
  CUresult rc;
  struct obj *l = get(state, K_LINK, &rc);
  if (!l) return rc;
  NEED(data && type >= 0 && type <= 5);
  return link_add(l, data, size ? size : SIZE_MAX);
}

static CUresult cuLinkAddFile_v2(CUlinkState state, int type, const char *path, unsigned n, int *options, void **values) {
  ENTER("cuLinkAddFile");
  (void)n, (void)options, (void)values;
  CUresult rc;
  struct obj *l = get(state, K_LINK, &rc);
  if (!l) return rc;
  NEED(path && type >= 0 && type <= 5);
  size_t len;
  char *text = read_file(path, &len);
  if (!text) return E_FILE_NOT_FOUND;
  rc = link_add(l, text, len);
  free(text);
  return rc;
}

static CUresult cuLinkComplete(CUlinkState state, void **out, size_t *size) {
  ENTER("cuLinkComplete");
  NEED(out);
  CUresult rc;
  struct obj *l = get(state, K_LINK, &rc);
  if (!l) return rc;
  size_t n = l->u.l.len;
  char *image = malloc(n + 11);
  if (!image) return E_OUT_OF_MEMORY;
  memcpy(image, "FAKECUBIN\n", 10);
  if (n) memcpy(image + 10, l->u.l.buf, n);
  image[10 + n] = '\0';
  free(l->u.l.out);
  l->u.l.out = image; /* owned by the link state: valid until cuLinkDestroy */
  *out = image;
  if (size) *size = n + 11;
  return OK;
}

static CUresult cuLinkDestroy(CUlinkState state) {
  ENTER("cuLinkDestroy");
  CUresult rc;
  struct obj *l = get(state, K_LINK, &rc);
  if (!l) return rc;
  kill_obj(l);
  return OK;
}

/* ------------------------------------------------------------------ libraries (context independent) */
static CUresult cuLibraryLoadData(CUlibrary *plib, const void *code, int *jit_options, void **jit_values,
                                  unsigned n_jit, int *lib_options, void **lib_values, unsigned n_lib) {
  ENTER("cuLibraryLoadData");
  (void)jit_options, (void)jit_values, (void)n_jit, (void)lib_options, (void)lib_values, (void)n_lib;
  NEED(plib && code);
  struct image *img;
  TRY(parse_image(code, SIZE_MAX, &img));
  /* No JIT here, lazily or eagerly: measured on driver 580 (2026-11-29), a library of PTX the JIT refuses
   * loads even with CUDA_MODULE_LOADING=EAGER, lists no kernel, and fails at cuLibraryGetKernel. */
  struct obj *l = new_obj(K_LIBRARY, 0, 0);
  if (!l) { free_image(img); return E_OUT_OF_MEMORY; }
  l->img = img;
  *plib = (CUlibrary)l->h;
  return OK;
}

static CUresult cuLibraryUnload(CUlibrary lib) {
  ENTER("cuLibraryUnload");
  CUresult rc;
  struct obj *l = get(lib, K_LIBRARY, &rc);
  if (!l) return rc;
  kill_obj(l);
  return OK;
}

/* The one kernel object of (library, kernel index), made on first request. */
static struct obj *kernel_of(struct obj *l, int k) {
  for (size_t i = 0; i < nlive; i++) {
    struct obj *o = live_obj(i);
    if (o->kind == K_KERNEL && o->parent == l->h && o->kidx == k) return o;
  }
  struct obj *kern = new_obj(K_KERNEL, 0, 0);
  if (!kern) return NULL;
  kern->parent = l->h;
  kern->img = l->img;
  kern->kidx = k;
  return kern;
}

static CUresult cuLibraryGetKernel(CUkernel *pk, CUlibrary lib, const char *name) {
  ENTER("cuLibraryGetKernel");
  NEED(pk && name);
  CUresult rc;
  struct obj *l = get(lib, K_LIBRARY, &rc);
  if (!l) return rc;
  int k = find_kernel(l->img, name);
  if (k < 0) return E_NOT_FOUND;
  TRY(jit_image(l->img)); /* lazy loading: compiled now (seen on an H200: the load succeeded, this failed) */
  struct obj *kern = kernel_of(l, k);
  if (!kern) return E_OUT_OF_MEMORY;
  *pk = (CUkernel)kern->h;
  return OK;
}

static CUresult cuLibraryGetKernelCount(unsigned *count, CUlibrary lib) {
  ENTER("cuLibraryGetKernelCount");
  NEED(count);
  CUresult rc;
  struct obj *l = get(lib, K_LIBRARY, &rc);
  if (!l) return rc;
  *count = jit_image(l->img) == OK ? (unsigned)l->img->nk : 0;   /* see cuLibraryEnumerateKernels */
  return OK;
}

/* A library whose PTX the JIT refuses lists no kernel (measured on driver 580, 2026-11-29: it loads, even
 * with CUDA_MODULE_LOADING=EAGER, and fails only at cuLibraryGetKernel). */
static CUresult cuLibraryEnumerateKernels(CUkernel *kernels, unsigned n, CUlibrary lib) {
  ENTER("cuLibraryEnumerateKernels");
  NEED(kernels);
  CUresult rc;
  struct obj *l = get(lib, K_LIBRARY, &rc);
  if (!l) return rc;
  int listed = jit_image(l->img) == OK ? l->img->nk : 0;
  for (int k = 0; k < listed && (unsigned)k < n; k++) {
    struct obj *kern = kernel_of(l, k);
    if (!kern) return E_OUT_OF_MEMORY;
    kernels[k] = (CUkernel)kern->h;
  }
  return OK;
}

static CUresult cuKernelGetName(const char **name, CUkernel kernel) {
  ENTER("cuKernelGetName");
  NEED(name);
  CUresult rc;
  struct obj *k = get(kernel, K_KERNEL, &rc);
  if (!k) return rc;
  *name = k->img->k[k->kidx].name;
  return OK;
}

/* __device__ variables exist once per context (made on first request, die with the context);
 * __managed__ ones once per library. */
static CUresult library_variable(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib, const char *name, int managed) {
  NEED(name);
  CUresult rc;
  struct obj *l = get(lib, K_LIBRARY, &rc);
  if (!l) return rc;
  int g = find_global(l->img, name);
  if (g < 0 || l->img->g[g].managed != managed) return E_NOT_FOUND;
  TRY(jit_image(l->img));
  struct obj *c = NULL;
  if (!managed) TRY(cur_ctx(&c));
  struct alloc *a = variable_of(l->h, c ? c->h : 0, g);
  if (!a) {
    a = new_alloc(managed ? A_MANAGED : A_GLOBAL, l->img->g[g].nbytes, c ? c->dev : 0, c ? c->h : 0, 0, &rc);
    if (!a) return rc;
    a->owner = l->h;
    a->gidx = g;
  }
  if (dptr) *dptr = a->base;
  if (bytes) *bytes = a->size;
  return OK;
}

static CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib, const char *name) {
  ENTER("cuLibraryGetGlobal");
  return library_variable(dptr, bytes, lib, name, 0);
}

static CUresult cuLibraryGetManaged(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib, const char *name) {
  ENTER("cuLibraryGetManaged");
  return library_variable(dptr, bytes, lib, name, 1);
}

static CUresult cuKernelGetFunction(CUfunction *pf, CUkernel kernel) {
  ENTER("cuKernelGetFunction");
  NEED(pf);
  CUresult rc;
  struct obj *k = get(kernel, K_KERNEL, &rc);
  if (!k) return rc;
  struct obj *c;
  TRY(cur_ctx(&c));
  TRY(jit_image(k->img));
  struct obj *f = function_of(k, c->h, k->kidx);
  if (!f) return E_OUT_OF_MEMORY;
  *pf = (CUfunction)f->h;
  return OK;
}

static CUresult cuKernelGetParamInfo(CUkernel kernel, size_t index, size_t *offset, size_t *size) {
  ENTER("cuKernelGetParamInfo");
  CUresult rc;
  struct obj *k = get(kernel, K_KERNEL, &rc);
  if (!k) return rc;
  return param_info(k, index, offset, size);
}

/* ------------------------------------------------------------------ launch */
struct launch {
  unsigned grid[3], block[3];
  CUstream stream;
  void **params, **extra;
  unsigned shared_mem;
};

/* Check under mu what the launch uses; copy the layout out (the image may go once mu drops). */
static CUresult launch_check(CUfunction func, const struct launch *L, struct kinfo *layout, char *name, size_t size) {
  struct obj *f;
  TRY(func_arg(func, &f));
  struct obj *sctx;
  if (f->kind == K_FUNCTION) {
    TRY(need_current(f));
    if (is_default_stream(L->stream) && f->ctx != top()) return foreign_handle();
  } else { struct obj *c; TRY(cur_ctx(&c)); } /* a CUkernel launches in the current context */
  TRY(use_stream(L->stream, &sctx, NULL));
  /* a function of one context on a stream of another: CUDA_ERROR_INVALID_HANDLE (measured on driver 580) */
  if (f->kind == K_FUNCTION && sctx->h != f->ctx) return foreign_handle();
  for (int i = 0; i < 3; i++) NEED(L->grid[i] && L->block[i]);
  NEED((unsigned long long)L->block[0] * L->block[1] * L->block[2] <= 1024);
  NEED(!(L->params && L->extra));
  *layout = f->img->k[f->kidx];
  layout->name = NULL;
  snprintf(name, size, "%s", f->img->k[f->kidx].name);
  NEED(layout->nparams == 0 || L->params || L->extra);
  return OK;
}

static int launch_pause = 1;   /* fake_set_launch_pause(0): no race detector, for timing cuproc's side */

static void pause_briefly(void) {
  if (!__atomic_load_n(&launch_pause, __ATOMIC_RELAXED)) return;
  struct timespec ts = {0, 2000};
  nanosleep(&ts, NULL);
  sched_yield();
}

/* Pack the arguments the way the kernel sees them: kernelParams (one pointer per parameter) or
 * extra = {BUFFER_POINTER, p, BUFFER_SIZE, &n, END}.  Runs without mu: reads caller memory.
 * Race detector: each parameter is read after a pause, so a caller who shares one argument
 * block between threads gets parameters from different launches (a torn pair for fake_pair). */
static CUresult launch_pack(const struct launch *L, const struct kinfo *k, unsigned char *buf, size_t *nbytes) {
  if (L->params) {
    if (k->total > MAX_ARG_BYTES) return E_INVALID_VALUE;
    memset(buf, 0, k->total);
    for (int i = 0; i < k->nparams; i++) {
      NEED(L->params[i]);
      pause_briefly();
      memcpy(buf + k->off[i], L->params[i], k->size[i]);
    }
    *nbytes = k->total;
    return OK;
  }
  if (!L->extra) { *nbytes = 0; return OK; }
  const unsigned char *ptr = NULL;
  const size_t *size = NULL;
  for (void **e = L->extra; (uintptr_t)e[0] != 0; e += 2) {
    switch ((uintptr_t)e[0]) {
    case 1: ptr = e[1]; break;
    case 2: size = e[1]; break;
    default: return E_INVALID_VALUE;
    }
  }
  NEED(ptr && size && *size >= k->total && *size <= MAX_ARG_BYTES);
  *nbytes = *size;
  pause_briefly();
  memcpy(buf, ptr, *nbytes);
  for (int i = 1; i < k->nparams; i++) { /* read each later parameter once more, later */
    pause_briefly();
    memcpy(buf + k->off[i], ptr + k->off[i], k->size[i]);
  }
  return OK;
}

static CUresult launch(const char *call, CUfunction func, const struct launch *L) {
  ENTER(call);
  struct kinfo k;
  char name[sizeof last_name];
  TRY(launch_check(func, L, &k, name, sizeof name));

  /* Race detector: read the arguments slowly with mu released (see launch_pack), so that a
   * caller who shares one argument block between threads has it overwritten under our eyes. */
  pthread_mutex_unlock(&mu);
  held_ = 0;
  unsigned char *buf = malloc(MAX_ARG_BYTES);
  if (!buf) return E_OUT_OF_MEMORY;
  size_t nbytes = 0;
  CUresult rc = launch_pack(L, &k, buf, &nbytes);
  pthread_mutex_lock(&mu);
  held_ = 1;
  cur_call = call;
  if (rc != OK) { free(buf); return rc; }

  /* Objects may have died while mu was released: that is the caller's race, and stale. */
  struct obj *f;
  struct queue q;
  if ((rc = func_arg(func, &f)) != OK || (rc = use_queue(L->stream, &q, NULL)) != OK) { free(buf); return rc; }

  /* Every 8-byte argument that falls in the device window must point into a live allocation. */
  for (int i = 0; i < k.nparams; i++) {
    if (k.size[i] != 8 || k.off[i] + 8 > nbytes) continue;
    CUdeviceptr v;
    memcpy(&v, buf + k.off[i], 8);
    if (v >= dev_base && v < dev_next && !find_alloc(v, 0)) { free(buf); return stale(E_INVALID_VALUE); }
  }
  if (strcmp(name, "fake_pair") == 0 && k.nparams == 2 && k.size[0] == 8 && k.size[1] == 8) {
    unsigned long long a, b;
    memcpy(&a, buf + k.off[0], 8);
    memcpy(&b, buf + k.off[1], 8);
    if (b != a * 3 + 1) launch_mismatches++;
  }
  if (strcmp(name, "fake_grid_pair") == 0 && k.nparams == 2 && k.size[0] == 8 && k.size[1] == 8) {
    unsigned long long a, b;   /* as fake_pair, and the grid's x is a % 4 + 1 */
    memcpy(&a, buf + k.off[0], 8);
    memcpy(&b, buf + k.off[1], 8);
    if (b != a * 3 + 1 || L->grid[0] != a % 4 + 1) launch_mismatches++;
  }
  /* Ordering: every 8-byte aligned word that points into a device allocation touches it. */
  unsigned long long work = enqueue(q.uid);
  for (size_t off = 0; off + 8 <= nbytes; off += 8) {
    CUdeviceptr v;
    memcpy(&v, buf + off, 8);
    if (v >= dev_base && v < dev_next) touch(find_alloc(v, 0), q.uid, work);
  }
  launch_count++;
  memcpy(last_name, name, sizeof name);
  memcpy(last_args, buf, nbytes);
  last_nargs = nbytes;
  memcpy(last_dims, L->grid, sizeof L->grid);
  memcpy(last_dims + 3, L->block, sizeof L->block);
  last_shared_mem = L->shared_mem;
  last_stream = L->stream;
  free(buf);
  return OK;
}

static CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shmem, CUstream stream, void **params, void **extra) {
  struct launch L = {{gx, gy, gz}, {bx, by, bz}, stream, params, extra, shmem};
  return launch("cuLaunchKernel", f, &L);
}

static CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                          unsigned by, unsigned bz, unsigned shmem, CUstream stream, void **params) {
  struct launch L = {{gx, gy, gz}, {bx, by, bz}, stream, params, NULL, shmem};
  return launch("cuLaunchCooperativeKernel", f, &L);
}

static CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
  if (!config) return E_INVALID_VALUE;
  struct launch L = {{config->gridDimX, config->gridDimY, config->gridDimZ},
                     {config->blockDimX, config->blockDimY, config->blockDimZ},
                     config->hStream, params, extra, config->sharedMemBytes};
  return launch("cuLaunchKernelEx", f, &L);
}

#include "fakedriver_graphs.c"   /* graphs and stream capture (its top comment says how) */
#include "fakedriver_arrays.c"   /* CUDA arrays, texture/surface objects, tensor maps (its top comment) */
#include "fakedriver_vmm.c"      /* virtual memory management (its top comment says how) */
#include "fakedriver_ipc.c"      /* IPC of memory and events (its top comment says how) */
#include "fakedriver_green.c"    /* green contexts and SM splits (its top comment says how) */

/* ================================================================== lookup */
struct entry { const char *symbol; int version; void *fn; };
struct error_name { int code; const char *name, *text; };

/* Generated by fakedriver.py: `entries` (every implemented symbol, the version of the variant
 * implemented, the function) and `error_names` (CUresult names from headers/cuda_types.h). */
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status);
EXPORT CUresult cuGetErrorName(CUresult code, const char **s);
EXPORT CUresult cuGetErrorString(CUresult code, const char **s);
#include "fakedriver_tables.h"

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status) {
  (void)flags; /* per-thread default stream entries are the same functions here */
  if (!symbol || !pfn) return E_INVALID_VALUE;
  *pfn = NULL;
  if (version > DRIVER_VERSION) return E_INVALID_VALUE;
  int found = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
  const struct entry *best = NULL;
  for (const struct entry *e = entries; e->symbol; e++) {
    if (strcmp(e->symbol, symbol) != 0) continue;
    /* a symbol's rows are oldest first (the 13.0 ABI, and a few older ones): the last that fits */
    if (e->version <= version) best = e;
    /* asked for an older ABI than any implemented: say so instead of a wrong signature */
    else if (!best) found = 2; /* VERSION_NOT_SUFFICIENT */
  }
  if (best) { *pfn = best->fn; found = 0; }
  if (status) *status = found;
  return OK;
}

EXPORT CUresult cuGetErrorName(CUresult code, const char **s) {
  if (!s) return E_INVALID_VALUE;
  for (const struct error_name *e = error_names; e->name; e++)
    if (e->code == code) { *s = e->name; return OK; }
  *s = NULL;
  return E_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult code, const char **s) {
  if (!s) return E_INVALID_VALUE;
  for (const struct error_name *e = error_names; e->name; e++)
    if (e->code == code) { *s = e->text; return OK; }
  *s = NULL;
  return E_INVALID_VALUE;
}

/* ================================================================== control API (tests) */
static void lock(void) { pthread_mutex_lock(&mu); }
static void unlock(void) { pthread_mutex_unlock(&mu); }

/* Destroy everything, clear records.  Not while other threads use the fake.  Kept: cuInit
 * (cuproc initializes once per process), the reuse switch, the handles of dead objects (with
 * reuse on, the next objects take them, the primary contexts' included; freed address ranges are
 * forgotten), and the default pools (a device's default pool is never destroyed; its statistics
 * are cleared). */
/* CUDA_MODULE_LOADING for what loads from now on: 1 LAZY, 0 EAGER (cuInit reads the environment once). */
EXPORT void fake_set_lazy_loading(int on) {
  lock();
  lazy_loading = on != 0;
  unlock();
}

EXPORT int fake_lazy_loading(void) { return lazy_loading; }

EXPORT void fake_reset(void) {
  lock();
  cur_call = "fake_reset";
  for (size_t i = nlive; i > 0;) {
    i--;
    struct obj *o = live_obj(i);
    if (o->kind == K_CTX || o->kind == K_LIBRARY || o->kind == K_LINK || (o->kind == K_POOL && !o->is_default))
      kill_obj(o);
    if (i > nlive) i = nlive;
  }
  while (nallocs) free_alloc(allocs[nallocs - 1]);
  for (int d = 0; d < MAX_DEV; d++) {
    prim[d].refcount = 0;
    prim[d].flags = 0;
    prim[d].ctx = 0;
    struct obj *p = obj_at(default_pool[d]);
    if (p) memset(&p->u.p, 0, sizeof p->u.p);
  }
  ndev = 2;
  reset_gen++;
  stale_count = binding_count = misrouted_count = 0;
  memset(&stale_ring, 0, sizeof stale_ring);
  memset(&binding_ring, 0, sizeof binding_ring);
  memset(&misrouted_ring, 0, sizeof misrouted_ring);
  memset(&call_ring, 0, sizeof call_ring);
  launch_count = launch_mismatches = 0;
  nsst = 0;     /* the ordering model: every stream state (no context is left to name one) */
  npending = 0;
  unordered_count = 0;
  memset(&unordered_ring, 0, sizeof unordered_ring);
  nreuse = 0; /* addresses freed before a reset are not handed out again */
  reuse_count = sync_reuses = handle_reuses = 0;
  last_name[0] = '\0';
  last_nargs = 0;
  memset(last_dims, 0, sizeof last_dims);
  last_shared_mem = 0;
  last_stream = NULL;
  memset(injects, 0, sizeof injects);
  __atomic_store_n(&fork_violations, 0, __ATOMIC_RELAXED);
  unlock();
}

EXPORT void fake_set_device_count(int n) {
  lock();
  ndev = n < 0 ? 0 : n > MAX_DEV ? MAX_DEV : n;
  unlock();
}

EXPORT long fake_stale_count(void) { lock(); long n = stale_count; unlock(); return n; }
EXPORT long fake_binding_errors(void) { lock(); long n = binding_count; unlock(); return n; }
EXPORT long fake_misrouted_count(void) { lock(); long n = misrouted_count; unlock(); return n; }
EXPORT void fake_clear_misrouted(void) {   /* for a test of the record itself */
  lock(); misrouted_count = 0; memset(&misrouted_ring, 0, sizeof misrouted_ring); unlock();
}

static int ring_format(const struct ring *r, char *buf, int size) {
  if (!buf || size <= 0) return 0;
  buf[0] = '\0';
  long first = r->total > RING ? r->total - RING : 0;
  int len = 0;
  for (long i = first; i < r->total; i++) {
    int n = snprintf(buf + len, (size_t)(size - len), "%s%s", i > first ? "," : "", r->names[i % RING]);
    if (n < 0 || n >= size - len) break;
    len += n;
  }
  return len;
}

/* The last 16 calls recorded, oldest first, comma-separated. */
EXPORT int fake_stale_calls(char *buf, int size) { lock(); int n = ring_format(&stale_ring, buf, size); unlock(); return n; }
EXPORT int fake_binding_calls(char *buf, int size) { lock(); int n = ring_format(&binding_ring, buf, size); unlock(); return n; }
EXPORT int fake_misrouted_calls(char *buf, int size) { lock(); int n = ring_format(&misrouted_ring, buf, size); unlock(); return n; }
/* cuMemFreeAsync calls that freed memory other streams' work may still use (see the model). */
EXPORT long fake_unordered_frees(void) { lock(); long n = unordered_count; unlock(); return n; }
EXPORT int fake_unordered_calls(char *buf, int size) { lock(); int n = ring_format(&unordered_ring, buf, size); unlock(); return n; }
/* Every entry point entered: how many since the last fake_clear_calls (or reset), and the last 16. */
EXPORT long fake_call_count(void) { lock(); long n = call_ring.total; unlock(); return n; }
EXPORT int fake_calls(char *buf, int size) { lock(); int n = ring_format(&call_ring, buf, size); unlock(); return n; }
EXPORT void fake_clear_calls(void) { lock(); memset(&call_ring, 0, sizeof call_ring); unlock(); }

/* Live objects of a kind; -1 for an unknown kind name. */
EXPORT long fake_live(const char *kind) {
  static const struct { const char *name; int obj_kind, primary, alloc_kind; } kinds[] = {
      {"context", K_CTX, 0, -1},   {"primary", K_CTX, 1, -1},        {"stream", K_STREAM, -1, -1},
      {"event", K_EVENT, -1, -1},  {"module", K_MODULE, -1, -1},     {"function", K_FUNCTION, -1, -1},
      {"library", K_LIBRARY, -1, -1}, {"kernel", K_KERNEL, -1, -1},  {"link", K_LINK, -1, -1},
      {"pool", K_POOL, 0, -1},     {"device_alloc", -1, -1, A_DEVICE}, {"async_alloc", -1, -1, A_ASYNC},
      {"global", -1, -1, A_GLOBAL}, {"host_alloc", -1, -1, A_HOST},  {"registered", -1, -1, A_REGISTERED},
      {"managed_alloc", -1, -1, A_MANAGED},
  };
  if (!kind) return -1;
  for (size_t t = 0; t < sizeof kinds / sizeof kinds[0]; t++) {
    if (strcmp(kinds[t].name, kind) != 0) continue;
    long n = 0;
    lock();
    if (kinds[t].obj_kind >= 0) {
      for (size_t i = 0; i < nlive; i++) {
        struct obj *o = live_obj(i);
        if (o->kind != kinds[t].obj_kind) continue;
        /* "primary" flag reused for pools: created pools only, not the default ones */
        int flag = o->kind == K_POOL ? o->is_default : o->primary;
        if (kinds[t].primary < 0 || flag == kinds[t].primary) n++;
      }
    } else {
      for (size_t i = 0; i < nallocs; i++) n += allocs[i]->kind == kinds[t].alloc_kind;
    }
    unlock();
    return n;
  }
  return -1;
}

EXPORT int fake_primary_refcount(int dev) {
  lock();
  int n = dev >= 0 && dev < MAX_DEV ? prim[dev].refcount : -1;
  unlock();
  return n;
}

EXPORT int fake_primary_active(int dev) {
  lock();
  int n = dev >= 0 && dev < MAX_DEV ? prim[dev].ctx != 0 : -1;
  unlock();
  return n;
}

EXPORT unsigned long long fake_pool_used(int dev) {
  lock();
  struct obj *p = dev >= 0 && dev < MAX_DEV ? obj_at(default_pool[dev]) : NULL;
  unsigned long long n = p ? p->u.p.used : 0;
  unlock();
  return n;
}

EXPORT unsigned long long fake_device_bytes_live(int dev) {
  lock();
  unsigned long long n = dev >= 0 && dev < MAX_DEV ? dev_bytes[dev] : 0;
  unlock();
  return n;
}

EXPORT void fake_set_launch_pause(int on) { __atomic_store_n(&launch_pause, on, __ATOMIC_RELAXED); }
EXPORT long fake_async_reuses(void) { lock(); long n = reuse_count; unlock(); return n; }
EXPORT long fake_sync_reuses(void) { lock(); long n = sync_reuses; unlock(); return n; }
EXPORT long fake_handle_reuses(void) { lock(); long n = handle_reuses; unlock(); return n; }

/* Reuse of handles and addresses on (1, the default) or off (0: every handle and cuMemAlloc
 * address is new, so every stale use is caught).  Takes effect for what is made next. */
EXPORT void fake_set_reuse(int on) { lock(); reuse_values = on != 0; unlock(); }
EXPORT int fake_reuse(void) { lock(); int on = reuse_values; unlock(); return on; }

__attribute__((constructor)) static void reuse_from_environment(void) {
  const char *v = getenv("FAKEDRIVER_REUSE");
  if (v && (strcmp(v, "0") == 0 || strcmp(v, "off") == 0 || strcmp(v, "no") == 0)) reuse_values = 0;
}
EXPORT long fake_launch_count(void) { lock(); long n = launch_count; unlock(); return n; }
EXPORT long fake_launch_mismatches(void) { lock(); long n = launch_mismatches; unlock(); return n; }

/* The last launch: kernel name into name_buf, argument bytes into args; returns the number of
 * argument bytes (which may exceed args_size: then only args_size were copied). */
EXPORT int fake_last_launch(char *name_buf, int name_size, unsigned char *args, int args_size) {
  lock();
  if (name_buf && name_size > 0) snprintf(name_buf, (size_t)name_size, "%s", last_name);
  int n = (int)last_nargs;
  if (args && args_size > 0) memcpy(args, last_args, (size_t)(n < args_size ? n : args_size));
  unlock();
  return n;
}

/* The last launch's grid and block (dims: 6 unsigned) and stream handle (NULL: the default stream). */
EXPORT void fake_last_launch_config(unsigned *dims, uintptr_t *stream) {
  lock();
  memcpy(dims, last_dims, sizeof last_dims);
  *stream = (uintptr_t)last_stream;
  unlock();
}

/* The last launch's dynamic shared memory size. */
EXPORT unsigned fake_last_shared_mem(void) { lock(); unsigned n = last_shared_mem; unlock(); return n; }

EXPORT long fake_fork_violations(void) { return __atomic_load_n(&fork_violations, __ATOMIC_RELAXED); }

/* The next `count` calls of `call` (base name, e.g. "cuMemFree") return `code` and do nothing;
 * count -1: every call; count 0: clear.  Returns 0, or -1 when the table is full. */
EXPORT int fake_fail(const char *call, int code, int count) {
  if (!call) return -1;
  lock();
  int rc = -1, free_slot = -1;
  for (int i = 0; i < 32; i++) {
    if (strcmp(injects[i].call, call) == 0) { free_slot = i; break; }
    if (free_slot < 0 && injects[i].count == 0) free_slot = i;
  }
  if (free_slot >= 0) {
    snprintf(injects[free_slot].call, sizeof injects[free_slot].call, "%s", call);
    injects[free_slot].code = code;
    injects[free_slot].count = count;
    rc = 0;
  }
  unlock();
  return rc;
}

/* First address of the device window (device pointers are in [base, base + 1 TiB)). */
EXPORT unsigned long long fake_device_window(void) { return dev_base; }

/* ================================================================== process setup */
static void atfork_prepare(void) { pthread_mutex_lock(&mu); }
static void atfork_release(void) { pthread_mutex_unlock(&mu); }

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

__attribute__((constructor)) static void fake_setup(void) {
  /* Reserve the device window so no host allocation can land there.  PROT_NONE: a host
   * dereference of a device pointer faults, as on a GPU.  1 TiB, because addresses are never
   * reused.  Prefer [0x7e0000000000, 0x7f0000000000), just below where the real driver's
   * addresses start (1 TiB from 0x7f0000000000 would cross the top of user space); take what
   * the kernel gives when that is taken. */
  size_t sizes[] = {1ULL << 40, 1ULL << 36, 1ULL << 32};
  for (size_t i = 0; i < 3 && !dev_base; i++) {
    void *p = mmap((void *)(0x7f0000000000ULL - sizes[i]), sizes[i], PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED)
      p = mmap(NULL, sizes[i], PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p != MAP_FAILED) { dev_base = (CUdeviceptr)(uintptr_t)p; dev_limit = dev_base + sizes[i]; }
  }
  if (!dev_base) { dev_base = 0x7f0000000000ULL; dev_limit = dev_base + (1ULL << 40); } /* unreserved */
  dev_next = dev_base;
  /* A child must find mu free and the state consistent: fork only between calls. */
  pthread_atfork(atfork_prepare, atfork_release, atfork_release);
}

/* ------------------------------------------------------------------ exit report
 * With FAKE_REPORT=<path>, the process writes what was left when the library is unloaded
 * (at exit, after the Python interpreter has finalized): the stale count and every kind of
 * object still live.  The shutdown test reads it to see that everything was released. */
__attribute__((destructor)) static void fake_exit_report(void) {
  const char *path = getenv("FAKE_REPORT");
  if (!path) return;
  FILE *f = fopen(path, "w");
  if (!f) return;
  static const char *kinds[] = {"context", "primary", "stream", "event", "module", "library", "link", "pool",
                                "device_alloc", "async_alloc", "host_alloc", "registered", "managed_alloc"};
  char calls[1024];
  fake_stale_calls(calls, sizeof calls);
  fprintf(f, "{\"stale\": %ld, \"stale_calls\": \"%s\", \"live\": {", fake_stale_count(), calls);
  int first = 1;
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    long n = fake_live(kinds[i]);
    if (n > 0) { fprintf(f, "%s\"%s\": %ld", first ? "" : ", ", kinds[i], n); first = 0; }
  }
  fprintf(f, "}}\n");
  fclose(f);
}
