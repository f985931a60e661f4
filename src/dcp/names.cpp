// DCP keys and model names (see names.h).
#include "dcp/names.h"

#include "fsdp/error.h"

namespace fsdp {

DcpRename parse_dcp_rename(const std::string& text) {
  const size_t eq = text.find('=');
  FSDP_CHECK(eq != std::string::npos && eq > 0, "--dcp-rename '", text, "' is not "
             "REGEX=REPLACEMENT; e.g. '^transformer\\.=' drops the prefix 'transformer.'");
  DcpRename r{text.substr(0, eq), text.substr(eq + 1)};
  try {
    std::regex check(r.pattern);
  } catch (const std::regex_error& e) {
    throw Error(cat("--dcp-rename '", text, "': '", r.pattern, "' is not a regular expression (",
                    e.what(), ")"));
  }
  return r;
}

}  // namespace fsdp

namespace fsdp::detail {

Renamer::Renamer(const std::vector<DcpRename>& rules) {
  for (const auto& r : rules) {
    try {
      rules_.emplace_back(std::regex(r.pattern), r.replacement);
    } catch (const std::regex_error& e) {
      throw Error(cat("DCP renaming rule '", r.pattern, "' is not a regular expression (",
                      e.what(), ")"));
    }
  }
}

std::string Renamer::operator()(std::string name) const {
  for (const auto& [re, replacement] : rules_) {
    if (name.empty()) break;
    name = std::regex_replace(name, re, replacement);
  }
  return name;
}

std::string strip_wrappers(std::string name) {
  const std::string inner = "_checkpoint_wrapped_module.";
  for (size_t at; (at = name.find(inner)) != std::string::npos;) name.erase(at, inner.size());
  for (bool again = true; again;) {
    again = false;
    for (const char* p : {"model.", "module.", "_orig_mod."}) {
      const std::string prefix = p;
      if (name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0) {
        name.erase(0, prefix.size());
        again = true;
      }
    }
  }
  return name;
}

std::optional<OptimizerStateKey> optimizer_state_key(const std::string& key) {
  static const std::regex re(
      R"(^(?:[A-Za-z_][A-Za-z0-9_]*\.)?state\.(.+)\.(exp_avg|exp_avg_sq|max_exp_avg_sq|step)$)");
  std::smatch m;
  if (!std::regex_match(key, m, re)) return std::nullopt;
  return OptimizerStateKey{m[1].str(), m[2].str()};
}

std::optional<ParamGroupKey> param_group_key(const std::string& key) {
  static const std::regex whole(R"(^(?:[A-Za-z_][A-Za-z0-9_]*\.)?param_groups$)");
  static const std::regex one(R"(^(?:[A-Za-z_][A-Za-z0-9_]*\.)?param_groups\.([0-9]{1,9})\.([A-Za-z_]+)$)");
  std::smatch m;
  if (std::regex_match(key, m, whole)) return ParamGroupKey{};
  if (std::regex_match(key, m, one)) return ParamGroupKey{std::stoll(m[1].str()), m[2].str()};
  return std::nullopt;
}

}  // namespace fsdp::detail
