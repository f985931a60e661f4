// addr_info.h (internal): AddrInfo, the result of getaddrinfo freed when its owner goes out of
// scope (RAII, like UniqueFd in unique_fd.h), and resolve(), which makes one.
#pragma once

#include <netdb.h>
#include <sys/socket.h>

#include <memory>
#include <string>

namespace fsdp::detail {

// A getaddrinfo result list (may be empty: then error() says why).
class AddrInfo {
 public:
  AddrInfo(addrinfo* list, int rc) : list_(list, &::freeaddrinfo), rc_(rc) {}
  bool ok() const { return rc_ == 0 && list_ != nullptr; }
  // The first address, or null; walk the rest with ai_next.
  const addrinfo* get() const { return list_.get(); }
  std::string error() const { return rc_ == 0 ? "no address" : ::gai_strerror(rc_); }

 private:
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> list_;
  int rc_;
};

// The addresses of `host`:`port` of one family (AF_INET, AF_INET6) and socket type.
inline AddrInfo resolve(const std::string& host, int port, int family, int socktype) {
  addrinfo hints{};
  hints.ai_family = family;
  hints.ai_socktype = socktype;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  return AddrInfo(rc == 0 ? res : nullptr, rc);
}

}  // namespace fsdp::detail
