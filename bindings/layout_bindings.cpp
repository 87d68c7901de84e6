// zerocore._C.FlatLayout: the torch-free FlatLayout (cpp/layout.hpp) with results as int64 tensors, so a
// million-tensor layout crosses into Python without a million Python objects.
#include <cstring>
#include <vector>

#include "bindings.hpp"
#include "zerocore/error.hpp"
#include "zerocore/layout.hpp"

namespace py = pybind11;

namespace zerocore::bindings {
namespace {

at::Tensor to_tensor(const std::vector<int64_t>& values) {
  at::Tensor out = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  if (!values.empty()) std::memcpy(out.data_ptr<int64_t>(), values.data(), values.size() * sizeof(int64_t));
  return out;
}

// Packs trivially copyable records of int64 fields into an [rows, fields] int64 tensor.
template <typename Record>
at::Tensor records_to_tensor(const std::vector<Record>& records) {
  constexpr int64_t kFields = sizeof(Record) / sizeof(int64_t);
  static_assert(sizeof(Record) == kFields * sizeof(int64_t), "records must hold int64 fields only");
  at::Tensor out = at::empty({static_cast<int64_t>(records.size()), kFields}, at::kLong);
  if (!records.empty()) std::memcpy(out.data_ptr<int64_t>(), records.data(), records.size() * sizeof(Record));
  return out;
}

FlatLayout layout_from_tensor(const at::Tensor& sizes, int64_t world_size, int64_t alignment, int64_t bucket_cap) {
  ZC_CHECK_ARG(sizes.dim() == 1, "sizes must be 1-D, got a tensor of shape ", sizes.sizes());
  ZC_CHECK_ARG(sizes.device().is_cpu(), "sizes must be on the CPU, got ", sizes.device());
  ZC_CHECK_ARG(!at::isFloatingType(sizes.scalar_type()) && !at::isComplexType(sizes.scalar_type()) &&
                   sizes.scalar_type() != at::kBool,
               "sizes must hold integers, got dtype ", sizes.scalar_type());
  const at::Tensor contiguous = sizes.to(at::kLong).contiguous();
  return FlatLayout(contiguous.data_ptr<int64_t>(), contiguous.numel(), world_size, alignment, bucket_cap);
}

}  // namespace

void bind_layout(py::module_& m) {
  py::class_<FlatLayout>(m, "FlatLayout", "Flat-partition layout; see Note [Flat-partition geometry].")
      .def(py::init(&layout_from_tensor), py::arg("sizes"), py::arg("world_size"), py::arg("alignment"),
           py::arg("bucket_cap"))
      .def(py::init([](const std::vector<int64_t>& sizes, int64_t world_size, int64_t alignment,
                       int64_t bucket_cap) { return FlatLayout(sizes, world_size, alignment, bucket_cap); }),
           py::arg("sizes"), py::arg("world_size"), py::arg("alignment"), py::arg("bucket_cap"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_tensors", &FlatLayout::num_tensors)
      .def_property_readonly("num_buckets", &FlatLayout::num_buckets)
      .def_property_readonly("world_size", &FlatLayout::world_size)
      .def_property_readonly("alignment", &FlatLayout::alignment)
      .def_property_readonly("bucket_cap", &FlatLayout::bucket_cap)
      .def_property_readonly("total_size", &FlatLayout::total_size)
      .def_property_readonly("shard_size", &FlatLayout::shard_size)
      .def("sizes", [](const FlatLayout& l) { return to_tensor(l.sizes()); })
      .def("offsets", [](const FlatLayout& l) { return to_tensor(l.offsets()); })
      .def("tensor_buckets", [](const FlatLayout& l) { return to_tensor(l.tensor_buckets()); })
      .def("buckets", [](const FlatLayout& l) { return records_to_tensor(l.buckets()); },
           "[num_buckets, 7] int64: flat_start, content_end, padded_size, shard_size, shard_offset, "
           "first_tensor, end_tensor")
      .def(
          "rank_pieces", [](const FlatLayout& l, int64_t rank) { return records_to_tensor(l.rank_pieces(rank)); },
          py::arg("rank"),
          "[pieces, 6] int64: tensor, bucket, tensor_offset, shard_offset, flat_offset, length")
      .def(
          "bucket_rank_pieces",
          [](const FlatLayout& l, int64_t bucket, int64_t rank) {
            std::vector<Piece> pieces;
            l.bucket_rank_pieces(bucket, rank, pieces);
            return records_to_tensor(pieces);
          },
          py::arg("bucket"), py::arg("rank"))
      .def("bucket_cuts", &FlatLayout::bucket_cuts,
           "Per bucket: where its non-empty tensors begin and end, relative to the bucket's start, sorted and "
           "distinct (the boundaries quantized collectives start a scale group at).");
}

}  // namespace zerocore::bindings
