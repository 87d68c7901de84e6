// zerocore._C.move_storage: hands one CPU storage's memory to another without copying or allocating, so
// stage 3 can keep a released unit's pages for the next gather (Note [Spare gather storage] in
// python/zerocore/_gather_spares.py).
#include <c10/core/StorageImpl.h>

#include "bindings.hpp"
#include "zerocore/error.hpp"

namespace zerocore::bindings {
namespace {

// dst's storage (empty) takes src's memory; src's storage is left empty. Every view of either storage sees
// the change, as after a resize_: that is what lets parameters' views and autograd's saved views of a
// unit's buffer see the memory again.
void move_storage(const at::Tensor& dst, const at::Tensor& src) {
  ZC_CHECK_ARG(dst.device().is_cpu() && src.device().is_cpu(), "move_storage: CPU tensors only");
  c10::StorageImpl* to = dst.storage().unsafeGetStorageImpl();
  c10::StorageImpl* from = src.storage().unsafeGetStorageImpl();
  ZC_CHECK_ARG(to != from, "move_storage: the two tensors share one storage");
  ZC_CHECK_ARG(to->nbytes() == 0, "move_storage: the destination storage holds ", to->nbytes(),
               " bytes; it must be empty");
  ZC_CHECK_ARG(to->resizable() && from->resizable(), "move_storage: both storages must be resizable");
  ZC_CHECK_ARG(to->allocator() == from->allocator(),
               "move_storage: the storages come from different allocators (their memory could not be freed "
               "by the one that takes it)");
  const size_t nbytes = from->nbytes();
  c10::DataPtr memory = from->set_data_ptr(c10::DataPtr(nullptr, from->device()));
  from->set_nbytes(0);
  to->set_data_ptr_noswap(std::move(memory));
  to->set_nbytes(nbytes);
}

}  // namespace

void bind_storage(pybind11::module_& m) {
  m.def("move_storage", &move_storage, pybind11::arg("dst"), pybind11::arg("src"),
        "dst's empty CPU storage takes src's memory (no copy, no allocation); src's storage is left empty.");
}

}  // namespace zerocore::bindings
