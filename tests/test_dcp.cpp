// PyTorch's distributed checkpoint format in the library (fsdp/dcp.h; PyTorch 2.6 itself checks
// it in tests/dcp_pytorch_test.sh): the pickle reader never constructs a class it was not told
// about; a flat shard's range becomes boxes that tile it exactly; export on one mesh and import
// on another continue training as if nothing happened (weights and AdamW's state); padded rows;
// and every damaged or mismatched checkpoint is refused on every rank in one line.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dcp/metadata.h"
#include "dcp/pickle.h"
#include "fsdp/dcp.h"
#include "fsdp/error.h"
#include "models.h"
#include "testing.h"

using namespace fsdp;
using namespace fsdp::testing;
namespace fs = std::filesystem;
namespace pk = fsdp::detail::pickle;

namespace {

// `fn` must throw fsdp::Error: one line containing `expected`.
void expect_error_contains(const std::function<void()>& fn, const std::string& expected) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << expected;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

FSDPStrategy strategy(ShardingStrategy s, std::vector<int64_t> mesh) {
  return FSDPStrategy().sharding_strategy(s).device_mesh(std::move(mesh));
}

std::shared_ptr<Runtime> borrow(Runtime& rt) { return {&rt, [](Runtime*) {}}; }

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

// Rank threads share the global generator: the data comes from generators of their own.
torch::Tensor batch() {
  return torch::randint(17, {4, 5}, at::detail::createCPUGenerator(11));
}
torch::Tensor targets() {
  return torch::randint(7, {4, 5}, at::detail::createCPUGenerator(12));
}

// One AdamW step of NetImpl on `world` ranks with `s`, exported to `dir`. Returns the loss after
// a second step on rank 0 (the reference a continued run must reproduce).
double train_and_export(int64_t world, const FSDPStrategy& s, const std::string& dir) {
  double after = 0;
  run_ranks(world, [&](Runtime& rt) {
    torch::manual_seed(7);
    auto model = shard(std::make_shared<NetImpl>(), s, borrow(rt));
    torch::optim::AdamW opt(model.parameters(), adamw());
    loss_of(model(batch()), targets()).backward();
    opt.step();
    opt.zero_grad();
    export_dcp(model, dir, &opt);
    loss_of(model(batch()), targets()).backward();
    opt.step();
    const double l = loss_of(model(batch()), targets()).item<double>();
    if (rt.rank() == 0) after = l;
  });
  return after;
}

// The same after importing `dir` (weights and AdamW's state) on `world` ranks with `s`.
double import_and_step(int64_t world, const FSDPStrategy& s, const std::string& dir,
                       DcpImportInfo* info = nullptr) {
  double after = 0;
  run_ranks(world, [&](Runtime& rt) {
    torch::manual_seed(99);  // other initial weights: the import must replace them all
    auto model = shard(std::make_shared<NetImpl>(), s, borrow(rt));
    torch::optim::AdamW opt(model.parameters(), adamw());
    DcpOptions o;
    o.optimizer = true;
    const DcpImportInfo got = import_dcp(model, dir, &opt, o);
    loss_of(model(batch()), targets()).backward();
    opt.step();
    const double l = loss_of(model(batch()), targets()).item<double>();
    if (rt.rank() == 0) {
      after = l;
      if (info) *info = got;
    }
  });
  return after;
}

// Exported by FULL_SHARD on 4 ranks (flat shards cut rows anywhere: partial-row boxes) after one
// step; `reference` is that run's loss after one more step.
const std::string& exported(double* reference = nullptr) {
  static TempDir tmp;
  static double after = 0;
  static const std::string dir = [] {
    const std::string d = tmp / "ckpt";
    after = train_and_export(4, strategy(ShardingStrategy::kFullShard, {4}), d);
    return d;
  }();
  if (reference) *reference = after;
  return dir;
}

// A copy of the exported checkpoint to damage.
std::string copy_of_export(const TempDir& tmp) {
  const std::string d = tmp / "copy";
  fs::copy(exported(), d, fs::copy_options::recursive);
  return d;
}

void import_into_fresh(Runtime& rt, const std::string& dir, const DcpOptions& o = {},
                       std::shared_ptr<NetImpl> net = nullptr) {
  auto model = shard(net ? net : std::make_shared<NetImpl>(),
                     strategy(ShardingStrategy::kFullShard, {rt.world_size()}), borrow(rt));
  import_dcp(model, dir, nullptr, o);
}

}  // namespace

TEST(DcpPickle, ReadsWhatItWritesAndConstructsNothingElse) {
  pk::PickleWriter w;
  w.global("m", "C");
  w.tuple(0);
  w.newobj();
  w.empty_dict();
  w.mark();
  w.str("ints");
  w.ints({0, 255, 256, -1, int64_t{1} << 40, INT64_MIN});
  w.str("f");
  w.number(-2.5);
  w.str("flags");
  w.mark();
  w.boolean(true);
  w.none();
  w.tuple_from_mark();
  w.str("size");
  w.size({3, 4});
  w.setitems();
  w.build();
  const std::string bytes = w.finish();
  const pk::Pickle p(bytes, {"m.C", "torch.Size"}, "test pickle");
  const pk::Value& root = p.root();
  ASSERT_TRUE(root.is_object_of("m.C"));
  EXPECT_EQ(pk::as_ints(root.state->get("ints"), "ints"),
            (std::vector<int64_t>{0, 255, 256, -1, int64_t{1} << 40, INT64_MIN}));
  EXPECT_EQ(pk::as_number(root.state->get("f"), "f"), -2.5);
  EXPECT_EQ(pk::as_ints(root.state->get("size"), "size"), (std::vector<int64_t>{3, 4}));
  const auto& flags = pk::as_tuple(root.state->get("flags"), "flags");
  ASSERT_EQ(flags.size(), 2u);
  EXPECT_TRUE(pk::as_bool(flags[0], "flag"));
  EXPECT_TRUE(flags[1]->is(pk::Value::Kind::kNone));

  // A class outside the list is refused by name, however harmless it looks.
  expect_error_contains([&] { pk::Pickle(bytes, {"torch.Size"}, "test pickle"); },
                        "test pickle refuses to load m.C");
  pk::PickleWriter evil;
  evil.global("os", "system");
  evil.str("echo pwned");
  evil.tuple(1);
  evil.reduce();
  expect_error_contains([&] { pk::Pickle(evil.finish(), {"torch.Size"}, "x"); },
                        "x refuses to load os.system");
  // Cut short anywhere: an error, never a crash.
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_THROW(pk::Pickle(bytes.substr(0, n), {"m.C", "torch.Size"}, "cut"), Error) << n;
  }
  expect_error_contains([&] { pk::Pickle(std::string("\x80\x01N.", 4), {}, "old"); },
                        "uses pickle protocol 1");
}

TEST(DcpBoxes, TileEveryFlatRangeExactly) {
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{}, {7}, {5, 4}, {3, 4, 5}, {2, 1, 3, 2}}) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    for (int64_t lo = 0; lo <= n; ++lo) {
      for (int64_t hi = lo; hi <= n; ++hi) {
        std::vector<int> seen(static_cast<size_t>(n), 0);
        int64_t next = lo;  // boxes come in flat order, each one contiguous
        const auto boxes = fsdp::detail::flat_range_boxes(shape, lo, hi);
        if (shape.size() == 2) EXPECT_LE(boxes.size(), 3u);
        for (const auto& [off, sz] : boxes) {
          ASSERT_EQ(off.size(), shape.size());
          int64_t count = 1, first = 0, stride = 1;
          for (size_t d = shape.size(); d-- > 0;) {
            ASSERT_GE(off[d], 0);
            ASSERT_LE(off[d] + sz[d], shape[d]);
            count *= sz[d];
            first += off[d] * stride;
            stride *= shape[d];
          }
          EXPECT_EQ(first, next) << "shape rank " << shape.size() << " [" << lo << ", " << hi << ")";
          next += count;
          for (int64_t k = first; k < first + count; ++k) ++seen[static_cast<size_t>(k)];
        }
        EXPECT_EQ(next, hi);
        for (int64_t k = 0; k < n; ++k) EXPECT_EQ(seen[k], k >= lo && k < hi ? 1 : 0);
      }
    }
  }
}

TEST(Dcp, ContinuesOnAnotherMeshAsIfNothingHappened) {
  double reference = 0;
  exported(&reference);
  const fsdp::detail::DcpMetadata m = fsdp::detail::parse_dcp_metadata(
      read_file(exported() + "/.metadata"), "the export");  // tiled exactly, or this throws
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(exported())) files += e.path().extension() == ".distcp";
  EXPECT_EQ(files, 4u);
  const fsdp::detail::DcpItem* emb = m.find("model.emb.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->size, (std::vector<int64_t>{17, 33}));
  EXPECT_NE(m.find("optim.state.emb.weight.exp_avg_sq"), nullptr);
  EXPECT_NE(m.find("optim.state.emb.weight.step"), nullptr);
  EXPECT_NE(m.find("optim.param_groups.0.betas"), nullptr);

  for (const auto& [world, s] : std::vector<std::pair<int64_t, FSDPStrategy>>{
           {1, strategy(ShardingStrategy::kNoShard, {1})},
           {3, strategy(ShardingStrategy::kFullShard, {3})},
           {4, strategy(ShardingStrategy::kHybridShard, {2, 2})}}) {
    DcpImportInfo info;
    const double got = import_and_step(world, s, exported(), &info);
    EXPECT_NEAR(got, reference, 1e-5 * std::abs(reference)) << "world " << world;
    EXPECT_EQ(info.optimizer_step, 1);
    // Rank 0 reads the chunks that meet its shards, not the checkpoint: for a third of the
    // model, the pieces of the two exporting ranks whose quarters it overlaps.
    int64_t total = 0;
    for (const auto& e : fs::directory_iterator(exported())) {
      if (e.path().extension() == ".distcp") total += static_cast<int64_t>(e.file_size());
    }
    if (world == 3) EXPECT_LT(info.bytes_read, total * 6 / 10) << info.bytes_read << " of " << total;
    EXPECT_DOUBLE_EQ(info.checkpoint_lr, 1e-2);
    EXPECT_GT(info.tensors, 0);
  }
}

TEST(Dcp, PadsRowsTheCheckpointLacks) {
  TempDir tmp;
  run_ranks(2, [&](Runtime& rt) {
    torch::manual_seed(3);
    auto model = shard(std::make_shared<NetImpl>(17), strategy(ShardingStrategy::kFullShard, {2}),
                       borrow(rt));
    export_dcp(model, tmp / "v17");
  });
  run_ranks(2, [&](Runtime& rt) {
    auto model = shard(std::make_shared<NetImpl>(20), strategy(ShardingStrategy::kFullShard, {2}),
                       borrow(rt));
    DcpOptions o;
    expect_error_contains([&] { import_dcp(model, tmp / "v17", nullptr, o); },
                          "'model.emb.weight' has shape [17, 33] but the model's 'emb.weight' has "
                          "[20, 33]");
    o.real_rows["emb.weight"] = 17;
    const DcpImportInfo info = import_dcp(model, tmp / "v17", nullptr, o);
    ASSERT_FALSE(info.notes.empty());
    EXPECT_NE(info.notes[0].find("rows 17..19 are padding, set to zero"), std::string::npos);
    const auto sd = model.state_dict();  // gathered
    const at::Tensor emb = sd["emb.weight"];
    EXPECT_TRUE(emb.narrow(0, 17, 3).eq(0).all().item<bool>());
    EXPECT_FALSE(emb.narrow(0, 0, 17).eq(0).all().item<bool>());
  });
}

TEST(Dcp, RefusesDamageInOneLineOnEveryRank) {
  TempDir tmp;
  const std::string meta_bytes = read_file(exported() + "/.metadata");
  struct Case {
    std::string name, expected;
    std::function<void(const std::string& dir)> damage;
  };
  auto splice = [&](const std::string& from, const std::string& to) {
    std::string b = meta_bytes;
    const size_t at = b.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return b.replace(at, from.size(), to);
  };
  auto with_chunks = [&](const std::function<void(fsdp::detail::DcpItem&)>& edit) {
    fsdp::detail::DcpMetadata m = fsdp::detail::parse_dcp_metadata(meta_bytes, "x");
    for (auto& it : m.items) {
      if (it.key == "model.emb.weight") edit(it);
    }
    return fsdp::detail::dcp_metadata_bytes(m);
  };
  const std::vector<Case> cases = {
      {"not a pickle", "is not a pickle",
       [&](const std::string& d) { write_bytes(d + "/.metadata", "{\"version\": 1}"); }},
      {"unknown version", "is of DCP format version '2.0'",
       [&](const std::string& d) {
         // storage_meta's key and None become version's key and "2.0" (a memo put between).
         std::string b = splice(std::string("X\x0c\0\0\0storage_meta", 17),
                                std::string("X\x07\0\0\0version", 12));
         const size_t value = b.find(std::string("X\x07\0\0\0version", 12)) + 12;
         const size_t none = value + (b[value] == 'q' ? 2 : 5);
         ASSERT_EQ(b[none], 'N');
         write_bytes(d + "/.metadata", b.replace(none, 1, std::string("X\x03\0\0\0" "2.0", 8)));
       }},
      {"foreign class", "refuses to load os.system",
       [&](const std::string& d) {
         write_bytes(d + "/.metadata", splice("ctorch.distributed.checkpoint.metadata\nMetadata\n",
                                             "cos\nsystem\n"));
       }},
      {"missing file", "__2_0.distcp, which is missing",
       [&](const std::string& d) { fs::remove(d + "/__2_0.distcp"); }},
      {"short file", "__3_0.distcp is too short",
       [&](const std::string& d) { fs::resize_file(d + "/__3_0.distcp", 1000); }},
      {"overlap", "has chunks that overlap",
       [&](const std::string& d) {
         write_bytes(d + "/.metadata", with_chunks([](fsdp::detail::DcpItem& it) {
                      it.chunks[1].offsets[0] -= 1;  // one row into the chunk before
                    }));
       }},
      {"gap", "is not covered by its chunks (a gap of",
       [&](const std::string& d) {
         write_bytes(d + "/.metadata",
                    with_chunks([](fsdp::detail::DcpItem& it) { it.chunks.pop_back(); }));
       }},
      {"chunk bytes", "is not in torch.save's format",
       [&](const std::string& d) {
         const fsdp::detail::DcpItem* it = fsdp::detail::parse_dcp_metadata(meta_bytes, "x").find("model.emb.weight");
         std::fstream f(d + "/" + it->chunks[0].file, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(it->chunks[0].offset + it->chunks[0].length - 30);  // the zip's directory end
         f.write("garbage garbage garbage", 23);
       }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir t;
    const std::string d = t / "copy";
    fs::copy(exported(), d, fs::copy_options::recursive);
    c.damage(d);
    expect_every_rank_fails(2, [&](Runtime& rt) { import_into_fresh(rt, d); }, c.expected);
  }
  // No .metadata: not a checkpoint (an export that did not finish).
  const std::string d = copy_of_export(tmp);
  fs::remove(d + "/.metadata");
  expect_every_rank_fails(2, [&](Runtime& rt) { import_into_fresh(rt, d); }, "it has no .metadata");
}

TEST(Dcp, ListsEveryNameMismatchInOneLine) {
  DcpOptions o;
  o.renames = {parse_dcp_rename("^emb\\.=embedding.")};
  expect_every_rank_fails(
      2, [&](Runtime& rt) { import_into_fresh(rt, exported(), o); },
      "does not match the model (2 problems): 'model.emb.weight' (as 'embedding.weight') is no "
      "parameter or buffer of the model; the model's 'emb.weight' is missing");
  o.renames = {parse_dcp_rename("^emb\\.weight$=")};  // skipped, so missing
  expect_every_rank_fails(2, [&](Runtime& rt) { import_into_fresh(rt, exported(), o); },
                          "the model's 'emb.weight' is missing");
  expect_every_rank_fails(
      2, [&](Runtime& rt) { import_into_fresh(rt, exported(), {}, std::make_shared<NetImpl>(19)); },
      "'model.emb.weight' has shape [17, 33] but the model's 'emb.weight' has [19, 33]");
  expect_error_contains([] { parse_dcp_rename("no equals sign"); }, "is not REGEX=REPLACEMENT");
  expect_error_contains([] { parse_dcp_rename("(=x"); }, "is not a regular expression");
  // The optimizer's settings must be this optimizer's.
  expect_every_rank_fails(
      2,
      [&](Runtime& rt) {
        auto model = shard(std::make_shared<NetImpl>(),
                           strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
        torch::optim::AdamW opt(model.parameters(), adamw().betas({0.8, 0.99}));
        DcpOptions with;
        with.optimizer = true;
        import_dcp(model, exported(), &opt, with);
      },
      "betas is (0.9, 0.999) there and (0.8, 0.99) here");
}
