// zerocore._C scheduling decisions of the torch-free core: the stage 3 prefetch plan
// (Note [Stage 3 prefetch plan]) and the reducer's bucket geometry (Note [Reducer bucket geometry]).
// The core's InvalidArgument derives from std::invalid_argument, which pybind11 raises as ValueError.
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "zerocore/bucket_geometry.hpp"
#include "zerocore/prefetch_plan.hpp"

namespace py = pybind11;

namespace zerocore::bindings {
namespace {

// The units' states in place: a bytearray the runtime keeps (one byte per unit, nonzero while sharded), read
// without a copy so that a question costs no pass over the units.
const uint8_t* sharded_flags(const PrefetchPlanner& planner, const py::buffer& unit_sharded) {
  const py::buffer_info info = unit_sharded.request();
  if (info.ndim != 1 || info.itemsize != 1 || info.size != static_cast<py::ssize_t>(planner.num_units()) ||
      (info.ndim == 1 && info.strides[0] != 1)) {
    throw py::value_error("unit_sharded must be a contiguous buffer of one byte per unit (" +
                          std::to_string(planner.num_units()) + "), got " + std::to_string(info.size) +
                          " item(s) of " + std::to_string(info.itemsize) + " byte(s)");
  }
  return static_cast<const uint8_t*>(info.ptr);
}

}  // namespace

void bind_plan(py::module_& m) {
  py::class_<PrefetchPlanner>(
      m, "PrefetchPlanner",
      "plan_forward_prefetch / plan_backward_prefetch for one recorded order, the order, sizes and persistence "
      "taken once and the units' states read in place from a bytearray (see Note [Stage 3 prefetch plan]).")
      .def(py::init<std::vector<int64_t>, std::vector<int64_t>, std::vector<uint8_t>>(), py::arg("recorded_order"),
           py::arg("unit_numel"), py::arg("unit_persistent"))
      .def(
          "forward",
          [](const PrefetchPlanner& planner, int64_t position, const py::buffer& unit_sharded, int64_t live_elements,
             int64_t max_live, int64_t prefetch_budget) {
            return planner.forward(position, sharded_flags(planner, unit_sharded), live_elements, max_live,
                                   prefetch_budget);
          },
          py::arg("position"), py::arg("unit_sharded"), py::arg("live_elements"), py::arg("max_live"),
          py::arg("prefetch_budget"), "plan_forward_prefetch's answer. ValueError on bad input.")
      .def(
          "backward",
          [](const PrefetchPlanner& planner, int64_t unit, int64_t visit, const py::buffer& unit_sharded,
             int64_t live_elements, int64_t max_live) {
            return planner.backward(unit, visit, sharded_flags(planner, unit_sharded), live_elements, max_live);
          },
          py::arg("unit"), py::arg("visit"), py::arg("unit_sharded"), py::arg("live_elements"), py::arg("max_live"),
          "plan_backward_prefetch's answer. ValueError on bad input.");
  m.def("plan_forward_prefetch", &plan_forward_prefetch, py::arg("recorded_order"), py::arg("position"),
        py::arg("unit_numel"), py::arg("unit_sharded"), py::arg("unit_persistent"), py::arg("live_elements"),
        py::arg("max_live"), py::arg("prefetch_budget"),
        "Units (indices into unit_numel) to start gathering before the forward of recorded_order[position:], "
        "in order; see Note [Stage 3 prefetch plan]. ValueError on bad input.");
  m.def("plan_backward_prefetch", &plan_backward_prefetch, py::arg("recorded_order"), py::arg("unit"),
        py::arg("visit"), py::arg("unit_numel"), py::arg("unit_sharded"), py::arg("unit_persistent"),
        py::arg("live_elements"), py::arg("max_live"),
        "The unit to start gathering before the `visit`-th backward (0: the first) of `unit` in this backward, or "
        "None; see Note [Stage 3 prefetch plan]. "
        "ValueError on bad input.");
  m.def("reducer_geometry", &reducer_geometry, py::arg("bucket_padded_size"), py::arg("param_bucket"),
        py::arg("param_offset"), py::arg("param_numel"), py::arg("world_size"),
        "Checks the reducer's bucket geometry and returns the bucket launch order; see "
        "Note [Reducer bucket geometry]. ValueError on bad input.");
  m.def("bucket_cuts", &bucket_cuts, py::arg("num_buckets"), py::arg("param_bucket"), py::arg("param_offset"),
        py::arg("param_numel"),
        "Per bucket: where its non-empty parameters begin and end inside it, sorted and distinct. ValueError on "
        "bad input.");
}

}  // namespace zerocore::bindings
