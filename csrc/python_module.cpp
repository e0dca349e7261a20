// The pybind11 module safeattn._C. Loading it runs the static registrations of every op and
// kernel (TORCH_LIBRARY*, the CPU ISA stubs); its Python functions report the build, and (private)
// serve the tests.
#include <torch/extension.h>

#include "ops/attention.h"
#include "ops/attention_choice.h"
#include "safeattn.h"

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
  m.def("cpu_parallel_threads", &safeattn::cpu_parallel_threads,
        "Threads at::parallel_for uses in safeattn's CPU code (1 if built without OpenMP).");
}
