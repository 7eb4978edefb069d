// Error messages built without std::ostream's integer insertion.
//
// On the H200 image (gcc 13.3, torch 2.11 cu130) an int64 streamed into an error message by
// c10::str crashed the process inside std::ostream::_M_insert<long> (backtrace in docs/op.md),
// while strings streamed fine. Every TORCH_CHECK in csrc/ therefore passes one std::string made here.
// Shared by the op (csrc/op/) and the harness kernels (csrc/harness/): it lies above both.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <string>
#include <type_traits>

namespace kvverify {

inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, c10::ScalarType t) { out += c10::toString(t); }
inline void append(std::string& out, const c10::Device& d) { out += d.str(); }
inline void append(std::string& out, c10::IntArrayRef sizes) {
  out += "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  out += "]";
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
void append(std::string& out, T value) {
  out += std::to_string(value);
}

// cat("sizes[", 3, "] must be > 0, got ", -8) == "sizes[3] must be > 0, got -8"
template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

}  // namespace kvverify
