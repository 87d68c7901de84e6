// zerocore._C scheduling decisions of the torch-free core: the stage 3 prefetch plan
// (Note [Stage 3 prefetch plan]) and the reducer's bucket geometry (Note [Reducer bucket geometry]).
// The core's InvalidArgument derives from std::invalid_argument, which pybind11 raises as ValueError.
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "bindings.hpp"
#include "zerocore/bucket_geometry.hpp"
#include "zerocore/prefetch_plan.hpp"

namespace py = pybind11;

namespace zerocore::bindings {

void bind_plan(py::module_& m) {
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
