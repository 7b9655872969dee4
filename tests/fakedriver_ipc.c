/*
 * Legacy CUDA IPC for the fake driver: device memory (cuIpcGetMemHandle, cuIpcOpenMemHandle_v2,
 * cuIpcCloseMemHandle) and events (cuIpcGetEventHandle, cuIpcOpenEventHandle).  Included by
 * fakedriver.c after fakedriver_vmm.c (one #include line each, before the cuGetProcAddress table), so
 * it uses that file's state and helpers; every entry point has the C signature CUDA 13.0 selects.
 *
 * Model (strict on purpose, like the rest of the fake):
 *   - A handle is 64 bytes: a magic word, the exporting process's pid, the device, the allocation's
 *     address, size and id (an event's handle value), and a checksum.  A handle whose magic or checksum
 *     is wrong (forged, truncated and padded, corrupted) is CUDA_ERROR_INVALID_VALUE.
 *   - Opening a handle in the process that exported it is refused as the real driver refuses it:
 *     CUDA_ERROR_INVALID_CONTEXT ("invalid device context", cudaErrorDeviceUninitialized in the
 *     runtime).  A handle of a process that has exited is CUDA_ERROR_INVALID_VALUE.
 *   - cuIpcGetMemHandle takes the base of a cuMemAlloc allocation (stream-ordered, VMM and imported
 *     memory is CUDA_ERROR_INVALID_VALUE: pool memory is shared through an exportable pool); an event
 *     must have been made with CU_EVENT_INTERPROCESS and CU_EVENT_DISABLE_TIMING.
 *   - An opened handle is memory of the context current at the open (it goes with that context),
 *     reference counted per context as documented: opening the same handle again there returns the same
 *     address, and each open needs its cuIpcCloseMemHandle; the last one unmaps it.  Closing anything
 *     else -- or freeing imported memory with cuMemFree -- is a stale use.
 *   - Bytes are not shared across processes here (each process's fake has its own storage): the
 *     opened memory starts zeroed.  What crosses processes is the handle and its checks; the data path
 *     is the GPU tests' (tests/test_gpu_ipc.py).  An imported event is an ordinary interprocess event
 *     of the importing context (work is done at once here, so it is always complete).
 */
#include <signal.h>
#include <stddef.h>

typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;

#define A_IPC 17
#define IPC_LAZY_ENABLE_PEER_ACCESS 1u
#define EVENT_DISABLE_TIMING 2u
#define EVENT_INTERPROCESS 4u

struct ipc_payload {
  char magic[8];
  int pid, dev;
  unsigned long long base, size, id, check;
};
_Static_assert(sizeof(struct ipc_payload) <= 64, "an IPC handle is 64 bytes");

/* Which export each opened allocation is (exporter pid, allocation id), by its address. */
#define IPC_OPENED 256
static struct { CUdeviceptr base; int pid; unsigned long long id; } ipc_opened[IPC_OPENED];

static int ipc_slot_of(CUdeviceptr base) {
  for (int i = 0; i < IPC_OPENED; i++) if (ipc_opened[i].base == base) return i;
  return -1;
}

/* A free entry: never used, or its memory went with its context (or fake_reset). */
static int ipc_free_slot(void) {
  for (int i = 0; i < IPC_OPENED; i++) {
    struct alloc *a = ipc_opened[i].base ? find_alloc(ipc_opened[i].base, 0) : NULL;
    if (!a || a->kind != A_IPC || a->base != ipc_opened[i].base) return i;
  }
  return -1;
}

static unsigned long long ipc_checksum(const struct ipc_payload *p) {
  const unsigned char *b = (const unsigned char *)p;
  unsigned long long h = 1469598103934665603ULL;   /* FNV-1a over everything but the checksum */
  for (size_t i = 0; i < offsetof(struct ipc_payload, check); i++) h = (h ^ b[i]) * 1099511628211ULL;
  return h;
}

static void ipc_pack(char out[64], const char *magic, int dev, unsigned long long base, unsigned long long size,
                     unsigned long long id) {
  struct ipc_payload p;
  memset(&p, 0, sizeof p);
  memcpy(p.magic, magic, 8);
  p.pid = (int)getpid();
  p.dev = dev;
  p.base = base;
  p.size = size;
  p.id = id;
  p.check = ipc_checksum(&p);
  memset(out, 0, 64);
  memcpy(out, &p, sizeof p);
}

/* A handle's payload checked: forged or corrupted -> INVALID_VALUE; this process's own -> INVALID_CONTEXT;
 * an exited exporter's -> INVALID_VALUE. */
static CUresult ipc_unpack(const char in[64], const char *magic, struct ipc_payload *p) {
  memcpy(p, in, sizeof *p);
  for (size_t i = sizeof *p; i < 64; i++) if (in[i]) return E_INVALID_VALUE;
  if (memcmp(p->magic, magic, 8) != 0 || p->check != ipc_checksum(p) || p->pid <= 0) return E_INVALID_VALUE;
  if (p->pid == (int)getpid()) return E_INVALID_CONTEXT;
  if (kill(p->pid, 0) != 0 && errno == ESRCH) return E_INVALID_VALUE;
  return OK;
}

/* What every import does first: a current context, then the handle's payload checked (ipc_unpack). */
static CUresult ipc_import(const char in[64], const char *magic, struct obj **c, struct ipc_payload *p) {
  TRY(cur_ctx(c));
  return ipc_unpack(in, magic, p);
}

/* ------------------------------------------------------------------ memory */
static CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr) {
  ENTER("cuIpcGetMemHandle");
  NEED(handle);
  struct obj *c;
  TRY(cur_ctx(&c));
  struct alloc *a = find_alloc(dptr, 0);
  if (!a) return stale(E_INVALID_VALUE);
  NEED(a->kind == A_DEVICE && a->base == dptr);
  ipc_pack(handle->reserved, "FAKEIPCM", a->dev, a->base, a->size, a->id);
  return OK;
}

static CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags) {
  ENTER("cuIpcOpenMemHandle");
  NEED(pdptr && (flags & ~IPC_LAZY_ENABLE_PEER_ACCESS) == 0);
  struct obj *c;
  struct ipc_payload p;
  TRY(ipc_import(handle.reserved, "FAKEIPCM", &c, &p));
  NEED(p.size > 0 && p.size <= DEVICE_TOTAL_MEM);
  for (size_t i = 0; i < nallocs; i++) {   /* opened before in this context: one more reference */
    struct alloc *a = allocs[i];
    int k = a->kind == A_IPC ? ipc_slot_of(a->base) : -1;
    if (k >= 0 && a->ctx == c->h && ipc_opened[k].pid == p.pid && ipc_opened[k].id == p.id) {
      a->gidx++;
      *pdptr = a->base;
      return OK;
    }
  }
  size_t span = (p.size + 255) / 256 * 256 + 256;
  if (span > dev_limit - dev_next || nallocs == cap_allocs) {
    if (span > dev_limit - dev_next) return E_OUT_OF_MEMORY;
    size_t cap = cap_allocs ? 2 * cap_allocs : 256;
    struct alloc **grown = realloc(allocs, cap * sizeof *grown);
    if (!grown) return E_OUT_OF_MEMORY;
    allocs = grown;
    cap_allocs = cap;
  }
  int k = ipc_free_slot();
  if (k < 0) return E_OUT_OF_MEMORY;
  struct alloc *a = calloc(1, sizeof *a);
  char *store = calloc(1, p.size);
  if (!a || !store) { free(a); free(store); return E_OUT_OF_MEMORY; }
  ipc_opened[k].base = dev_next;
  ipc_opened[k].pid = p.pid;
  ipc_opened[k].id = p.id;
  a->base = dev_next;
  dev_next += span;
  a->size = p.size;
  a->span = span;
  a->kind = A_IPC;
  a->dev = c->dev;
  a->ctx = c->h;
  a->bound = 1;
  a->store = store;
  a->gidx = 1;                 /* the reference count of cuIpcOpenMemHandle */
  a->id = ++buffer_ids;
  allocs[nallocs++] = a;
  *pdptr = a->base;
  return OK;
}

static CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  ENTER("cuIpcCloseMemHandle");
  struct obj *c;
  TRY(cur_ctx(&c));
  struct alloc *a = find_alloc(dptr, 0);
  if (!a || a->kind != A_IPC || a->base != dptr) return stale(E_INVALID_VALUE);
  if (--a->gidx > 0) return OK;
  int k = ipc_slot_of(a->base);
  if (k >= 0) ipc_opened[k].base = 0;
  free(a->store);
  a->store = NULL;
  free_alloc(a);
  return OK;
}

/* ------------------------------------------------------------------ events */
static CUresult cuIpcGetEventHandle(CUipcEventHandle *handle, CUevent event) {
  ENTER("cuIpcGetEventHandle");
  NEED(handle);
  CUresult rc;
  struct obj *e = get(event, K_EVENT, &rc);
  if (!e) return rc;
  NEED((e->flags & (EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)) == (EVENT_INTERPROCESS | EVENT_DISABLE_TIMING));
  ipc_pack(handle->reserved, "FAKEIPCE", e->dev, 0, 0, (unsigned long long)e->h);
  return OK;
}

static CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle) {
  ENTER("cuIpcOpenEventHandle");
  NEED(phEvent);
  struct obj *c;
  struct ipc_payload p;
  TRY(ipc_import(handle.reserved, "FAKEIPCE", &c, &p));
  struct obj *e = new_obj(K_EVENT, c->h, c->dev);
  if (!e) return E_OUT_OF_MEMORY;
  e->flags = EVENT_INTERPROCESS | EVENT_DISABLE_TIMING;
  *phEvent = (CUevent)e->h;
  return OK;
}

/* ------------------------------------------------------------------ shareable pools
 * A pool made with CUmemPoolProps.handleTypes = POSIX_FD or FABRIC (FABRIC only while fakedriver_vmm.c's
 * fabric switch is on; recorded by the wrapper of fakedriver.c's cuMemPoolCreate below, in the pool's
 * unused u.p.reuse[0]) exports (magic, pid, device, pool handle): as a descriptor of a memfd named
 * "fakecuda-pool" (POSIX_FD), or as the 64 bytes of the CUmemFabricHandle itself (FABRIC).  Importing it
 * in another process makes an imported pool there (POOL_IMPORTED); importing it in the exporting
 * process is CUDA_ERROR_INVALID_VALUE (strict: not measured).  cuMemPoolExportPointer takes the base of
 * a live allocation of a shareable pool that has been exported (cuMemPoolExportToShareableHandle) at
 * least once: before that it is CUDA_ERROR_INVALID_VALUE, as an H200 with driver 580 answered (the
 * documentation's "from an already shared memory pool"); cuMemPoolImportPointer takes an imported pool and data another process exported (the same
 * checks as the handles above; the exporter's own data: CUDA_ERROR_INVALID_VALUE) and gives a
 * stream-ordered allocation of the imported pool, zeroed, freed by cuMemFree or cuMemFreeAsync as
 * documented, and freed with its pool. */
#define POOL_SHAREABLE 1
#define POOL_FABRIC 2                /* shareable by fabric handle (else by descriptor) */
#define POOL_EXPORTED 4              /* cuMemPoolExportToShareableHandle has been called */
#define POOL_IMPORTED 0x100
struct pool_payload { char magic[8]; int pid, dev; unsigned long long pool; };

static CUresult vmm_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
  CUresult rc = cuMemPoolCreate(pool, props);
  if (rc != OK) return rc;
  int types = props->handleTypes;     /* (checked after: the original refuses bad props first) */
  int one = types == 0 || types == VMM_POSIX_FD || types == VMM_FABRIC;   /* one type a pool, as cuproc asks */
  pthread_mutex_lock(&mu);
  struct obj *p = pool_of((handle_t)*pool);
  rc = !one ? E_INVALID_VALUE : types == VMM_FABRIC ? check_fabric() : OK;
  if (p && rc != OK) kill_obj(p);
  if (p && rc == OK) p->u.p.reuse[0] = types == VMM_FABRIC ? POOL_SHAREABLE | POOL_FABRIC : types ? POOL_SHAREABLE : 0;
  pthread_mutex_unlock(&mu);
  return rc;
}
_Static_assert(__builtin_types_compatible_p(__typeof__(&vmm_cuMemPoolCreate), __typeof__(&cuMemPoolCreate)),
               "the wrapper has cuMemPoolCreate's type");

static CUresult cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool, int type,
                                                 unsigned long long flags) {
  ENTER("cuMemPoolExportToShareableHandle");
  NEED(handle_out && flags == 0);
  CUresult rc;
  struct obj *p = get(pool, K_POOL, &rc);
  if (!p) return rc;
  int how = p->u.p.reuse[0], fabric = (how & POOL_FABRIC) != 0;
  NEED((how & POOL_SHAREABLE) && !(how & POOL_IMPORTED) && type == (fabric ? VMM_FABRIC : VMM_POSIX_FD));
  struct pool_payload d = {{'F', 'A', 'K', 'E', 'P', 'O', 'O', 'L'}, (int)getpid(), p->dev, (unsigned long long)p->h};
  if (fabric) {
    memset(handle_out, 0, 64);
    memcpy(handle_out, &d, sizeof d);
  } else {
    int fd = memfd_create("fakecuda-pool", MFD_CLOEXEC);
    if (fd < 0) return E_OUT_OF_MEMORY;
    if (pwrite(fd, &d, sizeof d, 0) != (ssize_t)sizeof d) { close(fd); return E_OUT_OF_MEMORY; }
    *(int *)handle_out = fd;
  }
  p->u.p.reuse[0] |= POOL_EXPORTED;
  return OK;
}

/* The payload a pool's export names: read from the memfd a descriptor is, or from a fabric handle's bytes. */
static CUresult pool_payload_of(void *handle, int type, struct pool_payload *d) {
  if (type == VMM_FABRIC) {
    TRY(check_fabric());
    NEED(handle);
    memcpy(d, handle, sizeof *d);
    return OK;
  }
  NEED(type == VMM_POSIX_FD);
  int fd = (int)(intptr_t)handle;
  char link[64], target[256];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = fd >= 0 ? readlink(link, target, sizeof target - 1) : -1;
  if (n <= 0) return E_INVALID_VALUE;
  target[n] = '\0';
  if (strncmp(target, "/memfd:fakecuda-pool", 20) != 0 || pread(fd, d, sizeof *d, 0) != (ssize_t)sizeof *d)
    return E_INVALID_VALUE;
  return OK;
}

static CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle, int type,
                                                   unsigned long long flags) {
  ENTER("cuMemPoolImportFromShareableHandle");
  NEED(pool_out && flags == 0);
  struct pool_payload d;
  TRY(pool_payload_of(handle, type, &d));
  if (memcmp(d.magic, "FAKEPOOL", 8) != 0 || d.pid == (int)getpid()) return E_INVALID_VALUE;
  TRY(check_dev(d.dev));
  struct obj *p = new_obj(K_POOL, 0, d.dev);
  if (!p) return E_OUT_OF_MEMORY;
  p->u.p.reuse[0] = POOL_SHAREABLE | POOL_IMPORTED | (type == VMM_FABRIC ? POOL_FABRIC : 0);
  *pool_out = (CUmemoryPool)p->h;
  return OK;
}

typedef struct { unsigned char reserved[64]; } CUmemPoolPtrExportData;

static CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *data, CUdeviceptr ptr) {
  ENTER("cuMemPoolExportPointer");
  NEED(data);
  struct alloc *a = find_alloc(ptr, 0);
  if (!a) return stale(E_INVALID_VALUE);
  struct obj *p = a->kind == A_ASYNC ? pool_of(a->pool) : NULL;
  NEED(a->base == ptr && p && (p->u.p.reuse[0] & POOL_SHAREABLE) && !(p->u.p.reuse[0] & POOL_IMPORTED));
  NEED(p->u.p.reuse[0] & POOL_EXPORTED);   /* a pool "already shared": exported before its pointers */
  ipc_pack((char *)data->reserved, "FAKEPPTR", a->dev, a->base, a->size, a->id);
  return OK;
}

static CUresult cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData *data) {
  ENTER("cuMemPoolImportPointer");
  NEED(ptr_out && data);
  CUresult rc;
  struct obj *p = get(pool, K_POOL, &rc);
  if (!p) return rc;
  NEED(p->u.p.reuse[0] & POOL_IMPORTED);
  struct obj *c;
  struct ipc_payload d;
  rc = ipc_import((const char *)data->reserved, "FAKEPPTR", &c, &d);
  if (rc == E_INVALID_CONTEXT) return E_INVALID_VALUE;   /* the exporter's own data (strict: not measured) */
  if (rc != OK) return rc;
  NEED(d.size > 0 && d.size <= DEVICE_TOTAL_MEM);
  struct alloc *a = new_alloc(A_ASYNC, d.size, p->dev, c->h, p->h, &rc);
  if (!a) return rc;
  *ptr_out = a->base;
  return OK;
}

#define cuMemPoolCreate vmm_cuMemPoolCreate

/* ------------------------------------------------------------------ control API (tests) */
/* Opened IPC memory still mapped in this process (references not closed count once per open). */
EXPORT long fake_ipc_open_count(void) {
  pthread_mutex_lock(&mu);
  long n = 0;
  for (size_t i = 0; i < nallocs; i++) if (allocs[i]->kind == A_IPC) n += allocs[i]->gidx;
  pthread_mutex_unlock(&mu);
  return n;
}
