// The stateless Adam kernels as torch ops (zerocore::adam_step_), their multi-tensor forms as plain _C
// functions (multi_tensor_adam_step, multi_tensor_all_finite), plus the CPU thread-pool controls.
//
// Note [Adam op contract]
// -----------------------
// adam_step_(param, grad, exp_avg, exp_avg_sq, param_out?) updates param, exp_avg and exp_avg_sq in place
// (fp32, contiguous, same numel and device) from grad (fp32/bf16/fp16) multiplied by grad_scale, and
// writes the updated params into param_out (bf16/fp16, rounded to nearest even) when given. It returns a
// 0-d bool tensor on param's device: true when check_finite was set and grad held an inf/NaN, in which
// case nothing was written. On CUDA the verdict never leaves the device, so the op needs no host sync.
// Like torch's in-place ops (and torch.optim's updates), a call bumps the autograd version counter of every
// tensor it may write (param, exp_avg, exp_avg_sq, param_out), so a backward through a graph that saved the
// old values raises instead of using the new ones: the op's ADInplaceOrView kernel does it for adam_step_,
// multi_tensor_adam_step_py for its lists. A lazily negated (x.neg() view, torch._neg_view) argument is
// rejected by name (the op's Negative kernel) instead of reaching torch's math-bit fallback, which cannot
// handle an op whose result is not its mutated input.
#include <sched.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/variable.h>

#include "bindings.hpp"
#include "cpu_kernel_pool.hpp"
#include "tensor_checks.hpp"
#include "zerocore/cpu_adam.hpp"
#include "zerocore/kernel_threads.hpp"
#include "zerocore/thread_pool.hpp"

#if defined(ZEROCORE_HAVE_CUDA)
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "zerocore/cuda_adam.hpp"
#endif

namespace py = pybind11;

namespace zerocore::bindings {
namespace {

// The CPU kernels' pool, shared by every CPUAdam in the process like torch's intra-op pool. It follows
// at::get_num_threads() unless set_num_threads() pinned a count, or torchrun left torch on one thread (Note
// [Kernel threads under torchrun]). The mutex serialises kernel calls: a pool runs one parallel_for at a time.
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

  int num_threads() const { return pinned_threads_ > 0 ? pinned_threads_ : unpinned_threads(); }

  static int unpinned_threads() {
    return default_kernel_threads(at::get_num_threads(), environment("OMP_NUM_THREADS"),
                                  environment("LOCAL_WORLD_SIZE"), cores_this_process_may_use());
  }

  template <typename Fn>
  auto run(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int wanted = num_threads();
    if (!pool_ || pool_->num_threads() != wanted) pool_ = std::make_unique<ThreadPool>(wanted);
    return fn(pool_.get());
  }

 private:
  static std::optional<std::string_view> environment(const char* name) {
    const char* value = std::getenv(name);
    return value ? std::optional<std::string_view>(value) : std::nullopt;
  }

  static int cores_this_process_may_use() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }

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
  // Checked here for the CPU and CUDA kernels alike (NaN fails every comparison).
  ZC_CHECK_ARG(lr >= 0 && std::isfinite(lr), "lr must be a finite number >= 0, got ", lr);
  ZC_CHECK_ARG(std::isfinite(grad_scale), "grad_scale must be finite, got ", grad_scale);
  ZC_CHECK_ARG(eps >= 0 && std::isfinite(eps), "eps must be a finite number >= 0, got ", eps);
  ZC_CHECK_ARG(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay must be a finite number >= 0, got ",
               weight_decay);
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

// The names a tuple's tensors go by in error messages: the op's argument names, or list elements.
struct SpanNames {
  std::string param = "param";
  std::string grad = "grad";
  std::string exp_avg = "exp_avg";
  std::string exp_avg_sq = "exp_avg_sq";
  std::string param_out = "param_out";

  static SpanNames list_elements(size_t i) {
    const std::string index = "[" + std::to_string(i) + "]";
    return {"params" + index, "grads" + index, "exp_avgs" + index, "exp_avg_sqs" + index, "param_outs" + index};
  }
};

// A tensor the kernels write must take a version-counter bump afterwards, as torch's in-place ops require:
// an inference tensor (made under torch.inference_mode()) can only be updated inside inference mode. Checked
// before anything is written.
void check_version_bumpable(const at::Tensor& t, const std::string& name) {
  ZC_CHECK_ARG(!t.is_inference() || c10::InferenceMode::is_enabled(), name,
               " is an inference tensor (created under torch.inference_mode()); updating it in place is only "
               "allowed inside torch.inference_mode(), as for torch's in-place ops");
}

// Bumps the autograd version counter of each written tensor, once per call (see Note [Adam op contract]).
void bump_versions(const std::vector<NamedTensor>& written) {
  for (const auto& named : written) {
    // An inference tensor has no version counter (and check_version_bumpable admitted it only inside
    // inference mode); every other tensor is bumped, in inference mode too, as torch's in-place ops do.
    if (!named.tensor->is_inference()) torch::autograd::impl::bump_version(*named.tensor);
  }
}

// Validates the op's tensors and turns them into spans; see Note [Adam op contract]. With check_overlap
// false the caller checks the buffers for overlap itself (across several tuples).
AdamSpans make_spans(const AdamOpArgs& args, const SpanNames& names = SpanNames{}, bool check_overlap = true) {
  const at::Tensor& param = args.param;
  check_dtype(param, names.param.c_str(), at::kFloat);
  check_dtype(args.exp_avg, names.exp_avg.c_str(), at::kFloat);
  check_dtype(args.exp_avg_sq, names.exp_avg_sq.c_str(), at::kFloat);
  std::vector<NamedTensor> tensors{{names.param.c_str(), &param},
                                   {names.grad.c_str(), &args.grad},
                                   {names.exp_avg.c_str(), &args.exp_avg},
                                   {names.exp_avg_sq.c_str(), &args.exp_avg_sq}};
  if (args.param_out) tensors.push_back({names.param_out.c_str(), &*args.param_out});
  check_flat_args(tensors, param.numel(), param.device(), names.param.c_str());
  if (check_overlap) check_no_overlap(tensors);
  for (const auto& [name, t] : tensors) {
    if (t != &args.grad) check_version_bumpable(*t, name);
  }

  AdamSpans spans;
  spans.n = param.numel();
  spans.param = param.data_ptr<float>();
  spans.grad = args.grad.data_ptr();
  spans.grad_type = to_scalar_type(args.grad, names.grad.c_str());
  spans.exp_avg = args.exp_avg.data_ptr<float>();
  spans.exp_avg_sq = args.exp_avg_sq.data_ptr<float>();
  if (args.param_out) {
    const at::Tensor& out = *args.param_out;
    ZC_CHECK_ARG(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf, names.param_out,
                 " must be bfloat16 or float16, got ", out.scalar_type());
    spans.param_out = out.data_ptr();
    spans.param_out_type = to_scalar_type(out, names.param_out.c_str());
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
// torch's current stream on `device`, as a cudaStream_t.
void* current_cuda_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
}

at::Tensor adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double step,
                          double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                          bool bias_correction, double grad_scale, bool check_finite) {
  return translate_value_errors([&] {
    ZC_CHECK_ARG(param.device().is_cuda(), "param must be a CUDA tensor for the CUDA kernel, got ", param.device());
    const AdamSpans spans = make_spans({param, grad, exp_avg, exp_avg_sq, param_out});
    const AdamHyper hyper = make_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
    const c10::DeviceGuard guard(param.device());
    void* stream = current_cuda_stream(param.device());
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

// The device every tensor of a multi-tensor call is on: that of the first, which must be the CPU or (in a
// build with the CUDA kernels) a CUDA device. Each tensor's own device is checked against it later.
at::Device multi_tensor_device(const at::Tensor& first, const char* name, const char* caller) {
  const at::Device device = first.device();
#if defined(ZEROCORE_HAVE_CUDA)
  ZC_CHECK_ARG(device.is_cpu() || device.is_cuda(), caller, ": ", name,
               " must be on the CPU or a CUDA device, got ", device);
#else
  ZC_CHECK_ARG(device.is_cpu(), caller, ": ", name, " must be on the CPU (this build has no CUDA kernels), got ",
               device);
#endif
  return device;
}

// _C.multi_tensor_adam_step: adam_step_ (without check_finite) over lists of tensors, all in one call into
// the core: on the CPU one split over the kernel pool (GIL released), on CUDA launch_multi_tensor_adam on
// torch's current stream. Every tuple is validated, and no buffer may overlap another anywhere in the
// lists, before anything is written.
void multi_tensor_adam_step_py(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                               const std::optional<std::vector<std::optional<at::Tensor>>>& param_outs, double step,
                               double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                               bool bias_correction, double grad_scale) {
  translate_value_errors([&] {
    const size_t num = params.size();
    ZC_CHECK_ARG(grads.size() == num && exp_avgs.size() == num && exp_avg_sqs.size() == num &&
                     (!param_outs || param_outs->size() == num),
                 "params, grads, exp_avgs, exp_avg_sqs and param_outs must have the same length, got ", num, ", ",
                 grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), " and ",
                 param_outs ? std::to_string(param_outs->size()) : std::string("None"));
    const AdamHyper hyper = make_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
    if (num == 0) return;
    const at::Device device = multi_tensor_device(params[0], "params[0]", "multi_tensor_adam_step");
    static const std::optional<at::Tensor> kNoOut;
    std::vector<SpanNames> names;
    names.reserve(num);
    std::vector<AdamSpans> spans;
    spans.reserve(num);
    for (size_t i = 0; i < num; ++i) {
      names.push_back(SpanNames::list_elements(i));
      ZC_CHECK_ARG(params[i].device() == device, names[i].param, " must be on ", device, " like params[0], got ",
                   params[i].device());
      const std::optional<at::Tensor>& out = param_outs ? (*param_outs)[i] : kNoOut;
      spans.push_back(make_spans({params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], out}, names[i],
                                 /*check_overlap=*/false));
    }
    std::vector<NamedTensor> written, read;
    for (size_t i = 0; i < num; ++i) {
      written.push_back({names[i].param.c_str(), &params[i]});
      written.push_back({names[i].exp_avg.c_str(), &exp_avgs[i]});
      written.push_back({names[i].exp_avg_sq.c_str(), &exp_avg_sqs[i]});
      if (param_outs && (*param_outs)[i]) written.push_back({names[i].param_out.c_str(), &*(*param_outs)[i]});
      read.push_back({names[i].grad.c_str(), &grads[i]});
    }
    check_no_overlap_among(written, read);

    if (device.is_cpu()) {
      const SimdPath path = active_simd_path();
      py::gil_scoped_release no_gil;
      CpuKernelPool::instance().run([&](ThreadPool* pool) {
        multi_tensor_adam_step(spans.data(), static_cast<int64_t>(num), hyper, pool, path);
      });
    } else {
#if defined(ZEROCORE_HAVE_CUDA)
      const c10::DeviceGuard guard(device);
      launch_multi_tensor_adam(spans.data(), static_cast<int64_t>(num), hyper, AdamDeviceScalars{},
                               current_cuda_stream(device));
#endif
    }
    bump_versions(written);
  });
}

// _C.multi_tensor_all_finite: whether every element of every gradient is finite. CPU: a Python bool, from
// one split over the kernel pool (GIL released). CUDA: a 0-d bool tensor on that device, computed on torch's
// current stream without a host sync. An empty list: True.
py::object multi_tensor_all_finite_py(const std::vector<at::Tensor>& grads) {
  return translate_value_errors([&]() -> py::object {
    const size_t num = grads.size();
    if (num == 0) return py::bool_(true);
    const at::Device device = multi_tensor_device(grads[0], "grads[0]", "multi_tensor_all_finite");
    std::vector<AdamSpans> spans(num);
    for (size_t i = 0; i < num; ++i) {
      const at::Tensor& g = grads[i];
      const std::string name = "grads[" + std::to_string(i) + "]";
      ZC_CHECK_ARG(g.defined(), name, " is an undefined tensor");
      ZC_CHECK_ARG(g.device() == device, name, " must be on ", device, " like grads[0], got ", g.device());
      ZC_CHECK_ARG(g.is_contiguous(), name, " must be contiguous, got strides ", g.strides());
      spans[i].grad_type = to_scalar_type(g, name.c_str());
      spans[i].grad = g.data_ptr();
      spans[i].n = g.numel();
    }
    if (device.is_cpu()) {
      const SimdPath path = active_simd_path();
      bool finite = false;
      {
        py::gil_scoped_release no_gil;
        finite = CpuKernelPool::instance().run([&](ThreadPool* pool) {
          return multi_tensor_all_finite(spans.data(), static_cast<int64_t>(num), pool, path);
        });
      }
      return py::bool_(finite);
    }
#if defined(ZEROCORE_HAVE_CUDA)
    const c10::DeviceGuard guard(device);
    at::Tensor found = at::zeros({}, grads[0].options().dtype(at::kInt));
    launch_multi_tensor_check_finite(spans.data(), static_cast<int64_t>(num), found.data_ptr<int32_t>(),
                                     current_cuda_stream(device));
    return py::cast(found.eq(0));
#else
    throw std::logic_error("unreachable: multi_tensor_device accepts only the CPU without CUDA");
#endif
  });
}

// The tensors the op's schema marks as written (Tensor(a!) and the like; a None optional is skipped).
std::vector<at::Tensor> mutated_inputs(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t num_arguments = schema.arguments().size();
  const size_t start = stack.size() - num_arguments;
  std::vector<at::Tensor> mutated;
  for (size_t i = 0; i < num_arguments; ++i) {
    const c10::IValue& value = stack[start + i];
    if (value.isTensor() && schema.is_mutable({c10::SchemaArgType::input, i})) mutated.push_back(value.toTensor());
  }
  return mutated;
}

// The op's autograd kernel (boxed, driven by the schema). The update has no derivative, so, as for torch's
// in-place ops, a written tensor that requires grad is refused while grad mode is on (optimizers step under
// torch.no_grad()); then the call goes on to the ADInplaceOrView kernel below.
void adam_autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (at::GradMode::is_enabled()) {
    const std::vector<at::Tensor> mutated = mutated_inputs(op, *stack);
    for (const at::Tensor& t : mutated) {
      TORCH_CHECK(!t.requires_grad(), op.schema().name(),
                  " updates its tensors in place and has no derivative, but one of them requires grad and grad "
                  "mode is on; call it under torch.no_grad(), as optimizers do (a leaf Variable that requires "
                  "grad cannot be used in an in-place operation)");
    }
  }
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

// The op's ADInplaceOrView kernel: runs the op below this key, then bumps the version counter of every
// written tensor (torch's stock ADInplaceOrView fallback bumps only written outputs; this op returns none).
void adam_inplace_or_view_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const std::vector<at::Tensor> mutated = mutated_inputs(op, *stack);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : mutated) {
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
  }
}

}  // namespace

void run_on_cpu_kernel_pool(const std::function<void(ThreadPool*)>& fn) { CpuKernelPool::instance().run(fn); }

void bind_adam(py::module_& m) {
  m.def(
      "set_num_threads", [](int n) { CpuKernelPool::instance().set_num_threads(n); }, py::arg("num_threads"),
      "Threads for the CPU kernels; 0 follows torch.get_num_threads().");
  m.def("get_num_threads", [] { return CpuKernelPool::instance().num_threads(); });
  m.def("default_kernel_threads", &default_kernel_threads, py::arg("torch_threads"), py::arg("omp_num_threads"),
        py::arg("local_world_size"), py::arg("cores"),
        "The CPU kernels' thread count when none is pinned (Note [Kernel threads under torchrun]).");
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
  m.def("multi_tensor_adam_step", &multi_tensor_adam_step_py, py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("param_outs") = py::none(), py::kw_only(),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adamw"), py::arg("bias_correction"), py::arg("grad_scale"),
        "adam_step_ over lists of tensors (one tuple per index) in one call into the core; see ops.py.");
  m.def("multi_tensor_all_finite", &multi_tensor_all_finite_py, py::arg("grads"),
        "Whether every gradient is finite: a bool on the CPU, a 0-d bool tensor (no host sync) on CUDA.");
}

}  // namespace zerocore::bindings

TORCH_LIBRARY(zerocore, m) {
  m.def(
      "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_out, *, float step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool adamw, bool bias_correction, float grad_scale, bool check_finite) -> Tensor");
}

TORCH_LIBRARY_IMPL(zerocore, CPU, m) { m.impl("adam_step_", &zerocore::bindings::adam_step_cpu); }

// Autograd bookkeeping of the in-place op, as for torch's own in-place ops: the version counter of every
// argument the schema marks as written (param, exp_avg, exp_avg_sq, param_out) is bumped after the update,
// and a written tensor that requires grad is refused in grad mode. torch's default autograd fallback for
// custom ops skips the ADInplaceOrView key for an op that returns no written tensor, so the op has both.
TORCH_LIBRARY_IMPL(zerocore, Autograd, m) {
  m.impl("adam_step_", torch::CppFunction::makeFromBoxedFunction<&zerocore::bindings::adam_autograd_kernel>());
}

TORCH_LIBRARY_IMPL(zerocore, ADInplaceOrView, m) {
  m.impl("adam_step_",
         torch::CppFunction::makeFromBoxedFunction<&zerocore::bindings::adam_inplace_or_view_kernel>());
}

// A lazily negated argument routes the call here (torch's math-bit fallback would otherwise resolve it and
// then hit an internal assert, since the op's result is not its mutated input): reject it by name.
TORCH_LIBRARY_IMPL(zerocore, Negative, m) {
  m.impl("adam_step_", [](const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double, double,
                          double, double, double, double, bool, bool, double, bool) -> at::Tensor {
    const std::vector<std::pair<const char*, const at::Tensor*>> args{
        {"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq},
        {"param_out", param_out ? &*param_out : nullptr}};
    for (const auto& [name, t] : args) {
      TORCH_CHECK_VALUE(t == nullptr || !t->is_neg(), name,
                        " is a lazily negated view (x.neg() view / torch._neg_view, is_neg() is True); pass ",
                        name, ".resolve_neg() (a copy), or for a parameter, update it through a resolved copy "
                        "and copy the result back");
    }
    TORCH_CHECK_VALUE(false, "adam_step_ was dispatched for a negated view, but no argument is one");
  });
}

#if defined(ZEROCORE_HAVE_CUDA)
TORCH_LIBRARY_IMPL(zerocore, CUDA, m) { m.impl("adam_step_", &zerocore::bindings::adam_step_cuda); }
#endif
