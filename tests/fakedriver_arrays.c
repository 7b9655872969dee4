/*
 * CUDA arrays, texture and surface objects and tensor maps for the fake driver.  Included by fakedriver.c
 * after fakedriver_graphs.c (one #include line, before its cuGetProcAddress table), so it uses that file's
 * state and helpers (the object table, ENTER, stale(), the ordering model) and graphs' capture routing;
 * every entry point here has, like the ones there, exactly the C signature cuproc selects at CUDA 13.0
 * (fakedriver.py checks the names).
 *
 * Model (strict on purpose, like the rest of the fake):
 *   - Four more object kinds in fakedriver.c's handle table, so their handles are reused after destroy as
 *     the real driver reuses them, and a destroyed one is a stale use: a CUDA array, a mipmapped array (its
 *     levels are arrays whose parent it is: they go with it, and cuArrayDestroy of a level is a stale use),
 *     a texture object and a surface object (64-bit values: the object's handle).  All four belong to the
 *     context current when they were made and go with it.  Their data lives in a side table of this file
 *     indexed by the handle's slot (what a dead object left at a slot is freed when the slot is taken again).
 *   - An array's bytes are real, packed as (depth, height, width * element size); the driver's own layout
 *     is opaque, so only copies can see them.  Descriptors are checked as cuArray3DCreate documents them:
 *     format one of the CUarray_format basics, 1, 2 or 4 channels, width > 0; 1-D: height 0 and depth 0
 *     (any depth when layered); 3-D: height > 0; a cubemap has width == height and depth 6 (a multiple of 6
 *     when layered); unknown flag bits are refused.  cuArrayCreate takes 1-D and 2-D only (height 0 = 1-D).
 *   - cuMemcpy2D / cuMemcpy3D (and Async) with an array on either side are done here (the linear-only
 *     paths of fakedriver.c answer CUDA_ERROR_NOT_SUPPORTED for arrays): offsets and widths in bytes must be
 *     whole elements, and the region must lie inside the array (else CUDA_ERROR_INVALID_VALUE, as the driver
 *     documents).  The linear side is checked as fakedriver.c's copies check it (a stale use outside every
 *     live allocation).  A synchronous copy with an array side runs in the current context: made while
 *     neither the array's nor the linear side's context is current, it is misrouted (recorded).  An async
 *     one on a capturing stream is refused like fakedriver_graphs.c's other 2-D/3-D copies.
 *   - cuTexObjectCreate: over a live array or mipmapped array, or linear or pitch-2D device memory inside
 *     one live allocation whose address is a multiple of TEXTURE_ALIGNMENT (512 here) and, for pitch 2-D,
 *     whose pitch is a multiple of TEXTURE_PITCH_ALIGNMENT (32 here, answered by cuDeviceGetAttribute below)
 *     and at least width * element size; address modes 0..3, filter modes 0..1, flags among the CU_TRSF_
 *     bits; linear filtering of an integer format read as integers is refused (the documentation: linear
 *     filtering only for floating-point results); a mipmapped array needs a texture descriptor whose
 *     mipmap clamps are ordered.  cuSurfObjectCreate: an array made with CUDA_ARRAY3D_SURFACE_LDST only.
 *     A resource view is not supported (CUDA_ERROR_NOT_SUPPORTED).
 *   - Destroying an array, mipmapped array or allocation while a texture or surface object over it lives
 *     is allowed, as on a GPU (a later fetch would read freed memory): it is counted (fake_array_dangling),
 *     so that a test can tell cuproc's order.
 *   - cuTensorMapEncodeTiled / Im2col check the rules the driver documents (rank, 16-byte aligned global
 *     address -- 32 with 32-byte interleave --, dimensions, strides a multiple of 16 below 2^40, box sizes
 *     1..256 with an inner box of a multiple of 16 bytes, element strides 1..8, swizzle span, im2col
 *     corners and pixel counts), the map's own address a multiple of 64, and that the global address is in
 *     a live allocation (else a stale use).  The map written is 128 bytes that name the inputs
 *     (word 0 the address, word 1 type | rank << 8 | interleave << 16 | swizzle << 24, words 2..6 the
 *     dimensions, 7..10 the strides, 11..15 box | element stride << 32), so a test can read a launch's
 *     argument bytes back.
 */

/* ------------------------------------------------------------------ types */
typedef void *CUarray, *CUmipmappedArray;

typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR; /* _v2 */
typedef struct { size_t Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR;

typedef struct { /* CUDA_RESOURCE_DESC_v1 */
  int resType;
  union {
    struct { CUarray hArray; } array;
    struct { CUmipmappedArray hMipmappedArray; } mipmap;
    struct { CUdeviceptr devPtr; int format; unsigned numChannels; size_t sizeInBytes; } linear;
    struct { CUdeviceptr devPtr; int format; unsigned numChannels; size_t width, height, pitchInBytes; } pitch2D;
    struct { int reserved[32]; } reserved;
  } res;
  unsigned flags;
} CUDA_RESOURCE_DESC;

typedef struct { /* CUDA_TEXTURE_DESC_v1 */
  int addressMode[3];
  int filterMode;
  unsigned flags, maxAnisotropy;
  int mipmapFilterMode;
  float mipmapLevelBias, minMipmapLevelClamp, maxMipmapLevelClamp;
  float borderColor[4];
  int reserved[12];
} CUDA_TEXTURE_DESC;

typedef struct { cuuint64_t opaque[16]; } CUtensorMap;   /* 64-byte aligned where cuproc makes it */
typedef unsigned int cuuint32_t;

_Static_assert(sizeof(CUDA_RESOURCE_DESC) == 144, "CUDA_RESOURCE_DESC is 144 bytes");
_Static_assert(sizeof(CUDA_TEXTURE_DESC) == 104, "CUDA_TEXTURE_DESC is 104 bytes");

#define K_ARRAY 40
#define K_MIPMAP 41
#define K_TEXOBJ 42
#define K_SURFOBJ 43
enum { RES_ARRAY = 0, RES_MIPMAP = 1, RES_LINEAR = 2, RES_PITCH2D = 3 };
enum { MT_HOST = 1, MT_DEVICE = 2, MT_ARRAY = 3, MT_UNIFIED = 4 };
#define A3_LAYERED 1u
#define A3_SURFACE_LDST 2u
#define A3_CUBEMAP 4u
#define A3_TEXTURE_GATHER 8u
#define TRSF_KNOWN (1u | 2u | 16u | 32u | 64u)   /* READ_AS_INTEGER, NORMALIZED, SRGB, NO_TRILINEAR, SEAMLESS */
#define TEX_ALIGNMENT 512
#define TEX_PITCH_ALIGNMENT 32
#define MAX_LEVELS 16

enum { TAG_ARRAY = 0x41525259, TAG_MIPMAP = 0x4d49504d, TAG_TEX = 0x54455854 };

struct adata {            /* an array or a mipmapped array */
  int tag;
  size_t width, height, depth;
  int format;
  unsigned channels, flags, elem;
  char *store;            /* arrays: (depth, height, width * elem) bytes */
  int levels;             /* mipmapped: its level arrays */
  handle_t level[MAX_LEVELS];
};

struct tdata {            /* a texture or surface object: what it reads */
  int tag, resType;
  handle_t res;           /* array or mipmapped array */
  CUdeviceptr ptr;        /* linear and pitch 2-D */
  size_t bytes;
  CUDA_RESOURCE_DESC rdesc;
  CUDA_TEXTURE_DESC tdesc;
};

static void **aside;
static size_t naside;
static long array_dangling;
static long linear_textures;   /* see arrays_cuMemFree_v2 */

static void *aside_of(handle_t h, int kind, int tag, CUresult *rc) {
  struct obj *o = obj_at(h);
  if (!o || !o->alive || o->kind != kind) { *rc = stale(E_INVALID_HANDLE); return NULL; }
  size_t n = (h - HANDLE_BASE) / 16;
  if (n >= naside || !aside[n] || *(int *)aside[n] != tag) { *rc = stale(E_INVALID_HANDLE); return NULL; }
  return aside[n];
}

static void free_aside(void *p) {
  if (*(int *)p == TAG_ARRAY) free(((struct adata *)p)->store);
  free(p);
}

static int set_aside(struct obj *o, void *p) {
  size_t n = (o->h - HANDLE_BASE) / 16;
  if (n >= naside) {
    size_t cap = naside ? naside : 256;
    while (cap <= n) cap *= 2;
    void **grown = realloc(aside, cap * sizeof *grown);
    if (!grown) return 0;
    memset(grown + naside, 0, (cap - naside) * sizeof *grown);
    aside = grown;
    naside = cap;
  }
  if (aside[n]) free_aside(aside[n]);
  aside[n] = p;
  return 1;
}

static void drop_aside(handle_t h) {
  size_t n = (h - HANDLE_BASE) / 16;
  if (n < naside && aside[n]) { free_aside(aside[n]); aside[n] = NULL; }
}

/* bytes per channel of a basic CUarray_format; 0 for anything else */
static unsigned format_size(int f) {
  switch (f) {
  case 1: case 8: return 1;     /* UNSIGNED_INT8, SIGNED_INT8 */
  case 2: case 9: case 16: return 2;   /* (UN)SIGNED_INT16, HALF */
  case 3: case 10: case 32: return 4;  /* (UN)SIGNED_INT32, FLOAT */
  default: return 0;
  }
}

static int integer_format(int f) { return f != 16 && f != 32; }

static CUresult check_desc3(const CUDA_ARRAY3D_DESCRIPTOR *d) {
  NEED(d);
  NEED(format_size(d->Format) && (d->NumChannels == 1 || d->NumChannels == 2 || d->NumChannels == 4));
  NEED(!(d->Flags & ~(A3_LAYERED | A3_SURFACE_LDST | A3_CUBEMAP | A3_TEXTURE_GATHER)));
  NEED(d->Width > 0);
  if (d->Flags & A3_CUBEMAP) {
    NEED(d->Width == d->Height);
    NEED((d->Flags & A3_LAYERED) ? d->Depth > 0 && d->Depth % 6 == 0 : d->Depth == 6);
  } else if (d->Flags & A3_LAYERED) {
    NEED(d->Depth > 0);
  } else if (d->Depth) {
    NEED(d->Height > 0);
  }
  if (d->Flags & A3_TEXTURE_GATHER) NEED(d->Height > 0 && d->Depth == 0);
  return OK;
}

static struct adata *new_array(const CUDA_ARRAY3D_DESCRIPTOR *d, struct obj *c, handle_t parent, handle_t *out,
                               CUresult *rc) {
  struct adata *a = calloc(1, sizeof *a);
  if (!a) { *rc = E_OUT_OF_MEMORY; return NULL; }
  a->tag = TAG_ARRAY;
  a->width = d->Width; a->height = d->Height; a->depth = d->Depth;
  a->format = d->Format; a->channels = d->NumChannels; a->flags = d->Flags;
  a->elem = format_size(d->Format) * d->NumChannels;
  size_t rows = (a->height ? a->height : 1) * (a->depth ? a->depth : 1);
  a->store = calloc(rows, a->width * a->elem);
  struct obj *o = a->store ? new_obj(K_ARRAY, c->h, c->dev) : NULL;
  if (!o) { free(a->store); free(a); *rc = E_OUT_OF_MEMORY; return NULL; }
  o->parent = parent;
  if (!set_aside(o, a)) { free_aside(a); kill_obj(o); *rc = E_OUT_OF_MEMORY; return NULL; }
  *out = o->h;
  return a;
}

/* ================================================================== arrays */
static CUresult cuArray3DCreate_v2(CUarray *ph, const CUDA_ARRAY3D_DESCRIPTOR *d) {
  ENTER("cuArray3DCreate");
  NEED(ph);
  TRY(check_desc3(d));
  struct obj *c;
  TRY(cur_ctx(&c));
  CUresult rc;
  handle_t h;
  if (!new_array(d, c, 0, &h, &rc)) return rc;
  *ph = (CUarray)h;
  return OK;
}

static CUresult cuArrayCreate_v2(CUarray *ph, const CUDA_ARRAY_DESCRIPTOR *d) {
  ENTER("cuArrayCreate");
  NEED(ph && d);
  CUDA_ARRAY3D_DESCRIPTOR d3 = {d->Width, d->Height, 0, d->Format, d->NumChannels, 0};
  TRY(check_desc3(&d3));
  struct obj *c;
  TRY(cur_ctx(&c));
  CUresult rc;
  handle_t h;
  if (!new_array(&d3, c, 0, &h, &rc)) return rc;
  *ph = (CUarray)h;
  return OK;
}

/* Live texture or surface objects over resource h (an array, a mipmapped array, or memory at [p, p+n)). */
static int referenced(handle_t h, CUdeviceptr p, size_t n) {
  for (size_t i = 0; i < nlive; i++) {
    struct obj *o = live_obj(i);
    if (o->kind != K_TEXOBJ && o->kind != K_SURFOBJ) continue;
    size_t slot = (o->h - HANDLE_BASE) / 16;
    struct tdata *t = slot < naside ? aside[slot] : NULL;
    if (!t || t->tag != TAG_TEX) continue;
    if (h && t->res == h) return 1;
    if (n && t->ptr && (n == (size_t)-1 || (t->ptr < p + n && p < t->ptr + t->bytes))) return 1;
  }
  return 0;
}

static CUresult cuArrayDestroy(CUarray h) {
  ENTER("cuArrayDestroy");
  CUresult rc;
  if (!aside_of((handle_t)h, K_ARRAY, TAG_ARRAY, &rc)) return rc;
  struct obj *o = obj_at((handle_t)h);
  if (o->parent) return stale(E_INVALID_HANDLE);   /* a mipmap level: its mipmapped array owns it */
  TRY(need_current(o));
  if (referenced((handle_t)h, 0, 0)) array_dangling++;
  drop_aside((handle_t)h);
  kill_obj(o);
  return OK;
}

static void get_desc3(const struct adata *a, CUDA_ARRAY3D_DESCRIPTOR *d) {
  d->Width = a->width; d->Height = a->height; d->Depth = a->depth;
  d->Format = a->format; d->NumChannels = a->channels; d->Flags = a->flags;
}

static CUresult cuArray3DGetDescriptor_v2(CUDA_ARRAY3D_DESCRIPTOR *d, CUarray h) {
  ENTER("cuArray3DGetDescriptor");
  NEED(d);
  CUresult rc;
  struct adata *a = aside_of((handle_t)h, K_ARRAY, TAG_ARRAY, &rc);
  if (!a) return rc;
  get_desc3(a, d);
  return OK;
}

static CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR *d, CUarray h) {
  ENTER("cuArrayGetDescriptor");
  NEED(d);
  CUresult rc;
  struct adata *a = aside_of((handle_t)h, K_ARRAY, TAG_ARRAY, &rc);
  if (!a) return rc;
  if (a->depth) return E_INVALID_VALUE;    /* the documentation: a 3-D array needs cuArray3DGetDescriptor */
  d->Width = a->width; d->Height = a->height; d->Format = a->format; d->NumChannels = a->channels;
  return OK;
}

static CUresult cuMipmappedArrayCreate(CUmipmappedArray *ph, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
  ENTER("cuMipmappedArrayCreate");
  NEED(ph);
  TRY(check_desc3(d));
  size_t largest = d->Width > d->Height ? d->Width : d->Height;
  if (!(d->Flags & (A3_LAYERED | A3_CUBEMAP)) && d->Depth > largest) largest = d->Depth;
  unsigned most = 0;
  while (largest) { most++; largest >>= 1; }
  NEED(levels >= 1 && levels <= most && levels <= MAX_LEVELS);
  struct obj *c;
  TRY(cur_ctx(&c));
  struct adata *m = calloc(1, sizeof *m);
  if (!m) return E_OUT_OF_MEMORY;
  m->tag = TAG_MIPMAP;
  m->width = d->Width; m->height = d->Height; m->depth = d->Depth;
  m->format = d->Format; m->channels = d->NumChannels; m->flags = d->Flags;
  m->elem = format_size(d->Format) * d->NumChannels;
  struct obj *o = new_obj(K_MIPMAP, c->h, c->dev);
  if (!o) { free(m); return E_OUT_OF_MEMORY; }
  if (!set_aside(o, m)) { free(m); kill_obj(o); return E_OUT_OF_MEMORY; }
  int keep = (d->Flags & (A3_LAYERED | A3_CUBEMAP)) != 0;
  for (unsigned l = 0; l < levels; l++) {
    CUDA_ARRAY3D_DESCRIPTOR ld = *d;
    ld.Width = d->Width >> l ? d->Width >> l : 1;
    if (d->Height) ld.Height = d->Height >> l ? d->Height >> l : 1;
    if (d->Depth && !keep) ld.Depth = d->Depth >> l ? d->Depth >> l : 1;
    CUresult rc;
    if (!new_array(&ld, c, o->h, &m->level[l], &rc)) return rc;   /* (the levels made so far go with it) */
    m->levels++;
  }
  *ph = (CUmipmappedArray)o->h;
  return OK;
}

static CUresult cuMipmappedArrayGetLevel(CUarray *ph, CUmipmappedArray h, unsigned level) {
  ENTER("cuMipmappedArrayGetLevel");
  NEED(ph);
  CUresult rc;
  struct adata *m = aside_of((handle_t)h, K_MIPMAP, TAG_MIPMAP, &rc);
  if (!m) return rc;
  NEED(level < (unsigned)m->levels);
  *ph = (CUarray)m->level[level];
  return OK;
}

static CUresult cuMipmappedArrayDestroy(CUmipmappedArray h) {
  ENTER("cuMipmappedArrayDestroy");
  CUresult rc;
  struct adata *m = aside_of((handle_t)h, K_MIPMAP, TAG_MIPMAP, &rc);
  if (!m) return rc;
  struct obj *o = obj_at((handle_t)h);
  TRY(need_current(o));
  int dangling = referenced((handle_t)h, 0, 0);
  for (int l = 0; l < m->levels; l++) {
    struct obj *lo = obj_at(m->level[l]);
    if (!lo || !lo->alive || lo->kind != K_ARRAY || lo->parent != (handle_t)h) continue;
    dangling |= referenced(m->level[l], 0, 0);
    drop_aside(m->level[l]);
    kill_obj(lo);
  }
  if (dangling) array_dangling++;
  drop_aside((handle_t)h);
  kill_obj(o);
  return OK;
}

/* ================================================================== copies with an array side */
/* One side of a 3-D copy: its start and row pitch and slice height, the array or allocation it is in. */
struct xside { char *p; size_t pitch, height; struct alloc *a; struct obj *arr; };

static CUresult array_side(CUarray h, size_t x, size_t y, size_t z, size_t w, size_t rows, size_t depth,
                           struct xside *out) {
  CUresult rc;
  struct adata *a = aside_of((handle_t)h, K_ARRAY, TAG_ARRAY, &rc);
  if (!a) return rc;
  size_t row = a->width * a->elem, ah = a->height ? a->height : 1, ad = a->depth ? a->depth : 1;
  NEED(x % a->elem == 0 && w % a->elem == 0);
  NEED(x <= row && w <= row - x && y <= ah && rows <= ah - y && z <= ad && depth <= ad - z);
  out->p = a->store + (z * ah + y) * row + x;
  out->pitch = row;
  out->height = ah;
  out->arr = obj_at((handle_t)h);
  out->a = NULL;
  return OK;
}

static CUresult linear_side(int type, const void *host, CUdeviceptr dev, size_t x, size_t y, size_t z, size_t pitch,
                            size_t height, size_t w, size_t rows, size_t depth, struct xside *out) {
  size_t p = pitch ? pitch : w, hh = height ? height : rows;
  NEED(p >= w && hh >= rows);
  size_t off = (z * hh + y) * p + x, ext = ((depth - 1) * hh + (rows - 1)) * p + w;
  out->pitch = p;
  out->height = hh;
  out->arr = NULL;
  return copy_side(type, host, dev, off, ext, &out->a, &out->p);
}

static CUresult array_copy(const CUDA_MEMCPY3D *c, const struct queue *q) {
  size_t w = c->WidthInBytes, h = c->Height, depth = c->Depth;
  NEED(w && h && depth);   /* (the driver: a zero extent copies nothing; cuproc never asks for one) */
  struct xside s, d;
  if (c->srcMemoryType == MT_ARRAY)
    TRY(array_side(c->srcArray, c->srcXInBytes, c->srcY, c->srcZ, w, h, depth, &s));
  else
    TRY(linear_side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcXInBytes, c->srcY, c->srcZ, c->srcPitch,
                    c->srcHeight, w, h, depth, &s));
  if (c->dstMemoryType == MT_ARRAY)
    TRY(array_side(c->dstArray, c->dstXInBytes, c->dstY, c->dstZ, w, h, depth, &d));
  else
    TRY(linear_side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstXInBytes, c->dstY, c->dstZ, c->dstPitch,
                    c->dstHeight, w, h, depth, &d));
  /* bound: the array's context, or a linear side's; run in the current one (misrouted when it is none of them) */
  struct obj *cur;
  TRY(cur_ctx(&cur));
  int need = 0, here = 0;
  const struct xside *sides[2] = {&s, &d};
  for (int i = 0; i < 2; i++) {
    handle_t owner = sides[i]->arr ? sides[i]->arr->ctx : sides[i]->a && sides[i]->a->bound ? sides[i]->a->ctx : 0;
    if (owner) { need = 1; here |= owner == cur->h; }
  }
  if (need && !here && !(q && q->named)) misrouted();
  queued(q, s.a, d.a, !on_device(s.a) || !on_device(d.a) || s.arr || d.arr);
  for (size_t z = 0; z < depth; z++)
    for (size_t y = 0; y < h; y++)
      memmove(d.p + (z * d.height + y) * d.pitch, s.p + (z * s.height + y) * s.pitch, w);
  return OK;
}

static void widen(const CUDA_MEMCPY2D *c, CUDA_MEMCPY3D *t) {
  memset(t, 0, sizeof *t);
  t->srcXInBytes = c->srcXInBytes; t->srcY = c->srcY; t->srcMemoryType = c->srcMemoryType;
  t->srcHost = c->srcHost; t->srcDevice = c->srcDevice; t->srcArray = c->srcArray; t->srcPitch = c->srcPitch;
  t->dstXInBytes = c->dstXInBytes; t->dstY = c->dstY; t->dstMemoryType = c->dstMemoryType;
  t->dstHost = c->dstHost; t->dstDevice = c->dstDevice; t->dstArray = c->dstArray; t->dstPitch = c->dstPitch;
  t->WidthInBytes = c->WidthInBytes; t->Height = c->Height; t->Depth = 1;
}

static int has_array(int src, int dst) { return src == MT_ARRAY || dst == MT_ARRAY; }

static CUresult array_copy_sync(const char *name, const CUDA_MEMCPY3D *c) {
  ENTER(name);
  return array_copy(c, NULL);
}

static CUresult array_copy_async(const char *name, const CUDA_MEMCPY3D *c, CUstream stream) {
  ENTER(name);
  struct queue q;
  TRY(use_queue(stream, &q, NULL));
  return array_copy(c, &q);
}

/* The previous entry points (graphs' capture wrappers where there are some), then this file's in front. */
static CUresult (*const linear_memcpy2d)(const CUDA_MEMCPY2D *) = cuMemcpy2D_v2;
static CUresult (*const linear_memcpy3d)(const CUDA_MEMCPY3D *) = cuMemcpy3D_v2;
static CUresult (*const linear_memcpy2d_async)(const CUDA_MEMCPY2D *, CUstream) = cuMemcpy2DAsync_v2;
static CUresult (*const linear_memcpy3d_async)(const CUDA_MEMCPY3D *, CUstream) = cuMemcpy3DAsync_v2;
static CUresult (*const plain_device_attribute)(int *, int, CUdevice) = cuDeviceGetAttribute;

static CUresult arrays_cuMemcpy2D_v2(const CUDA_MEMCPY2D *c) {
  if (!c || !has_array(c->srcMemoryType, c->dstMemoryType)) return linear_memcpy2d(c);
  CUDA_MEMCPY3D t;
  widen(c, &t);
  return array_copy_sync("cuMemcpy2D", &t);
}

static CUresult arrays_cuMemcpy3D_v2(const CUDA_MEMCPY3D *c) {
  if (!c || !has_array(c->srcMemoryType, c->dstMemoryType)) return linear_memcpy3d(c);
  return array_copy_sync("cuMemcpy3D", c);
}

static CUresult arrays_cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *c, CUstream stream) {
  if (!c || !has_array(c->srcMemoryType, c->dstMemoryType)) return linear_memcpy2d_async(c, stream);
  CUDA_MEMCPY3D t;
  widen(c, &t);
  REFUSED_IN_CAPTURE("cuMemcpy2DAsync", stream, array_copy_async("cuMemcpy2DAsync", &t, stream));
}

static CUresult arrays_cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *c, CUstream stream) {
  if (!c || !has_array(c->srcMemoryType, c->dstMemoryType)) return linear_memcpy3d_async(c, stream);
  REFUSED_IN_CAPTURE("cuMemcpy3DAsync", stream, array_copy_async("cuMemcpy3DAsync", c, stream));
}

/* The texture attributes fakedriver.c does not answer (H100/H200 values). */
static CUresult arrays_cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
  CUresult rc = plain_device_attribute(pi, attrib, dev);
  if (rc == OK && attrib == 51) *pi = TEX_PITCH_ALIGNMENT;       /* TEXTURE_PITCH_ALIGNMENT */
  if (rc == OK && attrib == 69) *pi = 1 << 28;                   /* MAXIMUM_TEXTURE1D_LINEAR_WIDTH */
  return rc;
}

/* ================================================================== texture and surface objects */
static CUresult check_resource(const CUDA_RESOURCE_DESC *r, struct tdata *t, int surface) {
  NEED(r);
  NEED(r->flags == 0);
  CUresult rc;
  t->resType = r->resType;
  switch (r->resType) {
  case RES_ARRAY: {
    struct adata *a = aside_of((handle_t)r->res.array.hArray, K_ARRAY, TAG_ARRAY, &rc);
    if (!a) return rc;
    if (surface) NEED(a->flags & A3_SURFACE_LDST);
    t->res = (handle_t)r->res.array.hArray;
    return OK;
  }
  case RES_MIPMAP: {
    NEED(!surface);
    if (!aside_of((handle_t)r->res.mipmap.hMipmappedArray, K_MIPMAP, TAG_MIPMAP, &rc)) return rc;
    t->res = (handle_t)r->res.mipmap.hMipmappedArray;
    return OK;
  }
  case RES_LINEAR: {
    NEED(!surface);
    unsigned fs = format_size(r->res.linear.format), ch = r->res.linear.numChannels;
    NEED(fs && (ch == 1 || ch == 2 || ch == 4));
    NEED(r->res.linear.devPtr % TEX_ALIGNMENT == 0 && r->res.linear.sizeInBytes > 0);
    NEED(r->res.linear.sizeInBytes % (fs * ch) == 0);
    struct alloc *a;
    char *p;
    TRY(dev_range(r->res.linear.devPtr, r->res.linear.sizeInBytes, &a, &p));
    t->ptr = r->res.linear.devPtr;
    t->bytes = r->res.linear.sizeInBytes;
    return OK;
  }
  case RES_PITCH2D: {
    NEED(!surface);
    unsigned fs = format_size(r->res.pitch2D.format), ch = r->res.pitch2D.numChannels;
    size_t w = r->res.pitch2D.width, h = r->res.pitch2D.height, pitch = r->res.pitch2D.pitchInBytes;
    NEED(fs && (ch == 1 || ch == 2 || ch == 4) && w && h);
    NEED(r->res.pitch2D.devPtr % TEX_ALIGNMENT == 0 && pitch % TEX_PITCH_ALIGNMENT == 0 && pitch >= w * fs * ch);
    struct alloc *a;
    char *p;
    TRY(dev_range(r->res.pitch2D.devPtr, (h - 1) * pitch + w * fs * ch, &a, &p));
    t->ptr = r->res.pitch2D.devPtr;
    t->bytes = (h - 1) * pitch + w * fs * ch;
    return OK;
  }
  default:
    return E_INVALID_VALUE;
  }
}

static int resource_format(const struct tdata *t) {
  if (t->resType == RES_LINEAR) return t->rdesc.res.linear.format;
  if (t->resType == RES_PITCH2D) return t->rdesc.res.pitch2D.format;
  size_t n = (t->res - HANDLE_BASE) / 16;
  return n < naside && aside[n] ? ((struct adata *)aside[n])->format : 0;
}

static CUresult new_tex_obj(int kind, struct tdata *t, unsigned long long *out) {
  struct obj *c;
  TRY(cur_ctx(&c));
  struct tdata *keep = malloc(sizeof *keep);
  if (!keep) return E_OUT_OF_MEMORY;
  *keep = *t;
  keep->tag = TAG_TEX;
  struct obj *o = new_obj(kind, c->h, c->dev);
  if (!o) { free(keep); return E_OUT_OF_MEMORY; }
  if (!set_aside(o, keep)) { free(keep); kill_obj(o); return E_OUT_OF_MEMORY; }
  if (keep->ptr) linear_textures = 1;
  *out = o->h;
  return OK;
}

static CUresult cuTexObjectCreate(unsigned long long *out, const CUDA_RESOURCE_DESC *r, const CUDA_TEXTURE_DESC *td,
                                  const void *view) {
  ENTER("cuTexObjectCreate");
  NEED(out && r && td);
  if (view) return E_NOT_SUPPORTED;
  struct tdata t;
  memset(&t, 0, sizeof t);
  TRY(check_resource(r, &t, 0));
  t.rdesc = *r;
  t.tdesc = *td;
  for (int i = 0; i < 3; i++) NEED(td->addressMode[i] >= 0 && td->addressMode[i] <= 3);
  NEED(td->filterMode == 0 || td->filterMode == 1);
  NEED(td->mipmapFilterMode == 0 || td->mipmapFilterMode == 1);
  NEED(!(td->flags & ~TRSF_KNOWN));
  /* linear filtering returns floating point: not for an integer format read as integers */
  if (td->filterMode == 1 && (td->flags & 1u) && integer_format(resource_format(&t))) return E_INVALID_VALUE;
  if (r->resType == RES_MIPMAP) NEED(td->minMipmapLevelClamp <= td->maxMipmapLevelClamp);
  return new_tex_obj(K_TEXOBJ, &t, out);
}

static CUresult cuSurfObjectCreate(unsigned long long *out, const CUDA_RESOURCE_DESC *r) {
  ENTER("cuSurfObjectCreate");
  NEED(out && r);
  NEED(r->resType == RES_ARRAY);
  struct tdata t;
  memset(&t, 0, sizeof t);
  TRY(check_resource(r, &t, 1));
  t.rdesc = *r;
  return new_tex_obj(K_SURFOBJ, &t, out);
}

static CUresult destroy_tex_obj(unsigned long long h, int kind) {
  CUresult rc;
  if (!aside_of((handle_t)h, kind, TAG_TEX, &rc)) return rc;
  struct obj *o = obj_at((handle_t)h);
  TRY(need_current(o));
  drop_aside((handle_t)h);
  kill_obj(o);
  return OK;
}

static CUresult cuTexObjectDestroy(unsigned long long h) {
  ENTER("cuTexObjectDestroy");
  return destroy_tex_obj(h, K_TEXOBJ);
}

static CUresult cuSurfObjectDestroy(unsigned long long h) {
  ENTER("cuSurfObjectDestroy");
  return destroy_tex_obj(h, K_SURFOBJ);
}

static CUresult cuTexObjectGetResourceDesc(CUDA_RESOURCE_DESC *r, unsigned long long h) {
  ENTER("cuTexObjectGetResourceDesc");
  NEED(r);
  CUresult rc;
  struct tdata *t = aside_of((handle_t)h, K_TEXOBJ, TAG_TEX, &rc);
  if (!t) return rc;
  *r = t->rdesc;
  return OK;
}

static CUresult cuTexObjectGetTextureDesc(CUDA_TEXTURE_DESC *td, unsigned long long h) {
  ENTER("cuTexObjectGetTextureDesc");
  NEED(td);
  CUresult rc;
  struct tdata *t = aside_of((handle_t)h, K_TEXOBJ, TAG_TEX, &rc);
  if (!t) return rc;
  *td = t->tdesc;
  return OK;
}

static CUresult cuSurfObjectGetResourceDesc(CUDA_RESOURCE_DESC *r, unsigned long long h) {
  ENTER("cuSurfObjectGetResourceDesc");
  NEED(r);
  CUresult rc;
  struct tdata *t = aside_of((handle_t)h, K_SURFOBJ, TAG_TEX, &rc);
  if (!t) return rc;
  *r = t->rdesc;
  return OK;
}

/* cuMemFree of memory a texture object reads: counted (the free goes on; graphs' capture wrapper first).
 * Every cuMemFree of the suite passes here, so the walk of the live objects is made only while texture objects
 * over linear memory were made and may live (linear_textures: made since the last walk found none). */
static CUresult (*const plain_mem_free)(CUdeviceptr) = cuMemFree_v2;
static CUresult arrays_cuMemFree_v2(CUdeviceptr p) {
  if (__atomic_load_n(&linear_textures, __ATOMIC_RELAXED) && initialized && getpid() == init_pid) {
    pthread_mutex_lock(&mu);
    struct alloc *a = find_alloc(p, 0);
    if (a && a->base == p && referenced(0, a->base, a->size)) array_dangling++;
    else if (!referenced(0, 0, (size_t)-1)) linear_textures = 0;   /* none over any memory is left */
    pthread_mutex_unlock(&mu);
  }
  return plain_mem_free(p);
}

/* ================================================================== tensor maps */
static unsigned tensor_type_size(int t) {
  static const unsigned sizes[] = {1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4};
  return t >= 0 && t < 13 ? sizes[t] : 0;
}

static int float_type(int t) { return t >= 6; }

/* What Tiled and Im2col share: the map's address, the type, rank, global address, dimensions, strides,
 * element strides, interleave, swizzle, L2 promotion and OOB fill. */
static CUresult tensor_common(const CUtensorMap *map, int type, cuuint32_t rank, void *address, const cuuint64_t *dims,
                              const cuuint64_t *strides, const cuuint32_t *estrides, int interleave, int swizzle,
                              int l2, int oob, unsigned *elem) {
  NEED(map && dims && estrides && address);
  NEED((uintptr_t)map % 64 == 0);
  *elem = tensor_type_size(type);
  NEED(*elem);
  NEED(interleave >= 0 && interleave <= 2 && swizzle >= 0 && swizzle <= 6);
  NEED(l2 >= 0 && l2 <= 3 && (oob == 0 || oob == 1));
  NEED(rank >= 1 && rank <= 5);
  if (interleave) NEED(rank >= 3);
  if (oob) NEED(float_type(type));
  unsigned align = interleave == 2 ? 32 : 16;
  NEED((uintptr_t)address % align == 0);
  for (cuuint32_t i = 0; i < rank; i++) NEED(dims[i] > 0 && dims[i] <= (1ULL << 32));
  if (rank > 1) NEED(strides);
  for (cuuint32_t i = 0; i + 1 < rank; i++) NEED(strides[i] % align == 0 && strides[i] < (1ULL << 40));
  for (cuuint32_t i = 0; i < rank; i++) NEED(estrides[i] >= 1 && estrides[i] <= 8);
  struct alloc *a;
  char *p;
  TRY(uni_range((CUdeviceptr)(uintptr_t)address, 1, &a, &p));
  if (!a) return stale(E_INVALID_VALUE);   /* not memory the driver knows */
  return OK;
}

static void tensor_write(CUtensorMap *map, int type, cuuint32_t rank, void *address, const cuuint64_t *dims,
                         const cuuint64_t *strides, const cuuint32_t *box, const cuuint32_t *estrides, int interleave,
                         int swizzle) {
  memset(map, 0, sizeof *map);
  map->opaque[0] = (cuuint64_t)(uintptr_t)address;
  map->opaque[1] = (cuuint64_t)type | (cuuint64_t)rank << 8 | (cuuint64_t)interleave << 16 | (cuuint64_t)swizzle << 24;
  for (cuuint32_t i = 0; i < rank; i++) {
    map->opaque[2 + i] = dims[i];
    if (i + 1 < rank) map->opaque[7 + i] = strides[i];
    map->opaque[11 + i] = (box ? box[i] : 0) | (cuuint64_t)estrides[i] << 32;
  }
}

static CUresult cuTensorMapEncodeTiled(CUtensorMap *map, int type, cuuint32_t rank, void *address,
                                       const cuuint64_t *dims, const cuuint64_t *strides, const cuuint32_t *box,
                                       const cuuint32_t *estrides, int interleave, int swizzle, int l2, int oob) {
  ENTER("cuTensorMapEncodeTiled");
  unsigned elem;
  TRY(tensor_common(map, type, rank, address, dims, strides, estrides, interleave, swizzle, l2, oob, &elem));
  NEED(box);
  for (cuuint32_t i = 0; i < rank; i++) NEED(box[i] >= 1 && box[i] <= 256);
  if (interleave == 0) {
    NEED((box[0] * elem) % 16 == 0);
    static const unsigned span[] = {0, 32, 64, 128, 128, 128, 128};
    if (swizzle) NEED(box[0] * elem <= span[swizzle]);
  }
  tensor_write(map, type, rank, address, dims, strides, box, estrides, interleave, swizzle);
  return OK;
}

static CUresult cuTensorMapEncodeIm2col(CUtensorMap *map, int type, cuuint32_t rank, void *address,
                                        const cuuint64_t *dims, const cuuint64_t *strides, const int *lower,
                                        const int *upper, cuuint32_t channels, cuuint32_t pixels,
                                        const cuuint32_t *estrides, int interleave, int swizzle, int l2, int oob) {
  ENTER("cuTensorMapEncodeIm2col");
  unsigned elem;
  TRY(tensor_common(map, type, rank, address, dims, strides, estrides, interleave, swizzle, l2, oob, &elem));
  NEED(rank >= 3 && lower && upper);
  int limit = rank == 3 ? 1 << 15 : rank == 4 ? 1 << 7 : 1 << 4;
  for (cuuint32_t i = 0; i + 2 < rank; i++)
    NEED(lower[i] >= -limit && lower[i] < limit && upper[i] >= -limit && upper[i] < limit);
  NEED(channels >= 1 && channels <= 256 && pixels >= 1 && pixels <= 1024);
  if (interleave == 0) NEED((channels * elem) % 16 == 0);
  tensor_write(map, type, rank, address, dims, strides, NULL, estrides, interleave, swizzle);
  map->opaque[15] = (cuuint64_t)channels | (cuuint64_t)pixels << 32;
  return OK;
}

#undef cuMemcpy2D_v2
#undef cuMemcpy3D_v2
#undef cuMemcpy2DAsync_v2
#undef cuMemcpy3DAsync_v2
#undef cuMemFree_v2
#define cuMemcpy2D_v2 arrays_cuMemcpy2D_v2
#define cuMemcpy3D_v2 arrays_cuMemcpy3D_v2
#define cuMemcpy2DAsync_v2 arrays_cuMemcpy2DAsync_v2
#define cuMemcpy3DAsync_v2 arrays_cuMemcpy3DAsync_v2
#define cuMemFree_v2 arrays_cuMemFree_v2
#define cuDeviceGetAttribute arrays_cuDeviceGetAttribute

/* ------------------------------------------------------------------ control API (tests) */
/* Live objects of one of the kinds here: "array" (mipmap levels included), "mipmapped_array",
 * "texture", "surface"; -1 for another name. */
EXPORT long fake_array_live(const char *kind) {
  if (!kind) return -1;
  int k = strcmp(kind, "array") == 0 ? K_ARRAY : strcmp(kind, "mipmapped_array") == 0 ? K_MIPMAP
        : strcmp(kind, "texture") == 0 ? K_TEXOBJ : strcmp(kind, "surface") == 0 ? K_SURFOBJ : -1;
  if (k < 0) return -1;
  long n = 0;
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < nlive; i++) n += live_obj(i)->kind == k;
  pthread_mutex_unlock(&mu);
  return n;
}

/* Arrays, mipmapped arrays and allocations destroyed while a texture or surface object over them lived. */
EXPORT long fake_array_dangling(void) {
  pthread_mutex_lock(&mu);
  long n = array_dangling;
  pthread_mutex_unlock(&mu);
  return n;
}

EXPORT void fake_array_reset(void) {
  pthread_mutex_lock(&mu);
  array_dangling = 0;
  pthread_mutex_unlock(&mu);
}
