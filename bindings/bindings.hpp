// Registration functions of the zerocore._C submodules, one per binding file.
#pragma once

#include <torch/extension.h>

namespace zerocore::bindings {

void bind_layout(pybind11::module_& m);
void bind_plan(pybind11::module_& m);
void bind_adam(pybind11::module_& m);
void bind_distributed(pybind11::module_& m);
void bind_storage(pybind11::module_& m);  // storage_bindings.cpp: move_storage

}  // namespace zerocore::bindings
