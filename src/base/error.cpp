// One-line messages from any exception (see fsdp/error.h).
#include "fsdp/error.h"

#include <c10/util/Exception.h>

namespace fsdp {

std::string error_message(const std::exception& e) {
  std::string text;
  if (auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    text = c10->what_without_backtrace();
  } else {
    text = e.what();
  }
  auto nl = text.find('\n');
  if (nl != std::string::npos) text.resize(nl);
  return text;
}

}  // namespace fsdp
