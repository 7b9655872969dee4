/*
 * Virtual memory management for the fake driver: physical allocations (cuMemCreate / cuMemRelease /
 * cuMemRetainAllocationHandle), address reservations (cuMemAddressReserve / cuMemAddressFree),
 * mappings (cuMemMap / cuMemUnmap), access (cuMemSetAccess / cuMemGetAccess), granularity, and
 * exportable handles (POSIX file descriptors: cuMemExportToShareableHandle /
 * cuMemImportFromShareableHandle).  Included by fakedriver.c (one #include line, before its
 * cuGetProcAddress table), so it uses that file's state and helpers (ENTER, stale(), the allocation
 * list, the device window, reuse_values) and every entry point has exactly the C signature cuproc
 * selects at CUDA 13.0 (fakedriver.py checks the names).
 *
 * Model (strict on purpose, like the rest of the fake; where the documentation says "must", a
 * violation is refused, and a use of something dead or not owned is a stale use):
 *   - Physical memory is real and shared the way the GPU's is: each cuMemCreate makes a memfd of its
 *     size (counted in the device's bytes, so cuMemGetInfo sees it), and a mapping mmaps that memfd
 *     (MAP_SHARED) into a host "shadow" of the device window at the same offset as the device address.
 *     So two mappings of one allocation see the same bytes, a remap keeps the data without a copy,
 *     adjacent mappings (across reservations too) are one contiguous range for copies, memsets and
 *     launches, and an exported descriptor is a real file descriptor another process can import.
 *   - The allocation is freed only once it has no mapping and no unreleased handle reference
 *     (cuMemCreate, cuMemRetainAllocationHandle and an import each hold one), as the driver
 *     documents.  Releasing a reference that is not held is a stale use.  Handle values are reused
 *     after the free, most recently freed first (with reuse on), as the real driver reuses them.
 *   - Sizes, offsets, addresses and alignments are multiples of the granularity (2 MiB, minimum and
 *     recommended, like the GPUs cuproc is tested on); anything else is CUDA_ERROR_INVALID_VALUE.
 *   - cuMemAddressReserve honours the address hint only when the range there is free (above every
 *     address handed out so far, or inside a freed reservation); else it reserves elsewhere, as the
 *     driver may.  cuMemAddressFree takes exactly one reservation (pointer and size as reserved:
 *     anything else is a stale use -- freeing what one does not own), with no mapping left in it
 *     (a stale use too).  Freed ranges come back, most recently freed first (reuse on).
 *   - A mapping lies inside one reservation and overlaps no other mapping.  cuMemUnmap takes whole
 *     mappings (one or several adjacent ones); cuMemSetAccess takes whole mappings too.  Memory is
 *     usable by copies, memsets and kernels only where it is mapped and its device was given access
 *     (cuMemSetAccess): elsewhere it is no allocation at all, a stale use.
 *   - VMM calls need no current context (they name their device).
 *   - Handle types: POSIX file descriptor, and FABRIC only once a test turned fabric on
 *     (fake_vmm_set_fabric; off after fake_vmm_reset): off, the device reports
 *     CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED as 0 and FABRIC is CUDA_ERROR_NOT_SUPPORTED, as on
 *     a machine without an NVLink fabric; on, it reports 1.  The Windows types are CUDA_ERROR_INVALID_VALUE.
 *     An allocation made without a type cannot be exported as that type.  A POSIX import takes a
 *     descriptor of one of these memfds (this process's or another's); anything else (a closed
 *     descriptor, a regular file) is CUDA_ERROR_INVALID_VALUE.  A fabric handle (64 bytes) names the
 *     exporting process, its memfd's descriptor there and the memfd's inode; the import opens it through
 *     /proc, so it works while the exporter lives and holds the allocation, and is
 *     CUDA_ERROR_INVALID_VALUE after.
 */

#include <fcntl.h>
#include <sys/stat.h>

/* ------------------------------------------------------------------ types (cuda.h's layout) */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type, id; } CUmemLocation;
typedef struct {
  int type, requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  unsigned char compressionType, gpuDirectRDMACapable;
  unsigned short usage;
  unsigned char reserved[4];
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp_v1");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc_v1");

#define VMM_GRANULARITY (2ULL << 20)
#define VMM_POSIX_FD 1
#define VMM_FABRIC 8
#define ATTR_HANDLE_TYPE_FABRIC_SUPPORTED 128
#define VMM_HANDLE_BASE 0x7a000000ULL   /* physical handles are VMM_HANDLE_BASE + 16 * slot */
#define VMM_MAX_PHYS 4096
#define VMM_MAX_RES 1024
#define VMM_MAX_MAPS 4096
#define A_VMM 16                      /* the allocation kind of a mapped, accessible run */
enum { ACCESS_NONE = 0, ACCESS_READ = 1, ACCESS_READWRITE = 3 };

struct phys {
  int alive;          /* the slot holds an allocation */
  int refs, maps;     /* unreleased handle references, live mappings */
  int dev, handle_types, imported;
  int fd;             /* the memfd */
  size_t size;
};
struct reservation { int alive; CUdeviceptr base; size_t size; };
struct mapping { int alive; CUdeviceptr base; size_t size; size_t offset; int phys; int res; unsigned char access[MAX_DEV]; };

static struct phys vphys[VMM_MAX_PHYS];
static int nvphys;
static int vphys_free[VMM_MAX_PHYS];   /* freed slots, the most recently freed last */
static int nvphys_free;
static struct reservation vres[VMM_MAX_RES];
static struct mapping vmaps[VMM_MAX_MAPS];
static struct { CUdeviceptr base; size_t size; } vfreed[VMM_MAX_RES];  /* freed reservations' ranges */
static int nvfreed;
static char *vmm_shadow;               /* host memory standing for the device window, at the same offsets */
static int vmm_fabric;                 /* fabric handles on (fake_vmm_set_fabric) */

/* FABRIC where it is off: the driver's answer on a machine without an NVLink fabric. */
static CUresult check_fabric(void) { return vmm_fabric ? OK : E_NOT_SUPPORTED; }

static char *shadow_of(CUdeviceptr p) { return vmm_shadow + (p - dev_base); }

static int vmm_setup(void) {
  if (vmm_shadow) return 1;
  void *p = mmap(NULL, dev_limit - dev_base, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return 0;
  vmm_shadow = p;
  return 1;
}

static int aligned(unsigned long long v) { return v % VMM_GRANULARITY == 0; }

static struct phys *phys_of(CUmemGenericAllocationHandle h, int *slot) {
  if (h < VMM_HANDLE_BASE || (h - VMM_HANDLE_BASE) % 16) return NULL;
  unsigned long long n = (h - VMM_HANDLE_BASE) / 16;
  if (n >= (unsigned long long)nvphys || !vphys[n].alive || vphys[n].refs <= 0) return NULL;
  if (slot) *slot = (int)n;
  return &vphys[n];
}

static CUmemGenericAllocationHandle handle_of(int slot) { return VMM_HANDLE_BASE + 16ULL * (unsigned)slot; }

static int new_phys_slot(void) {
  int n;
  if (reuse_values && nvphys_free) n = vphys_free[--nvphys_free];
  else if (nvphys < VMM_MAX_PHYS) n = nvphys++;
  else if (nvphys_free) n = vphys_free[--nvphys_free];
  else return -1;
  memset(&vphys[n], 0, sizeof vphys[n]);
  vphys[n].fd = -1;
  return n;
}

/* A new physical allocation on fd (this process's from now on), holding one handle reference; its handle,
 * or 0 with fd closed when no slot is left.  Imported memory's bytes are counted where they were made. */
static CUmemGenericAllocationHandle phys_new(int fd, int dev, int handle_types, size_t size, int imported) {
  int n = new_phys_slot();
  if (n < 0) { close(fd); return 0; }
  vphys[n] = (struct phys){.alive = 1, .refs = 1, .dev = dev, .handle_types = handle_types, .imported = imported,
                           .fd = fd, .size = size};
  if (!imported) dev_bytes[dev] += size;
  return handle_of(n);
}

/* The allocation goes once nothing holds it: no mapping, no handle reference. */
static void phys_maybe_free(int n) {
  struct phys *p = &vphys[n];
  if (!p->alive || p->refs > 0 || p->maps > 0) return;
  if (!p->imported) dev_bytes[p->dev] -= p->size;
  if (p->fd >= 0) close(p->fd);
  p->alive = 0;
  p->fd = -1;
  if (nvphys_free < VMM_MAX_PHYS) vphys_free[nvphys_free++] = n;
}

static CUresult check_prop(const CUmemAllocationProp *prop) {
  NEED(prop);
  NEED(prop->type == 1 && prop->location.type == 1);   /* PINNED, on a DEVICE */
  TRY(check_dev(prop->location.id));
  if (prop->requestedHandleTypes & VMM_FABRIC) TRY(check_fabric());
  NEED((prop->requestedHandleTypes & ~(VMM_POSIX_FD | VMM_FABRIC)) == 0);
  return OK;
}

/* ------------------------------------------------------------------ the runs copies and kernels see */
/* Remove every A_VMM record (they are rebuilt from the mappings after each change). */
static void drop_runs(void) {
  for (size_t i = nallocs; i > 0;) {
    i--;
    if (allocs[i]->kind == A_VMM) free_alloc(allocs[i]);
    if (i > nallocs) i = nallocs;
  }
}

static int mapping_usable(const struct mapping *m) {
  return m->alive && vphys[m->phys].alive && m->access[vphys[m->phys].dev] != ACCESS_NONE;
}

/* Rebuild the allocation records: maximal runs of adjacent mapped memory that its device may access. */
static void rebuild_runs(void) {
  drop_runs();
  int order[VMM_MAX_MAPS], n = 0;
  for (int i = 0; i < VMM_MAX_MAPS; i++) if (mapping_usable(&vmaps[i])) order[n++] = i;
  for (int i = 1; i < n; i++) {   /* insertion sort by address */
    int v = order[i], j = i;
    while (j > 0 && vmaps[order[j - 1]].base > vmaps[v].base) { order[j] = order[j - 1]; j--; }
    order[j] = v;
  }
  for (int i = 0; i < n;) {
    CUdeviceptr base = vmaps[order[i]].base, end = base + vmaps[order[i]].size;
    int dev = vphys[vmaps[order[i]].phys].dev, j = i + 1;
    while (j < n && vmaps[order[j]].base == end && vphys[vmaps[order[j]].phys].dev == dev) {
      end += vmaps[order[j]].size;
      j++;
    }
    struct alloc *a = calloc(1, sizeof *a);
    if (a && nallocs == cap_allocs) {
      size_t cap = cap_allocs ? 2 * cap_allocs : 256;
      struct alloc **grown = realloc(allocs, cap * sizeof *grown);
      if (grown) { allocs = grown; cap_allocs = cap; } else { free(a); a = NULL; }
    }
    if (a) {
      a->base = base;
      a->size = end - base;
      a->kind = A_VMM;
      a->dev = dev;
      a->store = shadow_of(base);
      a->id = ++buffer_ids;
      allocs[nallocs++] = a;
    }
    i = j;
  }
}

/* ------------------------------------------------------------------ physical memory */
static CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option) {
  ENTER("cuMemGetAllocationGranularity");
  NEED(granularity && (option == 0 || option == 1));   /* MINIMUM, RECOMMENDED */
  TRY(check_prop(prop));
  *granularity = VMM_GRANULARITY;
  return OK;
}

static CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
  ENTER("cuMemCreate");
  NEED(handle && flags == 0 && size > 0 && aligned(size));
  TRY(check_prop(prop));
  int dev = prop->location.id;
  if (dev_bytes[dev] + size > DEVICE_TOTAL_MEM) return E_OUT_OF_MEMORY;
  int fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
  if (fd < 0) return E_OUT_OF_MEMORY;
  if (ftruncate(fd, (off_t)size) != 0) { close(fd); return E_OUT_OF_MEMORY; }
  CUmemGenericAllocationHandle h = phys_new(fd, dev, prop->requestedHandleTypes, size, 0);
  if (!h) return E_OUT_OF_MEMORY;
  *handle = h;
  return OK;
}

static CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  ENTER("cuMemRelease");
  int n;
  if (!phys_of(handle, &n)) return stale(E_INVALID_VALUE);   /* a reference not held: an over-release */
  vphys[n].refs--;
  phys_maybe_free(n);
  return OK;
}

static struct mapping *mapping_at(CUdeviceptr p) {
  for (int i = 0; i < VMM_MAX_MAPS; i++) {
    struct mapping *m = &vmaps[i];
    if (m->alive && p >= m->base && p < m->base + m->size) return m;
  }
  return NULL;
}

static CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
  ENTER("cuMemRetainAllocationHandle");
  NEED(handle);
  struct mapping *m = mapping_at((CUdeviceptr)(uintptr_t)addr);
  if (!m) return E_INVALID_VALUE;
  vphys[m->phys].refs++;
  *handle = handle_of(m->phys);
  return OK;
}

static CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle) {
  ENTER("cuMemGetAllocationPropertiesFromHandle");
  NEED(prop);
  struct phys *p = phys_of(handle, NULL);
  if (!p) return stale(E_INVALID_VALUE);
  memset(prop, 0, sizeof *prop);
  prop->type = 1;
  prop->requestedHandleTypes = p->handle_types;
  prop->location.type = 1;
  prop->location.id = p->dev;
  return OK;
}

/* A fabric handle's 64 bytes: the exporting process and its memfd's descriptor there. */
struct fabric_payload { char magic[8]; int pid, fd; unsigned long long inode; };
_Static_assert(sizeof(struct fabric_payload) <= 64, "a CUmemFabricHandle is 64 bytes");

static CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle, int type,
                                             unsigned long long flags) {
  ENTER("cuMemExportToShareableHandle");
  NEED(shareable && flags == 0);
  struct phys *p = phys_of(handle, NULL);
  if (!p) return stale(E_INVALID_VALUE);
  if (type == VMM_FABRIC) {
    TRY(check_fabric());
    NEED(p->handle_types & VMM_FABRIC);
    struct stat st;
    if (fstat(p->fd, &st) != 0) return E_OUT_OF_MEMORY;
    struct fabric_payload d = {{'F', 'A', 'K', 'E', 'F', 'A', 'B', 'R'}, (int)getpid(), p->fd, (unsigned long long)st.st_ino};
    memset(shareable, 0, 64);
    memcpy(shareable, &d, sizeof d);
    return OK;
  }
  NEED(type == VMM_POSIX_FD && (p->handle_types & VMM_POSIX_FD));
  int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return E_OUT_OF_MEMORY;
  *(int *)shareable = fd;
  return OK;
}

/* Whether fd is one of the fake's memfds (of any process): its /proc name says so. */
static int is_vmm_memfd(int fd, size_t *size) {
  char link[64], target[256];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n <= 0) return 0;
  target[n] = '\0';
  if (strncmp(target, "/memfd:fakecuda-vmm", 19) != 0) return 0;
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size <= 0) return 0;
  *size = (size_t)st.st_size;
  return 1;
}

/* The descriptor a fabric handle names, opened here (the exporter's memfd, through /proc); -1 if gone (its
 * number now another file's: another inode). */
static int open_fabric(const void *os_handle) {
  struct fabric_payload d;
  memcpy(&d, os_handle, sizeof d);
  if (memcmp(d.magic, "FAKEFABR", 8) != 0 || d.pid <= 0 || d.fd < 0) return -1;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", d.pid, d.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  struct stat st;
  if (fd >= 0 && (fstat(fd, &st) != 0 || (unsigned long long)st.st_ino != d.inode)) { close(fd); fd = -1; }
  return fd;
}

static CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type) {
  ENTER("cuMemImportFromShareableHandle");
  NEED(handle);
  if (type == VMM_FABRIC) TRY(check_fabric());
  NEED(type == VMM_POSIX_FD || (type == VMM_FABRIC && os_handle));
  /* this process's own descriptor of the memfd: a duplicate (the caller keeps and closes its descriptor) */
  int own = type == VMM_FABRIC ? open_fabric(os_handle) : fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 0);
  size_t size;
  if (own < 0) return E_INVALID_VALUE;
  if (!is_vmm_memfd(own, &size)) { close(own); return E_INVALID_VALUE; }
  struct stat st;
  fstat(own, &st);
  int dev = 0;   /* the device of an allocation of this process with the same memfd; else device 0 */
  for (int i = 0; i < nvphys; i++) {
    struct stat mine;
    if (vphys[i].alive && !vphys[i].imported && fstat(vphys[i].fd, &mine) == 0 && mine.st_ino == st.st_ino &&
        mine.st_dev == st.st_dev) dev = vphys[i].dev;
  }
  CUmemGenericAllocationHandle h = phys_new(own, dev, type, size, 1);
  if (!h) return E_OUT_OF_MEMORY;
  *handle = h;
  return OK;
}

/* ------------------------------------------------------------------ address reservations */
static int range_is_free(CUdeviceptr base, size_t size) {
  if (base < dev_base || base + size > dev_limit || base + size < base) return 0;
  if (base >= dev_next) return 1;
  for (int i = 0; i < nvfreed; i++)
    if (base >= vfreed[i].base && base + size <= vfreed[i].base + vfreed[i].size) return 1;
  return 0;
}

/* Take [base, base + size) out of the freed ranges (or off the top of the window). */
static void take_range(CUdeviceptr base, size_t size) {
  if (base >= dev_next) { dev_next = base + size; return; }
  for (int i = 0; i < nvfreed; i++) {
    CUdeviceptr lo = vfreed[i].base, hi = lo + vfreed[i].size;
    if (base < lo || base + size > hi) continue;
    memmove(&vfreed[i], &vfreed[i + 1], (size_t)(nvfreed - i - 1) * sizeof vfreed[0]);
    nvfreed--;
    if (base > lo && nvfreed < VMM_MAX_RES) { vfreed[nvfreed].base = lo; vfreed[nvfreed].size = base - lo; nvfreed++; }
    if (base + size < hi && nvfreed < VMM_MAX_RES) {
      vfreed[nvfreed].base = base + size;
      vfreed[nvfreed].size = hi - base - size;
      nvfreed++;
    }
    return;
  }
}

static CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags) {
  ENTER("cuMemAddressReserve");
  NEED(ptr && flags == 0 && size > 0 && aligned(size));
  NEED(alignment == 0 || (alignment & (alignment - 1)) == 0);
  NEED(aligned(addr));
  if (!vmm_setup()) return E_OUT_OF_MEMORY;
  size_t align = alignment > VMM_GRANULARITY ? alignment : VMM_GRANULARITY;
  int slot = -1;
  for (int i = 0; i < VMM_MAX_RES && slot < 0; i++) if (!vres[i].alive) slot = i;
  if (slot < 0) return E_OUT_OF_MEMORY;
  CUdeviceptr base = 0;
  if (addr && addr % align == 0 && range_is_free(addr, size)) base = addr;   /* the hint, where it is free */
  for (int i = nvfreed; !base && reuse_values && i > 0;) {   /* a freed range, the most recent first */
    i--;
    CUdeviceptr b = (vfreed[i].base + align - 1) / align * align;
    if (b + size <= vfreed[i].base + vfreed[i].size) base = b;
  }
  if (!base) {
    CUdeviceptr b = (dev_next + align - 1) / align * align;
    if (b + size > dev_limit || b + size < b) return E_OUT_OF_MEMORY;
    base = b;
  }
  take_range(base, size);
  vres[slot].alive = 1;
  vres[slot].base = base;
  vres[slot].size = size;
  *ptr = base;
  return OK;
}

static int reservation_of(CUdeviceptr base, size_t size) {
  for (int i = 0; i < VMM_MAX_RES; i++)
    if (vres[i].alive && base >= vres[i].base && base + size <= vres[i].base + vres[i].size && base + size > base)
      return i;
  return -1;
}

static CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  ENTER("cuMemAddressFree");
  int r = -1;
  for (int i = 0; i < VMM_MAX_RES; i++) if (vres[i].alive && vres[i].base == ptr && vres[i].size == size) r = i;
  if (r < 0) return stale(E_INVALID_VALUE);   /* not one reservation as reserved: not the caller's to free */
  for (int i = 0; i < VMM_MAX_MAPS; i++) if (vmaps[i].alive && vmaps[i].res == r) return stale(E_INVALID_VALUE);
  vres[r].alive = 0;
  if (nvfreed == VMM_MAX_RES) { memmove(&vfreed[0], &vfreed[1], (VMM_MAX_RES - 1) * sizeof vfreed[0]); nvfreed--; }
  vfreed[nvfreed].base = ptr;
  vfreed[nvfreed].size = size;
  nvfreed++;
  return OK;
}

/* ------------------------------------------------------------------ mappings and access */
static CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags) {
  ENTER("cuMemMap");
  NEED(flags == 0 && size > 0 && aligned(ptr) && aligned(size) && aligned(offset));
  int n;
  struct phys *p = phys_of(handle, &n);
  if (!p) return stale(E_INVALID_VALUE);
  NEED(offset + size <= p->size && offset + size > offset);
  int r = reservation_of(ptr, size);
  if (r < 0) return stale(E_INVALID_VALUE);   /* outside every reservation */
  int slot = -1;
  for (int i = 0; i < VMM_MAX_MAPS; i++) {
    struct mapping *m = &vmaps[i];
    if (!m->alive) { if (slot < 0) slot = i; continue; }
    if (ptr < m->base + m->size && m->base < ptr + size) return E_INVALID_VALUE;   /* already mapped there */
  }
  if (slot < 0) return E_OUT_OF_MEMORY;
  if (mmap(shadow_of(ptr), size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, p->fd, (off_t)offset) == MAP_FAILED)
    return E_OUT_OF_MEMORY;
  struct mapping *m = &vmaps[slot];
  memset(m, 0, sizeof *m);
  m->alive = 1;
  m->base = ptr;
  m->size = size;
  m->offset = offset;
  m->phys = n;
  m->res = r;
  p->maps++;
  return OK;
}

/* The mappings that make up [ptr, ptr + size) exactly (whole mappings, no gap); their count, or -1. */
static int whole_mappings(CUdeviceptr ptr, size_t size, int *out) {
  int n = 0;
  CUdeviceptr at = ptr;
  while (at < ptr + size) {
    int found = -1;
    for (int i = 0; i < VMM_MAX_MAPS; i++) if (vmaps[i].alive && vmaps[i].base == at) found = i;
    if (found < 0 || vmaps[found].base + vmaps[found].size > ptr + size) return -1;
    out[n++] = found;
    at += vmaps[found].size;
  }
  return n;
}

static CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  ENTER("cuMemUnmap");
  NEED(size > 0);
  static int found[VMM_MAX_MAPS];
  int n = whole_mappings(ptr, size, found);
  if (n <= 0) return stale(E_INVALID_VALUE);   /* not mapped, or part of a mapping */
  for (int i = 0; i < n; i++) {
    struct mapping *m = &vmaps[found[i]];
    mmap(shadow_of(m->base), m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    m->alive = 0;
    vphys[m->phys].maps--;
    phys_maybe_free(m->phys);
  }
  rebuild_runs();
  return OK;
}

static CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  ENTER("cuMemSetAccess");
  NEED(desc && count > 0 && size > 0);
  for (size_t d = 0; d < count; d++) {
    NEED(desc[d].location.type == 1);
    TRY(check_dev(desc[d].location.id));
    NEED(desc[d].flags == ACCESS_NONE || desc[d].flags == ACCESS_READ || desc[d].flags == ACCESS_READWRITE);
  }
  static int found[VMM_MAX_MAPS];
  int n = whole_mappings(ptr, size, found);
  if (n <= 0) return stale(E_INVALID_VALUE);
  for (int i = 0; i < n; i++)
    for (size_t d = 0; d < count; d++) vmaps[found[i]].access[desc[d].location.id] = (unsigned char)desc[d].flags;
  rebuild_runs();
  return OK;
}

static CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr) {
  ENTER("cuMemGetAccess");
  NEED(flags && location && location->type == 1);
  TRY(check_dev(location->id));
  struct mapping *m = mapping_at(ptr);
  if (!m) return E_INVALID_VALUE;
  *flags = m->access[location->id];
  return OK;
}

/* ------------------------------------------------------------------ control API (tests) */
/* Forget every reservation, mapping and physical allocation (after fake_reset, which drops the runs). */
EXPORT void fake_vmm_reset(void) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < VMM_MAX_MAPS; i++) {
    if (vmaps[i].alive && vmm_shadow)
      mmap(shadow_of(vmaps[i].base), vmaps[i].size, PROT_NONE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    vmaps[i].alive = 0;
  }
  for (int i = 0; i < nvphys; i++) {
    if (vphys[i].alive && vphys[i].fd >= 0) close(vphys[i].fd);
    if (vphys[i].alive && !vphys[i].imported) dev_bytes[vphys[i].dev] -= vphys[i].size;
    vphys[i].alive = 0;
  }
  nvphys = nvphys_free = 0;
  vmm_fabric = 0;
  memset(vres, 0, sizeof vres);
  nvfreed = 0;
  drop_runs();
  pthread_mutex_unlock(&mu);
}

/* Fabric handles on (1) or off (0, as after a reset): CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, and
 * whether pools and VMM memory take CU_MEM_HANDLE_TYPE_FABRIC. */
EXPORT void fake_vmm_set_fabric(int on) {
  pthread_mutex_lock(&mu);
  vmm_fabric = on != 0;
  pthread_mutex_unlock(&mu);
}

/* Live VMM objects: "physical" (allocations not yet freed), "handle" (unreleased references),
 * "reservation", "mapping"; -1 for another name. */
EXPORT long fake_vmm_live(const char *kind) {
  if (!kind) return -1;
  long n = 0;
  pthread_mutex_lock(&mu);
  if (strcmp(kind, "physical") == 0) {
    for (int i = 0; i < nvphys; i++) n += vphys[i].alive;
  } else if (strcmp(kind, "handle") == 0) {
    for (int i = 0; i < nvphys; i++) n += vphys[i].alive ? vphys[i].refs : 0;
  } else if (strcmp(kind, "reservation") == 0) {
    for (int i = 0; i < VMM_MAX_RES; i++) n += vres[i].alive;
  } else if (strcmp(kind, "mapping") == 0) {
    for (int i = 0; i < VMM_MAX_MAPS; i++) n += vmaps[i].alive;
  } else {
    n = -1;
  }
  pthread_mutex_unlock(&mu);
  return n;
}

/* cuDeviceGetAttribute with HANDLE_TYPE_FABRIC_SUPPORTED answered by the switch above (the table and the
 * files included after this one take the wrapper; it calls the one fakedriver_arrays.c put in front). */
static CUresult vmm_cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
  CUresult rc = cuDeviceGetAttribute(pi, attrib, dev);
  if (rc == OK && attrib == ATTR_HANDLE_TYPE_FABRIC_SUPPORTED) *pi = vmm_fabric;
  return rc;
}
_Static_assert(__builtin_types_compatible_p(__typeof__(&vmm_cuDeviceGetAttribute), __typeof__(&cuDeviceGetAttribute)),
               "the wrapper has cuDeviceGetAttribute's type");
#undef cuDeviceGetAttribute
#define cuDeviceGetAttribute vmm_cuDeviceGetAttribute
