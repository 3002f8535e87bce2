// gearcache.native's StateSnapshot: the calling thread's torch state, read at construction and compared by same().
// Part of the one translation unit guards.cpp (see its header comment for the type's contract), which includes it
// once, after torch's headers; its build key covers this file too (gearcache/native/__init__.py SOURCES).
#pragma once
#include <Python.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <array>
#include <exception>

namespace {

constexpr std::array<c10::DeviceType, 8> kAutocastDevices = {
    c10::DeviceType::CPU, c10::DeviceType::CUDA, c10::DeviceType::XPU, c10::DeviceType::MPS,
    c10::DeviceType::HPU, c10::DeviceType::XLA, c10::DeviceType::MTIA, c10::DeviceType::PrivateUse1};

// autocast_known[i]: this torch has autocast for kAutocastDevices[i] (asking about another one throws); set once,
// when the module is imported
std::array<bool, kAutocastDevices.size()> autocast_known{};

void find_autocast_devices() {
    for (size_t i = 0; i < kAutocastDevices.size(); i++) {
        try {
            (void)at::autocast::is_autocast_enabled(kAutocastDevices[i]);
            autocast_known[i] = true;
        } catch (const std::exception&) {
            autocast_known[i] = false;
        }
    }
}

// The thread's torch state. now() reads all of it; same_as(then) reads it again, cheapest parts first, and stops at
// the first difference. The thread's local dispatch key set holds autocast's on/off for every device type (autocast
// is on for a device type while its Autocast key is not excluded) and inference mode's keys, so the autocast dtypes
// and cache flag are read only where autocast was on.
struct State {
    uint64_t tls_included, tls_excluded;
    bool grad, inference;
    bool autocast_any;                                              // autocast on for some device type
    std::array<c10::ScalarType, kAutocastDevices.size()> autocast_dtype;   // Undefined where off or unknown
    bool autocast_cache;
    caffe2::TypeMeta default_dtype;
    bool deterministic, deterministic_warn_only;
    at::impl::TorchFunctionDisabledState torch_function;            // enabled, subclasses or all disabled
    int64_t torch_function_modes;                                   // TorchFunctionMode stack depth
    bool cublas_tf32;
    // the reduced-precision flags are bools on some torch versions and enums on others
    std::decay_t<decltype(std::declval<at::Context&>().allowFP16ReductionCuBLAS())> fp16_reduced;
    std::decay_t<decltype(std::declval<at::Context&>().allowBF16ReductionCuBLAS())> bf16_reduced;
    bool sdp_flash, sdp_mem_efficient, sdp_math, sdp_cudnn;
    int threads;

    static State now() {
        State s{};
        auto& ctx = at::globalContext();
        const auto tls = c10::impl::tls_local_dispatch_key_set();
        s.tls_included = tls.included_.raw_repr();
        s.tls_excluded = tls.excluded_.raw_repr();
        s.grad = c10::GradMode::is_enabled();
        s.inference = c10::InferenceMode::is_enabled();
        s.autocast_any = false;
        for (size_t i = 0; i < kAutocastDevices.size(); i++) {
            const bool on = autocast_known[i] && at::autocast::is_autocast_enabled(kAutocastDevices[i]);
            s.autocast_dtype[i] = on ? at::autocast::get_autocast_dtype(kAutocastDevices[i])
                                     : c10::ScalarType::Undefined;
            s.autocast_any |= on;
        }
        s.autocast_cache = at::autocast::is_autocast_cache_enabled();
        s.default_dtype = c10::get_default_dtype();
        s.deterministic = ctx.deterministicAlgorithms();
        s.deterministic_warn_only = ctx.deterministicAlgorithmsWarnOnly();
        s.torch_function = at::impl::PythonTorchFunctionTLS::get_disabled_state();
        s.torch_function_modes = at::impl::PythonTorchFunctionTLS::stack_len();
        s.cublas_tf32 = ctx.allowTF32CuBLAS();
        s.fp16_reduced = ctx.allowFP16ReductionCuBLAS();
        s.bf16_reduced = ctx.allowBF16ReductionCuBLAS();
        s.sdp_flash = ctx.userEnabledFlashSDP();
        s.sdp_mem_efficient = ctx.userEnabledMemEfficientSDP();
        s.sdp_math = ctx.userEnabledMathSDP();
        s.sdp_cudnn = ctx.userEnabledCuDNNSDP();
        s.threads = at::get_num_threads();
        return s;
    }

    bool same_as_now() const {
        const auto tls = c10::impl::tls_local_dispatch_key_set();
        if (tls.included_.raw_repr() != tls_included || tls.excluded_.raw_repr() != tls_excluded) return false;
        if (c10::GradMode::is_enabled() != grad || c10::InferenceMode::is_enabled() != inference) return false;
        if (autocast_any) {             // on/off per device type is as then (the key set): compare what is on
            for (size_t i = 0; i < kAutocastDevices.size(); i++) {
                if (autocast_dtype[i] != c10::ScalarType::Undefined &&
                    at::autocast::get_autocast_dtype(kAutocastDevices[i]) != autocast_dtype[i])
                    return false;
            }
            if (at::autocast::is_autocast_cache_enabled() != autocast_cache) return false;
        }
        auto& ctx = at::globalContext();
        return c10::get_default_dtype() == default_dtype && ctx.deterministicAlgorithms() == deterministic &&
               ctx.deterministicAlgorithmsWarnOnly() == deterministic_warn_only &&
               at::impl::PythonTorchFunctionTLS::get_disabled_state() == torch_function &&
               at::impl::PythonTorchFunctionTLS::stack_len() == torch_function_modes &&
               ctx.allowFP16ReductionCuBLAS() == fp16_reduced && ctx.allowBF16ReductionCuBLAS() == bf16_reduced &&
               ctx.userEnabledFlashSDP() == sdp_flash && ctx.userEnabledMemEfficientSDP() == sdp_mem_efficient &&
               ctx.userEnabledMathSDP() == sdp_math && ctx.userEnabledCuDNNSDP() == sdp_cudnn &&
               at::get_num_threads() == threads && ctx.allowTF32CuBLAS() == cublas_tf32;
    }
};

struct StateSnapshot {
    PyObject_HEAD
    State state;
};

int state_snapshot_init(StateSnapshot* self, PyObject* args, PyObject* kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "StateSnapshot() takes no arguments");
        return -1;
    }
    try {
        self->state = State::now();
    } catch (const std::exception& e) {
        PyErr_Format(PyExc_RuntimeError, "StateSnapshot: %s", e.what());
        return -1;
    }
    return 0;
}

PyObject* state_snapshot_call(StateSnapshot* self, PyObject* args, PyObject* kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "a StateSnapshot is called with no arguments");
        return nullptr;
    }
    bool same = false;
    try {
        same = self->state.same_as_now();
    } catch (const std::exception&) {
        same = false;
    }
    return PyBool_FromLong(same);
}

PyTypeObject StateSnapshotType = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace
