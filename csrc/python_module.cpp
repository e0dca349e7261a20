// The pybind11 module safeattn._C. Loading it runs the static registrations of every op and
// kernel (TORCH_LIBRARY*, the CPU ISA stubs); its Python functions report the build, and (private)
// serve the tests.
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>

#include "ops/attention.h"
#include "ops/attention_choice.h"
#include "ops/attention_kvcache.h"
#include "safeattn.h"

namespace {

namespace py = pybind11;

// The arguments _attention takes as they are: a torch.Tensor (not a subclass, which may have a
// __torch_function__ of its own), None where the op takes one, a bool, and Python numbers.
bool plain_tensor(py::handle h) {
  return THPVariable_CheckExact(h.ptr());
}
bool plain_optional_tensor(py::handle h) {
  return h.is_none() || plain_tensor(h);
}
bool plain_number(py::handle h) {
  return PyFloat_CheckExact(h.ptr()) || PyLong_CheckExact(h.ptr());
}
bool plain_bool(py::handle h) {
  return PyBool_Check(h.ptr());
}
std::optional<at::Tensor> optional_tensor(py::handle h) {
  return h.is_none() ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(h.ptr()));
}

// safeattn::attention called from Python (vectorcall, positional) through its typed C++ entry:
// the same dispatcher op, so autograd, torch.func, fake tensors, tracing and dispatch modes see
// the same call, without torch.ops' boxed call, which parses the arguments against the schema
// (a tiny CPU decode step: 8.2 us by torch.ops, 7.1 by this entry, SDPA 7.1-7.3). NotImplemented
// unless every argument is plain (above; offsets Python ints within int64, numbers within a
// double) and no __torch_function__ mode is on: the caller then takes torch.ops, whose
// overrides and messages stay what they are. The GIL is released around the op, as torch.ops
// does.
PyObject* attention_direct(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 13) {
    PyErr_SetString(PyExc_TypeError, "_attention takes the op's 13 arguments, in order");
    return nullptr;
  }
  const py::handle query = args[0], key = args[1], value = args[2], attn_mask = args[3], dropout_p = args[4],
                   is_causal = args[5], scale = args[6], enable_gqa = args[7], q_offset = args[8], kv_offset = args[9],
                   softcap = args[10], sinks = args[11], key_ranges = args[12];
  if (at::impl::torch_function_mode_enabled() || !plain_tensor(query) || !plain_tensor(key) || !plain_tensor(value) ||
      !plain_optional_tensor(attn_mask) || !plain_optional_tensor(sinks) || !plain_optional_tensor(key_ranges) ||
      !plain_number(dropout_p) || !plain_bool(is_causal) || !(scale.is_none() || plain_number(scale)) ||
      !plain_bool(enable_gqa) || !PyLong_CheckExact(q_offset.ptr()) || !PyLong_CheckExact(kv_offset.ptr()) ||
      !plain_number(softcap)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  int overflow_q = 0, overflow_kv = 0;
  const long long q_at = PyLong_AsLongLongAndOverflow(q_offset.ptr(), &overflow_q);
  const long long kv_at = PyLong_AsLongLongAndOverflow(kv_offset.ptr(), &overflow_kv);
  const double dropout = PyFloat_AsDouble(dropout_p.ptr()), cap = PyFloat_AsDouble(softcap.ptr());
  const std::optional<double> scale_value =
      scale.is_none() ? std::nullopt : std::optional<double>(PyFloat_AsDouble(scale.ptr()));
  if (overflow_q != 0 || overflow_kv != 0 || PyErr_Occurred()) {  // an int past a double's or int64's range
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;
  }
  HANDLE_TH_ERRORS
  std::tuple<at::Tensor, at::Tensor> result;
  {
    py::gil_scoped_release no_gil;
    result = safeattn::attention(THPVariable_Unpack(query.ptr()), THPVariable_Unpack(key.ptr()),
                                 THPVariable_Unpack(value.ptr()), optional_tensor(attn_mask), dropout,
                                 is_causal.ptr() == Py_True, scale_value, enable_gqa.ptr() == Py_True, q_at, kv_at, cap,
                                 optional_tensor(sinks), optional_tensor(key_ranges));
  }
  py::object out = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(std::get<0>(result))));
  py::object lse = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(std::get<1>(result))));
  return PyTuple_Pack(2, out.ptr(), lse.ptr());
  END_HANDLE_TH_ERRORS
}

PyMethodDef attention_direct_def = {"_attention",
                                    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&attention_direct)),
                                    METH_FASTCALL, "Private: see attention_direct in csrc/python_module.cpp."};

// safeattn.attention_with_kvcache's common case, a decode or append step without gradients,
// through the op's typed C++ entry (safeattn::attention_kvcache): the argument checks of
// serving.py, its int32 conversions and torch.ops' boxed call leave the step's host time. Takes
// (q, k_cache, v_cache, cache_seqlens, k, v, block_table, softmax_scale, causal, window_size,
// softcap, sinks) and returns (out, lse), or NotImplemented, for the Python route to take the call
// with its checks and messages, where: an argument is not plain (a tensor subclass, a number of
// another type, a window not a pair of ints >= -1); a __torch_function__ mode is on; a gradient
// is asked for; or the op's own checks (check_attention_kvcache: ranks, shapes, dtypes, devices,
// page sizes; int64 lengths and tables converted to int32 first, as serving.py does) refuse the
// arguments. Nothing has been written into the cache then: those checks come before the append.
// A tiny CPU decode step (B1 Hq8 Hkv8 D64, 16 keys; AMD EPYC, 1 thread): 21.4 us through
// serving.py's checks and torch.ops, 10.4 here, SDPA 11.0.
PyObject* attention_kvcache_direct(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 12) {
    PyErr_SetString(PyExc_TypeError, "_attention_kvcache takes attention_with_kvcache's 12 arguments, in order");
    return nullptr;
  }
  const py::handle q = args[0], k_cache = args[1], v_cache = args[2], cache_seqlens = args[3], k = args[4], v = args[5],
                   block_table = args[6], scale = args[7], causal = args[8], window = args[9], softcap = args[10],
                   sinks = args[11];
  if (at::impl::torch_function_mode_enabled() || !plain_tensor(q) || !plain_tensor(k_cache) || !plain_tensor(v_cache) ||
      !(plain_tensor(cache_seqlens) || PyLong_CheckExact(cache_seqlens.ptr())) || !plain_optional_tensor(k) ||
      !plain_optional_tensor(v) || !plain_optional_tensor(block_table) || !plain_optional_tensor(sinks) ||
      !(scale.is_none() || plain_number(scale)) || !plain_bool(causal) || !plain_number(softcap)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  PyObject* pair = window.ptr();
  const bool tuple = PyTuple_CheckExact(pair);
  if (!(tuple || PyList_CheckExact(pair)) || Py_SIZE(pair) != 2) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  PyObject* left = tuple ? PyTuple_GET_ITEM(pair, 0) : PyList_GET_ITEM(pair, 0);
  PyObject* right = tuple ? PyTuple_GET_ITEM(pair, 1) : PyList_GET_ITEM(pair, 1);
  if (!PyLong_CheckExact(left) || !PyLong_CheckExact(right)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  int overflow_left = 0, overflow_right = 0;
  const long long window_left = PyLong_AsLongLongAndOverflow(left, &overflow_left);
  const long long window_right = PyLong_AsLongLongAndOverflow(right, &overflow_right);
  const double cap = PyFloat_AsDouble(softcap.ptr());
  const std::optional<double> scale_value =
      scale.is_none() ? std::nullopt : std::optional<double>(PyFloat_AsDouble(scale.ptr()));
  if (overflow_left != 0 || overflow_right != 0 || PyErr_Occurred()) {
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;
  }
  if (window_left < -1 || window_right < -1) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  HANDLE_TH_ERRORS
  const at::Tensor& query = THPVariable_Unpack(q.ptr());
  const at::Tensor& keys = THPVariable_Unpack(k_cache.ptr());
  const at::Tensor& values = THPVariable_Unpack(v_cache.ptr());
  // int64 lengths and tables as the Python route takes them: converted to the op's int32.
  auto int32 = [](const at::Tensor& t) { return t.scalar_type() == at::kLong ? t.to(at::kInt) : t; };
  at::Tensor seqlens;
  if (PyLong_CheckExact(cache_seqlens.ptr())) {  // one length for every sequence
    int overflow = 0;
    const long long length = PyLong_AsLongLongAndOverflow(cache_seqlens.ptr(), &overflow);
    if (overflow != 0 || length < INT32_MIN || length > INT32_MAX || query.dim() != 4) {
      Py_RETURN_NOTIMPLEMENTED;
    }
    seqlens = at::full({query.size(0)}, length, query.options().dtype(at::kInt));
  } else {
    seqlens = int32(THPVariable_Unpack(cache_seqlens.ptr()));
  }
  std::optional<at::Tensor> table = optional_tensor(block_table);
  if (table.has_value()) {
    table = int32(*table);
  }
  const std::optional<at::Tensor> new_k = optional_tensor(k), new_v = optional_tensor(v), sink = optional_tensor(sinks);
  if (at::GradMode::is_enabled()) {
    for (const std::optional<at::Tensor>& t : {std::optional<at::Tensor>(query), std::optional<at::Tensor>(keys),
                                               std::optional<at::Tensor>(values), new_k, new_v, sink}) {
      if (t.has_value() && t->requires_grad()) {
        Py_RETURN_NOTIMPLEMENTED;
      }
    }
  }
  try {
    safeattn::check_attention_kvcache(query, keys, values, seqlens, new_k, new_v, table, sink);
  } catch (const c10::ValueError&) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  std::tuple<at::Tensor, at::Tensor> result;
  {
    py::gil_scoped_release no_gil;
    result = safeattn::attention_kvcache(query, keys, values, seqlens, new_k, new_v, table, scale_value,
                                         causal.ptr() == Py_True, window_left, window_right, cap, sink);
  }
  py::object out = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(std::get<0>(result))));
  py::object lse = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(std::get<1>(result))));
  return PyTuple_Pack(2, out.ptr(), lse.ptr());
  END_HANDLE_TH_ERRORS
}

PyMethodDef attention_kvcache_direct_def = {
    "_attention_kvcache", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&attention_kvcache_direct)),
    METH_FASTCALL, "Private: see attention_kvcache_direct in csrc/python_module.cpp."};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "safeattn native library; the ops are torch.ops.safeattn.*";
  m.def(
      "build_info",
      [] {
        const safeattn::BuildInfo info = safeattn::build_info();
        pybind11::dict d;
        d["version"] = info.version;
        d["torch_version"] = info.torch_version;
        d["cpu_isas"] = info.cpu_isas;
        d["cpu_isas_runnable"] = info.cpu_isas_runnable;
        d["cpu_isa_in_use"] = info.cpu_isa_in_use;
        d["with_cuda"] = info.with_cuda;
        d["cuda_version"] = info.cuda_version;
        d["cuda_archs"] = info.cuda_archs;
        d["attention_fwd_head_dims"] = info.attention_fwd_head_dims;
        d["attention_bwd_head_dims"] = info.attention_bwd_head_dims;
        d["attention_sm90_fwd_head_dims"] = info.attention_sm90_fwd_head_dims;
        d["attention_sm90_bwd_head_dims"] = info.attention_sm90_bwd_head_dims;
        // Read now, not at build time: the CPU, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and
        // torch.backends.mkldnn.enabled decide it.
        const auto tiles = safeattn::attention_cpu_tiles_stub().pick();
        pybind11::dict cpu_tiles;
        cpu_tiles["bfloat16"] = tiles(at::kBFloat16);
        cpu_tiles["float16"] = tiles(at::kHalf);
        d["cpu_tiles"] = cpu_tiles;
        return d;
      },
      "Version, torch built against, CPU ISA variants and tiles, CUDA archs.");
#ifdef SAFEATTN_WITH_CUDA
  // Private (safeattn._testing.generic_kernels_only): see safeattn.h.
  m.def("_set_generic_kernels_only", &safeattn::cuda::set_generic_kernels_only);
  m.def("_generic_tile_shapes", &safeattn::cuda::generic_tile_shapes,
        "The generic kernels' tile shapes for a head dim on a GPU with these shared-memory limits.");
  m.def("_decode_wave_ctas", &safeattn::cuda::decode_wave_ctas,
        "The CTAs an SM of the wave shape a decode step takes on a GPU with these SMs and shared memory "
        "(0: the default shape).");
  m.def("_check_device_supported", &safeattn::cuda::check_device_supported,
        "Raises the error a CUDA op raises on a GPU this build has no code for.");
#endif
  // Private (safeattn._testing.attention_path): which kernel attention, or its backward, would
  // run for these arguments, without running it (ops/attention_choice.h).
  m.def(
      "_attention_path",
      [](const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
         const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, std::optional<double> scale,
         bool enable_gqa, int64_t q_offset, int64_t kv_offset, double softcap, const std::optional<at::Tensor>& sinks,
         const std::optional<at::Tensor>& key_ranges, bool backward) {
        const safeattn::AttentionChoice choice =
            safeattn::attention_path(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, q_offset,
                                     kv_offset, softcap, sinks, key_ranges, backward);
        pybind11::list rejected;
        for (int i = 0; i < choice.rejected_count; ++i) {
          rejected.append(
              pybind11::make_tuple(safeattn::attention_path_name(choice.rejected[i].path), choice.rejected[i].reason));
        }
        return pybind11::make_tuple(safeattn::attention_path_name(choice.path), rejected, choice.draw_key_ranges);
      },
      pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("attn_mask"),
      pybind11::arg("dropout_p"), pybind11::arg("is_causal"), pybind11::arg("scale"), pybind11::arg("enable_gqa"),
      pybind11::arg("q_offset"), pybind11::arg("kv_offset"), pybind11::arg("softcap"), pybind11::arg("sinks"),
      pybind11::arg("key_ranges"), pybind11::arg("backward"),
      "(kernel, [(kernel, why not) for each kernel asked before it], key ranges drawn into the mask).");
  // Private (safeattn.ops._call_attention): see attention_direct.
  m.add_object("_attention", py::reinterpret_steal<py::object>(PyCFunction_New(&attention_direct_def, nullptr)));
  // Private (safeattn.serving.attention_with_kvcache): see attention_kvcache_direct.
  m.add_object("_attention_kvcache",
               py::reinterpret_steal<py::object>(PyCFunction_New(&attention_kvcache_direct_def, nullptr)));
  m.def("cpu_parallel_threads", &safeattn::cpu_parallel_threads,
        "Threads at::parallel_for uses in safeattn's CPU code (1 if built without OpenMP).");
}
