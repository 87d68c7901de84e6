// zerocore._C classes for the ZeRO engine: Comm (collectives through c10d) and the list of its registered
// algorithms, GradReducer (stages 1-2) and the pure ReadyTracker (exposed for tests of the launch order).
#include <optional>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "bindings.hpp"
#include "comm.hpp"
#include "grad_reducer.hpp"
#include "zerocore/ready_tracker.hpp"

namespace py = pybind11;

namespace zerocore::bindings {

void bind_distributed(py::module_& m) {
  py::class_<PendingCollective>(m, "PendingCollective")
      .def("wait", &PendingCollective::wait, py::call_guard<py::gil_scoped_release>())
      .def_readonly("tag", &PendingCollective::tag);

  py::class_<CollectiveStats>(m, "CollectiveStats")
      .def_readonly("calls", &CollectiveStats::calls)
      .def_readonly("logical_elements", &CollectiveStats::logical_elements)
      .def_readonly("algorithm_bytes", &CollectiveStats::algorithm_bytes)
      .def_readonly("backend_calls", &CollectiveStats::backend_calls)
      .def_readonly("unquantized_bytes", &CollectiveStats::unquantized_bytes);

  py::class_<Comm, std::shared_ptr<Comm>>(m, "Comm")
      .def(py::init([](c10::intrusive_ptr<c10d::ProcessGroup> group, const std::string& reduce_scatter_algo,
                       const std::string& all_gather_algo, int64_t quantization_group_size, int node_size,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> node_group,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> cross_group) {
             StrategyOptions options;
             options.quantization_group_size = quantization_group_size;
             options.node_size = node_size;
             if (node_group) options.node_group = *node_group;
             if (cross_group) options.cross_group = *cross_group;
             return std::make_shared<Comm>(std::move(group), reduce_scatter_algo, all_gather_algo, options);
           }),
           // Without the GIL: building a Comm runs collectives (the shared-memory rendezvous), and a Gloo thread
           // finishing an earlier collective may need the GIL to release a Python-owned tensor.
           py::call_guard<py::gil_scoped_release>(),
           py::arg("process_group"), py::arg("reduce_scatter_algo") = "auto", py::arg("all_gather_algo") = "auto",
           py::arg("quantization_group_size") = 256, py::arg("node_size") = 1, py::arg("node_group") = py::none(),
           py::arg("cross_group") = py::none())
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("world_size", &Comm::world_size)
      .def_property_readonly("backend", &Comm::backend)
      .def_property_readonly("reduce_scatter_algo", &Comm::reduce_scatter_algo)
      .def_property_readonly("all_gather_algo", &Comm::all_gather_algo)
      .def_property_readonly("shared_memory_bytes", &Comm::shared_memory_bytes,
                             "Bytes of the shared-memory segment this Comm maps (0: none).")
      .def("reduce_scatter", &Comm::reduce_scatter, py::arg("bucket"), py::arg("tag") = -1,
           py::arg("cuts") = std::vector<int64_t>{}, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("reduce_scatter_widens", &Comm::reduce_scatter_widens)
      .def(
          "reduce_scatter_widened",
          [](Comm& comm, const at::Tensor& bucket, const at::Tensor& destination, double prescale, bool accumulate,
             int64_t tag) { return comm.reduce_scatter_widened(bucket, WidenedSum{destination, prescale, accumulate}, tag); },
          py::arg("bucket"), py::arg("destination"), py::arg("prescale") = 1.0, py::arg("accumulate") = false,
          py::arg("tag") = -1, py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &Comm::all_gather, py::arg("bucket"), py::arg("tag") = -1, py::arg("label") = "all_gather",
           py::arg("cuts") = std::vector<int64_t>{}, py::call_guard<py::gil_scoped_release>())
      .def("all_reduce", &Comm::all_reduce, py::arg("tensor"), py::arg("max") = false, py::arg("tag") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &Comm::broadcast, py::arg("tensor"), py::arg("root"), py::arg("tag") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("stats", &Comm::stats)
      .def("reset_stats", &Comm::reset_stats)
      .def("log", &Comm::log)
      .def("set_logging", &Comm::set_logging)
      .def("clear_log", &Comm::clear_log);

  m.def(
      "reduce_scatter_widens",
      [](const std::string& algorithm, const std::string& backend) {
        return reduce_scatter_strategies().create(algorithm, backend)->widens();
      },
      py::arg("algorithm"), py::arg("backend"),
      "Whether the reduce-scatter `algorithm` ('auto' resolved for `backend`) sums at the receiver, so that "
      "16-bit gradients travel in 16 bits and are summed in fp32 (Note [Widening reduce-scatter]).");

  m.def("reduction_wire_dtype", &reduction_wire_dtype, py::arg("reduce_dtype"), py::arg("grad_dtype"),
        py::arg("world_size"), py::arg("algorithm_widens"),
        "The dtype gradient buckets travel in, as the GradReducer decides it (Note [Widening reduce-scatter]).");

  m.def(
      "collective_algorithms",
      [] {
        py::dict out;
        out[ReduceScatterStrategy::kOp] = reduce_scatter_strategies().names();
        out[AllGatherStrategy::kOp] = all_gather_strategies().names();
        return out;
      },
      "The registered algorithms of each logical bucket collective, by op, in registration order (Note "
      "[Collective algorithms]); Comm also accepts 'auto'.");

  py::class_<GradReducer>(m, "GradReducer")
      .def(py::init([](std::shared_ptr<Comm> comm, std::vector<int64_t> bucket_padded_size,
                       std::vector<int64_t> param_bucket, std::vector<int64_t> param_offset,
                       std::vector<int64_t> param_numel, std::vector<int64_t> launch_order,
                       std::vector<at::Tensor> shard_destinations, at::ScalarType reduce_dtype, double prescale,
                       bool overlap, std::vector<std::optional<at::Tensor>> in_place,
                       std::optional<at::ScalarType> grad_dtype) {
             ReducerGeometry geometry{std::move(bucket_padded_size), std::move(param_bucket), std::move(param_offset),
                                      std::move(param_numel), std::move(launch_order)};
             return std::make_unique<GradReducer>(std::move(comm), std::move(geometry), std::move(shard_destinations),
                                                  reduce_dtype, prescale, overlap, std::move(in_place), grad_dtype);
           }),
           py::arg("comm"), py::arg("bucket_padded_size"), py::arg("param_bucket"), py::arg("param_offset"),
           py::arg("param_numel"), py::arg("launch_order"), py::arg("shard_destinations"), py::arg("reduce_dtype"),
           py::arg("prescale"), py::arg("overlap") = true,
           py::arg("in_place") = std::vector<std::optional<at::Tensor>>{},
           py::arg("grad_dtype") = std::optional<at::ScalarType>{})
      .def("begin_backward", &GradReducer::begin_backward, py::arg("accumulate"), py::arg("full_width") = false)
      .def("mark_ready", &GradReducer::mark_ready, py::arg("param"), py::arg("grad"),
           py::call_guard<py::gil_scoped_release>())
      .def("finalize", &GradReducer::finalize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("in_backward", &GradReducer::in_backward)
      .def("unmarked_params", &GradReducer::unmarked_params)
      .def("is_marked", &GradReducer::is_marked, py::arg("param"))
      .def_property_readonly("wire_dtype", &GradReducer::wire_dtype)
      .def_property_readonly("buffer_bytes", &GradReducer::buffer_bytes)
      .def_property_readonly("peak_buffer_bytes", &GradReducer::peak_buffer_bytes)
      .def_property_readonly("launch_order", &GradReducer::launch_order)
      .def("completion_order", &GradReducer::completion_order)
      .def("set_launch_order", &GradReducer::set_launch_order, py::arg("order"));

  py::class_<ReadyTracker>(m, "ReadyTracker")
      .def(py::init<std::vector<int64_t>, int64_t, std::vector<int64_t>>(), py::arg("param_bucket"),
           py::arg("num_buckets"), py::arg("launch_order"))
      .def("reset", &ReadyTracker::reset)
      .def("mark_ready",
           [](ReadyTracker& t, int64_t param) {
             std::vector<int64_t> launch;
             t.mark_ready(param, launch);
             return launch;
           })
      .def("finalize", [](ReadyTracker& t) {
        std::vector<int64_t> launch, unmarked;
        t.finalize(launch, unmarked);
        return py::make_tuple(launch, unmarked);
      })
      .def("completion_order", &ReadyTracker::completion_order)
      .def("set_launch_order", &ReadyTracker::set_launch_order, py::arg("launch_order"))
      .def_property_readonly("launch_order", &ReadyTracker::launch_order);
}

}  // namespace zerocore::bindings
