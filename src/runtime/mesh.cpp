// Mesh arithmetic and group creation (see fsdp/mesh.h).
#include "fsdp/mesh.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <vector>

#include <c10/util/Exception.h>

#include "fsdp/error.h"
#include "fsdp/runtime.h"

namespace fsdp {

std::string MeshLayout::shape_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += detail::cat(i ? ", " : "", shape[i]);
  return s + ")";
}

std::string MeshLayout::shape_string() const { return shape_string(shape_); }

namespace {

std::vector<std::string> default_names(size_t ndim) {
  if (ndim == 1) return {"shard"};
  return {"replicate", "shard"};
}

// The 2-D mesh (R', S') with R' * S' == world to suggest instead of `given` (R, S) (-1: any):
// the shard size S' closest to S, then the replicate size R' closest to R, then the smaller S'.
// S' = 1 shards nothing, so it is suggested only for a world of 1: (2, 2) on 3 ranks suggests
// (1, 3), not (3, 1).
std::vector<int64_t> nearest_mesh(const std::vector<int64_t>& given, int64_t world) {
  const int64_t R = given[0], S = given[1];
  auto distance = [](int64_t have, int64_t want) {
    return want < 1 ? int64_t{0} : std::max(have, want) - std::min(have, want);
  };
  std::vector<int64_t> best{world, 1};
  bool found = false;
  for (int64_t d = 1; d <= world / d; ++d) {
    if (world % d != 0) continue;
    for (int64_t s : {d, world / d}) {
      if (s == 1 && world > 1) continue;
      const int64_t r = world / s;
      auto key = [&](int64_t rr, int64_t ss) {
        return std::make_tuple(distance(ss, S), distance(rr, R), ss);
      };
      if (!found || key(r, s) < key(best[0], best[1])) best = {r, s};
      found = true;
    }
  }
  return best;
}

std::string suggestion(const std::vector<int64_t>& given, int64_t world) {
  if (given.size() == 1) return detail::cat("use (", world, ") or (-1)");
  const std::vector<int64_t> m = nearest_mesh(given, world);
  return detail::cat("use (", m[0], ", ", m[1], ") or (-1, ", m[1], ")");
}

void check_names(const std::vector<std::string>& names, size_t ndim, const std::string& shape) {
  FSDP_CHECK(names.size() == ndim, "device_mesh ", shape, " has ", ndim, " dims but ",
             names.size(), " dim names were given; give one name per dim");
  std::set<std::string> seen;
  for (const auto& n : names) {
    FSDP_CHECK(!n.empty(), "device_mesh ", shape, ": a dim name is empty; name every dim");
    FSDP_CHECK(seen.insert(n).second, "device_mesh ", shape, ": dim name '", n,
               "' is used twice; give each dim its own name");
  }
}

}  // namespace

MeshLayout MeshLayout::resolve(const std::vector<int64_t>& shape_in, int64_t world_size,
                               std::vector<std::string> names) {
  const std::string given = shape_string(shape_in);
  FSDP_CHECK(world_size >= 1, "world size ", world_size, " is invalid");
  FSDP_CHECK(!shape_in.empty(), "device_mesh () is empty; give (S) for a 1-D mesh or (R, S)");
  FSDP_CHECK(shape_in.size() <= 2, "device_mesh ", given, " has ", shape_in.size(),
             " dims; fsdp supports 1-D (shard) and 2-D (replicate, shard) meshes");
  int64_t inferred = -1, known = 1;
  for (size_t d = 0; d < shape_in.size(); ++d) {
    const int64_t v = shape_in[d];
    if (v == -1) {
      FSDP_CHECK(inferred < 0, "device_mesh ", given,
                 " has more than one -1; only one dim can be inferred");
      inferred = static_cast<int64_t>(d);
      continue;
    }
    FSDP_CHECK(v >= 1, "device_mesh ", given, ": dim ", d, " is ", v,
               "; every dim must be >= 1 (or a single -1 to infer it)");
    // Dims whose product overflows int64 (found by fuzz_mesh_strategy) are far too large too.
    FSDP_CHECK(!__builtin_mul_overflow(known, v, &known), "device_mesh ", given,
               " has more ranks than the world of ", world_size, " processes; ",
               suggestion(shape_in, world_size));
  }
  std::vector<int64_t> shape = shape_in;
  if (inferred >= 0) {
    FSDP_CHECK(world_size % known == 0, "device_mesh ", given, " cannot be inferred: ", known,
               " does not divide the world of ", world_size, " processes; ",
               suggestion(shape, world_size));
    shape[inferred] = world_size / known;
  }
  int64_t product = 1;
  for (int64_t v : shape) product *= v;
  FSDP_CHECK(product == world_size, "device_mesh ", given, " has ", product,
             " ranks but the world has ", world_size, " processes; ",
             suggestion(shape, world_size));
  if (names.empty()) names = default_names(shape.size());
  check_names(names, shape.size(), given);
  MeshLayout m;
  m.shape_ = shape;
  m.names_ = std::move(names);
  m.ranks_.resize(world_size);
  for (int64_t r = 0; r < world_size; ++r) m.ranks_[r] = r;
  return m;
}

MeshLayout MeshLayout::from_grid(const std::vector<std::vector<int64_t>>& grid,
                                 int64_t world_size, std::vector<std::string> names) {
  FSDP_CHECK(!grid.empty() && !grid[0].empty(), "device mesh grid is empty");
  const int64_t R = static_cast<int64_t>(grid.size()), S = static_cast<int64_t>(grid[0].size());
  std::vector<int64_t> flat;
  for (const auto& row : grid) {
    FSDP_CHECK(static_cast<int64_t>(row.size()) == S, "device mesh grid rows differ in length (",
               S, " and ", row.size(), "); every replica needs the same shard size");
    flat.insert(flat.end(), row.begin(), row.end());
  }
  FSDP_CHECK(R * S == world_size, "device mesh grid has ", R * S, " ranks but the world has ",
             world_size, " processes; list every rank exactly once");
  std::vector<int64_t> sorted = flat;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < world_size; ++i) {
    FSDP_CHECK(sorted[i] == i, "device mesh grid must hold every rank 0..", world_size - 1,
               " exactly once; rank ", i, " is ", (sorted[i] > i ? "missing" : "listed twice"));
  }
  if (names.empty()) names = default_names(2);
  check_names(names, 2, shape_string({R, S}));
  MeshLayout m;
  m.shape_ = {R, S};
  m.names_ = std::move(names);
  m.ranks_ = std::move(flat);
  return m;
}

int64_t MeshLayout::dim_index(const std::string& name) const {
  for (size_t i = 0; i < names_.size(); ++i) {
    if (names_[i] == name) return static_cast<int64_t>(i);
  }
  std::string known;
  for (const auto& n : names_) known += (known.empty() ? "" : ", ") + n;
  throw Error(detail::cat("mesh dim '", name, "' does not exist; the dims are ", known));
}

int64_t MeshLayout::rank_at(const std::vector<int64_t>& c) const {
  TORCH_INTERNAL_ASSERT(c.size() == shape_.size());
  int64_t flat = 0;
  for (size_t d = 0; d < c.size(); ++d) flat = flat * shape_[d] + c[d];
  return ranks_.at(flat);
}

std::vector<int64_t> MeshLayout::coordinate_of(int64_t rank) const {
  auto it = std::find(ranks_.begin(), ranks_.end(), rank);
  FSDP_CHECK(it != ranks_.end(), "rank ", rank, " is not in the device mesh ", shape_string());
  int64_t flat = it - ranks_.begin();
  std::vector<int64_t> c(shape_.size());
  for (int64_t d = ndim() - 1; d >= 0; --d) {
    c[d] = flat % shape_[d];
    flat /= shape_[d];
  }
  return c;
}

std::vector<std::vector<int64_t>> MeshLayout::groups(int64_t dim) const {
  TORCH_INTERNAL_ASSERT(dim >= 0 && dim < ndim());
  std::vector<std::vector<int64_t>> out;
  const int64_t n = numel() / shape_[dim];
  for (int64_t g = 0; g < n; ++g) {
    // g enumerates the other coordinates row-major.
    std::vector<int64_t> c(shape_.size());
    int64_t rest = g;
    for (int64_t d = ndim() - 1; d >= 0; --d) {
      if (d == dim) continue;
      c[d] = rest % shape_[d];
      rest /= shape_[d];
    }
    std::vector<int64_t> group;
    for (int64_t i = 0; i < shape_[dim]; ++i) {
      c[dim] = i;
      group.push_back(rank_at(c));
    }
    out.push_back(std::move(group));
  }
  return out;
}

std::vector<int64_t> MeshLayout::group_of(int64_t dim, int64_t rank) const {
  std::vector<int64_t> c = coordinate_of(rank);
  std::vector<int64_t> group;
  for (int64_t i = 0; i < shape_.at(dim); ++i) {
    c[dim] = i;
    group.push_back(rank_at(c));
  }
  return group;
}

DeviceMesh::DeviceMesh(std::shared_ptr<Runtime> runtime, MeshLayout layout)
    : runtime_(std::move(runtime)), layout_(std::move(layout)) {
  FSDP_CHECK(layout_.numel() == runtime_->world_size(), "device_mesh ", layout_.shape_string(),
             " has ", layout_.numel(), " ranks but the world has ", runtime_->world_size(),
             " processes");
  coordinate_ = layout_.coordinate_of(runtime_->rank());
  // NOTE [group creation order]: every rank walks the same dims and groups in the same order, so
  // the runtime hands out identical store prefixes everywhere; non-members skip the connect.
  for (int64_t d = 0; d < layout_.ndim(); ++d) {
    std::shared_ptr<Group> mine;
    for (const auto& ranks : layout_.groups(d)) {
      auto g = runtime_->new_group(ranks, layout_.names()[d]);
      if (g) mine = g;
    }
    TORCH_INTERNAL_ASSERT(mine, "rank ", runtime_->rank(), " is in no group of dim ", d);
    groups_.push_back(mine);
  }
}

std::shared_ptr<DeviceMesh> DeviceMesh::create(std::shared_ptr<Runtime> runtime,
                                               const std::vector<int64_t>& shape,
                                               std::vector<std::string> names) {
  auto layout = MeshLayout::resolve(shape, runtime->world_size(), std::move(names));
  return std::make_shared<DeviceMesh>(std::move(runtime), std::move(layout));
}

std::shared_ptr<Group> DeviceMesh::group(int64_t dim) const { return groups_.at(dim); }
std::shared_ptr<Group> DeviceMesh::group(const std::string& name) const {
  return groups_.at(layout_.dim_index(name));
}
int64_t DeviceMesh::coordinate(int64_t dim) const { return coordinate_.at(dim); }
int64_t DeviceMesh::coordinate(const std::string& name) const {
  return coordinate_.at(layout_.dim_index(name));
}

}  // namespace fsdp
