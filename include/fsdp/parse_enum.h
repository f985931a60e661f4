// fsdp/parse_enum.h: parse_enum(), reading one of a fixed set of choices from text. Every option
// of the library and of its tools is read this way: ASCII case ignored, and an unknown word is one
// fsdp::Error line that names the option and lists the choices:
//
//   fsdp::parse_enum(text, {Backend::kAuto, Backend::kGloo, Backend::kNccl}, "backend")
//   -> "backend 'mpi' is unknown; use auto, gloo or nccl"
//   fsdp::parse_enum<bool>(o.init, {{"deferred", true}, {"eager", false}}, "--init")
//
// Header-only; no state, safe from any thread.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/error.h"

namespace fsdp {

// One spelling of a choice. Several names may map to one value (aliases such as "on" for full):
// the error lists only the first name of each value.
template <class T>
struct EnumName {
  std::string_view name;
  T value;
};

// How parse_enum compares the text with the names.
enum class Spelling {
  kAnyCase,  // "Gloo" is gloo
  kLoose,    // also: whitespace ignored, '-' read as '_' ("Replicate-On-Last" is replicate_on_last)
};

// `text` with its ASCII letters lower-cased.
inline std::string lower_ascii(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

namespace detail {
inline std::string enum_key(std::string_view text, Spelling spelling) {
  if (spelling == Spelling::kAnyCase) return lower_ascii(text);
  std::string out;
  for (char c : lower_ascii(text)) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v') continue;
    out += c == '-' ? '_' : c;
  }
  return out;
}

template <class T>
T parse_enum(std::string_view text, const EnumName<T>* names, size_t count, std::string_view what,
             Spelling spelling) {
  const std::string key = enum_key(text, spelling);
  for (size_t i = 0; i < count; ++i) {
    if (key == enum_key(names[i].name, spelling)) return names[i].value;
  }
  std::vector<const EnumName<T>*> listed;  // the first name of each value
  for (size_t i = 0; i < count; ++i) {
    bool dup = false;
    for (const EnumName<T>* l : listed) dup = dup || l->value == names[i].value;
    if (!dup) listed.push_back(&names[i]);
  }
  std::string choices;
  for (size_t i = 0; i < listed.size(); ++i) {
    choices += i == 0 ? "" : i + 1 == listed.size() ? " or " : ", ";
    choices += listed[i]->name;
  }
  throw Error(cat(what, " '", text, "' is unknown; use ", choices));
}
}  // namespace detail

// The value named `text` in `names`. Otherwise throws fsdp::Error:
//   "<what> '<text>' is unknown; use a, b or c"
template <class T>
T parse_enum(std::string_view text, std::initializer_list<EnumName<T>> names,
             std::string_view what, Spelling spelling = Spelling::kAnyCase) {
  return detail::parse_enum(text, names.begin(), names.size(), what, spelling);
}

// The same, each value named by to_string(value) (found by argument-dependent lookup).
template <class T>
T parse_enum(std::string_view text, std::initializer_list<T> values, std::string_view what,
             Spelling spelling = Spelling::kAnyCase) {
  std::vector<EnumName<T>> names;
  for (const T& v : values) names.push_back({to_string(v), v});
  return detail::parse_enum(text, names.data(), names.size(), what, spelling);
}

}  // namespace fsdp
