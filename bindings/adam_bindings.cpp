// The stateless Adam kernels as torch ops (zerocore::adam_step_) plus the CPU thread-pool controls.
//
// Note [Adam op contract]
// -----------------------
// adam_step_(param, grad, exp_avg, exp_avg_sq, param_out?) updates param, exp_avg and exp_avg_sq in place
// (fp32, contiguous, same numel and device) from grad (fp32/bf16/fp16) multiplied by grad_scale, and
// writes the updated params into param_out (bf16/fp16, rounded to nearest even) when given. It returns a
// 0-d bool tensor on param's device: true when check_finite was set and grad held an inf/NaN, in which
// case nothing was written. On CUDA the verdict never leaves the device, so the op needs no host sync.
#include <memory>
#include <mutex>

#include <ATen/Parallel.h>

#include "bindings.hpp"
#include "tensor_checks.hpp"
#include "zerocore/cpu_adam.hpp"
#include "zerocore/thread_pool.hpp"

#if defined(ZEROCORE_HAVE_CUDA)
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "zerocore/cuda_adam.hpp"
#endif

namespace py = pybind11;

namespace zerocore::bindings {
namespace {

// The CPU kernels' pool, shared by every CPUAdam in the process like torch's intra-op pool. It follows
// at::get_num_threads() unless set_num_threads() pinned a count. The mutex serialises kernel calls: a
// pool runs one parallel_for at a time.
class CpuKernelPool {
 public:
  static CpuKernelPool& instance() {
    static CpuKernelPool pool;
    return pool;
  }

  void set_num_threads(int num_threads) {
    ZC_CHECK_ARG(num_threads >= 0, "num_threads must be >= 0 (0 follows torch.get_num_threads()), got ",
                 num_threads);
    std::lock_guard<std::mutex> lock(mutex_);
    pinned_threads_ = num_threads;
  }

  int num_threads() const { return pinned_threads_ > 0 ? pinned_threads_ : std::max(1, at::get_num_threads()); }

  template <typename Fn>
  auto run(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int wanted = num_threads();
    if (!pool_ || pool_->num_threads() != wanted) pool_ = std::make_unique<ThreadPool>(wanted);
    return fn(pool_.get());
  }

 private:
  std::mutex mutex_;
  int pinned_threads_ = 0;
  std::unique_ptr<ThreadPool> pool_;
};

struct AdamOpArgs {
  const at::Tensor& param;
  const at::Tensor& grad;
  const at::Tensor& exp_avg;
  const at::Tensor& exp_avg_sq;
  const std::optional<at::Tensor>& param_out;
};

AdamHyper make_hyper(double step, double lr, double beta1, double beta2, double eps, double weight_decay,
                     bool adamw, bool bias_correction, double grad_scale) {
  ZC_CHECK_ARG(step >= 1 && step == static_cast<double>(static_cast<int64_t>(step)),
               "step must be a whole number >= 1, got ", step);
  AdamHyper hyper;
  hyper.step = static_cast<int64_t>(step);
  hyper.lr = lr;
  hyper.beta1 = beta1;
  hyper.beta2 = beta2;
  hyper.eps = eps;
  hyper.weight_decay = weight_decay;
  hyper.adamw = adamw;
  hyper.bias_correction = bias_correction;
  hyper.grad_scale = grad_scale;
  return hyper;
}

// Validates the op's tensors and turns them into spans; see Note [Adam op contract].
AdamSpans make_spans(const AdamOpArgs& args) {
  const at::Tensor& param = args.param;
  check_dtype(param, "param", at::kFloat);
  check_dtype(args.exp_avg, "exp_avg", at::kFloat);
  check_dtype(args.exp_avg_sq, "exp_avg_sq", at::kFloat);
  std::vector<NamedTensor> tensors{
      {"param", &param}, {"grad", &args.grad}, {"exp_avg", &args.exp_avg}, {"exp_avg_sq", &args.exp_avg_sq}};
  if (args.param_out) tensors.push_back({"param_out", &*args.param_out});
  check_flat_args(tensors, param.numel(), param.device());
  check_no_overlap(tensors);

  AdamSpans spans;
  spans.n = param.numel();
  spans.param = param.data_ptr<float>();
  spans.grad = args.grad.data_ptr();
  spans.grad_type = to_scalar_type(args.grad, "grad");
  spans.exp_avg = args.exp_avg.data_ptr<float>();
  spans.exp_avg_sq = args.exp_avg_sq.data_ptr<float>();
  if (args.param_out) {
    const at::Tensor& out = *args.param_out;
    ZC_CHECK_ARG(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf,
                 "param_out must be bfloat16 or float16, got ", out.scalar_type());
    spans.param_out = out.data_ptr();
    spans.param_out_type = to_scalar_type(out, "param_out");
  }
  return spans;
}

at::Tensor adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double step,
                         double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                         bool bias_correction, double grad_scale, bool check_finite) {
  return translate_value_errors([&] {
    ZC_CHECK_ARG(param.device().is_cpu(), "param must be on the CPU for the CPU kernel, got ", param.device());
    const AdamSpans spans = make_spans({param, grad, exp_avg, exp_avg_sq, param_out});
    const AdamHyper hyper = make_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
    const SimdPath path = active_simd_path();
    const bool skipped = CpuKernelPool::instance().run([&](ThreadPool* pool) {
      if (check_finite && !all_finite(spans.grad, spans.grad_type, spans.n, pool, path)) return true;
      adam_step(spans, hyper, pool, path);
      return false;
    });
    return at::scalar_tensor(skipped, at::TensorOptions().dtype(at::kBool));
  });
}

#if defined(ZEROCORE_HAVE_CUDA)
at::Tensor adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double step,
                          double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                          bool bias_correction, double grad_scale, bool check_finite) {
  return translate_value_errors([&] {
    ZC_CHECK_ARG(param.device().is_cuda(), "param must be a CUDA tensor for the CUDA kernel, got ", param.device());
    const AdamSpans spans = make_spans({param, grad, exp_avg, exp_avg_sq, param_out});
    const AdamHyper hyper = make_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
    const c10::DeviceGuard guard(param.device());
    void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(param.device()).native_handle();
    at::Tensor found = at::zeros({}, param.options().dtype(at::kInt));
    AdamDeviceScalars device_scalars;
    if (check_finite) {
      launch_check_finite(spans.grad, spans.grad_type, spans.n, found.data_ptr<int32_t>(), stream);
      device_scalars.skip = found.data_ptr<int32_t>();
    }
    launch_fused_adam(spans, hyper, device_scalars, stream);
    return found.to(at::kBool);
  });
}
#endif

}  // namespace

void bind_adam(py::module_& m) {
  m.def(
      "set_num_threads", [](int n) { CpuKernelPool::instance().set_num_threads(n); }, py::arg("num_threads"),
      "Threads for the CPU kernels; 0 follows torch.get_num_threads().");
  m.def("get_num_threads", [] { return CpuKernelPool::instance().num_threads(); });
  m.def(
      "all_finite",
      [](const at::Tensor& grad) {
        ZC_CHECK_ARG(grad.device().is_cpu(), "grad must be on the CPU, got ", grad.device());
        ZC_CHECK_ARG(grad.is_contiguous(), "grad must be contiguous");
        const ScalarType type = to_scalar_type(grad, "grad");
        const void* data = grad.data_ptr();
        const int64_t n = grad.numel();
        py::gil_scoped_release no_gil;
        return CpuKernelPool::instance().run(
            [&](ThreadPool* pool) { return all_finite(data, type, n, pool, active_simd_path()); });
      },
      py::arg("grad"), "True when every element of the CPU tensor grad is finite (reads only grad).");
}

}  // namespace zerocore::bindings

TORCH_LIBRARY(zerocore, m) {
  m.def(
      "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_out, *, float step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool adamw, bool bias_correction, float grad_scale, bool check_finite) -> Tensor");
}

TORCH_LIBRARY_IMPL(zerocore, CPU, m) { m.impl("adam_step_", &zerocore::bindings::adam_step_cpu); }

#if defined(ZEROCORE_HAVE_CUDA)
TORCH_LIBRARY_IMPL(zerocore, CUDA, m) { m.impl("adam_step_", &zerocore::bindings::adam_step_cuda); }
#endif
