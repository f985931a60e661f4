// fsdp::AsyncCheckpointer (fsdp/async_checkpoint.h), ranks as threads over Gloo: the files of a
// background save equal save_checkpoint's byte for byte although training changed the model
// before the write finished; poll() commits only once every rank has written; a failed
// background write is raised on every rank and leaves the previous checkpoint the latest one;
// the staging buffer is kept between saves; File::write_direct writes around the page cache.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "checkpoint/common.h"
#include "checkpoint/file_io.h"
#include "fsdp/async_checkpoint.h"
#include "fsdp/error.h"
#include "fsdp/memory.h"
#include "models.h"
#include "testing.h"

using namespace fsdp;
using namespace fsdp::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kBatch = 8, kSeq = 5, kVocab = 17, kClasses = 7;

std::shared_ptr<Runtime> borrow(Runtime& rt) {
  return std::shared_ptr<Runtime>(&rt, [](Runtime*) {});
}

std::shared_ptr<NetImpl> make_net() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(7);
  return std::make_shared<NetImpl>();
}

// One AdamW step on random data drawn from a generator seeded by (rank, step): the model changes.
void step(ShardedModule<NetImpl>& model, torch::optim::Optimizer& opt, Runtime& rt, int64_t n) {
  torch::Generator gen = at::detail::createCPUGenerator(100 * n + rt.rank());
  opt.zero_grad();
  loss_of(model(torch::randint(kVocab, {kBatch, kSeq}, gen)),
          torch::randint(kClasses, {kBatch, kSeq}, gen))
      .backward();
  opt.step();
}

// Removes `dir` while background writers may still create files in it: remove_all fails with
// "Directory not empty" when a file appears during the removal; once the directory is gone no
// writer can create one (they never create directories), so a few retries end it.
void remove_under_writers(const std::string& dir) {
  std::error_code ec;
  for (int attempt = 0; attempt < 100; ++attempt) {
    fs::remove_all(dir, ec);
    if (!ec && !fs::exists(dir)) return;
  }
  FAIL() << "cannot remove '" << dir << "': " << ec.message();
}

std::string bytes_of(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every file of directory `a` equals the same file of `b`, and they hold the same names.
void expect_same_files(const std::string& a, const std::string& b) {
  std::set<std::string> names_a, names_b;
  for (const auto& f : fs::directory_iterator(a)) names_a.insert(f.path().filename());
  for (const auto& f : fs::directory_iterator(b)) names_b.insert(f.path().filename());
  ASSERT_EQ(names_a, names_b);
  for (const auto& n : names_a) {
    EXPECT_TRUE(bytes_of(fs::path(a) / n) == bytes_of(fs::path(b) / n)) << n << " differs";
  }
}

}  // namespace

// Whether files in `path`'s directory can be opened with O_DIRECT (tmpfs before Linux 6.6 and
// some network file systems cannot).
bool direct_io_works(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0644);
  if (fd < 0) return false;
  ::close(fd);
  ::unlink(path.c_str());
  return true;
}

// File::write_direct (NOTE [direct writes]): an aligned image is written around the page cache
// where the file system allows it, an unaligned one through the cache; both files are exact,
// their tails (not a whole block) included.
TEST(DirectWrites, AlignedImagesBypassTheCacheOthersAreWrittenPlainly) {
  TempDir tmp;
  const int64_t n = 3 * fsdp::detail::kDirectAlign + 123;
  std::vector<uint8_t> bytes(static_cast<size_t>(n));
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 1);
  // Aligned, readable up to the whole block (write_direct's contract); the tail past n is junk.
  at::Tensor image = fsdp::detail::empty_direct_buffer(fsdp::detail::direct_bytes(n));
  std::memset(image.data_ptr(), 0xAB, static_cast<size_t>(image.numel()));
  std::memcpy(image.data_ptr(), bytes.data(), bytes.size());
  const std::string aligned = tmp / "aligned", unaligned = tmp / "unaligned";
  {
    fsdp::detail::File f(aligned, O_WRONLY | O_CREAT | O_TRUNC);
    EXPECT_EQ(f.write_direct(image.data_ptr(), n), direct_io_works(tmp / "probe"));
    f.sync_and_close();
  }
  {
    std::vector<uint8_t> shifted(bytes.size() + 1);
    std::memcpy(shifted.data() + 1, bytes.data(), bytes.size());
    fsdp::detail::File f(unaligned, O_WRONLY | O_CREAT | O_TRUNC);
    EXPECT_FALSE(f.write_direct(shifted.data() + 1, n));
    f.sync_and_close();
  }
  const std::string want(bytes.begin(), bytes.end());
  EXPECT_TRUE(bytes_of(aligned) == want);
  EXPECT_TRUE(bytes_of(unaligned) == want);
}

// Saved in the background while three more steps change every parameter and optimizer state:
// the checkpoint is the state at save(), byte for byte what save_checkpoint writes, and loads.
TEST(AsyncCheckpoint, EqualsTheSynchronousSaveAndLoads) {
  for (auto [strategy, mesh] : {std::pair{ShardingStrategy::kHybridShard, std::vector<int64_t>{2, 2}},
                                std::pair{ShardingStrategy::kFullShard, std::vector<int64_t>{3}}}) {
    TempDir tmp;
    const std::string sync_dir = tmp / "sync", async_dir = tmp / "async";
    const int64_t W = mesh.size() == 2 ? mesh[0] * mesh[1] : mesh[0];
    const auto st = FSDPStrategy().sharding_strategy(strategy).device_mesh(mesh);
    const int64_t through_cache = direct_io_works(tmp / "probe") ? 0 : mesh.back();  // files
    std::mutex mu;
    std::vector<std::string> sd_after_load, sd_at_save;
    std::vector<double> write_seconds;  // each rank's CheckpointInfo::write_seconds
    run_ranks(W, [&](Runtime& rt) {
      auto model = shard(make_net(), st, borrow(rt));
      torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
      step(model, opt, rt, 0);
      step(model, opt, rt, 1);
      TrainingState ts{2, {{"data", "position 16"}}};
      const CheckpointInfo sync_info = save_checkpoint(sync_dir, model, &opt, ts);
      // The slowest rank's file write, the same on every rank, and within the call.
      EXPECT_GT(sync_info.write_seconds, 0);
      EXPECT_LE(sync_info.write_seconds, sync_info.seconds + 1e-6);
      std::ostringstream at_save;
      for (const auto& kv : model.state_dict()) at_save << kv.key() << kv.value() << "\n";
      AsyncCheckpointer saver;
      saver.save(async_dir, model, &opt, ts);
      EXPECT_TRUE(saver.in_flight());
      EXPECT_EQ(saver.in_flight_path(), async_dir);
      EXPECT_FALSE(fs::exists(async_dir + "/meta.json"));  // not committed before poll/wait
      for (int64_t n = 2; n < 5; ++n) step(model, opt, rt, n);
      std::optional<CheckpointInfo> info;
      for (int i = 0; i < 10000 && !info; ++i) info = saver.poll();  // same count on every rank
      if (!info) info = saver.wait();
      ASSERT_TRUE(info.has_value());
      EXPECT_FALSE(saver.in_flight());
      EXPECT_EQ(info->path, async_dir);
      if (rt.rank() == 0) EXPECT_GT(info->bytes, 0);  // rank 0 writes meta.json and counts
      // Every shard file bypassed the page cache where the file system allows O_DIRECT.
      EXPECT_EQ(info->page_cache_writes, through_cache);
      // The background write was timed (the slowest rank's) and ended before the commit did.
      EXPECT_GT(info->write_seconds, 0);
      EXPECT_LE(info->write_seconds, info->seconds + 1e-6);
      {
        std::lock_guard<std::mutex> lock(mu);
        write_seconds.push_back(info->write_seconds);
      }
      EXPECT_FALSE(saver.wait().has_value());  // nothing in flight any more

      // Loaded into a fresh model: the state at save(), not the trained-on one.
      torch::manual_seed(1000 + rt.rank());
      auto fresh = shard(std::make_shared<NetImpl>(), st, borrow(rt));
      torch::optim::AdamW opt2(fresh.parameters(), torch::optim::AdamWOptions(1e-2));
      TrainingState got;
      load_checkpoint(async_dir, fresh, &opt2, &got);
      EXPECT_EQ(got.step, 2);
      EXPECT_EQ(got.values.at("data"), "position 16");
      std::ostringstream loaded;
      for (const auto& kv : fresh.state_dict()) loaded << kv.key() << kv.value() << "\n";
      std::lock_guard<std::mutex> lock(mu);
      sd_at_save.push_back(at_save.str());
      sd_after_load.push_back(loaded.str());
    });
    expect_same_files(sync_dir, async_dir);
    EXPECT_EQ(sd_after_load, sd_at_save);
    ASSERT_EQ(write_seconds.size(), static_cast<size_t>(W));
    for (double w : write_seconds) EXPECT_EQ(w, write_seconds.front());  // one value, all ranks
  }
}

using Net = ShardedModule<NetImpl>;
using FailSave = std::function<void(Net&, torch::optim::AdamW&, Runtime&, AsyncCheckpointer&)>;

// Two ranks, FULL_SHARD with AdamW: one step and a committed save of step 1 in `dir`; then
// `fail` starts a save of step 2 that must fail. Expects wait() to throw on every rank (each
// message passed to `check(rank, message)`), step 1 to stay the latest complete checkpoint and
// load, and the checkpointer to save step 3 with the same staging buffer.
void expect_failed_save(const std::string& dir, const FailSave& fail,
                        const std::function<void(int64_t, const std::string&)>& check) {
  const auto st = FSDPStrategy().sharding_strategy(ShardingStrategy::kFullShard).device_mesh({2});
  std::atomic<int> raised{0};
  run_ranks(2, [&](Runtime& rt) {
    auto model = shard(make_net(), st, borrow(rt));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
    AsyncCheckpointer saver;
    step(model, opt, rt, 0);
    saver.save(checkpoint_path(dir, 1), model, &opt, {1});
    ASSERT_TRUE(saver.wait().has_value());
    step(model, opt, rt, 1);
    fail(model, opt, rt, saver);
    EXPECT_TRUE(saver.in_flight());
    try {
      saver.wait();
      ADD_FAILURE() << "rank " << rt.rank() << ": wait() did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("saving checkpoint '" + checkpoint_path(dir, 2)),
                std::string::npos)
          << e.what();
      check(rt.rank(), e.what());
      ++raised;
    }
    EXPECT_FALSE(saver.in_flight());
    EXPECT_EQ(latest_checkpoint(dir), checkpoint_path(dir, 1));
    TrainingState got;
    load_checkpoint(*latest_checkpoint(dir), model, &opt, &got);
    EXPECT_EQ(got.step, 1);
    // A failed save does not break the next one, and the staging buffer is reused.
    const int64_t staging = saver.staging_bytes();
    EXPECT_GT(staging, 0);
    saver.save(checkpoint_path(dir, 3), model, &opt, {3});
    EXPECT_EQ(saver.staging_bytes(), staging);
    EXPECT_GE(process_memory().checkpoint_staging, staging);  // both ranks' buffers: one process
    EXPECT_GE(saver.last_blocked_seconds(), 0.0);
    ASSERT_TRUE(saver.wait().has_value());
    EXPECT_EQ(latest_checkpoint(dir), checkpoint_path(dir, 3));
  });
  EXPECT_EQ(raised.load(), 2);
  EXPECT_EQ(process_memory().checkpoint_staging, 0);  // released with the checkpointers
}

// The checkpoint directory vanishes under a background save (as if removed by an operator, or
// the disk went away): the next wait() throws on every rank, the earlier checkpoint stays the
// latest complete one and loads, and the checkpointer can save again.
TEST(AsyncCheckpoint, FailedBackgroundWriteIsRaisedOnEveryRank) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const FailSave vanish = [&](Net& model, torch::optim::AdamW& opt, Runtime& rt,
                              AsyncCheckpointer& saver) {
    saver.save(checkpoint_path(dir, 2), model, &opt, {2});
    // The writer thread makes the directory; removing it at any moment before the commit fails
    // the save.
    if (rt.rank() == 0) {
      const std::string partial = checkpoint_path(dir, 2) + ".partial";
      for (int i = 0; i < 10000 && !fs::exists(partial); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      remove_under_writers(partial);
    }
  };
  expect_failed_save(dir, vanish, [](int64_t, const std::string&) {});
}

// Arguments one rank refuses (here rank 1's state is not UTF-8) do not stop save() on the
// training thread: the writer threads agree on them, and the wait() that would have committed
// the save raises them on every rank; nothing is committed, and the next save works.
TEST(AsyncCheckpoint, ArgumentsOneRankRefusesAreRaisedOnEveryRank) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const FailSave refuse = [&](Net& model, torch::optim::AdamW& opt, Runtime& rt,
                              AsyncCheckpointer& saver) {
    TrainingState bad{2};
    if (rt.rank() == 1) bad.values["note"] = "\xff\xfe";
    saver.save(checkpoint_path(dir, 2), model, &opt, bad);
  };
  expect_failed_save(dir, refuse, [](int64_t rank, const std::string& what) {
    EXPECT_NE(what.find("UTF-8"), std::string::npos) << what;
    if (rank == 0) EXPECT_NE(what.find("failed on rank 1"), std::string::npos) << what;
  });
}

// A checkpointer destroyed while its save waits for a rank that never started it (that rank went
// another way, e.g. it threw) returns at once instead of waiting out the rendezvous timeout.
TEST(AsyncCheckpoint, DestructorDoesNotWaitForRanksThatNeverSaved) {
  TempDir tmp;
  const auto st = FSDPStrategy().sharding_strategy(ShardingStrategy::kFullShard).device_mesh({2});
  run_ranks(2, [&](Runtime& rt) {
    auto model = shard(make_net(), st, borrow(rt));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
    step(model, opt, rt, 0);
    if (rt.rank() != 0) return;
    const auto t0 = std::chrono::steady_clock::now();
    {
      AsyncCheckpointer saver;
      saver.save(checkpoint_path(tmp / "ck", 1), model, &opt, {1});
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the writer is waiting
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));  // timeout: 60 s
    EXPECT_FALSE(latest_checkpoint(tmp / "ck").has_value());
  });
}

// A save() while another is in flight commits the first one first: both end complete.
TEST(AsyncCheckpoint, SaveCommitsThePreviousSaveFirst) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const auto st = FSDPStrategy().sharding_strategy(ShardingStrategy::kShardGradOp).device_mesh({2});
  run_ranks(2, [&](Runtime& rt) {
    auto model = shard(make_net(), st, borrow(rt));
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    AsyncCheckpointer saver;
    for (int64_t n = 1; n <= 3; ++n) {
      step(model, opt, rt, n);
      saver.save(checkpoint_path(dir, n), model, &opt, {n});
    }
    ASSERT_TRUE(saver.wait().has_value());
    if (rt.rank() == 0) {
      const auto all = list_checkpoints(dir);
      ASSERT_EQ(all.size(), 3u);
      for (const auto& e : all) EXPECT_EQ(e.status, CheckpointStatus::kComplete) << e.path;
      for (const auto& e : all) EXPECT_NO_THROW(verify_checkpoint(e.path)) << e.path;
    }
  });
}

// reserve() allocates the staging buffer in the background: it is counted at once, the save
// adopts it instead of allocating (the same size, no growth), and what it writes loads. A
// reservation made before the optimizer has state is smaller; a second one, made while a save
// from the first is in flight, leaves the buffer being written alone. Local: one rank
// reserving and the other not is fine.
TEST(AsyncCheckpoint, ReserveAllocatesTheStagingBufferAhead) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const auto st = FSDPStrategy().sharding_strategy(ShardingStrategy::kFullShard).device_mesh({2});
  run_ranks(2, [&](Runtime& rt) {
    auto model = shard(make_net(), st, borrow(rt));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
    AsyncCheckpointer early, saver;
    early.reserve(model, &opt);  // no optimizer state yet: the shards only
    const int64_t params_only = early.staging_bytes();
    EXPECT_GT(params_only, 0);
    early.save(checkpoint_path(dir, 0), model, &opt, {0});  // written from the reservation
    step(model, opt, rt, 0);
    // A bigger reservation while that write runs: allocated beside the buffer being written,
    // which stays until the save is committed (ASan would see it freed under the writer).
    early.reserve(model, &opt);
    EXPECT_GT(early.staging_bytes(), params_only);
    const int64_t grown = early.staging_bytes();
    early.reserve(model, &opt);  // waits for the first; adopting it here would free the buffer
    EXPECT_EQ(early.staging_bytes(), grown);
    EXPECT_TRUE(early.in_flight());
    ASSERT_TRUE(early.wait().has_value());
    if (rt.rank() == 0) saver.reserve(model, &opt);
    const int64_t reserved = saver.staging_bytes();
    if (rt.rank() == 0) {
      EXPECT_GT(reserved, params_only);  // AdamW's two moments too
      EXPECT_GE(process_memory().checkpoint_staging, reserved + params_only);
    } else {
      EXPECT_EQ(reserved, 0);
    }
    saver.save(checkpoint_path(dir, 1), model, &opt, {1});
    const int64_t used = saver.staging_bytes();
    if (rt.rank() == 0) EXPECT_EQ(used, reserved);  // adopted, not grown
    saver.reserve(model, &opt);  // in flight and big enough: nothing to do
    EXPECT_EQ(saver.staging_bytes(), used);
    ASSERT_TRUE(saver.wait().has_value());
    early.save(checkpoint_path(dir, 2), model, &opt, {2});
    EXPECT_EQ(early.staging_bytes(), used);  // the second reservation, adopted
    ASSERT_TRUE(early.wait().has_value());
    TrainingState got;
    load_checkpoint(checkpoint_path(dir, 1), model, &opt, &got);
    EXPECT_EQ(got.step, 1);
    if (rt.rank() == 0) {
      for (const auto& e : list_checkpoints(dir)) EXPECT_NO_THROW(verify_checkpoint(e.path));
    }
  });
  EXPECT_EQ(process_memory().checkpoint_staging, 0);  // released with the checkpointers
}
