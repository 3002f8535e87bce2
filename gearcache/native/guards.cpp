// gearcache.native's compiled module: the dispatch shortcut's checks, read straight from torch's C++ state.
//
// Built against the headers of the torch it runs with (gearcache/native/build.py), once per machine and torch
// build, and loaded only into a process whose torch has the same build key (BUILD_KEY below). Two types, drop-ins
// for what gearcache used from Dynamo (torch._C._dynamo.guards) before, and a C function for gearcache.call._callpath:
//
//   TensorMatch(tensors, forbidden=None, distinct=False)
//                            match(*others) -> bool, as TensorGuards(...).check with every size and stride given:
//                            each argument has the same Python type, dispatch keys under the thread's dispatch
//                            state, dtype, device index, requires_grad, sizes and strides as the tensor at its
//                            place, and no argument is passed twice. Another argument count raises TypeError.
//                            `distinct`: also no two arguments over overlapping memory; `forbidden` (per tensor None or
//                            (start, end) byte ranges): no argument whose storage's bytes overlap its ranges, by memory
//                            as memory.Forbidden (from_numpy views overlap too; gearcache/call/state_alias.py).
//   StateSnapshot()          same() -> bool: True while the calling thread's torch state is as at construction:
//                            grad and inference mode, the thread's local dispatch keys (so autocast on/off for
//                            every device type), autocast's dtypes and cache where it is on, default dtype,
//                            deterministic algorithms (on, warn only), torch-function state (enabled, subclasses or
//                            all disabled; the depth of the TorchFunctionMode stack), cuBLAS TF32 and reduced-precision reductions, the four scaled-dot-product
//                            attention backends, the thread count. Like Dynamo's GlobalStateGuard it leaves out
//                            cuDNN's TF32 flag and the float32 matmul precision (but "highest" against "high" or
//                            "medium" moves cuBLAS TF32, which it reads): reading those costs ~1,000 instructions on
//                            torch 2.13 (a hash lookup each); a change of only those is seen at the next miss.
//   MetaMatch(tensors)       holds() -> bool: each tensor (held) still has the dtype, device, sizes, strides and
//                            data address it had at construction (a `.data` swap keeps the Python object but
//                            changes these); META_HOLDS, a PyCapsule named "gearcache.meta_holds" holding
//                            int gearcache_meta_holds(PyObject* meta_match), the same check for gearcache.call._callpath
//   DATA_PTR                 a PyCapsule named "gearcache.data_ptr" holding
//                            int gearcache_data_ptr(PyObject* tensor, uintptr_t* out): tensor.data_ptr() in C, for
//                            gearcache.call._callpath's alignment checks (0: done; -1: ask Python)
//
// Why: Dynamo's checks are general (symbolic sizes, a hash set for aliasing, a vector per tensor) and cost ~5,400
// instructions per call of the decode step; these read the same fields directly. A check that cannot answer (a
// C++ exception) answers False: the caller then takes its general path, which computes the full key.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "guards_state.h"          // StateSnapshot

#ifndef GEARCACHE_BUILD_KEY
#error "build with -DGEARCACHE_BUILD_KEY=\"...\" (gearcache/native/build.py does)"
#endif

namespace {

// ------------------------------------------------------------------------------------------------ TensorMatch
uint64_t effective_keys(c10::DispatchKeySet keys, const c10::impl::LocalDispatchKeySet& tls) {
    return ((keys | tls.included_) - tls.excluded_).raw_repr();
}

struct Expected {
    PyTypeObject* type;
    uint64_t keys;                  // effective_keys at construction
    caffe2::TypeMeta dtype;
    c10::DeviceIndex device_index;
    bool requires_grad;
    size_t offset;                  // of this tensor's sizes, then strides, in TensorMatch::dims
    size_t ndim;
};

// byte ranges [start, end) sorted by start; reach[i]: the largest end of the first i + 1 (ranges may overlap)
struct Ranges {
    std::vector<uintptr_t> starts, ends, reach;

    bool overlaps(uintptr_t start, uintptr_t end) const {
        if (starts.empty() || end <= start) return false;
        const auto it = std::lower_bound(starts.begin(), starts.end(), end);   // ranges before it start below `end`
        return it != starts.begin() && reach[static_cast<size_t>(it - starts.begin()) - 1] > start;
    }
};

struct TensorMatch {
    PyObject_HEAD
    std::vector<Expected>* expected;
    std::vector<int64_t>* dims;
    // per tensor, the byte ranges its storage must not overlap; nullptr without `forbidden`
    std::vector<Ranges>* forbidden;
    bool distinct;                  // no two tensors over overlapping memory
};

// the address of the first byte of a tensor's storage (storage_address in gearcache/call/signature.py); 0 for one
// without storage or data (which shares memory with nothing)
uintptr_t storage_address(const c10::TensorImpl* impl) {
    const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
    return storage ? reinterpret_cast<uintptr_t>(storage->data_ptr().get()) : 0;
}

// `forbidden`: None, or a tuple with an item per tensor: None or an iterable of (start, end) int pairs
bool read_forbidden(PyObject* forbidden, Py_ssize_t n, std::vector<Ranges>& out) {
    if (!PyTuple_Check(forbidden) || PyTuple_GET_SIZE(forbidden) != n) {
        PyErr_SetString(PyExc_TypeError, "TensorMatch: forbidden must be a tuple with an item per tensor");
        return false;
    }
    out.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject* item = PyTuple_GET_ITEM(forbidden, i);
        if (item == Py_None) continue;
        PyObject* fast = PySequence_Fast(item, "TensorMatch: forbidden items are None or sequences of (start, end)");
        if (!fast) return false;
        std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(fast); k++) {
            unsigned long long start = 0, end = 0;
            PyObject* pair = PySequence_Fast_GET_ITEM(fast, k);
            if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "KK", &start, &end)) {
                if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                    PyErr_Clear();
                    PyErr_SetString(PyExc_TypeError, "TensorMatch: a forbidden range is a (start, end) int pair");
                }
                Py_DECREF(fast);
                return false;
            }
            if (end > start) ranges.emplace_back(start, end);                  // empty: no memory
        }
        Py_DECREF(fast);
        std::sort(ranges.begin(), ranges.end());
        Ranges& r = out[static_cast<size_t>(i)];
        uintptr_t top = 0;
        for (const auto& [start, end] : ranges) {
            top = std::max(top, end);
            r.starts.push_back(start);
            r.ends.push_back(end);
            r.reach.push_back(top);
        }
    }
    return true;
}

bool plain_strided(const c10::TensorImpl* impl) {
    return impl->layout() == c10::kStrided && !impl->has_symbolic_sizes_strides() && !impl->is_nested();
}

int tensor_match_init(TensorMatch* self, PyObject* args, PyObject* kwds) {
    PyObject* tensors = nullptr;
    PyObject* forbidden = Py_None;
    int distinct = 0;
    static const char* kwlist[] = {"tensors", "forbidden", "distinct", nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!|Op", const_cast<char**>(kwlist), &PyTuple_Type, &tensors,
                                     &forbidden, &distinct))
        return -1;
    auto storages = std::vector<Ranges>();
    if (forbidden != Py_None && !read_forbidden(forbidden, PyTuple_GET_SIZE(tensors), storages)) return -1;
    try {
        auto expected = std::vector<Expected>();
        auto dims = std::vector<int64_t>();
        const auto tls = c10::impl::tls_local_dispatch_key_set();
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors); i++) {
            PyObject* item = PyTuple_GET_ITEM(tensors, i);
            if (!THPVariable_Check(item)) {
                PyErr_Format(PyExc_TypeError, "TensorMatch: tensors[%zd] is a %s, not a tensor", i,
                             Py_TYPE(item)->tp_name);
                return -1;
            }
            const at::Tensor& t = THPVariable_Unpack(item);
            const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
            if (!plain_strided(impl)) {
                PyErr_Format(PyExc_TypeError, "TensorMatch: tensors[%zd] is not a plain strided tensor", i);
                return -1;
            }
            const auto sizes = impl->sizes();
            const auto strides = impl->strides();
            expected.push_back(Expected{Py_TYPE(item), effective_keys(impl->key_set(), tls), impl->dtype(),
                                        impl->device().index(), t.requires_grad(), dims.size(), sizes.size()});
            dims.insert(dims.end(), sizes.begin(), sizes.end());
            dims.insert(dims.end(), strides.begin(), strides.end());
        }
        self->expected = new std::vector<Expected>(std::move(expected));
        self->dims = new std::vector<int64_t>(std::move(dims));
        self->forbidden = forbidden == Py_None ? nullptr
                                               : new std::vector<Ranges>(std::move(storages));
        self->distinct = distinct != 0;
    } catch (const std::exception& e) {
        PyErr_Format(PyExc_RuntimeError, "TensorMatch: %s", e.what());
        return -1;
    }
    return 0;
}

void tensor_match_dealloc(TensorMatch* self) {
    delete self->expected;
    delete self->dims;
    delete self->forbidden;
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// no two arguments whose storages overlap in memory (with `distinct`), none whose storage overlaps a range
// `forbidden` names for it
bool storages_apart(const TensorMatch* self, PyObject* args) {
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    std::array<std::pair<uintptr_t, uintptr_t>, 16> small{};
    std::vector<std::pair<uintptr_t, uintptr_t>> large;
    auto* seen = small.data();
    if (n > static_cast<Py_ssize_t>(small.size())) {
        large.resize(static_cast<size_t>(n));
        seen = large.data();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const c10::TensorImpl* impl = THPVariable_Unpack(PyTuple_GET_ITEM(args, i)).unsafeGetTensorImpl();
        const uintptr_t a = storage_address(impl);
        const uintptr_t end = a ? a + impl->unsafe_storage().unsafeGetStorageImpl()->nbytes() : 0;
        seen[i] = {a, end};
        if (a == end) continue;
        for (Py_ssize_t j = 0; self->distinct && j < i; j++) {
            if (seen[j].first < end && a < seen[j].second) return false;     // by bytes: from_numpy views too
        }
        if (self->forbidden) {
            const Ranges& no = (*self->forbidden)[static_cast<size_t>(i)];
            if (!no.starts.empty() && no.overlaps(a, end)) return false;
        }
    }
    return true;
}

bool matches(const TensorMatch* self, PyObject* args) {
    const auto& expected = *self->expected;
    const int64_t* dims = self->dims->data();
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    const auto tls = c10::impl::tls_local_dispatch_key_set();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject* item = PyTuple_GET_ITEM(args, i);
        const Expected& e = expected[i];
        if (Py_TYPE(item) != e.type) return false;                  // the type was a tensor type at construction
        for (Py_ssize_t j = 0; j < i; j++) {
            if (PyTuple_GET_ITEM(args, j) == item) return false;    // passed twice (Dynamo's check refuses it too)
        }
        const at::Tensor& t = THPVariable_Unpack(item);
        const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
        if (effective_keys(impl->key_set(), tls) != e.keys || impl->dtype() != e.dtype || !plain_strided(impl) ||
            impl->device().index() != e.device_index || t.requires_grad() != e.requires_grad)
            return false;
        const auto sizes = impl->sizes();
        if (sizes.size() != e.ndim) return false;
        const auto strides = impl->strides();
        const int64_t* want = dims + e.offset;
        for (size_t d = 0; d < e.ndim; d++) {
            if (sizes[d] != want[d] || strides[d] != want[e.ndim + d]) return false;
        }
    }
    return (!self->distinct && !self->forbidden) || storages_apart(self, args);
}

PyObject* tensor_match_call(TensorMatch* self, PyObject* args, PyObject* kwargs) {
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "TensorMatch takes positional tensors only");
        return nullptr;
    }
    if (!self->expected) {
        PyErr_SetString(PyExc_TypeError, "TensorMatch was not initialised: make it with TensorMatch(tensors)");
        return nullptr;
    }
    if (PyTuple_GET_SIZE(args) != static_cast<Py_ssize_t>(self->expected->size())) {
        PyErr_Format(PyExc_TypeError, "TensorMatch made for %zd tensors called with %zd arguments",
                     static_cast<Py_ssize_t>(self->expected->size()), PyTuple_GET_SIZE(args));
        return nullptr;
    }
    bool ok = false;
    try {
        ok = matches(self, args);
    } catch (const std::exception&) {
        ok = false;
    }
    return PyBool_FromLong(ok);
}

PyTypeObject TensorMatchType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// -------------------------------------------------------------------------------------------------- MetaMatch
// The module tensors a graph reads (parameters, buffers): held, and each call compared with their metadata at
// construction (dispatch keys, dtype, device, sizes, strides, storage, its address and the storage offset: a CUDA
// graph holds the address, Inductor's code assumes its alignment). `.data = t` swaps a tensor's storage and metadata in place, keeping its
// Python object: only a read of the tensor itself sees it.
struct Meta {
    PyObject* tensor;               // strong
    uint64_t keys;                  // the dispatch key set: layout, device type, conjugate/negative bits, subclasses
    caffe2::TypeMeta dtype;
    c10::Device device;
    const void* storage;            // the StorageImpl, and its first byte's address
    const void* data;
    int64_t storage_offset;
    size_t offset;                  // of this tensor's sizes, then strides, in MetaMatch::dims
    size_t ndim;
};

struct MetaMatch {
    PyObject_HEAD
    std::vector<Meta>* metas;
    std::vector<int64_t>* dims;
};

// a tensor's storage and the address of its first byte (nullptrs for a tensor without storage)
std::pair<const void*, const void*> storage_of(const c10::TensorImpl* impl) {
    const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
    return {storage, storage ? storage->data_ptr().get() : nullptr};
}

int meta_match_init(MetaMatch* self, PyObject* args, PyObject* kwds) {
    PyObject* tensors = nullptr;
    static const char* kwlist[] = {"tensors", nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", const_cast<char**>(kwlist), &PyTuple_Type, &tensors))
        return -1;
    if (self->metas) {
        PyErr_SetString(PyExc_TypeError, "MetaMatch is initialised once");
        return -1;
    }
    try {
        auto metas = std::vector<Meta>();
        auto dims = std::vector<int64_t>();
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors); i++) {
            PyObject* item = PyTuple_GET_ITEM(tensors, i);
            if (!THPVariable_Check(item)) {
                PyErr_Format(PyExc_TypeError, "MetaMatch: tensors[%zd] is a %s, not a tensor", i,
                             Py_TYPE(item)->tp_name);
                return -1;
            }
            const c10::TensorImpl* impl = THPVariable_Unpack(item).unsafeGetTensorImpl();
            if (!plain_strided(impl)) {
                PyErr_Format(PyExc_TypeError, "MetaMatch: tensors[%zd] is not a plain strided tensor", i);
                return -1;
            }
            const auto sizes = impl->sizes();
            const auto strides = impl->strides();
            const auto storage = storage_of(impl);
            metas.push_back(Meta{item, impl->key_set().raw_repr(), impl->dtype(), impl->device(), storage.first,
                                 storage.second, impl->storage_offset(), dims.size(), sizes.size()});
            dims.insert(dims.end(), sizes.begin(), sizes.end());
            dims.insert(dims.end(), strides.begin(), strides.end());
        }
        for (auto& m : metas) Py_INCREF(m.tensor);
        self->metas = new std::vector<Meta>(std::move(metas));
        self->dims = new std::vector<int64_t>(std::move(dims));
    } catch (const std::exception& e) {
        PyErr_Format(PyExc_RuntimeError, "MetaMatch: %s", e.what());
        return -1;
    }
    return 0;
}

void meta_match_dealloc(MetaMatch* self) {
    if (self->metas) {
        for (auto& m : *self->metas) Py_DECREF(m.tensor);
    }
    delete self->metas;
    delete self->dims;
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

bool metas_hold(const MetaMatch* self) noexcept {
    if (!self->metas) return false;
    const int64_t* dims = self->dims->data();
    try {
        for (const Meta& m : *self->metas) {
            const c10::TensorImpl* impl = THPVariable_Unpack(m.tensor).unsafeGetTensorImpl();
            if (impl->key_set().raw_repr() != m.keys || impl->dtype() != m.dtype ||
                impl->storage_offset() != m.storage_offset || impl->device() != m.device)
                return false;
            if (storage_of(impl) != std::make_pair(m.storage, m.data)) return false;
            const auto sizes = impl->sizes();
            if (sizes.size() != m.ndim) return false;
            const auto strides = impl->strides();
            const int64_t* want = dims + m.offset;
            for (size_t d = 0; d < m.ndim; d++) {
                if (sizes[d] != want[d] || strides[d] != want[m.ndim + d]) return false;
            }
        }
    } catch (const std::exception&) {
        return false;
    }
    return true;
}

PyObject* meta_match_call(MetaMatch* self, PyObject* args, PyObject* kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "a MetaMatch is called with no arguments");
        return nullptr;
    }
    return PyBool_FromLong(metas_hold(self));
}

PyTypeObject MetaMatchType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// --------------------------------------------------------------------------------------------------- module
// The C function behind the DATA_PTR capsule, for gearcache.call._callpath's alignment checks: 0 and the address of the
// tensor's first element (tensor.data_ptr()), or -1 (not a tensor, or no data: the caller asks Python instead).
// No Python error is set either way.
extern "C" int gearcache_data_ptr(PyObject* obj, uintptr_t* out) noexcept {
    if (!THPVariable_Check(obj)) return -1;
    try {
        *out = reinterpret_cast<uintptr_t>(THPVariable_Unpack(obj).const_data_ptr());
        return 0;
    } catch (const std::exception&) {
        return -1;
    }
}

// The C function behind the META_HOLDS capsule, for gearcache.call._callpath's GuardWatch: 1 while every tensor of the
// MetaMatch `obj` has its metadata as at construction, else 0 (and 0 for any other object). No Python error is set.
extern "C" int gearcache_meta_holds(PyObject* obj) noexcept {
    if (!obj || Py_TYPE(obj) != &MetaMatchType) return 0;
    return metas_hold(reinterpret_cast<MetaMatch*>(obj)) ? 1 : 0;
}

void init_type(PyTypeObject& type, const char* name, size_t size, const char* doc, initproc init, ternaryfunc call) {
    type.tp_name = name;
    type.tp_basicsize = static_cast<Py_ssize_t>(size);
    type.tp_flags = Py_TPFLAGS_DEFAULT;
    type.tp_doc = doc;
    type.tp_new = PyType_GenericNew;
    type.tp_init = init;
    type.tp_call = call;
}

// plain_tensors(args) -> bool: every item is an exact torch.Tensor (no subclass, no Parameter), no two are the same
// object, and none has its conjugate or negative bit set: a call whose signature key needs nothing but each tensor's
// shape, stride, dtype and device (gearcache/call/signature.py's fast path).
PyObject* plain_tensors(PyObject* /*module*/, PyObject* args) {
    if (!PyTuple_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "plain_tensors takes a tuple");
        return nullptr;
    }
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject* item = PyTuple_GET_ITEM(args, i);
        if (Py_TYPE(item) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) Py_RETURN_FALSE;
        for (Py_ssize_t j = 0; j < i; j++) {
            if (PyTuple_GET_ITEM(args, j) == item) Py_RETURN_FALSE;
        }
        const c10::TensorImpl* impl = THPVariable_Unpack(item).unsafeGetTensorImpl();
        if (impl->is_conj() || impl->is_neg()) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

PyMethodDef module_methods[] = {
    {"plain_tensors", plain_tensors, METH_O,
     "plain_tensors(args) -> bool: exact torch.Tensor objects, none twice, no conjugate or negative bit"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "gearcache_native_guards", "gearcache's native dispatch checks",
                          -1, module_methods};

}  // namespace

PyMODINIT_FUNC PyInit_gearcache_native_guards(void) {
    init_type(TensorMatchType, "gearcache_native_guards.TensorMatch", sizeof(TensorMatch),
              "match(*tensors) -> bool: the tensors' metadata as at construction",
              reinterpret_cast<initproc>(tensor_match_init), reinterpret_cast<ternaryfunc>(tensor_match_call));
    TensorMatchType.tp_dealloc = reinterpret_cast<destructor>(tensor_match_dealloc);
    init_type(StateSnapshotType, "gearcache_native_guards.StateSnapshot", sizeof(StateSnapshot),
              "same() -> bool: the thread's torch state as at construction",
              reinterpret_cast<initproc>(state_snapshot_init), reinterpret_cast<ternaryfunc>(state_snapshot_call));
    init_type(MetaMatchType, "gearcache_native_guards.MetaMatch", sizeof(MetaMatch),
              "holds() -> bool: the held tensors' metadata as at construction",
              reinterpret_cast<initproc>(meta_match_init), reinterpret_cast<ternaryfunc>(meta_match_call));
    MetaMatchType.tp_dealloc = reinterpret_cast<destructor>(meta_match_dealloc);
    find_autocast_devices();
    if (PyType_Ready(&TensorMatchType) < 0 || PyType_Ready(&StateSnapshotType) < 0 ||
        PyType_Ready(&MetaMatchType) < 0)
        return nullptr;
    PyObject* m = PyModule_Create(&module_def);
    if (!m) return nullptr;
    PyObject* data_ptr = PyCapsule_New(reinterpret_cast<void*>(&gearcache_data_ptr), "gearcache.data_ptr", nullptr);
    if (!data_ptr || PyModule_AddObject(m, "DATA_PTR", data_ptr) < 0) {
        Py_XDECREF(data_ptr);
        Py_DECREF(m);
        return nullptr;
    }
    PyObject* meta_holds = PyCapsule_New(reinterpret_cast<void*>(&gearcache_meta_holds), "gearcache.meta_holds",
                                         nullptr);
    if (!meta_holds || PyModule_AddObject(m, "META_HOLDS", meta_holds) < 0) {
        Py_XDECREF(meta_holds);
        Py_DECREF(m);
        return nullptr;
    }
    if (PyModule_AddStringConstant(m, "BUILD_KEY", GEARCACHE_BUILD_KEY) < 0 ||
        PyModule_AddObjectRef(m, "MetaMatch", reinterpret_cast<PyObject*>(&MetaMatchType)) < 0 ||
        PyModule_AddObjectRef(m, "TensorMatch", reinterpret_cast<PyObject*>(&TensorMatchType)) < 0 ||
        PyModule_AddObjectRef(m, "StateSnapshot", reinterpret_cast<PyObject*>(&StateSnapshotType)) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
