// Checks that turn at::Tensors into raw spans for cpp/ and cuda/, with errors that name the argument.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/extension.h>

#include "zerocore/adam_types.hpp"
#include "zerocore/error.hpp"

namespace zerocore::bindings {

// A tensor with the argument name it came in as, for error messages.
struct NamedTensor {
  const char* name;
  const at::Tensor* tensor;
};

inline ScalarType to_scalar_type(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return ScalarType::kFloat32;
    case at::kBFloat16: return ScalarType::kBFloat16;
    case at::kHalf: return ScalarType::kFloat16;
    default:
      throw InvalidArgument(detail::concat(name, " must be float32, bfloat16 or float16, got ", t.scalar_type()));
  }
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType expected) {
  ZC_CHECK_ARG(t.scalar_type() == expected, name, " must be ", expected, ", got ", t.scalar_type());
}

// Every tensor contiguous, with `numel` elements, on `device` (those of the tensor named `reference`).
inline void check_flat_args(const std::vector<NamedTensor>& tensors, int64_t numel, const at::Device& device,
                            const char* reference = "param") {
  for (const auto& [name, t] : tensors) {
    ZC_CHECK_ARG(t->defined(), name, " is an undefined tensor");
    ZC_CHECK_ARG(t->device() == device, name, " must be on ", device, " like ", reference, ", got ", t->device());
    ZC_CHECK_ARG(t->numel() == numel, name, " must have ", numel, " elements like ", reference, ", got ",
                 t->numel());
    ZC_CHECK_ARG(t->is_contiguous(), name, " must be contiguous (any storage offset is fine), got strides ",
                 t->strides());
    ZC_CHECK_ARG(!t->is_neg() && !t->is_conj(), name, " must not be a lazily negated or conjugated view");
  }
}

// No two tensors' memory ranges overlap: the kernels read and write every element once and in parallel.
inline void check_no_overlap(const std::vector<NamedTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (size_t j = i + 1; j < tensors.size(); ++j) {
      const at::Tensor& a = *tensors[i].tensor;
      const at::Tensor& b = *tensors[j].tensor;
      if (a.numel() == 0 || b.numel() == 0) continue;
      const auto a_begin = reinterpret_cast<uintptr_t>(a.data_ptr());
      const auto b_begin = reinterpret_cast<uintptr_t>(b.data_ptr());
      const auto a_end = a_begin + a.numel() * a.element_size();
      const auto b_end = b_begin + b.numel() * b.element_size();
      ZC_CHECK_ARG(a_end <= b_begin || b_end <= a_begin, tensors[i].name, " and ", tensors[j].name,
                   " overlap in memory; every buffer must be distinct");
    }
  }
}

// No tensor in `written` overlaps any other tensor in `written` or `read` (tensors in `read` may overlap
// one another: they are only read). Sorts the ranges once, so a long list costs O(n log n), not O(n^2).
inline void check_no_overlap_among(const std::vector<NamedTensor>& written, const std::vector<NamedTensor>& read) {
  struct Range {
    uintptr_t begin, end;
    bool is_written;
    const char* name;
  };
  std::vector<Range> ranges;
  ranges.reserve(written.size() + read.size());
  for (const auto* list : {&written, &read}) {
    for (const auto& [name, t] : *list) {
      if (t->numel() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(t->data_ptr());
      ranges.push_back({begin, begin + t->numel() * t->element_size(), list == &written, name});
    }
  }
  std::stable_sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  // Sweeping by start: a range overlaps an earlier one exactly when it starts before that one's end.
  const Range* furthest_written = nullptr;  // among the earlier ranges, the written one reaching furthest
  const Range* furthest_any = nullptr;      // and the one of any kind reaching furthest
  for (const Range& r : ranges) {
    const Range* other = nullptr;
    if (furthest_written != nullptr && r.begin < furthest_written->end) {
      other = furthest_written;
    } else if (r.is_written && furthest_any != nullptr && r.begin < furthest_any->end) {
      other = furthest_any;
    }
    if (other != nullptr) {
      throw InvalidArgument(
          detail::concat(other->name, " and ", r.name, " overlap in memory; every buffer must be distinct"));
    }
    if (r.is_written && (furthest_written == nullptr || r.end > furthest_written->end)) furthest_written = &r;
    if (furthest_any == nullptr || r.end > furthest_any->end) furthest_any = &r;
  }
}

// Runs fn, turning the core's InvalidArgument into c10::ValueError: ops called through torch's dispatcher
// surface c10 errors as their Python types, but any other std::exception as RuntimeError.
template <typename Fn>
auto translate_value_errors(Fn&& fn) {
  try {
    return fn();
  } catch (const InvalidArgument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace zerocore::bindings
