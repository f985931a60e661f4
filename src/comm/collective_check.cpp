// NOTE [collective check]: a group's numbered collectives compared across its members through
// the rendezvous store before they run (see collective_check.h, fsdp/collectives.h).
#include "comm/collective_check.h"

#include "fsdp/error.h"

namespace fsdp::detail {

CollectiveCheck::CollectiveCheck(c10::intrusive_ptr<c10d::Store> store,
                                 std::chrono::milliseconds timeout)
    : store_(std::move(store)), timeout_(timeout) {}

std::string mismatch_message(const Group& group, int64_t sequence,
                             const std::vector<std::string>& summaries) {
  for (size_t i = 1; i < summaries.size(); ++i) {
    if (summaries[i] == summaries[0]) continue;
    return cat("collective #", sequence, " on the ", group.describe(), ": rank ", group.ranks()[i],
               " issued ", summaries[i], " while rank ", group.ranks()[0], " issued ",
               summaries[0], "; the ranks' control flow differs (a data-dependent branch or loop, "
               "or a unit called on some ranks only): every rank must issue the same collectives "
               "in the same order (found by debug_collectives)");
  }
  return "";
}

void CollectiveCheck::verify(const Group& group, const CollectiveCall& call) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t S = group.size(), me = group.rank();
  const std::string base = cat(call.sequence, "/");
  const std::string mine = call.summary();
  auto key = [&](int64_t r) { return base + std::to_string(r); };
  try {
    store_->set(key(me), std::vector<uint8_t>(mine.begin(), mine.end()));
  } catch (const std::exception& e) {
    throw Error(cat("collective #", call.sequence, " on the ", group.describe(),
                    ": debug_collectives could not publish this rank's call in the rendezvous "
                    "store: ", error_message(e)));
  }
  std::vector<std::string> peers;
  for (int64_t r = 0; r < S; ++r) {
    if (r != me) peers.push_back(key(r));
  }
  std::vector<std::string> summaries(static_cast<size_t>(S));
  summaries[static_cast<size_t>(me)] = mine;
  try {
    store_->wait(peers, timeout_);
  } catch (const std::exception& e) {
    for (int64_t r = 0; r < S; ++r) {
      if (r == me || store_->check({key(r)})) continue;
      throw Error(cat("collective #", call.sequence, " on the ", group.describe(), ": rank ",
                      group.ranks()[r], " did not issue it within ",
                      std::chrono::duration<double>(timeout_).count(), " s while rank ",
                      group.ranks()[me], " issued ", mine, "; that rank issued fewer collectives "
                      "(an early exit, or a unit or step skipped) or is stuck or dead: see its "
                      "output (found by debug_collectives)"));
    }
    throw Error(cat("collective #", call.sequence, " on the ", group.describe(),
                    ": debug_collectives could not read the other ranks' calls from the "
                    "rendezvous store: ", error_message(e)));
  }
  for (int64_t r = 0; r < S; ++r) {
    if (r == me) continue;
    const std::vector<uint8_t> v = store_->get(key(r));
    summaries[static_cast<size_t>(r)] = std::string(v.begin(), v.end());
  }
  if (!published_.empty()) store_->deleteKey(published_);
  published_ = key(me);
  const std::string mismatch = mismatch_message(group, call.sequence, summaries);
  if (!mismatch.empty()) throw Error(mismatch);
}

}  // namespace fsdp::detail
