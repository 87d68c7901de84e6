// Errors raised by the torch-free core. The bindings translate them into Python exceptions:
// InvalidArgument -> ValueError, everything else derived from std::runtime_error -> RuntimeError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace zerocore {

// Bad input from the caller (a size, a rank, a dtype). Maps to ValueError in Python.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
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
