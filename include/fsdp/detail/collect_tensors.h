// fsdp/detail/collect_tensors.h (internal): the tensors inside a forward's arguments and results,
// which the engine hooks around a unit's forward. Include fsdp/sharded.h instead.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp::detail {

// The tensors a forward returned: a Tensor, a std::vector of them, or tuples/pairs of those
// (non-tensor arithmetic members are allowed and carry no gradient).
inline void collect_tensors(std::vector<at::Tensor>& out, const at::Tensor& t) { out.push_back(t); }
inline void collect_tensors(std::vector<at::Tensor>& out, const std::vector<at::Tensor>& v) {
  out.insert(out.end(), v.begin(), v.end());
}
template <class A, class B>
void collect_tensors(std::vector<at::Tensor>& out, const std::pair<A, B>& p);
template <class... T>
void collect_tensors(std::vector<at::Tensor>& out, const std::tuple<T...>& t) {
  std::apply([&](const auto&... e) { (collect_tensors(out, e), ...); }, t);
}
template <class A, class B>
void collect_tensors(std::vector<at::Tensor>& out, const std::pair<A, B>& p) {
  collect_tensors(out, p.first);
  collect_tensors(out, p.second);
}
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void collect_tensors(std::vector<at::Tensor>&, const T&) {}

// The tensors among a forward's arguments (NOTE [frozen parameters] in fsdp/sharded.h): tensors,
// vectors and optionals of them; other argument types carry none.
inline void collect_input_tensors(std::vector<at::Tensor>& out, const at::Tensor& t) {
  out.push_back(t);
}
inline void collect_input_tensors(std::vector<at::Tensor>& out, const std::vector<at::Tensor>& v) {
  out.insert(out.end(), v.begin(), v.end());
}
template <class T>
void collect_input_tensors(std::vector<at::Tensor>& out, const T& value) {
  if constexpr (std::is_same_v<T, c10::optional<at::Tensor>> ||
                std::is_same_v<T, std::optional<at::Tensor>>) {
    if (value) out.push_back(*value);
  }
}

}  // namespace fsdp::detail
