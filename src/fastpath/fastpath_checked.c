/* The checked call in C: cuproc._fastpath_c.make_checked(...) returns the callable that
 * ``drv.checked.cuX`` is on the compiled fast path.  Compiled into the cffi API-mode module by
 * tools/build_fastpath.py, after fastpath_launch.c (which includes structmember.h and defines
 * cuproc_publish).
 *
 * Why C: a checked call is the raw call plus three tests (fork, argument count, result).  As a
 * Python function those cost a frame, about 35 ns on a ~100 ns trivial call (1.36x); as a
 * vectorcall type they cost one more C call.
 *
 * A call:
 *   1. refuses keyword arguments and, when the arity is known (>= 0), a wrong argument count,
 *      with the TypeError text Python gives for a function with the positional-only parameters
 *      it was given (the pure wrapper is that function, whose binding checks come first too);
 *   2. refuses in a child forked after cuInit: FORKED[0] (the very list cuproc._fork sets in its
 *      at-fork hook, read here on every call, so the check is the pure wrapper's) is true ->
 *      raise forked_error(name);
 *   3. calls the raw callable (the trampoline) with the same arguments (PyObject_Vectorcall, or
 *      for a one-argument builtin its C function directly: see meth_o);
 *   4. returns None when the result is the int 0; else raise error(result, name), where ``error``
 *      (Driver.error) returns the CudaError to raise.  A result that is no int (a Python wrapper
 *      returning something else) is returned as the pure wrapper would have: raised on when true.
 */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *function, *name, *params, *error, *forked, *forked_error, *doc;
    Py_ssize_t arity;   /* -1: the callable checks its own count */
    /* When ``function`` is a builtin taking one argument (METH_O) and the arity is 1 -- a slot
     * trampoline, cffi's form for one parameter -- its C function and self, called directly: what
     * PyObject_Vectorcall would do after its checks of the count and keywords, done here already. */
    PyCFunction meth_o;
    PyObject *meth_self;
} cuproc_checked;

static PyTypeObject *cuproc_checked_type;
static PyObject *cuproc_zero;   /* the int 0: cffi returns the cached small int, so a test of identity */

/* The exception ``factory(args...)`` returns, raised; NULL always. */
static PyObject *cuproc_checked_raise(PyObject *made)
{
    if (made == NULL)
        return NULL;   /* the factory itself raised: that error stands */
    if (PyExceptionInstance_Check(made))
        PyErr_SetObject((PyObject *)Py_TYPE(made), made);
    else
        PyErr_Format(PyExc_TypeError, "cuproc checked call: the error factory returned %.200s, not an "
                     "exception (a cuproc bug)", Py_TYPE(made)->tp_name);
    Py_DECREF(made);
    return NULL;
}

/* "'a'", "'a' and 'b'", "'a', 'b', and 'c'": the names of params[from:] as Python lists them. */
static PyObject *cuproc_checked_missing(PyObject *params, Py_ssize_t from)
{
    Py_ssize_t i, n = PyTuple_GET_SIZE(params) - from;
    PyObject *text = NULL, *part;
    for (i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(params, from + i);
        if (text == NULL)
            part = PyUnicode_FromFormat("'%U'", name);
        else if (i < n - 1)
            part = PyUnicode_FromFormat("%U, '%U'", text, name);
        else
            part = PyUnicode_FromFormat(n == 2 ? "%U and '%U'" : "%U, and '%U'", text, name);
        Py_XDECREF(text);
        if (part == NULL)
            return NULL;
        text = part;
    }
    return text;
}

static PyObject *cuproc_checked_count_error(cuproc_checked *self, Py_ssize_t nargs)
{
    if (nargs > self->arity) {
        PyErr_Format(PyExc_TypeError, "%U() takes %zd positional argument%s but %zd %s given", self->name,
                     self->arity, self->arity == 1 ? "" : "s", nargs, nargs == 1 ? "was" : "were");
    } else {
        PyObject *missing = cuproc_checked_missing(self->params, nargs);
        if (missing == NULL)
            return NULL;
        PyErr_Format(PyExc_TypeError, "%U() missing %zd required positional argument%s: %U", self->name,
                     self->arity - nargs, self->arity - nargs == 1 ? "" : "s", missing);
        Py_DECREF(missing);
    }
    return NULL;
}

/* Keywords are refused, as Python refuses them for the pure wrapper's positional-only parameters:
 * a name that is no parameter is unexpected; parameter names are listed as positional-only. */
static PyObject *cuproc_checked_keyword_error(cuproc_checked *self, PyObject *kwnames)
{
    Py_ssize_t i;
    PyObject *named, *sep, *text;
    int found;
    for (i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
        found = self->params == Py_None ? 0 : PySequence_Contains(self->params, PyTuple_GET_ITEM(kwnames, i));
        if (found < 0)
            return NULL;
        if (!found) {
            PyErr_Format(PyExc_TypeError, "%U() got an unexpected keyword argument '%U'", self->name,
                         PyTuple_GET_ITEM(kwnames, i));
            return NULL;
        }
    }
    named = PyList_New(0);
    if (named == NULL)
        return NULL;
    for (i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
        PyObject *quoted = PyUnicode_FromFormat("'%U'", PyTuple_GET_ITEM(kwnames, i));
        if (quoted == NULL || PyList_Append(named, quoted) < 0) {
            Py_XDECREF(quoted);
            Py_DECREF(named);
            return NULL;
        }
        Py_DECREF(quoted);
    }
    sep = PyUnicode_FromString(", ");
    text = sep == NULL ? NULL : PyUnicode_Join(sep, named);
    Py_XDECREF(sep);
    Py_DECREF(named);
    if (text == NULL)
        return NULL;
    PyErr_Format(PyExc_TypeError, "%U() got some positional-only arguments passed as keyword arguments: %U",
                 self->name, text);
    Py_DECREF(text);
    return NULL;
}

static PyObject *cuproc_checked_call(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    cuproc_checked *self = (cuproc_checked *)obj;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *forked, *rc;
    int failed;
    if (self->function == NULL) return cuproc_front_cleared(obj);   /* cleared: nothing below is there */
    /* keywords and count first, as Python checks the pure wrapper's parameters before its body */
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0)
        return cuproc_checked_keyword_error(self, kwnames);
    if (self->arity >= 0 && nargs != self->arity)
        return cuproc_checked_count_error(self, nargs);
    forked = PyList_GET_ITEM(self->forked, 0);
    if (forked != Py_False) {   /* a checked function captured before fork() refuses in the child */
        int is_forked = PyObject_IsTrue(forked);
        if (is_forked < 0)
            return NULL;
        if (is_forked)
            return cuproc_checked_raise(PyObject_CallOneArg(self->forked_error, self->name));
    }
    if (self->meth_o != NULL)
        rc = self->meth_o(self->meth_self, args[0]);
    else
        rc = PyObject_Vectorcall(self->function, args, nargsf, NULL);
    if (rc == cuproc_zero) {
        Py_DECREF(rc);
        Py_RETURN_NONE;
    }
    if (rc == NULL)
        return NULL;
    if (PyLong_CheckExact(rc)) {
        long value = PyLong_AsLong(rc);
        failed = value != 0 || PyErr_Occurred() != NULL;   /* out of a long's range: not 0 either */
        PyErr_Clear();
    } else {
        failed = PyObject_IsTrue(rc);
        if (failed < 0) {
            Py_DECREF(rc);
            return NULL;
        }
    }
    if (!failed) {
        Py_DECREF(rc);
        Py_RETURN_NONE;
    }
    {
        PyObject *call_args[2] = {rc, self->name};
        PyObject *made = PyObject_Vectorcall(self->error, call_args, 2, NULL);
        Py_DECREF(rc);
        return cuproc_checked_raise(made);
    }
}

static int cuproc_checked_traverse(PyObject *obj, visitproc visit, void *arg)
{
    cuproc_checked *self = (cuproc_checked *)obj;
    Py_VISIT(self->function); Py_VISIT(self->name); Py_VISIT(self->params); Py_VISIT(self->error);
    Py_VISIT(self->forked); Py_VISIT(self->forked_error); Py_VISIT(self->doc);
    Py_VISIT(Py_TYPE(obj));
    return 0;
}

static int cuproc_checked_clear(PyObject *obj)
{
    cuproc_checked *self = (cuproc_checked *)obj;
    Py_CLEAR(self->function); Py_CLEAR(self->name); Py_CLEAR(self->params); Py_CLEAR(self->error);
    Py_CLEAR(self->forked); Py_CLEAR(self->forked_error); Py_CLEAR(self->doc);
    return 0;
}

static PyObject *cuproc_checked_repr(PyObject *obj)
{
    PyObject *name = ((cuproc_checked *)obj)->name;
    if (name == NULL)   /* cleared by the collector */
        return PyUnicode_FromString("<cuproc checked function (cleared)>");
    return PyUnicode_FromFormat("<cuproc checked function %U>", name);
}

static PyMemberDef cuproc_checked_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(cuproc_checked, vectorcall), READONLY, NULL},
    {"__name__", T_OBJECT, offsetof(cuproc_checked, name), READONLY, NULL},
    {"__qualname__", T_OBJECT, offsetof(cuproc_checked, name), READONLY, NULL},
    {"__doc__", T_OBJECT, offsetof(cuproc_checked, doc), READONLY, NULL},
    {"function", T_OBJECT, offsetof(cuproc_checked, function), READONLY, "the raw callable it calls"},
    {"parameters", T_OBJECT, offsetof(cuproc_checked, params), READONLY,
     "the parameter names it takes exactly, or None when the raw callable checks its own count"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot cuproc_checked_slots[] = {
    {Py_tp_call, (void *)PyVectorcall_Call},
    {Py_tp_traverse, (void *)cuproc_checked_traverse},
    {Py_tp_clear, (void *)cuproc_checked_clear},
    {Py_tp_dealloc, (void *)cuproc_front_dealloc},
    {Py_tp_repr, (void *)cuproc_checked_repr},
    {Py_tp_members, (void *)cuproc_checked_members},
    {0, NULL},
};

static PyType_Spec cuproc_checked_spec = {
    "cuproc._fastpath_c.Checked", sizeof(cuproc_checked), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
        | Py_TPFLAGS_DISALLOW_INSTANTIATION,   /* made by its factory only: never with NULL fields */
        cuproc_checked_slots,
};

/* make_checked(function, name, params, error, forked, forked_error, doc): ``params`` a tuple of
 * str (the exact parameters) or None (any count); ``forked`` a one-element list. */
static PyObject *cuproc_make_checked(PyObject *module, PyObject *args)
{
    PyObject *function, *name, *params, *error, *forked, *forked_error, *doc;
    cuproc_checked *self;
    Py_ssize_t i;
    (void)module;
    if (!PyArg_ParseTuple(args, "OUOOO!OU", &function, &name, &params, &error, &PyList_Type, &forked,
                          &forked_error, &doc))
        return NULL;
    if (!PyCallable_Check(function) || !PyCallable_Check(error) || !PyCallable_Check(forked_error)
        || PyList_GET_SIZE(forked) != 1 || (params != Py_None && !PyTuple_Check(params))) {
        PyErr_SetString(PyExc_TypeError, "make_checked: inconsistent arguments (a cuproc bug)");
        return NULL;
    }
    if (params != Py_None) {
        for (i = 0; i < PyTuple_GET_SIZE(params); i++) {
            if (!PyUnicode_Check(PyTuple_GET_ITEM(params, i))) {
                PyErr_SetString(PyExc_TypeError, "make_checked: a parameter name is not a str (a cuproc bug)");
                return NULL;
            }
        }
    }
    self = PyObject_GC_New(cuproc_checked, cuproc_checked_type);
    if (self == NULL)
        return NULL;
    self->vectorcall = cuproc_checked_call;
    self->arity = params == Py_None ? -1 : PyTuple_GET_SIZE(params);
    Py_INCREF(function); self->function = function;
    Py_INCREF(name); self->name = name;
    Py_INCREF(params); self->params = params;
    Py_INCREF(error); self->error = error;
    Py_INCREF(forked); self->forked = forked;
    Py_INCREF(forked_error); self->forked_error = forked_error;
    Py_INCREF(doc); self->doc = doc;
    self->meth_o = NULL;
    self->meth_self = NULL;
    if (self->arity == 1 && PyCFunction_Check(function)
        && (PyCFunction_GET_FLAGS(function) & (METH_VARARGS | METH_FASTCALL | METH_NOARGS | METH_O | METH_KEYWORDS
                                               | METH_METHOD)) == METH_O) {
        self->meth_o = PyCFunction_GET_FUNCTION(function);
        self->meth_self = PyCFunction_GET_SELF(function);   /* borrowed: ``function`` holds it */
    }
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyMethodDef cuproc_make_checked_def = {
    "make_checked", cuproc_make_checked, METH_VARARGS,
    "make_checked(function, name, params, error, forked, forked_error, doc): a checked call in C "
    "(cuproc.driver builds the arguments).",
};

/* Called once through cffi (which released the GIL): put Checked and make_checked on the module. */
static int cuproc_install_checked(void)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc;
    if (cuproc_checked_type == NULL) {
        cuproc_zero = PyLong_FromLong(0);
        if (cuproc_zero != NULL)
            cuproc_checked_type = (PyTypeObject *)PyType_FromSpec(&cuproc_checked_spec);
    }
    rc = cuproc_publish(&cuproc_make_checked_def, "Checked", cuproc_checked_type);
    PyGILState_Release(gil);
    return rc;
}
