/* gearcache.call._callpath: the per-call work in C (optional; without it gearcache does the same in Python).
 *
 * Three types:
 *   Runner      a loaded entry's ``run(leaves) -> outputs`` (entry.py)
 *   Dispatcher  the base class of CachedFunction: its __call__ serves a call like the last one through a shortcut
 *               and hands every other call to the subclass's ``_call`` (dispatch.py)
 *   GuardWatch  notices that an object on the paths of an entry's value guards may have changed (guard_watch.py)
 *
 * ---- Runner
 *
 * Runner(call, fallback, recipe, check, always_fallback, is_grad_enabled, is_autocast_enabled, data_ptr=None)
 *   -> runner; runner(leaves) -> outputs
 *
 *   call             Inductor's generated call(list) (it empties the list it is given)
 *   fallback         the run plan's Python run_list(list): realigns misaligned inputs (and copies mutated ones
 *                    back), bumps version counters, turns grad off around call(); used for any call that needs one
 *                    of these, so that behaviour is written once, in Python (runplan/loader.py)
 *   recipe           one item per graph input, in order: an int i (the call's flattened input leaves[i]) or a
 *                    (dict, key) pair (a module's _parameters or _buffers dict and the name; read on every call, so
 *                    a replaced weight is seen at once)
 *   check            indices of the graph inputs whose 16-byte alignment Inductor's code assumes
 *                    (the plan's inputs_to_check)
 *   always_fallback  true when every call needs the Python path (the graph bumps version counters)
 *   is_grad_enabled  torch.is_grad_enabled
 *   is_autocast_enabled  torch._C._is_any_autocast_enabled (compiled code runs with autocast off: its casts are
 *                    in the graph; the Python path turns autocast off around the call, as AOTAutograd does)
 *   data_ptr         None, or a PyCapsule named "gearcache.data_ptr" holding
 *                    int (*)(PyObject *tensor, uintptr_t *out) (gearcache.native's DATA_PTR): reads a tensor's
 *                    address in C for the alignment checks; where it returns -1, or without it, tensor.data_ptr()
 *
 * Per call: build the input list from the recipe; check the alignment (tensor.data_ptr() % 16) of the checked
 * inputs taken from the call's leaves, and of the checked module tensors only when one of the module tensors is a
 * different object than on the last call that passed (strong references are kept, so an address cannot be reused
 * by another tensor while it is remembered); with grad and autocast off and everything aligned, return call(list);
 * otherwise return fallback(list), which re-checks everything itself.
 *
 * Reading the module dicts: on Python 3.12+ every dict a runner reads is watched (PyDict_AddWatcher, one watcher
 * for the process): any change to any watched dict (an added, replaced or deleted parameter, the dict cleared or
 * freed) advances a process-wide generation counter. A call in the generation of the last call that read the dicts,
 * and whose module tensors all passed then, takes them from the runner's own references instead of reading the
 * dicts again: on a model with ~100 weights that saves ~100 dict reads, cold in the CPU caches after the previous
 * call's kernel launches. Without watchers (Python 3.10/3.11, or all 8 watcher slots taken) every call reads them.
 *
 * Only the CPython C API is used (no torch headers): it builds in a second with the C compiler of any machine that
 * runs Triton or Inductor's C++ kernels.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>               /* signbit, isnan: plain_equal of floats */
#include <structmember.h>       /* T_OBJECT_EX, READONLY: the entry's __slots__ member for hits */

#define ALIGNMENT 16

typedef struct {
    PyObject_HEAD
    PyObject *call;
    PyObject *fallback;
    PyObject *is_grad_enabled;
    PyObject *is_autocast_enabled;
    PyObject *recipe;          /* tuple, kept for the dicts' and keys' references */
    Py_ssize_t n;              /* graph inputs */
    Py_ssize_t *leaf_index;    /* per input: >= 0 a leaf index, -1 a module tensor */
    PyObject **dicts;          /* per input: borrowed from recipe (NULL for leaves) */
    PyObject **keys;
    PyObject **last;           /* per input: strong reference to the module tensor last seen aligned, or NULL */
    Py_ssize_t *check_leaf;    /* checked inputs taken from the leaves */
    Py_ssize_t n_check_leaf;
    Py_ssize_t *check_state;   /* checked inputs taken from the module */
    Py_ssize_t n_check_state;
    int always_fallback;
    int (*data_ptr)(PyObject *, uintptr_t *);  /* NULL: tensor.data_ptr() */
    PyObject *data_ptr_capsule;                 /* keeps the capsule (and so its module) alive */
    Py_ssize_t fast_calls;     /* calls served without the Python fallback (tests and diagnostics read it) */
    Py_ssize_t fallback_calls;
    Py_ssize_t state_reads;    /* calls that read the module dicts */
    int watched;               /* every module dict is watched: see the header */
    int remembered;            /* last[] holds what the dicts held in generation `seen` */
    unsigned long long seen;
} Runner;

static PyObject *str_data_ptr;

/* The watcher: any change to a watched dict starts a new generation. -1: no watcher (see the header). */
static int watcher_id = -1;
static unsigned long long generation = 0;

#if PY_VERSION_HEX >= 0x030C0000
static int on_dict_event(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *new_value) {
    (void)event; (void)dict; (void)key; (void)new_value;
    generation++;
    return 0;
}

static void add_watcher(void) {
    watcher_id = PyDict_AddWatcher(on_dict_event);
    if (watcher_id < 0) PyErr_Clear();       /* all slots taken: every call reads the dicts */
}

/* 1 when every module dict of the runner is watched */
static int watch_dicts(Runner *self) {
    if (watcher_id < 0) return 0;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (self->dicts[i] && PyDict_Watch(watcher_id, self->dicts[i]) < 0) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}
#else
static void add_watcher(void) {}
static int watch_dicts(Runner *self) { (void)self; return 0; }
#endif

static void runner_free_arrays(Runner *self) {
    if (self->last) {
        for (Py_ssize_t i = 0; i < self->n; i++) Py_CLEAR(self->last[i]);
    }
    PyMem_Free(self->leaf_index); self->leaf_index = NULL;
    PyMem_Free(self->dicts); self->dicts = NULL;
    PyMem_Free(self->keys); self->keys = NULL;
    PyMem_Free(self->last); self->last = NULL;
    PyMem_Free(self->check_leaf); self->check_leaf = NULL;
    PyMem_Free(self->check_state); self->check_state = NULL;
}

static int runner_traverse(Runner *self, visitproc visit, void *arg) {
    Py_VISIT(self->call);
    Py_VISIT(self->fallback);
    Py_VISIT(self->is_grad_enabled);
    Py_VISIT(self->is_autocast_enabled);
    Py_VISIT(self->recipe);
    if (self->last) {
        for (Py_ssize_t i = 0; i < self->n; i++) Py_VISIT(self->last[i]);
    }
    return 0;
}

static int runner_clear(Runner *self) {
    Py_CLEAR(self->call);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->is_grad_enabled);
    Py_CLEAR(self->is_autocast_enabled);
    self->data_ptr = NULL;
    Py_CLEAR(self->data_ptr_capsule);
    if (self->last) {
        for (Py_ssize_t i = 0; i < self->n; i++) Py_CLEAR(self->last[i]);
    }
    /* the dicts and keys are borrowed from recipe: forget them with it */
    if (self->dicts) {
        for (Py_ssize_t i = 0; i < self->n; i++) { self->dicts[i] = NULL; self->keys[i] = NULL; self->leaf_index[i] = -2; }
    }
    Py_CLEAR(self->recipe);
    return 0;
}

static void runner_dealloc(Runner *self) {
    PyObject_GC_UnTrack(self);
    runner_clear(self);
    runner_free_arrays(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int runner_init(Runner *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"call", "fallback", "recipe", "check", "always_fallback", "is_grad_enabled",
                             "is_autocast_enabled", "data_ptr", NULL};
    PyObject *call, *fallback, *recipe, *check, *grad, *autocast, *data_ptr = Py_None;
    int always;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!OpOO|O", kwlist, &call, &fallback, &PyTuple_Type, &recipe,
                                     &check, &always, &grad, &autocast, &data_ptr))
        return -1;
    if (data_ptr != Py_None && !PyCapsule_IsValid(data_ptr, "gearcache.data_ptr")) {
        PyErr_Format(PyExc_TypeError, "data_ptr: expected None or gearcache.native's DATA_PTR capsule, got %R",
                     data_ptr);
        return -1;
    }
    if (self->recipe != NULL) {
        PyErr_SetString(PyExc_TypeError, "Runner is initialised once");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(recipe);
    self->n = n;
    self->leaf_index = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    self->dicts = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    self->keys = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    self->last = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    if (!self->leaf_index || !self->dicts || !self->keys || !self->last) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(recipe, i);
        if (PyLong_Check(item)) {
            Py_ssize_t j = PyLong_AsSsize_t(item);
            if (j < 0) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "recipe[%zd]: leaf index must be >= 0, got %zd", i, j);
                return -1;
            }
            self->leaf_index[i] = j;
        } else if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 && PyDict_Check(PyTuple_GET_ITEM(item, 0))) {
            self->leaf_index[i] = -1;
            self->dicts[i] = PyTuple_GET_ITEM(item, 0);
            self->keys[i] = PyTuple_GET_ITEM(item, 1);
        } else {
            PyErr_Format(PyExc_TypeError, "recipe[%zd]: expected a leaf index or a (dict, key) pair, got %R", i, item);
            return -1;
        }
    }
    PyObject *fast = PySequence_Fast(check, "check must be a sequence of input indices");
    if (!fast) return -1;
    Py_ssize_t nc = PySequence_Fast_GET_SIZE(fast);
    self->check_leaf = PyMem_Calloc(nc ? nc : 1, sizeof(Py_ssize_t));
    self->check_state = PyMem_Calloc(nc ? nc : 1, sizeof(Py_ssize_t));
    if (!self->check_leaf || !self->check_state) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t k = 0; k < nc; k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, k));
        if (i == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        if (i < 0 || i >= n) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "check: input index %zd out of range for %zd inputs", i, n);
            return -1;
        }
        if (self->leaf_index[i] >= 0) self->check_leaf[self->n_check_leaf++] = i;
        else self->check_state[self->n_check_state++] = i;
    }
    Py_DECREF(fast);
    Py_INCREF(call); self->call = call;
    Py_INCREF(fallback); self->fallback = fallback;
    Py_INCREF(grad); self->is_grad_enabled = grad;
    Py_INCREF(autocast); self->is_autocast_enabled = autocast;
    Py_INCREF(recipe); self->recipe = recipe;
    if (data_ptr != Py_None) {
        self->data_ptr = (int (*)(PyObject *, uintptr_t *))PyCapsule_GetPointer(data_ptr, "gearcache.data_ptr");
        Py_INCREF(data_ptr); self->data_ptr_capsule = data_ptr;
    }
    self->always_fallback = always;
    self->watched = watch_dicts(self);
    return 0;
}

/* 1 misaligned, 0 aligned, -1 error */
static int misaligned(Runner *self, PyObject *tensor) {
    uintptr_t address;
    if (self->data_ptr && self->data_ptr(tensor, &address) == 0) return (address % ALIGNMENT) != 0;
    PyObject *ptr = PyObject_CallMethodNoArgs(tensor, str_data_ptr);
    if (!ptr) return -1;
    unsigned long long p = PyLong_AsUnsignedLongLong(ptr);
    Py_DECREF(ptr);
    if (p == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    return (p % ALIGNMENT) != 0;
}

static PyObject *missing_state(Runner *self, Py_ssize_t i) {
    PyErr_Format(PyExc_KeyError,
                 "gearcache: the module no longer has the parameter or buffer %R that compiled graph input %zd reads "
                 "(it was deleted after the entry loaded); fix: keep the module's parameters and buffers registered, "
                 "or build a new module and cache_compile it", self->keys[i], i);
    return NULL;
}

/* The per-call work (see the header). `state_checked`: the caller has just checked that grad and autocast are off
 * (the dispatcher's shortcut for a matcher made in that state), so they are not read again. */
static PyObject *runner_run(Runner *self, PyObject *leaves_seq, int state_checked) {
    if (self->recipe == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Runner was cleared");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(leaves_seq, "the call's leaves must be a tuple or list");
    if (!seq) return NULL;
    Py_ssize_t n_leaves = PySequence_Fast_GET_SIZE(seq);
    PyObject **leaves = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = self->n;
    PyObject *list = PyList_New(n);
    if (!list) { Py_DECREF(seq); return NULL; }
    /* module tensors from the runner's references when no watched dict changed since they were read */
    unsigned long long now = generation;
    int from_dicts = !(self->watched && self->remembered && self->seen == now);
    int changed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t j = self->leaf_index[i];
        PyObject *item;
        if (j >= 0) {
            if (j >= n_leaves) {
                PyErr_Format(PyExc_IndexError, "graph input %zd reads leaf %zd of a call with %zd leaves", i, j, n_leaves);
                goto error;
            }
            item = leaves[j];
        } else if (!from_dicts) {
            item = self->last[i];
        } else {
            item = PyDict_GetItemWithError(self->dicts[i], self->keys[i]);     /* borrowed */
            if (!item) {
                if (!PyErr_Occurred()) missing_state(self, i);
                goto error;
            }
            if (item != self->last[i]) changed = 1;
        }
        Py_INCREF(item);
        PyList_SET_ITEM(list, i, item);
    }
    Py_DECREF(seq);
    seq = NULL;
    if (from_dicts) self->state_reads++;

    int slow = self->always_fallback;
    if (!slow && !state_checked) {
        PyObject *grad = PyObject_CallNoArgs(self->is_grad_enabled);
        if (!grad) goto error;
        slow = (grad == Py_True);
        Py_DECREF(grad);
    }
    if (!slow && !state_checked) {
        PyObject *autocast = PyObject_CallNoArgs(self->is_autocast_enabled);
        if (!autocast) goto error;
        slow = (autocast == Py_True);
        Py_DECREF(autocast);
    }
    for (Py_ssize_t k = 0; !slow && k < self->n_check_leaf; k++) {
        int m = misaligned(self, PyList_GET_ITEM(list, self->check_leaf[k]));
        if (m < 0) goto error;
        slow = m;
    }
    if (changed) {
        /* new module tensors: remembered only once all the checked ones are aligned */
        int state_misaligned = 0;
        for (Py_ssize_t k = 0; !state_misaligned && k < self->n_check_state; k++) {
            int m = misaligned(self, PyList_GET_ITEM(list, self->check_state[k]));
            if (m < 0) goto error;
            state_misaligned = m;
        }
        if (state_misaligned) {
            slow = 1;
            self->remembered = 0;
        } else {
            for (Py_ssize_t i = 0; i < n; i++) {
                if (self->leaf_index[i] < 0) {
                    PyObject *item = PyList_GET_ITEM(list, i);
                    Py_INCREF(item);
                    Py_XSETREF(self->last[i], item);
                }
            }
            self->remembered = 1;
        }
    } else if (from_dicts) {
        self->remembered = 1;      /* the dicts hold what last[] holds */
    }
    if (from_dicts) self->seen = now;
    PyObject *out;
    if (slow) {
        self->fallback_calls++;
        out = PyObject_CallOneArg(self->fallback, list);
    } else {
        self->fast_calls++;
        out = PyObject_CallOneArg(self->call, list);
    }
    Py_DECREF(list);
    return out;

error:
    Py_XDECREF(seq);
    Py_DECREF(list);
    return NULL;
}

static PyObject *runner_call(Runner *self, PyObject *args, PyObject *kwds) {
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Runner takes one argument, the call's leaves");
        return NULL;
    }
    if (PyTuple_GET_SIZE(args) != 1) {
        PyErr_Format(PyExc_TypeError, "Runner takes one argument, the call's leaves (%zd given)", PyTuple_GET_SIZE(args));
        return NULL;
    }
    return runner_run(self, PyTuple_GET_ITEM(args, 0), 0);
}

static PyObject *runner_get_fast_calls(Runner *self, void *closure) { return PyLong_FromSsize_t(self->fast_calls); }
static PyObject *runner_get_fallback_calls(Runner *self, void *closure) { return PyLong_FromSsize_t(self->fallback_calls); }
static PyObject *runner_get_state_reads(Runner *self, void *closure) { return PyLong_FromSsize_t(self->state_reads); }
static PyObject *runner_get_watched(Runner *self, void *closure) { return PyBool_FromLong(self->watched); }

static PyGetSetDef runner_getset[] = {
    {"fast_calls", (getter)runner_get_fast_calls, NULL, "calls that ran call() directly", NULL},
    {"fallback_calls", (getter)runner_get_fallback_calls, NULL, "calls handed to the Python fallback", NULL},
    {"state_reads", (getter)runner_get_state_reads, NULL, "calls that read the module dicts", NULL},
    {"watched", (getter)runner_get_watched, NULL, "the module dicts are watched (Python 3.12+)", NULL},
    {NULL}
};

static PyTypeObject RunnerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gearcache.call._callpath.Runner",
    .tp_doc = "A loaded entry's per-call work: gather the graph inputs, check alignment, grad and autocast, run call().",
    .tp_basicsize = sizeof(Runner),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)runner_init,
    .tp_dealloc = (destructor)runner_dealloc,
    .tp_traverse = (traverseproc)runner_traverse,
    .tp_clear = (inquiry)runner_clear,
    .tp_call = (ternaryfunc)runner_call,
    .tp_getset = runner_getset,
};

/* ---- GuardWatch
 *
 * GuardWatch(dicts, types, checked, absent, meta=None, meta_holds=None) -> watch; watch.valid() -> bool (see
 * gearcache/keys/guard_watch.py)
 *   dicts    [(dict, key, expected)]: dict[key] is `expected` (`absent`: the key is not there); key None: any change
 *            of the dict counts. Rows of one dict should be consecutive: where its version tag has not moved since
 *            the group was last seen valid, none of its keys is read (< 3.12)
 *   types    [type]: any change of the class (an attribute set, its bases) counts
 *   checked  [(op, parent, key, expected)], re-read at every valid() (leading "class" rows, then "code", "defaults"
 *            and "kwdefaults" rows, are read in tight loops: list them first): op "attr": getattr(parent, key) is
 *            `expected`;
 *            "item": parent[key] is `expected`; "len": len(parent) == `expected`; "contains": (key in parent) is
 *            `expected` (True or False); "seq": the list `parent` holds the items of the tuple `expected`, by identity;
 *            "class": type(parent) is `expected` (a pointer compare: `obj.__class__ = Other` sets no watched dict or
 *            type); "code", "defaults", "kwdefaults": the function `parent`'s __code__, __defaults__ or __kwdefaults__
 *            (None for none) is `expected` (`f.__code__ = ...` keeps the function; read from its struct: a getattr
 *            of __defaults__ raises an audit event); "cell": the closure cell `parent` holds `expected` (`absent`:
 *            empty)
 *   meta     None, or a callable holds() -> bool (module tensors' metadata as at its construction: a `.data` swap keeps
 *            the tensor object); meta_holds: None, or gearcache.native's META_HOLDS capsule, the same check in C
 * valid() is 1 until a change is seen; it never turns back to 1 (the caller re-checks the guards and makes a new
 * watch). Python 3.12+: the dicts and types are watched (PyDict_Watch with a filter of the keys on the paths,
 * PyType_Watch): any event that may matter advances one process-wide generation, and valid() compares it with the
 * watch's (other processes' watches share it: an event makes every watch re-check once). Where a watcher cannot be
 * had, or before 3.12, valid() compares each dict's version tag and re-reads the keys of a dict whose tag moved, and
 * compares each type's version tag.
 */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n_dicts;
    PyObject **dicts, **dict_keys, **dict_expected;   /* strong; a key may be NULL: every key */
    uint64_t *versions;                               /* the dicts' version tags when last seen valid (< 3.12) */
    Py_ssize_t n_types;
    PyObject **types;
    unsigned int *type_tags;
    Py_ssize_t n_checked;
    PyObject **parents, **keys, **expected;
    int *op;                    /* per checked row: CHECK_* */
    Py_ssize_t leading_end[4];  /* the first rows, by kind: "class" rows up to leading_end[0], then "code",
                                 * "defaults", "kwdefaults" rows (a tight loop of pointer compares each); the rest
                                 * go through checked_holds */
    PyObject *absent;
    PyObject *meta;             /* NULL, or the tensors' metadata check (called when meta_holds is NULL) */
    int (*meta_holds)(PyObject *);
    int watched;                /* 3.12+: every dict and type is watched */
    unsigned long long gen;
    int changed;                /* a change was seen: valid() stays 0 */
} GuardWatch;

enum { CHECK_ATTR, CHECK_ITEM, CHECK_LEN, CHECK_CONTAINS, CHECK_SEQ, CHECK_ATTR_EQ, CHECK_CLASS, CHECK_CODE,
       CHECK_DEFAULTS, CHECK_KWDEFAULTS, CHECK_CELL };
static const char *check_ops[] = {"attr", "item", "len", "contains", "seq", "attr_eq", "class", "code", "defaults",
                                  "kwdefaults", "cell", NULL};

static unsigned long long guard_generation = 0;
static PyObject *guard_filters = NULL;     /* {address of a watched dict: set of keys, or None: every key} */

#if PY_VERSION_HEX >= 0x030C0000
static int guard_dict_watcher = -1, guard_type_watcher = -1;

static void forget_filter(PyObject *dict) {
    if (!guard_filters) return;
    PyObject *addr = PyLong_FromVoidPtr(dict);
    if (addr) {
        if (PyDict_DelItem(guard_filters, addr) < 0) PyErr_Clear();
        Py_DECREF(addr);
    }
}

static int on_guard_dict_event(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *new_value) {
    (void)new_value;
    PyObject *pending = PyErr_GetRaisedException();    /* a callback must leave a pending exception as it was */
    int matters = 1;
    if (event == PyDict_EVENT_DEALLOCATED) {
        forget_filter(dict);
    } else if (key != NULL && guard_filters != NULL &&
               (event == PyDict_EVENT_ADDED || event == PyDict_EVENT_MODIFIED || event == PyDict_EVENT_DELETED)) {
        PyObject *addr = PyLong_FromVoidPtr(dict);
        PyObject *filter = addr ? PyDict_GetItemWithError(guard_filters, addr) : NULL;     /* borrowed */
        Py_XDECREF(addr);
        if (filter != NULL && filter != Py_None) {
            int r = PySet_Contains(filter, key);
            matters = (r != 0);                            /* on error: conservatively a change */
        }
        PyErr_Clear();
    }
    if (matters) guard_generation++;
    PyErr_SetRaisedException(pending);
    return 0;
}

static int on_guard_type_event(PyTypeObject *type) {
    (void)type;
    guard_generation++;
    return 0;
}

static void add_guard_watchers(void) {
    guard_dict_watcher = PyDict_AddWatcher(on_guard_dict_event);
    if (guard_dict_watcher < 0) PyErr_Clear();
    guard_type_watcher = PyType_AddWatcher(on_guard_type_event);
    if (guard_type_watcher < 0) PyErr_Clear();
}

/* 0 ok, -1 error: watch `dict` for `key` (NULL: every key) */
static int watch_guard_dict(PyObject *dict, PyObject *key) {
    if (PyDict_Watch(guard_dict_watcher, dict) < 0) return -1;
    PyObject *addr = PyLong_FromVoidPtr(dict);
    if (!addr) return -1;
    PyObject *filter = PyDict_GetItemWithError(guard_filters, addr);       /* borrowed */
    int r = 0;
    if (!filter && PyErr_Occurred()) r = -1;
    else if (key == NULL) r = PyDict_SetItem(guard_filters, addr, Py_None);
    else if (filter == Py_None) r = 0;
    else if (filter) r = PySet_Add(filter, key);
    else {
        PyObject *set = PySet_New(NULL);
        r = (!set || PySet_Add(set, key) < 0 || PyDict_SetItem(guard_filters, addr, set) < 0) ? -1 : 0;
        Py_XDECREF(set);
    }
    Py_DECREF(addr);
    return r;
}

static int watch_all(GuardWatch *self) {
    if (guard_dict_watcher < 0 || guard_type_watcher < 0 || !guard_filters) return 0;
    for (Py_ssize_t i = 0; i < self->n_dicts; i++) {
        if (watch_guard_dict(self->dicts[i], self->dict_keys[i]) < 0) { PyErr_Clear(); return 0; }
    }
    for (Py_ssize_t i = 0; i < self->n_types; i++) {
        if (PyType_Watch(guard_type_watcher, self->types[i]) < 0) { PyErr_Clear(); return 0; }
    }
    return 1;
}

static uint64_t dict_version(PyObject *dict) { (void)dict; return 0; }
#else
static void add_guard_watchers(void) {}
static int watch_all(GuardWatch *self) { (void)self; return 0; }
static uint64_t dict_version(PyObject *dict) { return ((PyDictObject *)dict)->ma_version_tag; }
#endif

/* the type's version tag, assigned now if it has none (0: it cannot get one) */
static unsigned int type_tag(PyObject *type) {
    PyTypeObject *t = (PyTypeObject *)type;
    if (!(t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) {
        static PyObject *name = NULL;
        if (!name) name = PyUnicode_InternFromString("__dict__");
        if (name) (void)_PyType_Lookup(t, name);        /* a lookup through the method cache assigns a tag */
    }
    return (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) ? t->tp_version_tag : 0;
}

static int guardwatch_traverse(GuardWatch *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < self->n_dicts; i++) {
        Py_VISIT(self->dicts[i]); Py_VISIT(self->dict_keys[i]); Py_VISIT(self->dict_expected[i]);
    }
    for (Py_ssize_t i = 0; i < self->n_types; i++) Py_VISIT(self->types[i]);
    for (Py_ssize_t i = 0; i < self->n_checked; i++) {
        Py_VISIT(self->parents[i]); Py_VISIT(self->keys[i]); Py_VISIT(self->expected[i]);
    }
    Py_VISIT(self->absent);
    Py_VISIT(self->meta);
    return 0;
}

static int guardwatch_clear(GuardWatch *self) {
    for (Py_ssize_t i = 0; i < self->n_dicts; i++) {
        Py_CLEAR(self->dicts[i]); Py_CLEAR(self->dict_keys[i]); Py_CLEAR(self->dict_expected[i]);
    }
    for (Py_ssize_t i = 0; i < self->n_types; i++) Py_CLEAR(self->types[i]);
    for (Py_ssize_t i = 0; i < self->n_checked; i++) {
        Py_CLEAR(self->parents[i]); Py_CLEAR(self->keys[i]); Py_CLEAR(self->expected[i]);
    }
    Py_CLEAR(self->absent);
    Py_CLEAR(self->meta);
    self->meta_holds = NULL;
    self->changed = 1;                  /* a cleared watch vouches for nothing */
    return 0;
}

static void guardwatch_dealloc(GuardWatch *self) {
    PyObject_GC_UnTrack(self);
    guardwatch_clear(self);
    PyMem_Free(self->dicts); PyMem_Free(self->dict_keys); PyMem_Free(self->dict_expected); PyMem_Free(self->versions);
    PyMem_Free(self->types); PyMem_Free(self->type_tags);
    PyMem_Free(self->parents); PyMem_Free(self->keys); PyMem_Free(self->expected); PyMem_Free(self->op);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* a list of `width`-tuples as a fast sequence (new reference), or NULL with an error */
static PyObject *tuple_rows(PyObject *rows, Py_ssize_t width, const char *what) {
    PyObject *fast = PySequence_Fast(rows, what);
    if (!fast) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        PyObject *row = PySequence_Fast_GET_ITEM(fast, i);
        if (width && (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != width)) {
            PyErr_Format(PyExc_TypeError, "%s: item %zd must be a %zd-tuple, got %R", what, i, width, row);
            Py_DECREF(fast);
            return NULL;
        }
    }
    return fast;
}

static PyObject *own(PyObject *o) { Py_XINCREF(o); return o; }

static int guardwatch_init(GuardWatch *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"dicts", "types", "checked", "absent", "meta", "meta_holds", NULL};
    PyObject *dicts, *types, *checked, *absent, *meta = Py_None, *meta_holds = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|OO", kwlist, &dicts, &types, &checked, &absent, &meta,
                                     &meta_holds))
        return -1;
    if (self->absent != NULL) { PyErr_SetString(PyExc_TypeError, "GuardWatch is initialised once"); return -1; }
    if (meta_holds != Py_None && !PyCapsule_IsValid(meta_holds, "gearcache.meta_holds")) {
        PyErr_Format(PyExc_TypeError, "meta_holds: expected None or gearcache.native's META_HOLDS, got %R", meta_holds);
        return -1;
    }
    if (meta != Py_None && meta_holds == Py_None && !PyCallable_Check(meta)) {
        PyErr_Format(PyExc_TypeError, "meta: expected None or a callable, got %R", meta);
        return -1;
    }
    PyObject *d = tuple_rows(dicts, 3, "dicts"), *t = d ? tuple_rows(types, 0, "types") : NULL;
    PyObject *c = t ? tuple_rows(checked, 4, "checked") : NULL;
    if (!c) { Py_XDECREF(d); Py_XDECREF(t); return -1; }
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(d), nt = PySequence_Fast_GET_SIZE(t), nc = PySequence_Fast_GET_SIZE(c);
    self->dicts = PyMem_Calloc(nd + 1, sizeof(PyObject *));
    self->dict_keys = PyMem_Calloc(nd + 1, sizeof(PyObject *));
    self->dict_expected = PyMem_Calloc(nd + 1, sizeof(PyObject *));
    self->versions = PyMem_Calloc(nd + 1, sizeof(uint64_t));
    self->types = PyMem_Calloc(nt + 1, sizeof(PyObject *));
    self->type_tags = PyMem_Calloc(nt + 1, sizeof(unsigned int));
    self->parents = PyMem_Calloc(nc + 1, sizeof(PyObject *));
    self->keys = PyMem_Calloc(nc + 1, sizeof(PyObject *));
    self->expected = PyMem_Calloc(nc + 1, sizeof(PyObject *));
    self->op = PyMem_Calloc(nc + 1, sizeof(int));
    int r = -1;
    if (!self->dicts || !self->dict_keys || !self->dict_expected || !self->versions || !self->types ||
        !self->type_tags || !self->parents || !self->keys || !self->expected || !self->op) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *row = PySequence_Fast_GET_ITEM(d, i), *dict = PyTuple_GET_ITEM(row, 0);
        if (!PyDict_Check(dict)) { PyErr_Format(PyExc_TypeError, "dicts: item %zd is not a dict", i); goto done; }
        PyObject *key = PyTuple_GET_ITEM(row, 1);
        self->dicts[i] = own(dict);
        self->dict_keys[i] = key == Py_None ? NULL : own(key);
        self->dict_expected[i] = own(PyTuple_GET_ITEM(row, 2));
        self->versions[i] = dict_version(dict);
        self->n_dicts = i + 1;
    }
    for (Py_ssize_t i = 0; i < nt; i++) {
        PyObject *type = PySequence_Fast_GET_ITEM(t, i);
        if (!PyType_Check(type)) { PyErr_Format(PyExc_TypeError, "types: item %zd is not a type", i); goto done; }
        self->types[i] = own(type);
        self->type_tags[i] = type_tag(type);
        self->n_types = i + 1;
    }
    for (Py_ssize_t i = 0; i < nc; i++) {
        PyObject *row = PySequence_Fast_GET_ITEM(c, i), *name = PyTuple_GET_ITEM(row, 0);
        int op = -1;
        for (int k = 0; check_ops[k] && op < 0; k++) {
            if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, check_ops[k]) == 0) op = k;
        }
        if (op < 0) { PyErr_Format(PyExc_ValueError, "checked: item %zd has an unknown op %R", i, name); goto done; }
        self->op[i] = op;
        self->parents[i] = own(PyTuple_GET_ITEM(row, 1));
        self->keys[i] = own(PyTuple_GET_ITEM(row, 2));
        self->expected[i] = own(PyTuple_GET_ITEM(row, 3));
        self->n_checked = i + 1;
        if ((op == CHECK_ATTR || op == CHECK_ATTR_EQ) && !PyUnicode_Check(self->keys[i])) {
            PyErr_Format(PyExc_TypeError, "checked: item %zd reads an attribute whose name is not a str", i);
            goto done;
        }
        if (((op == CHECK_CODE || op == CHECK_DEFAULTS || op == CHECK_KWDEFAULTS) && !PyFunction_Check(self->parents[i]))
            || (op == CHECK_CELL && !PyCell_Check(self->parents[i])) ||
            (op == CHECK_LEN && !PyLong_Check(self->expected[i])) ||
            (op == CHECK_SEQ && (!PyList_Check(self->parents[i]) || !PyTuple_Check(self->expected[i])))) {
            PyErr_Format(PyExc_TypeError, "checked: item %zd (%s) has a wrong parent or expected value", i,
                         check_ops[op]);
            goto done;
        }
    }
    static const int leading_ops[4] = {CHECK_CLASS, CHECK_CODE, CHECK_DEFAULTS, CHECK_KWDEFAULTS};
    for (int k = 0, end = 0; k < 4; k++) {
        while (end < nc && self->op[end] == leading_ops[k]) end++;
        self->leading_end[k] = end;
    }
    self->absent = own(absent);
    if (meta != Py_None) {
        self->meta = own(meta);
        if (meta_holds != Py_None)
            self->meta_holds = (int (*)(PyObject *))PyCapsule_GetPointer(meta_holds, "gearcache.meta_holds");
    }
    self->watched = watch_all(self);
    self->gen = guard_generation;
    r = 0;
done:
    Py_DECREF(d); Py_DECREF(t); Py_DECREF(c);
    return r;
}

/* 1: the read value is `expected`; 0: not (a failed read counts as `absent`); -1 error */
static int reads_expected(PyObject *got, PyObject *expected, PyObject *absent) {
    if (got) {
        int same = (got == expected);
        Py_DECREF(got);
        return same;
    }
    if (PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_LookupError) ||
        PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        return expected == absent;
    }
    return -1;
}

/* 1: `a` and `b` are equal plain data of the same types (bool, int, float, str, bytes, None, and lists and tuples of
 * them: what guard_watch._plain admits; floats by value and sign, NaN equal to NaN), 0: not, -1 error */
static int plain_equal(PyObject *a, PyObject *b) {
    if (Py_TYPE(a) != Py_TYPE(b)) return 0;
    if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
        if (n != PySequence_Fast_GET_SIZE(b)) return 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            int r = plain_equal(PySequence_Fast_GET_ITEM(a, k), PySequence_Fast_GET_ITEM(b, k));
            if (r != 1) return r;
        }
        return 1;
    }
    if (PyFloat_CheckExact(a)) {            /* by value and sign (copysign tells -0.0 from 0.0); NaN equals NaN */
        double x = PyFloat_AS_DOUBLE(a), y = PyFloat_AS_DOUBLE(b);
        return (x == y && signbit(x) == signbit(y)) || (isnan(x) && isnan(y));
    }
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

/* a function's defaults as Python reads them: None where the struct holds none */
static inline PyObject *or_none(PyObject *o) { return o ? o : Py_None; }

/* checked row i: 1 holds, 0 not, -1 error */
static int checked_holds(GuardWatch *self, Py_ssize_t i) {
    PyObject *parent = self->parents[i], *key = self->keys[i], *expected = self->expected[i];
    switch (self->op[i]) {
    case CHECK_ATTR: return reads_expected(PyObject_GetAttr(parent, key), expected, self->absent);
    case CHECK_ATTR_EQ: {                   /* a property that builds an equal value at every read */
        PyObject *got = PyObject_GetAttr(parent, key);
        if (!got) return reads_expected(NULL, expected, self->absent);
        int r = plain_equal(got, expected);
        Py_DECREF(got);
        return r;
    }
    case CHECK_ITEM: return reads_expected(PyObject_GetItem(parent, key), expected, self->absent);
    case CHECK_CLASS: return (PyObject *)Py_TYPE(parent) == expected;
    case CHECK_CODE: return PyFunction_GET_CODE(parent) == expected;
    /* read from the structs, not through getattr: reading __defaults__ or __kwdefaults__ raises an audit event, and
     * where an audit hook is installed (as on the GPU host) each read costs ~0.3 us */
    case CHECK_DEFAULTS: return or_none(PyFunction_GET_DEFAULTS(parent)) == expected;
    case CHECK_KWDEFAULTS: return or_none(PyFunction_GET_KW_DEFAULTS(parent)) == expected;
    case CHECK_CELL: {                      /* an empty cell reads as `absent` */
        PyObject *got = PyCell_GET(parent);
        return (got ? got : self->absent) == expected;
    }
    case CHECK_LEN: {
        Py_ssize_t n = PyObject_Length(parent);
        if (n < 0) { PyErr_Clear(); return 0; }
        return n == PyLong_AsSsize_t(expected);
    }
    case CHECK_CONTAINS: {
        int r = PySequence_Contains(parent, key);
        if (r < 0) { PyErr_Clear(); return 0; }
        return (r ? Py_True : Py_False) == expected;
    }
    default: {                              /* CHECK_SEQ: a list, the items of a tuple */
        Py_ssize_t n = PyList_GET_SIZE(parent);
        if (n != PyTuple_GET_SIZE(expected)) return 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            if (PyList_GET_ITEM(parent, k) != PyTuple_GET_ITEM(expected, k)) return 0;
        }
        return 1;
    }
    }
}

/* 1: every dict row and type is as at the watch's construction, 0: not. `by_version`: skip the keys of a dict whose
 * version tag has not moved (< 3.12); else every keyed row is read (a row watching a whole dict then counts as
 * changed: without a version tag it cannot be compared) */
static int rows_hold(GuardWatch *self, int by_version) {
    /* rows of one dict are consecutive (guard_watch.make_watch sorts them): its version is read once per group */
    for (Py_ssize_t i = 0, end; i < self->n_dicts; i = end) {
        PyObject *dict = self->dicts[i];
        for (end = i + 1; end < self->n_dicts && self->dicts[end] == dict; end++) {}
        uint64_t v = dict_version(dict);
        if (by_version && v != 0 && v == self->versions[i]) continue;
        for (Py_ssize_t k = i; k < end; k++) {
            if (self->dict_keys[k] == NULL) return 0;
            PyObject *got = PyDict_GetItemWithError(dict, self->dict_keys[k]);     /* borrowed */
            if (!got && PyErr_Occurred()) { PyErr_Clear(); return 0; }
            if ((got ? got : self->absent) != self->dict_expected[k]) return 0;
        }
        self->versions[i] = v;
    }
    for (Py_ssize_t i = 0; i < self->n_types; i++) {
        if (self->type_tags[i] && type_tag(self->types[i]) != self->type_tags[i]) return 0;
    }
    return 1;
}

/* 1 valid, 0 a change was seen, -1 error */
static int guardwatch_valid(GuardWatch *self) {
    if (self->changed) return 0;
    if (self->watched) {
        /* the generation is process-wide: an event on another watch's dict or type moves it too, so the rows are
         * read once before the watch counts as changed */
        if (self->gen != guard_generation) {
            unsigned long long now = guard_generation;
            if (!rows_hold(self, 0)) goto changed;
            self->gen = now;
        }
    } else if (!rows_hold(self, 1)) {
        goto changed;
    }
    Py_ssize_t i = 0;
    for (; i < self->leading_end[0]; i++) {
        if ((PyObject *)Py_TYPE(self->parents[i]) != self->expected[i]) goto changed;
    }
    for (; i < self->leading_end[1]; i++) {
        if (PyFunction_GET_CODE(self->parents[i]) != self->expected[i]) goto changed;
    }
    for (; i < self->leading_end[2]; i++) {
        if (or_none(PyFunction_GET_DEFAULTS(self->parents[i])) != self->expected[i]) goto changed;
    }
    for (; i < self->leading_end[3]; i++) {
        if (or_none(PyFunction_GET_KW_DEFAULTS(self->parents[i])) != self->expected[i]) goto changed;
    }
    for (; i < self->n_checked; i++) {
        int same = checked_holds(self, i);
        if (same < 0) return -1;
        if (!same) goto changed;
    }
    if (self->meta) {
        int holds;
        if (self->meta_holds) {
            holds = self->meta_holds(self->meta);
        } else {
            PyObject *r = PyObject_CallNoArgs(self->meta);
            if (!r) return -1;
            holds = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (holds < 0) return -1;
        }
        if (!holds) goto changed;
    }
    return 1;
changed:
    self->changed = 1;
    return 0;
}

static PyObject *guardwatch_valid_method(GuardWatch *self, PyObject *unused) {
    (void)unused;
    int v = guardwatch_valid(self);
    if (v < 0) return NULL;
    return PyBool_FromLong(v);
}

static PyObject *guardwatch_get_watched(GuardWatch *self, void *closure) { return PyBool_FromLong(self->watched); }
static PyObject *guardwatch_get_counts(GuardWatch *self, void *closure) {
    return Py_BuildValue("{s:n,s:n,s:n,s:O}", "dicts", self->n_dicts, "types", self->n_types, "checked",
                         self->n_checked, "meta", self->meta ? (self->meta_holds ? Py_True : Py_False) : Py_None);
}

static PyMethodDef guardwatch_methods[] = {
    {"valid", (PyCFunction)guardwatch_valid_method, METH_NOARGS, "True until a change of a watched object is seen"},
    {NULL}
};

static PyGetSetDef guardwatch_getset[] = {
    {"watched", (getter)guardwatch_get_watched, NULL, "dicts and types watched by the interpreter (3.12+)", NULL},
    {"counts", (getter)guardwatch_get_counts, NULL, "{dicts, types, checked}: what is watched and re-read", NULL},
    {NULL}
};

static PyTypeObject GuardWatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gearcache.call._callpath.GuardWatch",
    .tp_doc = "Notices a change of an object on the paths of value guards (see gearcache/keys/guard_watch.py).",
    .tp_basicsize = sizeof(GuardWatch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)guardwatch_init,
    .tp_dealloc = (destructor)guardwatch_dealloc,
    .tp_traverse = (traverseproc)guardwatch_traverse,
    .tp_clear = (inquiry)guardwatch_clear,
    .tp_methods = guardwatch_methods,
    .tp_getset = guardwatch_getset,
};

static PyObject *guard_generation_fn(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
    return PyLong_FromUnsignedLongLong(guard_generation);
}

/* ---- Dispatcher
 *
 * d._set_shortcut(matcher, entry, counters, watch=None) / d._set_shortcut(None): the shortcut, or none.
 *   matcher   signature.Matcher, a tuple (check, n, inference, same_state, is_inference_mode_enabled, plain):
 *             a call takes the shortcut when it has exactly n positional arguments and no keywords,
 *             same_state() is True (grad off and the thread's global torch state as when the matcher was made),
 *             inference mode is `inference` (is_inference_mode_enabled None: same_state() covers it) and
 *             check(*args) is True; `plain`: autocast was off when the matcher
 *             was made (so it is off whenever same_state() holds), and a Runner is then called directly, told
 *             that grad and autocast are off (it does not read them again)
 *   entry     the entry the shortcut serves: entry.build(entry.run(args), args); entry.run is read at every call
 *             (it changes when entry.compiled does); entry.hits and counters.hits are incremented (in place:
 *             through the entry's __slots__ member and the counters' instance dict, found once here; through
 *             getattr/setattr where they are not of that kind). Where entry.result_outputs (read once) is an int
 *             i or a tuple of ints, the result is outputs[i] or the tuple of those outputs, built here instead of
 *             by entry.build
 *   watch     None, or a GuardWatch over the value guards of the method's entries: the shortcut applies only while
 *             watch.valid() (checked first, in C)
 * d(*args, **kwargs): the shortcut when it applies, else d._call(*args, **kwargs).
 * d.shortcut_calls: calls served by the shortcut.
 */
/* The shortcut: one tuple, so that a call holds it alive with one reference (the objects a call touches after
 * Inductor's call() are cold in the CPU caches by then: the fewer, the better) */
enum { S_MATCHER, S_ENTRY, S_COUNTERS, S_PICKS, S_COUNTERS_DICT, S_WATCH, S_SIZE };

typedef struct {
    PyObject_HEAD
    PyObject *shortcut;         /* NULL: no shortcut; else a tuple indexed by S_*: */
                                /*   S_PICKS: entry.result_outputs, or None (entry.build builds the result) */
                                /*   S_COUNTERS_DICT: counters.__dict__ holding "hits" as a plain attribute, or None */
                                /*   S_WATCH: a GuardWatch, or None */
    int plain;                  /* autocast off in the matcher's state: a Runner need not check the state */
    Py_ssize_t hits_offset;     /* entry.hits as a __slots__ member: its offset in the entry; 0: getattr/setattr */
    Py_ssize_t shortcut_calls;
} Dispatcher;

static PyObject *str_run, *str_build, *str_hits, *str_call, *str_result_outputs;

static int dispatcher_traverse(Dispatcher *self, visitproc visit, void *arg) {
    Py_VISIT(self->shortcut);
    return 0;
}

static int dispatcher_clear(Dispatcher *self) {
    Py_CLEAR(self->shortcut);
    self->hits_offset = 0;
    self->plain = 0;
    return 0;
}

static void dispatcher_dealloc(Dispatcher *self) {
    PyObject_GC_UnTrack(self);
    dispatcher_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* an int >= 0, or a tuple of them */
static int valid_result_outputs(PyObject *r) {
    if (PyLong_Check(r)) {
        if (PyLong_AsSsize_t(r) >= 0) return 1;
        PyErr_Clear();
        return 0;
    }
    if (!PyTuple_Check(r)) return 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(r); k++) {
        PyObject *i = PyTuple_GET_ITEM(r, k);
        if (!PyLong_Check(i)) return 0;
        Py_ssize_t v = PyLong_AsSsize_t(i);
        if (v < 0) { PyErr_Clear(); return 0; }
    }
    return 1;
}

/* outputs[i] for r an int, the tuple of outputs[i] for r a tuple of ints (an IndexError for a short outputs) */
static PyObject *pick_outputs(PyObject *outs, PyObject *r) {
    PyObject *seq = PySequence_Fast(outs, "a compiled graph returns a list or tuple of outputs");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = NULL;
    if (PyLong_Check(r)) {
        Py_ssize_t i = PyLong_AsSsize_t(r);
        if (i >= n) PyErr_Format(PyExc_IndexError, "graph output %zd of %zd", i, n);
        else { result = items[i]; Py_INCREF(result); }
    } else {
        Py_ssize_t k = PyTuple_GET_SIZE(r);
        result = PyTuple_New(k);
        for (Py_ssize_t j = 0; result && j < k; j++) {
            Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(r, j));
            if (i >= n) {
                PyErr_Format(PyExc_IndexError, "graph output %zd of %zd", i, n);
                Py_CLEAR(result);
                break;
            }
            Py_INCREF(items[i]);
            PyTuple_SET_ITEM(result, j, items[i]);
        }
    }
    Py_DECREF(seq);
    return result;
}

/* The offset of obj's __slots__ member `name` holding an object, or 0 where `name` is not such a member. */
static Py_ssize_t member_offset(PyObject *obj, PyObject *name) {
    PyObject *descr = PyObject_GetAttr((PyObject *)Py_TYPE(obj), name);
    if (!descr) { PyErr_Clear(); return 0; }
    Py_ssize_t offset = 0;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY) && m->offset > 0) offset = m->offset;
    }
    Py_DECREF(descr);
    return offset;
}

/* obj.__dict__ (a new reference) where `name` is a plain instance attribute in it, else NULL (no error set). */
static PyObject *plain_attribute_dict(PyObject *obj, PyObject *name) {
    PyObject *on_type = PyObject_GetAttr((PyObject *)Py_TYPE(obj), name);
    if (!on_type) PyErr_Clear();
    else if (Py_TYPE(on_type)->tp_descr_set) { Py_DECREF(on_type); return NULL; }   /* a data descriptor */
    Py_XDECREF(on_type);
    PyObject *dict = PyObject_GenericGetDict(obj, NULL);
    if (!dict) { PyErr_Clear(); return NULL; }
    PyObject *value = PyDict_GetItemWithError(dict, name);
    if (!value || !PyLong_CheckExact(value)) { PyErr_Clear(); Py_DECREF(dict); return NULL; }
    return dict;
}

static PyObject *dispatcher_set_shortcut(Dispatcher *self, PyObject *args) {
    PyObject *matcher, *entry = Py_None, *counters = Py_None, *watch = Py_None;
    if (!PyArg_ParseTuple(args, "O|OOO:_set_shortcut", &matcher, &entry, &counters, &watch)) return NULL;
    if (watch != Py_None && !Py_IS_TYPE(watch, &GuardWatchType)) {
        PyErr_Format(PyExc_TypeError, "_set_shortcut: watch must be a GuardWatch or None, got %R", watch);
        return NULL;
    }
    if (matcher == Py_None) {
        dispatcher_clear(self);
        Py_RETURN_NONE;
    }
    if (!PyTuple_Check(matcher) || PyTuple_GET_SIZE(matcher) != 6 || !PyLong_Check(PyTuple_GET_ITEM(matcher, 1))) {
        PyErr_Format(PyExc_TypeError, "_set_shortcut: matcher must be a signature.Matcher, got %R", matcher);
        return NULL;
    }
    if (entry == Py_None || counters == Py_None) {
        PyErr_SetString(PyExc_TypeError, "_set_shortcut: a matcher needs its entry and the counters");
        return NULL;
    }
    PyObject *result_outputs = PyObject_GetAttr(entry, str_result_outputs);
    if (!result_outputs) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
    } else if (!valid_result_outputs(result_outputs)) {
        Py_CLEAR(result_outputs);
    }
    int plain = PyObject_IsTrue(PyTuple_GET_ITEM(matcher, 5));
    if (plain < 0) { Py_XDECREF(result_outputs); return NULL; }
    PyObject *counters_dict = plain_attribute_dict(counters, str_hits);
    PyObject *shortcut = PyTuple_Pack(S_SIZE, matcher, entry, counters, result_outputs ? result_outputs : Py_None,
                                      counters_dict ? counters_dict : Py_None, watch);
    Py_XDECREF(result_outputs);
    Py_XDECREF(counters_dict);
    if (!shortcut) return NULL;
    self->hits_offset = member_offset(entry, str_hits);
    self->plain = plain;
    Py_XSETREF(self->shortcut, shortcut);
    Py_RETURN_NONE;
}

/* obj.name += 1 */
static int increment(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    PyObject *one = PyLong_FromLong(1);
    PyObject *w = one ? PyNumber_Add(v, one) : NULL;
    Py_DECREF(v);
    Py_XDECREF(one);
    if (!w) return -1;
    int r = PyObject_SetAttr(obj, name, w);
    Py_DECREF(w);
    return r;
}

/* v + 1 for an exact int v (a new reference); NULL with no error set when v is not one */
static PyObject *int_plus_one(PyObject *v) {
    if (!v || !PyLong_CheckExact(v)) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    return (n == -1 && PyErr_Occurred()) ? NULL : PyLong_FromSsize_t(n + 1);
}

/* entry.hits += 1 and counters.hits += 1: in place where _set_shortcut found how, else through getattr/setattr */
static int count_hit(PyObject *shortcut, Py_ssize_t hits_offset) {
    PyObject *entry = PyTuple_GET_ITEM(shortcut, S_ENTRY), *counters = PyTuple_GET_ITEM(shortcut, S_COUNTERS);
    PyObject *counters_dict = PyTuple_GET_ITEM(shortcut, S_COUNTERS_DICT);
    PyObject **slot = hits_offset ? (PyObject **)((char *)entry + hits_offset) : NULL;
    PyObject *w = slot ? int_plus_one(*slot) : NULL;
    if (w) Py_SETREF(*slot, w);
    else if (PyErr_Occurred() || increment(entry, str_hits) < 0) return -1;
    if (counters_dict == Py_None) return increment(counters, str_hits);
    w = int_plus_one(PyDict_GetItemWithError(counters_dict, str_hits));    /* borrowed item */
    if (!w) return PyErr_Occurred() ? -1 : increment(counters, str_hits);
    int r = PyDict_SetItem(counters_dict, str_hits, w);
    Py_DECREF(w);
    return r;
}

/* 1: the shortcut applies, 0: it does not, -1: error. `m` is a strong reference the caller holds. */
static int shortcut_applies(PyObject *m, PyObject *args, PyObject *kwargs) {
    if ((kwargs && PyDict_GET_SIZE(kwargs)) || PyTuple_GET_SIZE(args) != PyLong_AsSsize_t(PyTuple_GET_ITEM(m, 1)))
        return 0;
    PyObject *r = PyObject_CallNoArgs(PyTuple_GET_ITEM(m, 3));          /* same_state: grad off, ... */
    if (!r) return -1;
    int same = (r == Py_True);
    Py_DECREF(r);
    if (!same) return 0;
    PyObject *inference = PyTuple_GET_ITEM(m, 4);                      /* is_inference_mode_enabled, or None */
    if (inference != Py_None) {
        r = PyObject_CallNoArgs(inference);
        if (!r) return -1;
        int same_mode = PyObject_IsTrue(r) == PyObject_IsTrue(PyTuple_GET_ITEM(m, 2));
        Py_DECREF(r);
        if (!same_mode) return 0;
    }
    r = PyObject_Call(PyTuple_GET_ITEM(m, 0), args, NULL);              /* check(*args) */
    if (!r) return -1;
    int ok = (r == Py_True);
    Py_DECREF(r);
    return ok;
}

static PyObject *dispatcher_call(Dispatcher *self, PyObject *args, PyObject *kwargs) {
    /* a strong reference for the whole call: the code it runs may replace the shortcut */
    PyObject *shortcut = self->shortcut;
    Py_ssize_t hits_offset = self->hits_offset;
    int plain = self->plain;
    int applies = 0;
    if (shortcut) {
        Py_INCREF(shortcut);
        PyObject *watch = PyTuple_GET_ITEM(shortcut, S_WATCH);
        applies = watch == Py_None ? 1 : guardwatch_valid((GuardWatch *)watch);
        if (applies > 0) applies = shortcut_applies(PyTuple_GET_ITEM(shortcut, S_MATCHER), args, kwargs);
    }
    PyObject *result = NULL, *outs = NULL, *run = NULL;
    if (applies < 0) goto done;
    if (!applies) {
        PyObject *slow = PyObject_GetAttr((PyObject *)self, str_call);
        if (slow) {
            result = PyObject_Call(slow, args, kwargs);
            Py_DECREF(slow);
        }
        goto done;
    }
    PyObject *entry = PyTuple_GET_ITEM(shortcut, S_ENTRY), *picks = PyTuple_GET_ITEM(shortcut, S_PICKS);
    run = PyObject_GetAttr(entry, str_run);
    if (!run) goto done;
    outs = Py_IS_TYPE(run, &RunnerType) ? runner_run((Runner *)run, args, plain) : PyObject_CallOneArg(run, args);
    if (!outs) goto done;
    if (picks != Py_None) {
        result = pick_outputs(outs, picks);
    } else {
        PyObject *build = PyObject_GetAttr(entry, str_build);
        result = build ? PyObject_CallFunctionObjArgs(build, outs, args, NULL) : NULL;
        Py_XDECREF(build);
    }
    if (!result) goto done;
    self->shortcut_calls++;
    if (count_hit(shortcut, hits_offset) < 0) Py_CLEAR(result);
done:
    Py_XDECREF(run);
    Py_XDECREF(outs);
    Py_XDECREF(shortcut);
    return result;
}

static PyObject *dispatcher_get_shortcut_calls(Dispatcher *self, void *closure) {
    return PyLong_FromSsize_t(self->shortcut_calls);
}

static PyMethodDef dispatcher_methods[] = {
    {"_set_shortcut", (PyCFunction)dispatcher_set_shortcut, METH_VARARGS,
     "_set_shortcut(matcher, entry, counters, watch=None) or _set_shortcut(None)"},
    {NULL}
};

static PyGetSetDef dispatcher_getset[] = {
    {"shortcut_calls", (getter)dispatcher_get_shortcut_calls, NULL, "calls served by the shortcut", NULL},
    {NULL}
};

static PyTypeObject DispatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gearcache.call._callpath.Dispatcher",
    .tp_doc = "Base class of CachedFunction: a call like the last one through a shortcut, others to self._call.",
    .tp_basicsize = sizeof(Dispatcher),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)dispatcher_dealloc,
    .tp_traverse = (traverseproc)dispatcher_traverse,
    .tp_clear = (inquiry)dispatcher_clear,
    .tp_call = (ternaryfunc)dispatcher_call,
    .tp_methods = dispatcher_methods,
    .tp_getset = dispatcher_getset,
};

static PyObject *type_version_fn(PyObject *module, PyObject *type) {
    (void)module;
    if (!PyType_Check(type)) { PyErr_Format(PyExc_TypeError, "type_version: expected a class, got %R", type); return NULL; }
    return PyLong_FromUnsignedLong(type_tag(type));
}

static PyMethodDef module_methods[] = {
    {"type_version", type_version_fn, METH_O,
     "type_version(cls) -> int: cls's version tag, which changes whenever cls or a base class is modified (an "
     "attribute set or deleted, its bases replaced); 0 where none can be assigned"},
    {"guard_generation", guard_generation_fn, METH_NOARGS,
     "how many changes of watched guard objects the interpreter reported (tests)"},
    {NULL}
};

static struct PyModuleDef callpath_module = {
    PyModuleDef_HEAD_INIT, "gearcache.call._callpath",
    "The per-call work in C (see gearcache/call/entry.py, gearcache/call/dispatch.py and gearcache/keys/guard_watch.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__callpath(void) {
    str_data_ptr = PyUnicode_InternFromString("data_ptr");
    if (!str_data_ptr) return NULL;
    str_run = PyUnicode_InternFromString("run");
    str_build = PyUnicode_InternFromString("build");
    str_hits = PyUnicode_InternFromString("hits");
    str_call = PyUnicode_InternFromString("_call");
    str_result_outputs = PyUnicode_InternFromString("result_outputs");
    if (!str_run || !str_build || !str_hits || !str_call || !str_result_outputs) return NULL;
    if (watcher_id < 0) add_watcher();
    if (!guard_filters) {
        guard_filters = PyDict_New();
        if (!guard_filters) return NULL;
        add_guard_watchers();
    }
    if (PyType_Ready(&RunnerType) < 0 || PyType_Ready(&DispatcherType) < 0 || PyType_Ready(&GuardWatchType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&callpath_module);
    if (!m) return NULL;
    Py_INCREF(&RunnerType);
    if (PyModule_AddObject(m, "Runner", (PyObject *)&RunnerType) < 0) {
        Py_DECREF(&RunnerType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&DispatcherType);
    if (PyModule_AddObject(m, "Dispatcher", (PyObject *)&DispatcherType) < 0) {
        Py_DECREF(&DispatcherType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&GuardWatchType);
    if (PyModule_AddObject(m, "GuardWatch", (PyObject *)&GuardWatchType) < 0) {
        Py_DECREF(&GuardWatchType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ALIGNMENT", ALIGNMENT) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
