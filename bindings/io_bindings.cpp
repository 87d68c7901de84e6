// File I/O: zerocore._C.crc32c over a tensor's bytes and zerocore._C.AsyncIO, the asynchronous file engine
// (Note [Async I/O engine] in zerocore/async_io.hpp) reading into and writing from CPU tensors.
//
// Errors: the core's IoError becomes OSError(errno, message, path) -- so FileNotFoundError,
// PermissionError, ... where errno has one -- with .errno, .strerror (the whole message) and .filename set;
// InvalidArgument becomes ValueError (pybind11's translation of std::invalid_argument).
//
// Tensors: a request keeps its tensor alive until it is waited (wait, wait_all) or the engine is
// destroyed, which waits for every request first. A read bumps the tensor's autograd version counter at
// submission, as an in-place op would.
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/autograd/variable.h>

#include "bindings.hpp"
#include "zerocore/async_io.hpp"
#include "zerocore/crc32c.hpp"
#include "zerocore/error.hpp"

namespace py = pybind11;

namespace zerocore::bindings {
namespace {

// The bytes of a dense, contiguous CPU tensor.
struct TensorBytes {
  void* data;
  size_t nbytes;
};

TensorBytes tensor_bytes(const at::Tensor& t, const char* caller) {
  ZC_CHECK_ARG(t.defined(), caller, ": the tensor is undefined");
  ZC_CHECK_ARG(t.layout() == at::kStrided, caller, ": the tensor must be dense (strided), got layout ", t.layout());
  ZC_CHECK_ARG(t.device().is_cpu(), caller, ": the tensor must be on the CPU, got device ", t.device());
  ZC_CHECK_ARG(t.is_contiguous(), caller, ": the tensor must be contiguous, got sizes ", t.sizes(), " and strides ",
               t.strides(), "; pass tensor.contiguous() (a copy)");
  ZC_CHECK_ARG(!t.is_neg() && !t.is_conj(), caller,
               ": the tensor is a lazily negated or conjugated view; pass tensor.resolve_neg().resolve_conj()");
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  return {nbytes == 0 ? nullptr : t.mutable_data_ptr(), nbytes};
}

uint64_t checked_offset(int64_t offset, const char* caller) {
  ZC_CHECK_ARG(offset >= 0, caller, ": the file offset must be >= 0, got ", offset);
  return static_cast<uint64_t>(offset);
}

std::string fspath(const py::object& path) {
  py::object text = py::module_::import("os").attr("fsdecode")(path);
  return text.cast<std::string>();
}

class PyAsyncIO {
 public:
  explicit PyAsyncIO(const AioConfig& config) : engine_(std::make_unique<AsyncIO>(config)) {}

  const AioConfig& config() const { return engine_->config(); }

  int64_t open(const py::object& path, const std::string& mode) {
    const OpenMode open_mode = parse_open_mode(mode);
    const std::string p = fspath(path);
    py::gil_scoped_release no_gil;
    return engine_->open(p, open_mode);
  }

  int64_t read(int64_t handle, int64_t offset, const at::Tensor& tensor) {
    const TensorBytes bytes = tensor_bytes(tensor, "AsyncIO.read");
    const uint64_t file_offset = checked_offset(offset, "AsyncIO.read");
    ZC_CHECK_ARG(!(tensor.requires_grad() && at::GradMode::is_enabled()),
                 "AsyncIO.read writes into the tensor in place, but it requires grad and grad mode is on; "
                 "read under torch.no_grad()");
    const int64_t id = engine_->submit_read(handle, file_offset, bytes.data, bytes.nbytes);
    if (!tensor.is_inference()) torch::autograd::impl::bump_version(tensor);
    keep_alive_.emplace(id, tensor);
    return id;
  }

  int64_t write(int64_t handle, int64_t offset, const at::Tensor& tensor) {
    const TensorBytes bytes = tensor_bytes(tensor, "AsyncIO.write");
    const uint64_t file_offset = checked_offset(offset, "AsyncIO.write");
    const int64_t id = engine_->submit_write(handle, file_offset, bytes.data, bytes.nbytes);
    keep_alive_.emplace(id, tensor);
    return id;
  }

  void wait(int64_t request) {
    std::exception_ptr error;
    {
      py::gil_scoped_release no_gil;
      try {
        engine_->wait(request);
      } catch (...) {
        error = std::current_exception();
      }
    }
    keep_alive_.erase(request);  // with the GIL: dropping the last reference may free a Python object
    if (error) std::rethrow_exception(error);
  }

  bool poll(int64_t request) const { return engine_->poll(request); }

  void wait_all() {
    std::exception_ptr error;
    {
      py::gil_scoped_release no_gil;
      try {
        engine_->wait_all();
      } catch (...) {
        error = std::current_exception();
      }
    }
    // Requests another thread submitted meanwhile are still pending and keep their tensors.
    for (auto it = keep_alive_.begin(); it != keep_alive_.end();) {
      it = engine_->is_pending(it->first) ? std::next(it) : keep_alive_.erase(it);
    }
    if (error) std::rethrow_exception(error);
  }

  void fsync(int64_t handle) {
    py::gil_scoped_release no_gil;
    engine_->fsync(handle);
  }

  void close(int64_t handle) { engine_->close(handle); }
  void close_all() { engine_->close_all(); }
  bool direct(int64_t handle) const { return engine_->direct(handle); }
  uint64_t size(int64_t handle) const { return engine_->size(handle); }

  void truncate(int64_t handle, int64_t nbytes) {
    ZC_CHECK_ARG(nbytes >= 0, "AsyncIO.truncate: nbytes must be >= 0, got ", nbytes);
    py::gil_scoped_release no_gil;
    engine_->truncate(handle, static_cast<uint64_t>(nbytes));
  }

  size_t pending() const { return engine_->pending(); }

 private:
  // Declared before engine_, so destroyed after it: the engine's destructor waits for every request.
  std::unordered_map<int64_t, at::Tensor> keep_alive_;
  std::unique_ptr<AsyncIO> engine_;
};

uint32_t crc32c_tensor(const at::Tensor& tensor, int64_t crc) {
  const TensorBytes bytes = tensor_bytes(tensor, "crc32c");
  ZC_CHECK_ARG(crc >= 0 && crc <= 0xFFFFFFFFll, "crc32c: crc must be in [0, 2**32), got ", crc);
  py::gil_scoped_release no_gil;
  return crc32c(bytes.data, bytes.nbytes, static_cast<uint32_t>(crc));
}

void raise_os_error(const IoError& e) {
  py::object filename = py::reinterpret_steal<py::object>(
      PyUnicode_DecodeFSDefaultAndSize(e.path().data(), static_cast<Py_ssize_t>(e.path().size())));
  if (!filename) throw py::error_already_set();
  // OSError(errno, strerror, filename) picks the subclass for errno (FileNotFoundError, PermissionError, ...).
  py::object error = py::reinterpret_borrow<py::object>(PyExc_OSError)(e.error_code(), e.what(), filename);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
}

}  // namespace

void bind_io(py::module_& m) {
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      raise_os_error(e);
    }
  });

  m.def("crc32c", &crc32c_tensor, py::arg("tensor"), py::arg("crc") = 0,
        "CRC-32C (Castagnoli) of the bytes of a contiguous CPU tensor, continuing from crc (the value of the "
        "bytes before); crc32c of no bytes is 0. Releases the GIL.");

  py::class_<PyAsyncIO>(m, "AsyncIO",
                        "Asynchronous file I/O on worker threads (pread/pwrite, O_DIRECT for 4096-aligned chunks); "
                        "DeepSpeed's aio settings. See Note [Async I/O engine].")
      .def(py::init([](int64_t block_size, int queue_depth, int thread_count, bool single_submit,
                       bool overlap_events) {
             ZC_CHECK_ARG(block_size > 0, "aio block_size must be a positive multiple of ", kDirectAlignment,
                          " bytes, got ", block_size);
             AioConfig config;
             config.block_size = static_cast<size_t>(block_size);
             config.queue_depth = queue_depth;
             config.thread_count = thread_count;
             config.single_submit = single_submit;
             config.overlap_events = overlap_events;
             return std::make_unique<PyAsyncIO>(config);
           }),
           py::arg("block_size") = 1 << 20, py::arg("queue_depth") = 8, py::arg("thread_count") = 1,
           py::arg("single_submit") = false, py::arg("overlap_events") = true)
      .def_property_readonly("block_size", [](const PyAsyncIO& io) { return io.config().block_size; })
      .def_property_readonly("queue_depth", [](const PyAsyncIO& io) { return io.config().queue_depth; })
      .def_property_readonly("thread_count", [](const PyAsyncIO& io) { return io.config().thread_count; })
      .def_property_readonly("single_submit", [](const PyAsyncIO& io) { return io.config().single_submit; })
      .def_property_readonly("overlap_events", [](const PyAsyncIO& io) { return io.config().overlap_events; })
      .def("open", &PyAsyncIO::open, py::arg("path"), py::arg("mode"),
           "Open a file: 'r' read, 'w' write (create or truncate), 'rw' read and write (create if missing). "
           "Returns a handle.")
      .def("read", &PyAsyncIO::read, py::arg("handle"), py::arg("offset"), py::arg("tensor"),
           "Queue a read of tensor.numel() * tensor.element_size() bytes at the file offset into the contiguous "
           "CPU tensor; returns the request id. Reading past the end of the file fails the request.")
      .def("write", &PyAsyncIO::write, py::arg("handle"), py::arg("offset"), py::arg("tensor"),
           "Queue a write of the contiguous CPU tensor's bytes at the file offset; returns the request id.")
      .def("wait", &PyAsyncIO::wait, py::arg("request"),
           "Block (without the GIL) until the request finished; raises its OSError if it failed. The request "
           "is then forgotten.")
      .def("poll", &PyAsyncIO::poll, py::arg("request"), "Whether the request finished; it stays pending.")
      .def("wait_all", &PyAsyncIO::wait_all,
           "Wait for every pending request; raises the error of the earliest failed one, if any.")
      .def("fsync", &PyAsyncIO::fsync, py::arg("handle"), "fsync the file (wait its writes first).")
      .def("close", &PyAsyncIO::close, py::arg("handle"),
           "Forget the handle; its submitted requests still complete.")
      .def("close_all", &PyAsyncIO::close_all, "Close every handle.")
      .def("direct", &PyAsyncIO::direct, py::arg("handle"),
           "Whether the handle's 4096-aligned chunks use O_DIRECT (False where the file system refused it).")
      .def("size", &PyAsyncIO::size, py::arg("handle"), "The file's current size in bytes.")
      .def("truncate", &PyAsyncIO::truncate, py::arg("handle"), py::arg("nbytes"),
           "Set the file's size (writable handles).")
      .def("pending", &PyAsyncIO::pending, "Requests submitted and not yet waited.");
}

}  // namespace zerocore::bindings
