// zerocore._C: pybind11 definitions only. Heavy lifting lives in cpp/ (torch-free) and cuda/.
#include <string>

#include "bindings.hpp"
#include "zerocore/simd.hpp"

namespace py = pybind11;

namespace zerocore::bindings {
void bind_io(pybind11::module_& m);        // io_bindings.cpp: crc32c, AsyncIO
void bind_quantize(pybind11::module_& m);  // quantize_bindings.cpp: quantize, dequantize
}  // namespace zerocore::bindings

namespace {

std::string compiler_description() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#else
  return "unknown";
#endif
}

py::dict native_build_info() {
  py::dict info;
  info["torch_version_built"] = ZEROCORE_TORCH_VERSION;
  info["compiler"] = compiler_description();
  py::list compiled;
  for (auto path : zerocore::compiled_simd_paths()) compiled.append(zerocore::simd_path_name(path));
  info["simd_compiled"] = compiled;
  info["simd_best"] = zerocore::simd_path_name(zerocore::best_simd_path());
  info["simd_active"] = zerocore::simd_path_name(zerocore::active_simd_path());
#if defined(ZEROCORE_HAVE_CUDA)
  info["cuda_compiled"] = true;
#else
  info["cuda_compiled"] = false;
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "zerocore native core (layout, kernels, collectives)";
  m.def("native_build_info", &native_build_info, "What this _C was compiled with and what this CPU will run.");
  m.def(
      "force_simd_path", [](const std::string& name) { zerocore::force_simd_path(zerocore::parse_simd_path(name)); },
      py::arg("path"), "Force the CPU kernels onto one SIMD path: 'scalar', 'avx2' or 'avx512'.");
  m.def("reset_simd_path", &zerocore::reset_simd_path, "Return to the automatic SIMD path choice.");
  m.def("active_simd_path", [] { return std::string(zerocore::simd_path_name(zerocore::active_simd_path())); });
  m.def("cpu_supports_simd_path",
        [](const std::string& name) { return zerocore::cpu_supports(zerocore::parse_simd_path(name)); });
  zerocore::bindings::bind_layout(m);
  zerocore::bindings::bind_plan(m);
  zerocore::bindings::bind_adam(m);
  zerocore::bindings::bind_distributed(m);
  zerocore::bindings::bind_io(m);
  zerocore::bindings::bind_quantize(m);
  zerocore::bindings::bind_storage(m);
}
