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
 */

#include "structmember.h"

enum { K_PTR, K_I8, K_I16, K_I32, K_I64, K_U8, K_U16, K_U32, K_U64, K_F32, K_F64, K_COUNT };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *slow, *on_error, *epoch, *seen, *owner, *buffer_type, *keep;
    int ex, owned;
    unsigned long owner_ident;
    void *fn, *config, *handle, *stream;
    void **params, **extra;
    unsigned int grid[3], blk[3], shmem;
    char *block;
    Py_ssize_t nargs, fallbacks;
    unsigned char *kinds;
    Py_ssize_t *offsets;
} cuproc_launcher;

static PyObject *cuproc_s_ended, *cuproc_s_context, *cuproc_s_address;

/* 0: the value is in *out; -1: not taken here (any Python error is cleared) */
static int cuproc_live_address(cuproc_launcher *self, PyObject *a, unsigned long long *out)
{
    PyObject *ended, *ctx, *ctx_ended, *addr;
    int ok = -1;
    if (PyLong_Check(a)) {
        *out = PyLong_AsUnsignedLongLong(a);
        if (*out == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
        return 0;
    }
    if ((PyObject *)Py_TYPE(a) != self->buffer_type)
        return -1;
    /* DeviceBuffer: usable while neither it nor its context has ended (the pure launcher's test) */
    ended = PyObject_GetAttr(a, cuproc_s_ended);
    if (ended == NULL) { PyErr_Clear(); return -1; }
    Py_DECREF(ended);
    if (ended != Py_None) return -1;
    ctx = PyObject_GetAttr(a, cuproc_s_context);
    if (ctx == NULL) { PyErr_Clear(); return -1; }
    ctx_ended = PyObject_GetAttr(ctx, cuproc_s_ended);
    Py_DECREF(ctx);
    if (ctx_ended == NULL) { PyErr_Clear(); return -1; }
    Py_DECREF(ctx_ended);
    if (ctx_ended != Py_None) return -1;
    addr = PyObject_GetAttr(a, cuproc_s_address);
    if (addr == NULL) { PyErr_Clear(); return -1; }
    if (PyLong_CheckExact(addr)) {
        *out = PyLong_AsUnsignedLongLong(addr);
        ok = (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
    }
    Py_DECREF(addr);
    if (ok) PyErr_Clear();
    return ok;
}

/* An integer value for an integer parameter, exactly when cffi would store it unchanged. */
static int cuproc_integer(PyObject *a, int kind, char *dst)
{
    long long v;
    unsigned long long u;
    PyObject *index;
    if (!PyIndex_Check(a) || PyFloat_Check(a))
        return -1;
    index = PyNumber_Index(a);
    if (index == NULL) { PyErr_Clear(); return -1; }
    if (kind == K_U64) {
        u = PyLong_AsUnsignedLongLong(index);
        Py_DECREF(index);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
        memcpy(dst, &u, 8);
        return 0;
    }
    v = PyLong_AsLongLong(index);
    Py_DECREF(index);
    if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    switch (kind) {
    case K_I8:  if (v < INT8_MIN || v > INT8_MAX) return -1; { int8_t x = (int8_t)v; memcpy(dst, &x, 1); } break;
    case K_I16: if (v < INT16_MIN || v > INT16_MAX) return -1; { int16_t x = (int16_t)v; memcpy(dst, &x, 2); } break;
    case K_I32: if (v < INT32_MIN || v > INT32_MAX) return -1; { int32_t x = (int32_t)v; memcpy(dst, &x, 4); } break;
    case K_I64: memcpy(dst, &v, 8); break;
    case K_U8:  if (v < 0 || v > UINT8_MAX) return -1; { uint8_t x = (uint8_t)v; memcpy(dst, &x, 1); } break;
    case K_U16: if (v < 0 || v > UINT16_MAX) return -1; { uint16_t x = (uint16_t)v; memcpy(dst, &x, 2); } break;
    case K_U32: if (v < 0 || v > (long long)UINT32_MAX) return -1; { uint32_t x = (uint32_t)v; memcpy(dst, &x, 4); } break;
    default: return -1;
    }
    return 0;
}

static PyObject *cuproc_launcher_call(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_launcher *self = (cuproc_launcher *)obj;
    Py_ssize_t i, nargs = PyVectorcall_NARGS(nargsf);
    CUresult rc;
    PyObject *code, *result;
    if (kwnames != NULL || nargs != self->nargs)
        goto slow;
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
    for (i = 0; i < nargs; i++) {
        PyObject *a = args[i];
        char *dst = self->block + self->offsets[i];
        int kind = self->kinds[i];
        if (kind == K_PTR) {
            unsigned long long p;
            if (cuproc_live_address(self, a, &p)) goto slow;
            memcpy(dst, &p, 8);
        } else if (kind == K_F32 || kind == K_F64) {
            double d = PyFloat_CheckExact(a) ? PyFloat_AS_DOUBLE(a) : PyFloat_AsDouble(a);
            if (d == -1.0 && PyErr_Occurred()) { PyErr_Clear(); goto slow; }
            if (kind == K_F32) { float f = (float)d; memcpy(dst, &f, 4); }
            else memcpy(dst, &d, 8);
        } else if (cuproc_integer(a, kind, dst)) {
            goto slow;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (self->ex)
        rc = ((PFN_cuLaunchKernelEx_v11060)self->fn)((const CUlaunchConfig *)self->config,
                                                      (CUfunction)self->handle, self->params, self->extra);
    else
        rc = ((PFN_cuLaunchKernel_v4000)self->fn)((CUfunction)self->handle, self->grid[0], self->grid[1],
                                                   self->grid[2], self->blk[0], self->blk[1], self->blk[2],
                                                   self->shmem, (CUstream)self->stream, self->params, self->extra);
    Py_END_ALLOW_THREADS
    if (rc == 0)
        Py_RETURN_NONE;
    code = PyLong_FromLong((long)rc);
    if (code == NULL) return NULL;
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
    Py_VISIT(self->dict); Py_VISIT(self->slow); Py_VISIT(self->on_error); Py_VISIT(self->epoch);
    Py_VISIT(self->seen); Py_VISIT(self->owner); Py_VISIT(self->buffer_type); Py_VISIT(self->keep);
    Py_VISIT(Py_TYPE(obj));
    return 0;
}

static int cuproc_launcher_clear(PyObject *obj)
{
    cuproc_launcher *self = (cuproc_launcher *)obj;
    Py_CLEAR(self->dict); Py_CLEAR(self->slow); Py_CLEAR(self->on_error); Py_CLEAR(self->epoch);
    Py_CLEAR(self->seen); Py_CLEAR(self->owner); Py_CLEAR(self->buffer_type); Py_CLEAR(self->keep);
    return 0;
}

static void cuproc_launcher_dealloc(PyObject *obj)
{
    cuproc_launcher *self = (cuproc_launcher *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    cuproc_launcher_clear(obj);
    PyMem_Free(self->kinds);
    PyMem_Free(self->offsets);
    tp->tp_free(obj);
    Py_DECREF(tp);
}

static PyMemberDef cuproc_launcher_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(cuproc_launcher, dict), READONLY, NULL},
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
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL, cuproc_launcher_slots,
};

static PyTypeObject *cuproc_launcher_type;

/* make_launcher(slow, on_error, epoch, seen, owner, buffer_type, keep, ex, fn, config, handle,
 *               (gx, gy, gz), (bx, by, bz), shmem, stream, params, extra, block, kinds, offsets) */
static PyObject *cuproc_make_launcher(PyObject *module, PyObject *args)
{
    PyObject *slow, *on_error, *epoch, *seen, *owner, *buffer_type, *keep, *kind_bytes, *offsets;
    int ex;
    unsigned long long fn, config, handle, stream, params, extra, block;
    unsigned int g[3], b[3], shmem;
    const char *kinds;
    Py_ssize_t nkinds, i;
    cuproc_launcher *self;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOO!O!O!OOpKKK(III)(III)IKKKKO!O!", &slow, &on_error, &PyList_Type, &epoch,
                          &PyList_Type, &seen, &PyList_Type, &owner, &buffer_type, &keep, &ex, &fn, &config,
                          &handle, &g[0], &g[1], &g[2], &b[0], &b[1], &b[2], &shmem, &stream, &params, &extra,
                          &block, &PyBytes_Type, &kind_bytes, &PyTuple_Type, &offsets))
        return NULL;
    kinds = PyBytes_AS_STRING(kind_bytes);   /* no '#' format: cffi includes Python.h without PY_SSIZE_T_CLEAN */
    nkinds = PyBytes_GET_SIZE(kind_bytes);
    if (PyList_GET_SIZE(epoch) != 1 || PyList_GET_SIZE(seen) != 1 || PyList_GET_SIZE(owner) != 1
        || PyTuple_GET_SIZE(offsets) != nkinds || !PyCallable_Check(slow) || !PyCallable_Check(on_error)
        || fn == 0 || (ex && config == 0)) {
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
    Py_INCREF(slow); self->slow = slow;
    Py_INCREF(on_error); self->on_error = on_error;
    Py_INCREF(epoch); self->epoch = epoch;
    Py_INCREF(seen); self->seen = seen;
    Py_INCREF(owner); self->owner = owner;
    Py_INCREF(buffer_type); self->buffer_type = buffer_type;
    Py_INCREF(keep); self->keep = keep;
    self->ex = ex; self->owned = 0; self->owner_ident = 0;
    self->fn = (void *)(uintptr_t)fn; self->config = (void *)(uintptr_t)config;
    self->handle = (void *)(uintptr_t)handle; self->stream = (void *)(uintptr_t)stream;
    self->params = (void **)(uintptr_t)params; self->extra = (void **)(uintptr_t)extra;
    memcpy(self->grid, g, sizeof g); memcpy(self->blk, b, sizeof b); self->shmem = shmem;
    self->block = (char *)(uintptr_t)block;
    self->nargs = nkinds;
    self->fallbacks = 0;
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
        if (self->offsets[i] < 0) {
            PyObject_GC_Track(self);
            Py_DECREF(self);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "make_launcher: negative offset (a cuproc bug)");
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

/* Called once through cffi (which released the GIL): put Launcher and make_launcher on the module. */
static int cuproc_install_launcher(void)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc = -1;
    PyObject *module = NULL, *function = NULL;
    if (cuproc_launcher_type == NULL) {
        cuproc_s_ended = PyUnicode_InternFromString("ended");
        cuproc_s_context = PyUnicode_InternFromString("context");
        cuproc_s_address = PyUnicode_InternFromString("address");
        if (!cuproc_s_ended || !cuproc_s_context || !cuproc_s_address) goto done;
        cuproc_launcher_type = (PyTypeObject *)PyType_FromSpec(&cuproc_launcher_spec);
        if (cuproc_launcher_type == NULL) goto done;
    }
    module = PyImport_ImportModule("cuproc._fastpath_c");
    if (module == NULL) goto done;
    function = PyCFunction_New(&cuproc_make_launcher_def, NULL);
    if (function == NULL) goto done;
    if (PyObject_SetAttrString(module, "make_launcher", function) < 0) goto done;
    if (PyObject_SetAttrString(module, "Launcher", (PyObject *)cuproc_launcher_type) < 0) goto done;
    rc = 0;
done:
    if (rc) PyErr_Print();   /* the caller sees -1; the reason goes to stderr, not lost */
    Py_XDECREF(function);
    Py_XDECREF(module);
    PyGILState_Release(gil);
    return rc;
}
