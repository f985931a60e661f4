// collective_check.h (internal): NOTE [collective check] (fsdp/collectives.h), the comparison of
// a group's numbered collectives across its members through the rendezvous store, switched on
// by Group::set_debug_collectives (FSDPStrategy::debug_collectives, fsdp-train
// --debug-collectives).
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "base/compat.h"
#include "fsdp/collectives.h"

namespace fsdp::detail {

// One per group and member. Thread-safe (a mutex: one call is checked at a time).
class CollectiveCheck {
 public:
  // `store`: shared by the group's members under the same keys and used for nothing else
  // (make_group gives each group its own prefix). `timeout`: how long to wait for a member.
  CollectiveCheck(c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds timeout);

  // Publishes `call` as this member's, reads every member's call of the same number and throws
  // fsdp::Error, the same text on every member (mismatch_message), if any differs from group
  // rank 0's; or, if a member did not publish within the timeout, an error naming it. Costs one
  // set, one wait, size() - 1 gets and one delete on the store.
  void verify(const Group& group, const CollectiveCall& call);

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  // This member's last published key. Every member publishes call n only after it read every
  // member's call n-1, so once this member has read all of call n, its call n-1 key is read by
  // all and is deleted: the store holds at most two calls per member, however long the run.
  std::string published_;
};

// The error for `summaries` (CollectiveCall::summary of group rank i at [i]) of call `sequence`
// on `group`, naming the first group rank whose summary differs from group rank 0's; "" if all
// are equal. Pure: every member computes the same text.
std::string mismatch_message(const Group& group, int64_t sequence,
                             const std::vector<std::string>& summaries);

}  // namespace fsdp::detail
