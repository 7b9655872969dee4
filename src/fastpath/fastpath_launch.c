/* The prepared launch in C: cuproc._fastpath_c.make_launcher(...) returns a callable that stores
 * the argument values into the launch's packed block at offsets computed once in Python
 * (cuproc.launch.layout) and calls cuLaunchKernel / cuLaunchKernelEx through the pointer the
 * driver resolved.  Compiled into the cffi API-mode module by tools/build_fastpath.py, after
 * the declarations of headers/ (CUresult, CUlaunchConfig, the PFN typedefs).
 *
 * It takes only the common case and hands everything else, unchanged, to the pure-Python
 * launcher it was given (``slow``): another thread than the block's owner, a moved EPOCH
 * (a resource ended, or a forked child), a value it does not convert exactly as cffi would,
 * a wrong argument count.  The pure launcher then checks, packs and raises as it always does.
 * A failed launch goes to ``on_error(rc)`` (rebind on a context error, else raise).
 *
 * A launcher made without dimensions (a one-shot entry, cuproc.launch.launch) takes them with each
 * call, in front of the kernel's arguments: launcher(grid, block, shared_mem, *values).  It takes
 * exact ints (grid and block also as tuples of 1-3 exact ints) in an unsigned int's range, writes
 * them into the config (cuLaunchKernelEx) or passes them (cuLaunchKernel); anything else goes to the
 * pure launcher, which checks and refuses.  Its failed launches go to on_error(rc, grid, block,
 * shared_mem).
 */

#include "structmember.h"

/* The argument kinds.  tools/build_fastpath.py cdefs this enum, so Python reads the values from
 * the module (cuproc.fastpath.launcher_kinds) instead of repeating them. */
enum cuproc_kind {
    CUPROC_K_PTR, CUPROC_K_I8, CUPROC_K_I16, CUPROC_K_I32, CUPROC_K_I64, CUPROC_K_U8, CUPROC_K_U16,
    CUPROC_K_U32, CUPROC_K_U64, CUPROC_K_F32, CUPROC_K_F64, CUPROC_K_COUNT
};
#define K_PTR CUPROC_K_PTR
#define K_I8 CUPROC_K_I8
#define K_I16 CUPROC_K_I16
#define K_I32 CUPROC_K_I32
#define K_I64 CUPROC_K_I64
#define K_U8 CUPROC_K_U8
#define K_U16 CUPROC_K_U16
#define K_U32 CUPROC_K_U32
#define K_U64 CUPROC_K_U64
#define K_F32 CUPROC_K_F32
#define K_F64 CUPROC_K_F64
#define K_COUNT CUPROC_K_COUNT

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *weaklist;   /* its ``prepared`` (cuproc.launch) reaches it weakly, as a Python launcher's does */
    PyObject *slow, *on_error, *recheck, *epoch, *seen, *owner, *buffer_type, *context_type, *keep;
    Py_ssize_t off_ended, off_context, off_address;   /* a DeviceBuffer's slots (ended: every Resource's) */
    int ex, owned, per_call;   /* per_call: the dimensions come with each call (grid, blk, shmem unused) */
    unsigned long owner_ident;
    void *fn, *config, *handle, *stream;
    void **params, **extra;
    unsigned int grid[3], blk[3], shmem;
    char *block;
    Py_ssize_t nargs, fallbacks, block_size;
    unsigned char *kinds;
    Py_ssize_t *offsets;
} cuproc_launcher;

/* An object slot of ``obj`` at ``off`` (a borrowed reference; NULL while unset). */
#define CUPROC_SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* tp_dealloc of the fronts' heap types (collected objects that own no C memory): untrack, the type's own
 * tp_clear, free, and the reference a heap type's instance holds on its type. */
static void cuproc_front_dealloc(PyObject *obj)
{
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    tp->tp_clear(obj);
    tp->tp_free(obj);
    Py_DECREF(tp);
}

/* What a front answers when called after the garbage collector cleared it (tp_clear: a reference cycle through
 * it being collected, or interpreter shutdown, while something still reaches it): a RuntimeError, never a
 * call through the NULL it left.  Every front's entry tests the one member its tp_clear empties first. */
static PyObject *cuproc_front_cleared(PyObject *obj)
{
    PyErr_Format(PyExc_RuntimeError, "%s: this compiled front was cleared by the garbage collector (a reference "
                 "cycle through it is being collected, or the interpreter is shutting down) and cannot be called",
                 Py_TYPE(obj)->tp_name);
    return NULL;
}

/* The offset of an object slot from its member descriptor (e.g. DeviceBuffer.__dict__["stream"]), which
 * must be a writable object slot of ``owner`` or of one of its bases, lying inside an ``owner``.  The
 * fronts read (and fastpath_memory.c stores) such slots directly instead of through getattr. */
static int cuproc_slot_offset(PyObject *descr, PyObject *owner, Py_ssize_t *out, const char *who)
{
    PyMemberDef *member;
    if (Py_TYPE(descr) != &PyMemberDescr_Type || !PyType_Check(owner)
        || !PyType_IsSubtype((PyTypeObject *)owner, ((PyDescrObject *)descr)->d_type)) goto bad;
    member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY) || member->offset <= 0
        || member->offset + (Py_ssize_t)sizeof(PyObject *) > ((PyTypeObject *)owner)->tp_basicsize) goto bad;
    *out = member->offset;
    return 0;
bad:
    PyErr_Format(PyExc_ValueError, "%s: a slot is not a writable object slot of its class (a cuproc bug)", who);
    return -1;
}

/* An int's value as PyLong_AsUnsignedLongLong gives it (an OverflowError for a negative or too large
 * one), through PyLong_AsLongLongAndOverflow first: CPython 3.12 converts an int of more than one
 * 30-bit digit -- every device address -- with a generic byte-array routine in
 * PyLong_AsUnsignedLongLong, several times the cost of the other's digit loop.  ``v``: an int. */
static unsigned long long cuproc_u64(PyObject *v)
{
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow == 0 && x >= 0)
        return (unsigned long long)x;
    if (x == -1 && PyErr_Occurred())
        return (unsigned long long)-1;
    return PyLong_AsUnsignedLongLong(v);   /* 2**63 and above, or negative (it raises) */
}

/* The conversion helpers return 0: converted; 1: not taken here, the pure launcher decides; -1: a
 * Python error to raise.  Only the errors a refused value raises (TypeError, OverflowError,
 * ValueError) mean "not taken": anything else -- KeyboardInterrupt, MemoryError, from user
 * conversion code -- is raised as is, never swallowed and never provoked a second time. */
static int cuproc_declined(void)
{
    if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_OverflowError)
        || PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        return 1;
    }
    return -1;
}

static int cuproc_live_address(cuproc_launcher *self, PyObject *a, unsigned long long *out)
{
    PyObject *ctx, *addr;
    if (PyLong_Check(a)) {
        *out = cuproc_u64(a);
        return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? cuproc_declined() : 0;
    }
    if ((PyObject *)Py_TYPE(a) != self->buffer_type)
        return 1;
    /* DeviceBuffer: usable while neither it nor its context has ended (the pure launcher's test), read
     * from the slots that ``a.ended``, ``a.context``, ``a.context.ended`` and ``a.address`` read; an unset
     * slot or anything unexpected goes to the pure launcher, which raises as it always does */
    if (CUPROC_SLOT(a, self->off_ended) != Py_None)
        return 1;
    ctx = CUPROC_SLOT(a, self->off_context);
    if (ctx == NULL || !PyObject_TypeCheck(ctx, (PyTypeObject *)self->context_type)
        || CUPROC_SLOT(ctx, self->off_ended) != Py_None)
        return 1;
    addr = CUPROC_SLOT(a, self->off_address);
    if (addr == NULL || !PyLong_CheckExact(addr))
        return 1;
    *out = cuproc_u64(addr);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? cuproc_declined() : 0;
}

/* Whether ``a``'s class has a length: an array or a tensor (NumPy's and torch's have one, their scalars none).
 * Such a value is the pure launcher's, whose writer refuses a host array, even one of one element that its own
 * __int__ or __float__ would convert. */
static int cuproc_sized(PyObject *a)
{
    PySequenceMethods *sq = Py_TYPE(a)->tp_as_sequence;
    PyMappingMethods *mp = Py_TYPE(a)->tp_as_mapping;
    return (sq != NULL && sq->sq_length != NULL) || (mp != NULL && mp->mp_length != NULL);
}

/* An integer value for an integer parameter, exactly when cffi would store it unchanged.  cffi
 * takes an int (bool included) as is and any other non-float object through its nb_int slot
 * (__int__), never through __index__ alone.  Here: an int, or an object with both slots that is no
 * float and has no length (NumPy's integer scalars), converted through nb_int as cffi does; anything else, e.g. an
 * object with only __index__ or only __int__, goes to the pure launcher. */
static int cuproc_integer(PyObject *a, int kind, char *dst)
{
    long long v;
    unsigned long long u;
    PyObject *number;
    PyNumberMethods *nb = Py_TYPE(a)->tp_as_number;
    if (PyLong_Check(a)) {
        Py_INCREF(a);
        number = a;
    } else {
        if (PyFloat_Check(a) || nb == NULL || nb->nb_int == NULL || nb->nb_index == NULL || cuproc_sized(a))
            return 1;
        number = nb->nb_int(a);
        if (number == NULL) return cuproc_declined();
        if (!PyLong_Check(number)) { Py_DECREF(number); return 1; }
    }
    if (kind == K_U64) {
        u = cuproc_u64(number);
        Py_DECREF(number);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) return cuproc_declined();
        memcpy(dst, &u, 8);
        return 0;
    }
    v = PyLong_AsLongLong(number);
    Py_DECREF(number);
    if (v == -1 && PyErr_Occurred()) return cuproc_declined();
    switch (kind) {
    case K_I8:  if (v < INT8_MIN || v > INT8_MAX) return 1; { int8_t x = (int8_t)v; memcpy(dst, &x, 1); } break;
    case K_I16: if (v < INT16_MIN || v > INT16_MAX) return 1; { int16_t x = (int16_t)v; memcpy(dst, &x, 2); } break;
    case K_I32: if (v < INT32_MIN || v > INT32_MAX) return 1; { int32_t x = (int32_t)v; memcpy(dst, &x, 4); } break;
    case K_I64: memcpy(dst, &v, 8); break;
    case K_U8:  if (v < 0 || v > UINT8_MAX) return 1; { uint8_t x = (uint8_t)v; memcpy(dst, &x, 1); } break;
    case K_U16: if (v < 0 || v > UINT16_MAX) return 1; { uint16_t x = (uint16_t)v; memcpy(dst, &x, 2); } break;
    case K_U32: if (v < 0 || v > (long long)UINT32_MAX) return 1; { uint32_t x = (uint32_t)v; memcpy(dst, &x, 4); } break;
    default: return 1;
    }
    return 0;
}

/* One launch dimension or the shared memory size given with a call: an exact int in [low, UINT32_MAX].
 * 0: stored in *out; 1: not taken here (the pure launcher checks it, and refuses or converts it). */
static int cuproc_call_dimension(PyObject *value, unsigned long low, unsigned int *out)
{
    int overflow;
    long long v;
    if (!PyLong_CheckExact(value))
        return 1;
    v = PyLong_AsLongLongAndOverflow(value, &overflow);   /* an exact int: no error besides overflow */
    if (overflow || v < (long long)low || v > (long long)UINT32_MAX)
        return 1;
    *out = (unsigned int)v;
    return 0;
}

/* Grid or block dimensions given with a call: an exact int, or a tuple of 1-3 of them (the rest 1), as
 * cuproc.launch._dims reads them; 0 or 1 as cuproc_call_dimension. */
static int cuproc_call_dims(PyObject *value, unsigned int out[3])
{
    Py_ssize_t i, n;
    out[1] = out[2] = 1;
    if (!PyTuple_CheckExact(value))
        return cuproc_call_dimension(value, 1, &out[0]);
    n = PyTuple_GET_SIZE(value);
    if (n < 1 || n > 3)
        return 1;
    for (i = 0; i < n; i++)
        if (cuproc_call_dimension(PyTuple_GET_ITEM(value, i), 1, &out[i])) return 1;
    return 0;
}

/* owner[1] = flag (Py_True or Py_False): whether the owner's launch is converting its values now. */
static void cuproc_launcher_busy(cuproc_launcher *self, PyObject *flag)
{
    PyObject *old = PyList_GET_ITEM(self->owner, 1);
    PyList_SET_ITEM(self->owner, 1, Py_NewRef(flag));
    Py_DECREF(old);   /* a bool: freeing nothing, running no code */
}

/* Whether something changed under a launch whose conversions ran Python: the epoch moved, or a buffer argument
 * is no longer live (the addresses of those that are live are stored again). */
static int cuproc_launcher_changed(cuproc_launcher *self, PyObject *const *values)
{
    Py_ssize_t i;
    if (PyList_GET_ITEM(self->epoch, 0) != PyList_GET_ITEM(self->seen, 0))
        return 1;
    for (i = 0; i < self->nargs; i++) {
        unsigned long long p = 0;
        if (self->kinds[i] != K_PTR)
            continue;
        if (cuproc_live_address(self, values[i], &p) != 0) {
            PyErr_Clear();
            return 1;
        }
        memcpy(self->block + self->offsets[i], &p, 8);
    }
    return 0;
}

/* After a conversion that ran Python: 0 when nothing changed (cuproc_launcher_changed); else the pure launcher's
 * recheck(values) runs -- 1 with its error set when it raised, or, once it passed, whether something is still
 * changed (its own Python may have ended something: 1, no error). */
static int cuproc_launcher_recheck(cuproc_launcher *self, PyObject *const *values)
{
    Py_ssize_t i;
    PyObject *tuple, *result;
    if (!cuproc_launcher_changed(self, values))
        return 0;
    tuple = PyTuple_New(self->nargs);
    if (tuple == NULL) return 1;
    for (i = 0; i < self->nargs; i++)
        PyTuple_SET_ITEM(tuple, i, Py_NewRef(values[i]));
    result = PyObject_CallOneArg(self->recheck, tuple);
    Py_DECREF(tuple);
    if (result == NULL) return 1;
    Py_DECREF(result);
    return cuproc_launcher_changed(self, values);
}

static PyObject *cuproc_launcher_call(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_launcher *self = (cuproc_launcher *)obj;
    Py_ssize_t i, nargs = PyVectorcall_NARGS(nargsf);
    CUresult rc;
    PyObject *code, *result;
    PyObject *const *values = args;   /* the kernel's arguments: after the dimensions where they come per call */
    unsigned int grid[3], blk[3], shmem;
    int converted = 0;   /* a value's conversion may have run Python (its __int__, __float__) */
    if (self->slow == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    if (kwnames != NULL || nargs != self->nargs + (self->per_call ? 3 : 0))
        goto slow;
    if (self->per_call) {
        if (cuproc_call_dims(args[0], grid) || cuproc_call_dims(args[1], blk)
            || cuproc_call_dimension(args[2], 0, &shmem))
            goto slow;
        values = args + 3;
    } else {
        memcpy(grid, self->grid, sizeof grid);
        memcpy(blk, self->blk, sizeof blk);
        shmem = self->shmem;
    }
    if (PyList_GET_ITEM(self->epoch, 0) != PyList_GET_ITEM(self->seen, 0))
        goto slow;   /* something ended, or this is a forked child: the pure launcher verifies */
    if (!self->owned) {   /* the first thread to launch owns the block (set once, by the pure launcher) */
        PyObject *owner = PyList_GET_ITEM(self->owner, 0);
        if (!PyLong_CheckExact(owner))
            goto slow;
        self->owner_ident = PyLong_AsUnsignedLong(owner);
        if (self->owner_ident == (unsigned long)-1 && PyErr_Occurred()) { PyErr_Clear(); goto slow; }
        self->owned = 1;
    }
    if (PyThread_get_thread_ident() != self->owner_ident)
        goto slow;
    /* owner[1]: this thread's launch is converting its values (a value's __int__ launched this kernel again):
     * the pure launcher gives this nested one a private block, so the outer one's block and config stay its own */
    if (PyList_GET_ITEM(self->owner, 1) != Py_False)
        goto slow;
    cuproc_launcher_busy(self, Py_True);
    for (i = 0; i < self->nargs; i++) {
        PyObject *a = values[i];
        char *dst = self->block + self->offsets[i];
        int kind = self->kinds[i], taken = 0;
        if (kind == K_PTR) {
            unsigned long long p = 0;
            taken = cuproc_live_address(self, a, &p);
            if (taken == 0) memcpy(dst, &p, 8);
        } else if (kind == K_F32 || kind == K_F64) {
            /* an exact int: PyFloat_AsDouble's own result (int.__float__ is PyLong_AsDouble) without its float object */
            if (!PyFloat_CheckExact(a) && !PyLong_CheckExact(a) && cuproc_sized(a)) {
                taken = 1;   /* an array or a tensor: the pure launcher's, whose writer refuses it */
            } else {
                double d = PyFloat_CheckExact(a) ? PyFloat_AS_DOUBLE(a)
                           : PyLong_CheckExact(a) ? PyLong_AsDouble(a) : (converted = 1, PyFloat_AsDouble(a));
                if (d == -1.0 && PyErr_Occurred()) taken = cuproc_declined();
                else if (kind == K_F32) { float f = (float)d; memcpy(dst, &f, 4); }
                else memcpy(dst, &d, 8);
            }
        } else {
            converted |= !PyLong_Check(a);   /* (an int, subclasses too, converts without Python) */
            taken = cuproc_integer(a, kind, dst);
        }
        if (taken != 0) {
            cuproc_launcher_busy(self, Py_False);
            if (taken < 0) return NULL;     /* raised by the value's own conversion code */
            goto slow;
        }
    }
    /* A conversion that ran Python may have ended what this launch holds (a module unloaded: the epoch moved)
     * or freed a buffer read before it (a leaf: its slots are read again).  Then the pure launcher's recheck
     * runs, still as the block's owner (a launch it makes gets a block of its own): it raises naming the
     * launch, or finds that what ended is not this launch's and notes the epoch; the values stand, each
     * converted once, as the pure launcher converts them. */
    if (converted && cuproc_launcher_recheck(self, values)) {
        cuproc_launcher_busy(self, Py_False);
        if (PyErr_Occurred()) return NULL;
        goto slow;   /* still changed after the recheck (its own Python ended something): made again */
    }
    cuproc_launcher_busy(self, Py_False);   /* no Python code runs from here to the driver call */
    if (self->per_call && self->ex) {   /* the owner's config: only this thread writes it (others: private) */
        CUlaunchConfig *config = (CUlaunchConfig *)self->config;
        config->gridDimX = grid[0]; config->gridDimY = grid[1]; config->gridDimZ = grid[2];
        config->blockDimX = blk[0]; config->blockDimY = blk[1]; config->blockDimZ = blk[2];
        config->sharedMemBytes = shmem;
    }
    Py_BEGIN_ALLOW_THREADS
    if (self->ex)
        rc = ((PFN_cuLaunchKernelEx_v11060)self->fn)((const CUlaunchConfig *)self->config,
                                                      (CUfunction)self->handle, self->params, self->extra);
    else
        rc = ((PFN_cuLaunchKernel_v4000)self->fn)((CUfunction)self->handle, grid[0], grid[1], grid[2], blk[0],
                                                   blk[1], blk[2], shmem, (CUstream)self->stream, self->params,
                                                   self->extra);
    Py_END_ALLOW_THREADS
    if (rc == 0)
        Py_RETURN_NONE;
    code = PyLong_FromLong((long)rc);
    if (code == NULL) return NULL;
    if (self->per_call)   /* rebind makes the launch again with this call's dimensions */
        result = PyObject_CallFunctionObjArgs(self->on_error, code, args[0], args[1], args[2], NULL);
    else
        result = PyObject_CallOneArg(self->on_error, code);
    Py_DECREF(code);
    return result;
slow:
    self->fallbacks++;
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static int cuproc_launcher_traverse(PyObject *obj, visitproc visit, void *arg)
{
    cuproc_launcher *self = (cuproc_launcher *)obj;
    Py_VISIT(self->dict); Py_VISIT(self->slow); Py_VISIT(self->on_error); Py_VISIT(self->recheck);
    Py_VISIT(self->epoch); Py_VISIT(self->seen); Py_VISIT(self->owner); Py_VISIT(self->buffer_type);
    Py_VISIT(self->context_type); Py_VISIT(self->keep);
    Py_VISIT(Py_TYPE(obj));
    return 0;
}

static int cuproc_launcher_clear(PyObject *obj)
{
    cuproc_launcher *self = (cuproc_launcher *)obj;
    Py_CLEAR(self->dict); Py_CLEAR(self->slow); Py_CLEAR(self->on_error); Py_CLEAR(self->recheck);
    Py_CLEAR(self->epoch); Py_CLEAR(self->seen); Py_CLEAR(self->owner); Py_CLEAR(self->buffer_type);
    Py_CLEAR(self->context_type); Py_CLEAR(self->keep);
    return 0;
}

static void cuproc_launcher_dealloc(PyObject *obj)
{
    cuproc_launcher *self = (cuproc_launcher *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    if (self->weaklist != NULL) PyObject_ClearWeakRefs(obj);
    cuproc_launcher_clear(obj);
    PyMem_Free(self->kinds);
    PyMem_Free(self->offsets);
    tp->tp_free(obj);
    Py_DECREF(tp);
}

static PyMemberDef cuproc_launcher_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(cuproc_launcher, dict), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(cuproc_launcher, weaklist), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(cuproc_launcher, vectorcall), READONLY, NULL},
    {"fallbacks", T_PYSSIZET, offsetof(cuproc_launcher, fallbacks), READONLY,
     "how many calls went to the pure launcher (the first one claims the block; the rest say why it is slow)"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot cuproc_launcher_slots[] = {
    {Py_tp_call, (void *)PyVectorcall_Call},
    {Py_tp_traverse, (void *)cuproc_launcher_traverse},
    {Py_tp_clear, (void *)cuproc_launcher_clear},
    {Py_tp_dealloc, (void *)cuproc_launcher_dealloc},
    {Py_tp_members, (void *)cuproc_launcher_members},
    {Py_tp_doc, (void *)"A prepared launch packed and launched in C; anything uncommon goes to the pure launcher."},
    {0, NULL},
};

static PyType_Spec cuproc_launcher_spec = {
    "cuproc._fastpath_c.Launcher", sizeof(cuproc_launcher), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
        | Py_TPFLAGS_DISALLOW_INSTANTIATION,   /* made by its factory only: never with NULL fields */
        cuproc_launcher_slots,
};

static PyTypeObject *cuproc_launcher_type;

/* One launch dimension or the shared memory size: an int in [0, UINT32_MAX], else ValueError. */
static int cuproc_dimension(PyObject *value, unsigned int *out)
{
    unsigned long long v = PyLong_Check(value) ? PyLong_AsUnsignedLongLong(value) : (unsigned long long)-1;
    if ((v == (unsigned long long)-1 && PyErr_Occurred()) || !PyLong_Check(value) || v > UINT32_MAX) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "make_launcher: a grid, block or shared memory value is not an "
                                          "unsigned 32-bit int (a cuproc bug)");
        return -1;
    }
    *out = (unsigned int)v;
    return 0;
}

/* make_launcher(slow, on_error, epoch, seen, owner, buffer_type, context_type,
 *               (the member descriptors that a buffer's ended, context and address and a context's ended
 *               resolve to), keep, ex, fn, config, handle, (gx, gy, gz), (bx, by, bz), shmem, stream, params,
 *               extra, block, block_size, kinds, offsets): every offset plus its kind's size must lie within
 *               block_size; the two ``ended`` must be the one descriptor (both classes are cuproc Resources).
 *               The dimensions None, None, None: they come with each call (see the top of this file). */
static PyObject *cuproc_make_launcher(PyObject *module, PyObject *args)
{
    PyObject *slow, *on_error, *recheck, *epoch, *seen, *owner, *buffer_type, *context_type, *members, *keep;
    PyObject *kind_bytes;
    PyObject *offsets;
    Py_ssize_t off_ended, off_context, off_address, off_ctx_ended;   /* the last: checked, equal to the first */
    int ex;
    unsigned long long fn, config, handle, stream, params, extra, block;
    unsigned int g[3] = {1, 1, 1}, b[3] = {1, 1, 1}, shmem = 0;
    PyObject *grid_obj, *blk_obj, *shmem_obj;
    int per_call;
    Py_ssize_t block_size;
    static const Py_ssize_t kind_size[K_COUNT] = {8, 1, 2, 4, 8, 1, 2, 4, 8, 4, 8};
    const char *kinds;
    Py_ssize_t nkinds, i;
    cuproc_launcher *self;
    (void)module;
    /* "I" would truncate silently: the dimensions are objects here, checked by cuproc_dimension */
    if (!PyArg_ParseTuple(args, "OOOO!O!O!O!O!O!OpKKKOOOKKKKnO!O!", &slow, &on_error, &recheck, &PyList_Type,
                          &epoch, &PyList_Type, &seen, &PyList_Type, &owner, &PyType_Type, &buffer_type, &PyType_Type,
                          &context_type, &PyTuple_Type, &members, &keep, &ex, &fn, &config,
                          &handle, &grid_obj, &blk_obj, &shmem_obj, &stream, &params,
                          &extra, &block, &block_size, &PyBytes_Type, &kind_bytes, &PyTuple_Type, &offsets))
        return NULL;
    per_call = grid_obj == Py_None && blk_obj == Py_None && shmem_obj == Py_None;
    if (!per_call && (!PyTuple_CheckExact(grid_obj) || PyTuple_GET_SIZE(grid_obj) != 3
                      || !PyTuple_CheckExact(blk_obj) || PyTuple_GET_SIZE(blk_obj) != 3)) {
        PyErr_SetString(PyExc_ValueError, "make_launcher: grid and block are 3-tuples, or all three dimensions "
                                          "None (a cuproc bug)");
        return NULL;
    }
    if (PyTuple_GET_SIZE(members) != 4 || PyTuple_GET_ITEM(members, 3) != PyTuple_GET_ITEM(members, 0)) {
        PyErr_SetString(PyExc_ValueError, "make_launcher: four slots expected, a buffer's and a context's ended "
                                          "the same (a cuproc bug)");
        return NULL;
    }
    if (cuproc_slot_offset(PyTuple_GET_ITEM(members, 0), buffer_type, &off_ended, "make_launcher")
        || cuproc_slot_offset(PyTuple_GET_ITEM(members, 1), buffer_type, &off_context, "make_launcher")
        || cuproc_slot_offset(PyTuple_GET_ITEM(members, 2), buffer_type, &off_address, "make_launcher")
        || cuproc_slot_offset(PyTuple_GET_ITEM(members, 3), context_type, &off_ctx_ended, "make_launcher"))
        return NULL;
    for (i = 0; i < 3 && !per_call; i++)
        if (cuproc_dimension(PyTuple_GET_ITEM(grid_obj, i), &g[i])
            || cuproc_dimension(PyTuple_GET_ITEM(blk_obj, i), &b[i])) return NULL;
    if (!per_call && cuproc_dimension(shmem_obj, &shmem)) return NULL;
    kinds = PyBytes_AS_STRING(kind_bytes);   /* no '#' format: cffi includes Python.h without PY_SSIZE_T_CLEAN */
    nkinds = PyBytes_GET_SIZE(kind_bytes);
    if (PyList_GET_SIZE(epoch) != 1 || PyList_GET_SIZE(seen) != 1 || PyList_GET_SIZE(owner) != 2
        || PyTuple_GET_SIZE(offsets) != nkinds || !PyCallable_Check(slow) || !PyCallable_Check(on_error)
        || !PyCallable_Check(recheck)
        || fn == 0 || (ex && config == 0) || block == 0 || block_size < 0) {
        PyErr_SetString(PyExc_ValueError, "make_launcher: inconsistent arguments (a cuproc bug)");
        return NULL;
    }
    for (i = 0; i < nkinds; i++) {
        if ((unsigned char)kinds[i] >= K_COUNT) {
            PyErr_SetString(PyExc_ValueError, "make_launcher: unknown argument kind (a cuproc bug)");
            return NULL;
        }
    }
    self = PyObject_GC_New(cuproc_launcher, cuproc_launcher_type);
    if (self == NULL) return NULL;
    self->vectorcall = cuproc_launcher_call;
    self->dict = NULL;
    self->weaklist = NULL;
    Py_INCREF(slow); self->slow = slow;
    Py_INCREF(on_error); self->on_error = on_error;
    self->recheck = Py_NewRef(recheck);
    Py_INCREF(epoch); self->epoch = epoch;
    Py_INCREF(seen); self->seen = seen;
    Py_INCREF(owner); self->owner = owner;
    Py_INCREF(buffer_type); self->buffer_type = buffer_type;
    self->context_type = Py_NewRef(context_type);
    self->off_ended = off_ended; self->off_context = off_context; self->off_address = off_address;
    Py_INCREF(keep); self->keep = keep;
    self->ex = ex; self->owned = 0; self->owner_ident = 0; self->per_call = per_call;
    self->fn = (void *)(uintptr_t)fn; self->config = (void *)(uintptr_t)config;
    self->handle = (void *)(uintptr_t)handle; self->stream = (void *)(uintptr_t)stream;
    self->params = (void **)(uintptr_t)params; self->extra = (void **)(uintptr_t)extra;
    memcpy(self->grid, g, sizeof g); memcpy(self->blk, b, sizeof b); self->shmem = shmem;
    self->block = (char *)(uintptr_t)block;
    self->nargs = nkinds;
    self->fallbacks = 0;
    self->block_size = block_size;
    self->kinds = PyMem_Malloc(nkinds ? (size_t)nkinds : 1);
    self->offsets = PyMem_Malloc(sizeof(Py_ssize_t) * (nkinds ? (size_t)nkinds : 1));
    if (self->kinds == NULL || self->offsets == NULL) {
        PyObject_GC_Track(self);
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    memcpy(self->kinds, kinds, (size_t)nkinds);
    for (i = 0; i < nkinds; i++) {
        self->offsets[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, i));
        if (self->offsets[i] < 0 || self->offsets[i] > block_size - kind_size[(unsigned char)kinds[i]]) {
            Py_ssize_t bad = self->offsets[i];
            PyObject_GC_Track(self);
            Py_DECREF(self);
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "make_launcher: argument %zd at offset %zd does not fit the "
                             "%zd-byte block (a cuproc bug)", i, bad, block_size);
            return NULL;
        }
    }
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyMethodDef cuproc_make_launcher_def = {
    "make_launcher", cuproc_make_launcher, METH_VARARGS,
    "A C launcher over a prepared launch's packed block (cuproc.launch builds the arguments).",
};

/* The one-shot launch in C: cuproc._fastpath_c.make_one_shot(slow, types, epoch, buffer) returns
 * a method-like callable (Function.launch) that takes the common warm case of cuproc.launch.launch
 * -- fn.launch(grid, block, args) with at most ``signature=``, ``stream=`` (None or a cuproc
 * Stream) and ``shared_mem=``, the default convention and entry -- builds the very key the Python
 * launch builds, finds the entry in ``function.launch_cache`` and calls its launcher with the call's
 * grid, block and shared memory (the launcher checks them: they are not part of the key).  The entry
 * found is remembered with its key in ``function.launch_last``, and a call whose key would equal that
 * one takes it without building the key.  Everything else (a Kernel, another stream object, another
 * keyword, a miss, a moved EPOCH, an entry for another Stream at the same id) goes to ``slow`` (the
 * Python launch) with the arguments unchanged. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *slow, *types, *epoch, *buffer;
    Py_ssize_t taken, off_cache, off_last;   /* Function's launch_cache and launch_last slots (0: not read yet) */
} cuproc_one_shot;

static PyObject *cuproc_s_signature, *cuproc_s_stream, *cuproc_s_shared_mem, *cuproc_zero;

/* The most kernel arguments the front passes on itself (with grid, block and shared memory, on the C
 * stack); a launch of more goes to the Python launch, which passes them as well. */
#define CUPROC_FRONT_ARGS 61

/* The key of cuproc.launch.launch for these values, or NULL with no error set (not taken here). */
static PyObject *cuproc_one_shot_key(cuproc_one_shot *self, PyObject *values, PyObject *signature, PyObject *stream)
{
    PyObject *classes, *key, *stream_key = Py_None;
    Py_ssize_t i, n;
    if (signature == NULL) {
        n = PyTuple_GET_SIZE(values);
        classes = PyTuple_New(n);
        if (classes == NULL) return NULL;
        for (i = 0; i < n; i++) {
            PyObject *cls = (PyObject *)Py_TYPE(PyTuple_GET_ITEM(values, i));
            Py_INCREF(cls);
            PyTuple_SET_ITEM(classes, i, cls);
        }
    } else if (PyTuple_CheckExact(signature)) {
        Py_INCREF(signature);
        classes = signature;
    } else if (PyList_CheckExact(signature)) {
        classes = PyList_AsTuple(signature);
        if (classes == NULL) return NULL;
    } else {
        return NULL;
    }
    if (stream == Py_None) {
        Py_INCREF(Py_None);
    } else {   /* ("stream", id(stream)), as the Python launch keys a Stream */
        stream_key = Py_BuildValue("(ON)", cuproc_s_stream, PyLong_FromVoidPtr(stream));
        if (stream_key == NULL) { Py_DECREF(classes); return NULL; }
    }
    key = PyTuple_New(4);   /* (classes, stream key, convention, entry) */
    if (key == NULL) { Py_DECREF(classes); Py_DECREF(stream_key); return NULL; }
    PyTuple_SET_ITEM(key, 0, classes);
    PyTuple_SET_ITEM(key, 1, stream_key);
    Py_INCREF(self->buffer); PyTuple_SET_ITEM(key, 2, self->buffer);
    Py_INCREF(Py_None); PyTuple_SET_ITEM(key, 3, Py_None);
    return key;
}

/* 1 when the weak reference ``ref`` refers to ``target`` (which the caller holds), else 0; never an
 * error (``ref`` is known to be a weak reference).  PyWeakref_GetObject is deprecated from 3.13. */
static int cuproc_weakly_refers_to(PyObject *ref, PyObject *target)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *referent = NULL;   /* a new reference, or NULL when the referent is gone */
    if (PyWeakref_GetRef(ref, &referent) < 0) {
        PyErr_Clear();
        return 0;
    }
    Py_XDECREF(referent);   /* only the address is compared; target, if equal, is held by the caller */
    return referent == target;
#else
    return PyWeakref_GetObject(ref) == target;   /* borrowed; Py_None when the referent is gone */
#endif
}

/* Whether the key cuproc_one_shot_key would build for these values equals ``key`` (a key built
 * before, the function's last hit), without building it: the same stream key, convention and entry,
 * and the same classes (each value's type, or each signature entry: the very object, or an equal
 * exact str).  Stricter than the dict's equality, never looser; runs no Python code. */
static int cuproc_same_key(cuproc_one_shot *self, PyObject *key, PyObject *values, PyObject *signature,
                           PyObject *stream)
{
    PyObject *classes = PyTuple_GET_ITEM(key, 0), *stream_key = PyTuple_GET_ITEM(key, 1), *id;
    PyObject *const *items;
    Py_ssize_t i, n;
    if (!PyTuple_CheckExact(classes) || PyTuple_GET_ITEM(key, 2) != self->buffer || PyTuple_GET_ITEM(key, 3) != Py_None)
        return 0;
    n = PyTuple_GET_SIZE(classes);
    if (stream == Py_None) {
        if (stream_key != Py_None) return 0;
    } else {
        if (!PyTuple_CheckExact(stream_key) || PyTuple_GET_SIZE(stream_key) != 2) return 0;
        id = PyTuple_GET_ITEM(stream_key, 1);
        if (!PyLong_CheckExact(id)) return 0;
        if (PyLong_AsUnsignedLongLongMask(id) != (unsigned long long)(uintptr_t)stream) return 0;
    }
    if (signature == NULL) {
        if (PyTuple_GET_SIZE(values) != n) return 0;
        for (i = 0; i < n; i++)
            if ((PyObject *)Py_TYPE(PyTuple_GET_ITEM(values, i)) != PyTuple_GET_ITEM(classes, i)) return 0;
        return 1;
    }
    if (PyTuple_CheckExact(signature)) {
        if (PyTuple_GET_SIZE(signature) != n) return 0;
        items = &PyTuple_GET_ITEM(signature, 0);
    } else {   /* a list: the caller checked */
        if (PyList_GET_SIZE(signature) != n) return 0;
        items = (PyObject *const *)((PyListObject *)signature)->ob_item;
    }
    for (i = 0; i < n; i++) {
        PyObject *a = items[i], *b = PyTuple_GET_ITEM(classes, i);
        if (a != b && !(PyUnicode_CheckExact(a) && PyUnicode_CheckExact(b) && PyUnicode_Compare(a, b) == 0))
            return 0;
    }
    return 1;
}

/* The offsets of Function's launch_cache and launch_last slots, read once from the member
 * descriptors the Python launch lists after the classes (types[2] and types[3]). */
static int cuproc_one_shot_offsets(cuproc_one_shot *self)
{
    PyObject *function_type = PyList_GET_ITEM(self->types, 0);
    if (cuproc_slot_offset(PyList_GET_ITEM(self->types, 2), function_type, &self->off_cache, "make_one_shot") < 0
        || cuproc_slot_offset(PyList_GET_ITEM(self->types, 3), function_type, &self->off_last, "make_one_shot") < 0) {
        self->off_cache = self->off_last = 0;
        return -1;
    }
    return 0;
}

/* 1 when a cache entry's stream is this call's: None for the default stream, else a weak reference
 * to this very Stream (not another Stream at a dead one's id). */
static int cuproc_entry_for_stream(PyObject *entry, PyObject *stream)
{
    PyObject *held = PyTuple_GET_ITEM(entry, 1);
    return stream == Py_None ? held == Py_None : (PyWeakref_CheckRef(held) && cuproc_weakly_refers_to(held, stream));
}

/* A cache entry as the Python launch stores it: (launcher, None or a weak reference, [epoch seen]). */
static int cuproc_is_entry(PyObject *entry)
{
    return PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 3 && PyList_CheckExact(PyTuple_GET_ITEM(entry, 2))
           && PyList_GET_SIZE(PyTuple_GET_ITEM(entry, 2)) == 1;
}

/* 1 when nothing has ended since the entry's function and stream were last checked (its epoch is
 * EPOCH's); else the Python launch checks them again. */
static int cuproc_entry_current(cuproc_one_shot *self, PyObject *entry)
{
    return PyList_GET_ITEM(PyTuple_GET_ITEM(entry, 2), 0) == PyList_GET_ITEM(self->epoch, 0);
}

static PyObject *cuproc_one_shot_call(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_one_shot *self = (cuproc_one_shot *)obj;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *function, *values, *signature = NULL, *stream = Py_None, *cache, *key, *entry = NULL, *launcher;
    PyObject *last, *record = NULL, *result, *shared_mem = cuproc_zero;
    PyObject *stack[3 + CUPROC_FRONT_ARGS];   /* the launcher's arguments: grid, block, shared memory, values */
    Py_ssize_t k, n;
    if (self->slow == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    if (nargs != 4 || (PyObject *)Py_TYPE(args[0]) != PyList_GET_ITEM(self->types, 0))
        goto slow;
    for (k = 0; kwnames != NULL && k < PyTuple_GET_SIZE(kwnames); k++) {   /* these keywords only */
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        if (name == cuproc_s_signature)
            signature = args[nargs + k] == Py_None ? NULL : args[nargs + k];   /* None: keyed by the classes */
        else if (name == cuproc_s_stream)
            stream = args[nargs + k];
        else if (name == cuproc_s_shared_mem)
            shared_mem = args[nargs + k];   /* any object: the launcher checks it, as grid and block */
        else
            goto slow;
    }
    if (stream != Py_None && (PyObject *)Py_TYPE(stream) != PyList_GET_ITEM(self->types, 1))
        goto slow;   /* another library's stream, a handle: the Python launch resolves it */
    if (signature != NULL && !PyTuple_CheckExact(signature) && !PyList_CheckExact(signature))
        goto slow;
    function = args[0];
    values = args[3];
    if (!PyTuple_CheckExact(values) || PyTuple_GET_SIZE(values) > CUPROC_FRONT_ARGS)
        goto slow;
    if (self->off_cache == 0 && cuproc_one_shot_offsets(self) < 0)
        return NULL;
    /* The function's last hit, (key, entry): taken when this call's key equals its key, without
     * building the key (its tuples, hashes and the dict lookup are most of a warm call's cost). */
    last = CUPROC_SLOT(function, self->off_last);
    if (last != NULL && PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 2
        && PyTuple_CheckExact(PyTuple_GET_ITEM(last, 0)) && PyTuple_GET_SIZE(PyTuple_GET_ITEM(last, 0)) == 4
        && cuproc_is_entry(PyTuple_GET_ITEM(last, 1))
        && cuproc_same_key(self, PyTuple_GET_ITEM(last, 0), values, signature, stream)
        && cuproc_entry_for_stream(PyTuple_GET_ITEM(last, 1), stream)
        && cuproc_entry_current(self, PyTuple_GET_ITEM(last, 1)))
        entry = PyTuple_GET_ITEM(last, 1);   /* borrowed: nothing below allocates or runs Python code before
                                                the launcher is held.  A record whose epoch moved (perhaps of
                                                an entry the cache dropped since) goes to the dict: the entry
                                                there is the one the Python launch rechecks and refreshes. */
    if (entry == NULL) {   /* the dict, under the very key the Python launch builds */
        /* The key first: allocating may run a collection, hence Python code (3.10 and 3.11: any
         * allocation of a tracked object), which may replace or clear the cache; so the cache is read
         * after it and held, and the entry found is held across the record's allocation. */
        key = cuproc_one_shot_key(self, values, signature, stream);
        if (key == NULL) {
            if (PyErr_Occurred()) return NULL;
            goto slow;
        }
        cache = CUPROC_SLOT(function, self->off_cache);
        if (cache == NULL || !PyDict_CheckExact(cache)) {
            Py_DECREF(key);
            goto slow;
        }
        Py_INCREF(cache);
        entry = PyDict_GetItemWithError(cache, key);
        if (entry == NULL) {
            Py_DECREF(key);
            Py_DECREF(cache);
            if (PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_LookupError))
                    return NULL;   /* what the Python launch raises */
                PyErr_Clear();   /* an unhashable signature entry (or one whose hash raises a LookupError):
                                    the Python launch catches both and takes the general path */
            }
            goto slow;
        }
        Py_INCREF(entry);
        Py_DECREF(cache);
        /* not for this very stream (e.g. an entry of a Stream that ended, at the id of this new one), or
         * something ended since: the Python launch decides, and rechecks */
        if (!cuproc_is_entry(entry) || !cuproc_entry_for_stream(entry, stream) || !cuproc_entry_current(self, entry)) {
            Py_DECREF(entry);
            Py_DECREF(key);
            goto slow;
        }
        record = PyTuple_Pack(2, key, entry);
        Py_DECREF(key);
        Py_DECREF(entry);   /* held by the record from here on (when it failed, entry is not used again) */
        if (record == NULL) return NULL;
    }
    launcher = PyTuple_GET_ITEM(entry, 0);
    Py_INCREF(launcher);   /* another thread may replace the record or drop the entry while it runs */
    if (record != NULL) {   /* the new last hit; the old record goes after the slot holds the new one */
        last = CUPROC_SLOT(function, self->off_last);
        CUPROC_SLOT(function, self->off_last) = record;
        Py_XDECREF(last);
    }
    self->taken++;
    /* borrowed: the caller holds grid, block, shared memory and the values tuple, which holds the values */
    n = PyTuple_GET_SIZE(values);
    stack[0] = args[1];
    stack[1] = args[2];
    stack[2] = shared_mem;
    for (k = 0; k < n; k++)
        stack[3 + k] = PyTuple_GET_ITEM(values, k);
    result = PyObject_Vectorcall(launcher, stack, 3 + n, NULL);
    Py_DECREF(launcher);
    return result;
slow:
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

/* Function.launch = this object: a method (Py_TPFLAGS_METHOD_DESCRIPTOR lets fn.launch(...) call it
 * with fn first, as a Python function's method call does, without a bound-method object). */
static PyObject *cuproc_one_shot_get(PyObject *obj, PyObject *instance, PyObject *owner)
{
    (void)owner;
    if (instance == NULL || instance == Py_None) {
        Py_INCREF(obj);
        return obj;
    }
    return PyMethod_New(obj, instance);
}

static int cuproc_one_shot_traverse(PyObject *obj, visitproc visit, void *arg)
{
    cuproc_one_shot *self = (cuproc_one_shot *)obj;
    Py_VISIT(self->dict); Py_VISIT(self->slow); Py_VISIT(self->types); Py_VISIT(self->epoch);
    Py_VISIT(self->buffer); Py_VISIT(Py_TYPE(obj));
    return 0;
}

static int cuproc_one_shot_clear(PyObject *obj)
{
    cuproc_one_shot *self = (cuproc_one_shot *)obj;
    Py_CLEAR(self->dict); Py_CLEAR(self->slow); Py_CLEAR(self->types); Py_CLEAR(self->epoch);
    Py_CLEAR(self->buffer);
    return 0;
}

static PyMemberDef cuproc_one_shot_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(cuproc_one_shot, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(cuproc_one_shot, vectorcall), READONLY, NULL},
    {"taken", T_PYSSIZET, offsetof(cuproc_one_shot, taken), READONLY,
     "how many calls this object launched itself (the rest went to the Python launch)"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef cuproc_one_shot_getset[] = {   /* __dict__: functools.update_wrapper fills it */
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot cuproc_one_shot_slots[] = {
    {Py_tp_getset, (void *)cuproc_one_shot_getset},
    {Py_tp_call, (void *)PyVectorcall_Call},
    {Py_tp_descr_get, (void *)cuproc_one_shot_get},
    {Py_tp_traverse, (void *)cuproc_one_shot_traverse},
    {Py_tp_clear, (void *)cuproc_one_shot_clear},
    {Py_tp_dealloc, (void *)cuproc_front_dealloc},
    {Py_tp_members, (void *)cuproc_one_shot_members},
    {Py_tp_doc, (void *)"cuproc.launch.launch with its common warm case in C; the rest goes to the Python launch."},
    {0, NULL},
};

static PyType_Spec cuproc_one_shot_spec = {
    "cuproc._fastpath_c.OneShot", sizeof(cuproc_one_shot), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR
        | Py_TPFLAGS_DISALLOW_INSTANTIATION,   /* made by make_one_shot only: never with NULL fields */
    cuproc_one_shot_slots,
};

static PyTypeObject *cuproc_one_shot_type;

/* make_one_shot(slow, types, epoch, buffer): types is a four-item list, the exact classes taken here
 * and the member descriptors of Function's two cache slots -- [cuproc.module.Function,
 * cuproc.stream.Stream, Function.launch_cache, Function.launch_last], None until the Python launch
 * fills them in --; epoch is EPOCH; buffer is the string "buffer" (the default convention, as the
 * key holds it). */
static PyObject *cuproc_make_one_shot(PyObject *module, PyObject *args)
{
    PyObject *slow, *types, *epoch, *buffer;
    cuproc_one_shot *self;
    (void)module;
    if (!PyArg_ParseTuple(args, "OO!O!U", &slow, &PyList_Type, &types, &PyList_Type, &epoch, &buffer))
        return NULL;
    if (!PyCallable_Check(slow) || PyList_GET_SIZE(types) != 4 || PyList_GET_SIZE(epoch) != 1) {
        PyErr_SetString(PyExc_ValueError, "make_one_shot: inconsistent arguments (a cuproc bug)");
        return NULL;
    }
    self = PyObject_GC_New(cuproc_one_shot, cuproc_one_shot_type);
    if (self == NULL) return NULL;
    self->vectorcall = cuproc_one_shot_call;
    self->dict = NULL;
    Py_INCREF(slow); self->slow = slow;
    Py_INCREF(types); self->types = types;
    Py_INCREF(epoch); self->epoch = epoch;
    Py_INCREF(buffer); self->buffer = buffer;
    self->taken = self->off_cache = self->off_last = 0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyMethodDef cuproc_make_one_shot_def = {
    "make_one_shot", cuproc_make_one_shot, METH_VARARGS,
    "The one-shot launch's C front (cuproc.launch builds it over the Python launch).",
};

/* Put ``factory`` (as its ml_name) and ``type`` (as ``type_name``) on cuproc._fastpath_c, with the
 * GIL held (``type`` NULL: making it failed, its error is set): 0, or -1 with the error printed (the caller sees -1 through cffi; the reason goes to
 * stderr, not lost).  Shared with fastpath_checked.c, compiled after this file. */
static int cuproc_publish(PyMethodDef *factory, const char *type_name, PyTypeObject *type)
{
    int rc = -1;
    PyObject *module = NULL, *function = NULL;
    if (type != NULL && (module = PyImport_ImportModule("cuproc._fastpath_c")) != NULL
        && (function = PyCFunction_New(factory, NULL)) != NULL
        && PyObject_SetAttrString(module, factory->ml_name, function) == 0
        && PyObject_SetAttrString(module, type_name, (PyObject *)type) == 0)
        rc = 0;
    if (rc) PyErr_Print();
    Py_XDECREF(function);
    Py_XDECREF(module);
    return rc;
}

/* Called once through cffi (which released the GIL): put Launcher, make_launcher, OneShot and
 * make_one_shot on the module. */
static int cuproc_install_launcher(void)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc;
    if (cuproc_launcher_type == NULL) {
        cuproc_s_signature = PyUnicode_InternFromString("signature");
        cuproc_s_stream = PyUnicode_InternFromString("stream");
        cuproc_s_shared_mem = PyUnicode_InternFromString("shared_mem");
        cuproc_zero = PyLong_FromLong(0);   /* the default shared memory, held for good */
        if (cuproc_s_signature && cuproc_s_stream && cuproc_s_shared_mem && cuproc_zero)
            cuproc_launcher_type = (PyTypeObject *)PyType_FromSpec(&cuproc_launcher_spec);
        if (cuproc_launcher_type != NULL)
            cuproc_one_shot_type = (PyTypeObject *)PyType_FromSpec(&cuproc_one_shot_spec);
    }
    /* OneShot first: NULL when either type failed, and publishing it prints that error */
    rc = cuproc_publish(&cuproc_make_one_shot_def, "OneShot", cuproc_one_shot_type);
    if (rc == 0)
        rc = cuproc_publish(&cuproc_make_launcher_def, "Launcher", cuproc_launcher_type);
    PyGILState_Release(gil);
    return rc;
}
