// ZeRO++ quantization kernels: zerocore._C.quantize / dequantize over tensors, on the CPU (the SIMD core,
// zerocore/quantize.hpp, GIL released) or a CUDA device (cuda/quantize.cu on torch's current stream), plus
// the size helpers. Arithmetic and storage: Note [Quantization arithmetic] in zerocore/quantize.hpp.
//
// Note [Quantize op contract]
// ---------------------------
// quantize(input, bits, group_size, q_out, scales_out) -> (nonfinite_count, first_index)
//   input: fp32/bf16/fp16, contiguous, n = input.numel() elements (any shape). q_out: int8 with n elements
//   (bits = 8) or uint8 with ceil(n / 2) (bits = 4, two per byte, low nibble first). scales_out: fp32 with
//   ceil(n / group_size) elements. All on one device, contiguous, not overlapping. When the input holds inf or
//   NaN, nonfinite_count > 0 and first_index is the flat index of the first one (-1 otherwise): those groups
//   get scale NaN and q = 0, and the caller must raise. On CUDA the counts are read back, so the call
//   synchronises with the current stream.
// dequantize(q, scales, n, bits, group_size, out) -> None
//   writes the n dequantized values into out (fp32/bf16/fp16, contiguous, n elements: any contiguous slice
//   of a larger buffer works) and nothing else; q and scales as quantize wrote them for the same n.
// Errors are ValueErrors naming the argument. Written tensors get an autograd version bump, as in-place ops do.
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/variable.h>

#include "bindings.hpp"
#include "cpu_kernel_pool.hpp"
#include "quantize_ops.hpp"
#include "tensor_checks.hpp"
#include "zerocore/error.hpp"
#include "zerocore/quantize.hpp"

#if defined(ZEROCORE_HAVE_CUDA)
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "zerocore/cuda_quantize.hpp"
#endif

namespace py = pybind11;

namespace zerocore::bindings {
namespace {

void check_bits(int bits, const char* caller) {
  ZC_CHECK_ARG(bits == 8 || bits == 4, caller, ": bits must be 8 (int8) or 4 (int4), got ", bits);
}

// The dtype q must have for `bits`: int8 values, or uint8 bytes of two packed nibbles.
at::ScalarType q_dtype(int bits) { return bits == 8 ? at::kChar : at::kByte; }

// A tensor argument: defined, dense, contiguous, not a lazy negated/conjugated view, on `device`, with
// `numel` elements of `dtype` (dtype kUndefined: any of fp32/bf16/fp16).
void check_tensor(const at::Tensor& t, const char* caller, const char* name, const at::Device& device, int64_t numel,
                  at::ScalarType dtype, const char* numel_reason) {
  ZC_CHECK_ARG(t.defined(), caller, ": ", name, " is an undefined tensor");
  ZC_CHECK_ARG(t.layout() == at::kStrided, caller, ": ", name, " must be a dense (strided) tensor, got ", t.layout());
  ZC_CHECK_ARG(t.device() == device, caller, ": ", name, " must be on ", device, ", got ", t.device());
  if (dtype == at::ScalarType::Undefined) {
    to_scalar_type(t, (std::string(caller) + ": " + name).c_str());
  } else {
    ZC_CHECK_ARG(t.scalar_type() == dtype, caller, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  }
  ZC_CHECK_ARG(t.numel() == numel, caller, ": ", name, " must have ", numel, " elements (", numel_reason, "), got ",
               t.numel());
  ZC_CHECK_ARG(t.is_contiguous(), caller, ": ", name, " must be contiguous, got sizes ", t.sizes(), " and strides ",
               t.strides(), "; pass .contiguous() (a copy) or a contiguous slice");
  ZC_CHECK_ARG(!t.is_neg() && !t.is_conj(), caller, ": ", name,
               " is a lazily negated or conjugated view; pass .resolve_neg().resolve_conj()");
}

// The device of the first tensor: the CPU, or a CUDA device in a build with the CUDA kernels.
at::Device kernel_device(const at::Tensor& t, const char* caller, const char* name) {
  ZC_CHECK_ARG(t.defined(), caller, ": ", name, " is an undefined tensor");
#if defined(ZEROCORE_HAVE_CUDA)
  ZC_CHECK_ARG(t.device().is_cpu() || t.device().is_cuda(), caller, ": ", name,
               " must be on the CPU or a CUDA device, got ", t.device());
#else
  ZC_CHECK_ARG(t.device().is_cpu(), caller, ": ", name, " must be on the CPU (this build has no CUDA kernels), got ",
               t.device());
#endif
  return t.device();
}

// Written tensors: refused when autograd would need their old values, bumped afterwards.
void check_writable(const at::Tensor& t, const char* caller, const char* name) {
  ZC_CHECK_ARG(!(t.requires_grad() && at::GradMode::is_enabled()), caller, ": ", name,
               " requires grad and grad mode is on, but it is written in place; call under torch.no_grad()");
  ZC_CHECK_ARG(!t.is_inference() || c10::InferenceMode::is_enabled(), caller, ": ", name,
               " is an inference tensor; it can only be written inside torch.inference_mode()");
}

void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}

#if defined(ZEROCORE_HAVE_CUDA)
void* current_cuda_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
}
#endif

}  // namespace

QuantizeResult quantize_tensor(const at::Tensor& input, int bits, int64_t group_size, uint8_t* q, float* scales,
                               bool read_back) {
  (void)read_back;  // CPU kernels return the count without a sync
  const int64_t n = input.numel();
  const ScalarType in_type = to_scalar_type(input, "input");
  const void* data = n > 0 ? input.data_ptr() : nullptr;
  QuantizeResult result;
  if (input.device().is_cpu()) {
    const SimdPath path = active_simd_path();
    run_on_cpu_kernel_pool([&](ThreadPool* pool) {
      result = quantize_symmetric(data, in_type, n, bits, group_size, q, scales, pool, path);
    });
  } else {
#if defined(ZEROCORE_HAVE_CUDA)
    const c10::DeviceGuard guard(input.device());
    const at::Tensor counters = at::empty({2}, input.options().dtype(at::kLong));
    launch_quantize_symmetric(data, in_type, n, bits, group_size, q, scales, counters.data_ptr<int64_t>(),
                              current_cuda_stream(input.device()));
    if (read_back) {
      const at::Tensor host = counters.cpu();  // synchronises with the stream
      result.nonfinite_count = host.data_ptr<int64_t>()[0];
      result.first_nonfinite = result.nonfinite_count > 0 ? host.data_ptr<int64_t>()[1] : -1;
    }
#else
    throw InvalidArgument("quantize: this build has no CUDA kernels");
#endif
  }
  return result;
}

void dequantize_into(const uint8_t* q, const float* scales, int64_t n, int bits, int64_t group_size,
                     const at::Tensor& out) {
  const ScalarType out_type = to_scalar_type(out, "out");
  void* out_data = n > 0 ? out.data_ptr() : nullptr;
  if (out.device().is_cpu()) {
    const SimdPath path = active_simd_path();
    run_on_cpu_kernel_pool([&](ThreadPool* pool) {
      dequantize_symmetric(q, scales, n, bits, group_size, out_data, out_type, pool, path);
    });
  } else {
#if defined(ZEROCORE_HAVE_CUDA)
    const c10::DeviceGuard guard(out.device());
    launch_dequantize_symmetric(q, scales, n, bits, group_size, out_data, out_type, current_cuda_stream(out.device()));
#else
    throw InvalidArgument("dequantize: this build has no CUDA kernels");
#endif
  }
}

namespace {

std::tuple<int64_t, int64_t> quantize_py(const at::Tensor& input, int bits, int64_t group_size, const at::Tensor& q_out,
                                         const at::Tensor& scales_out) {
  constexpr const char* kCaller = "quantize";
  check_bits(bits, kCaller);
  ZC_CHECK_ARG(group_size > 0, kCaller, ": group_size must be > 0, got ", group_size);
  ZC_CHECK_ARG(bits == 8 || group_size % 2 == 0, kCaller,
               ": group_size must be even for bits = 4 (two values per byte, every group starting on a byte "
               "boundary), got ", group_size);
  const at::Device device = kernel_device(input, kCaller, "input");
  const int64_t n = input.numel();
  check_tensor(input, kCaller, "input", device, n, at::ScalarType::Undefined, "its own");
  check_tensor(q_out, kCaller, "q_out", device, quantized_bytes(n, bits), q_dtype(bits),
               bits == 8 ? "one int8 per input element" : "ceil(n / 2): two int4 values per byte");
  check_tensor(scales_out, kCaller, "scales_out", device, quantize_num_groups(n, group_size), at::kFloat,
               "ceil(n / group_size): one per group");
  check_no_overlap({{"input", &input}, {"q_out", &q_out}, {"scales_out", &scales_out}});
  check_writable(q_out, kCaller, "q_out");
  check_writable(scales_out, kCaller, "scales_out");
  auto* q = n > 0 ? static_cast<uint8_t*>(q_out.data_ptr()) : nullptr;
  float* scales = n > 0 ? scales_out.data_ptr<float>() : nullptr;

  QuantizeResult result;
  {
    py::gil_scoped_release no_gil;
    result = quantize_tensor(input, bits, group_size, q, scales);
  }
  bump_version(q_out);
  bump_version(scales_out);
  return {result.nonfinite_count, result.first_nonfinite};
}

void dequantize_py(const at::Tensor& q, const at::Tensor& scales, int64_t n, int bits, int64_t group_size,
                   const at::Tensor& out) {
  constexpr const char* kCaller = "dequantize";
  check_bits(bits, kCaller);
  ZC_CHECK_ARG(n >= 0, kCaller, ": n must be >= 0, got ", n);
  ZC_CHECK_ARG(group_size > 0, kCaller, ": group_size must be > 0, got ", group_size);
  ZC_CHECK_ARG(bits == 8 || group_size % 2 == 0, kCaller,
               ": group_size must be even for bits = 4 (two values per byte, every group starting on a byte "
               "boundary), got ", group_size);
  const at::Device device = kernel_device(out, kCaller, "out");
  check_tensor(out, kCaller, "out", device, n, at::ScalarType::Undefined, "n");
  check_tensor(q, kCaller, "q", device, quantized_bytes(n, bits), q_dtype(bits),
               bits == 8 ? "one int8 per element" : "ceil(n / 2): two int4 values per byte");
  check_tensor(scales, kCaller, "scales", device, quantize_num_groups(n, group_size), at::kFloat,
               "ceil(n / group_size): one per group");
  check_no_overlap({{"out", &out}, {"q", &q}, {"scales", &scales}});
  check_writable(out, kCaller, "out");
  const auto* q_data = n > 0 ? static_cast<const uint8_t*>(q.data_ptr()) : nullptr;
  const float* scale_data = n > 0 ? scales.data_ptr<float>() : nullptr;

  {
    py::gil_scoped_release no_gil;
    dequantize_into(q_data, scale_data, n, bits, group_size, out);
  }
  bump_version(out);
}

}  // namespace

void bind_quantize(py::module_& m) {
  m.def("quantize", &quantize_py, py::arg("input"), py::arg("bits"), py::arg("group_size"), py::arg("q_out"),
        py::arg("scales_out"),
        "Symmetric int8/int4 quantization with one fp32 scale per group into q_out and scales_out; returns "
        "(nonfinite_count, first_index). See Note [Quantize op contract].");
  m.def("dequantize", &dequantize_py, py::arg("q"), py::arg("scales"), py::arg("n"), py::arg("bits"),
        py::arg("group_size"), py::arg("out"),
        "Writes the n dequantized values (q * scale, rounded to out's dtype) into out.");
  m.def(
      "quantized_bytes", [](int64_t n, int bits) { return quantized_bytes(n, bits); }, py::arg("n"), py::arg("bits"),
      "Bytes of q for n elements: n (bits = 8) or ceil(n / 2) (bits = 4).");
  m.def(
      "quantize_num_groups", [](int64_t n, int64_t group_size) { return quantize_num_groups(n, group_size); },
      py::arg("n"), py::arg("group_size"), "Scales for n elements: ceil(n / group_size).");
}

}  // namespace zerocore::bindings
