// zerocore._C.move_storage: hands one CPU storage's memory to another without copying or allocating, so
// stage 3 can keep a released unit's pages for the next gather (Note [Spare gather storage] in
// python/zerocore/_gather_spares.py). zerocore._C.advise_huge_pages: asks the kernel to back a buffer with
// transparent huge pages (Note [Huge pages for direct I/O] in python/zerocore/_safetensors_io.py).
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <fstream>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

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
  // The whole storage moves, so src must be all of it: a view (base[2:6]) would empty its base's memory
  // behind the caller's back.
  ZC_CHECK_ARG(src.storage_offset() == 0 && src.is_contiguous() && src.nbytes() >= nbytes,
               "move_storage: src must cover its whole storage (offset 0, contiguous, ", nbytes,
               " bytes), but it is a view of ", src.nbytes(), " bytes at element offset ", src.storage_offset(),
               src.is_contiguous() ? "" : ", not contiguous");
  // dst's elements must lie inside the memory it takes: reading past it would read freed or foreign memory.
  const auto width = static_cast<size_t>(dst.element_size());
  ZC_CHECK_ARG(nbytes % width == 0, "move_storage: the ", nbytes, " bytes moved are not a whole number of dst's ",
               dst.scalar_type(), " elements (", width, " bytes each)");
  size_t extent = 0;  // elements from the storage's start to one past dst's last element
  if (dst.numel() > 0) {
    extent = static_cast<size_t>(dst.storage_offset()) + 1;
    for (int64_t d = 0; d < dst.dim(); ++d) extent += static_cast<size_t>((dst.size(d) - 1) * dst.stride(d));
  }
  ZC_CHECK_ARG(extent * width <= nbytes, "move_storage: dst (storage offset ", dst.storage_offset(), ", shape ",
               dst.sizes(), ") reaches ", extent * width, " bytes into its storage, but src moves only ", nbytes);
  c10::DataPtr memory = from->set_data_ptr(c10::DataPtr(nullptr, from->device()));
  from->set_nbytes(0);
  to->set_data_ptr_noswap(std::move(memory));
  to->set_nbytes(nbytes);
}

// The size of a transparent huge page (2 MiB on x86-64), or 0 where the kernel offers none.
int64_t huge_page_size() {
  static const int64_t size = [] {
    std::ifstream in("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
    int64_t bytes = 0;
    if (!(in >> bytes) || bytes <= 0) return int64_t{0};
    std::ifstream mode("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string line;
    std::getline(mode, line);
    return line.find("[never]") == std::string::npos ? bytes : int64_t{0};
  }();
  return size;
}

// madvise(MADV_HUGEPAGE) over the whole huge pages inside `tensor`'s bytes; returns how many bytes were
// advised (0 where the kernel has no huge pages or refuses). Advice only: the values are untouched, and pages
// already faulted in stay as they are until the kernel's khugepaged merges them.
int64_t advise_huge_pages(const at::Tensor& tensor) {
  ZC_CHECK_ARG(tensor.device().is_cpu() && tensor.is_contiguous(),
               "advise_huge_pages: a contiguous CPU tensor is needed");
  const int64_t huge = huge_page_size();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (huge == 0) return 0;
  const auto begin = reinterpret_cast<uintptr_t>(tensor.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(tensor.nbytes());
  const auto step = static_cast<uintptr_t>(huge);
  const uintptr_t lo = (begin + step - 1) / step * step;
  const uintptr_t hi = end / step * step;
  if (hi <= lo) return 0;
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE) != 0) return 0;
  return static_cast<int64_t>(hi - lo);
#else
  (void)huge;
  return 0;
#endif
}

}  // namespace

void bind_storage(pybind11::module_& m) {
  m.def("move_storage", &move_storage, pybind11::arg("dst"), pybind11::arg("src"),
        "dst's empty CPU storage takes src's memory (no copy, no allocation); src's storage is left empty.");
  m.def("huge_page_size", &huge_page_size,
        "The size of a transparent huge page in bytes, or 0 where the kernel offers none.");
  m.def("advise_huge_pages", &advise_huge_pages, pybind11::arg("tensor"),
        "madvise(MADV_HUGEPAGE) over the whole huge pages inside the tensor's bytes; returns the bytes advised.");
}

}  // namespace zerocore::bindings
