// Errors raised by the torch-free core. The bindings translate them into Python exceptions:
// InvalidArgument -> ValueError, IoError -> OSError (errno and filename set), everything else derived from
// std::runtime_error -> RuntimeError.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace zerocore {

// Bad input from the caller (a size, a rank, a dtype). Maps to ValueError in Python.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A failed file operation: the errno, the path and the file offset of the failing transfer (-1 when the
// operation has none, e.g. open or fsync). The message says all three. Maps to OSError in Python.
class IoError : public std::runtime_error {
 public:
  IoError(const std::string& message, int error_code, std::string path, int64_t offset = -1)
      : std::runtime_error(message), error_code_(error_code), path_(std::move(path)), offset_(offset) {}
  int error_code() const { return error_code_; }
  const std::string& path() const { return path_; }
  int64_t offset() const { return offset_; }

 private:
  int error_code_;
  std::string path_;
  int64_t offset_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace zerocore

// ZC_CHECK_ARG(cond, parts...) throws InvalidArgument with the message built from parts when cond is false.
#define ZC_CHECK_ARG(cond, ...)                                                   \
  do {                                                                            \
    if (!(cond)) throw ::zerocore::InvalidArgument(::zerocore::detail::concat(__VA_ARGS__)); \
  } while (0)

// ZC_CHECK(cond, parts...) throws std::runtime_error: a broken internal invariant or an illegal state.
#define ZC_CHECK(cond, ...)                                                       \
  do {                                                                            \
    if (!(cond)) throw std::runtime_error(::zerocore::detail::concat(__VA_ARGS__)); \
  } while (0)
