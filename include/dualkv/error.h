// Errors raised by the DualKV core: bad input is reported, never silently accepted.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dualkv {

// Thrown for invalid arguments (shapes, lengths, options). The message names the argument.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace dualkv

// DUALKV_CHECK(cond, "argument 'x' must be ...", value) throws dualkv::Error when cond is false.
#define DUALKV_CHECK(cond, ...)                                                \
  do {                                                                         \
    if (!(cond)) throw ::dualkv::Error(::dualkv::detail::concat(__VA_ARGS__)); \
  } while (0)
