// fsdp/mesh.h: device meshes. A mesh arranges the world's ranks in a grid; each dim of the grid
// has one process group per line along it.
//
//   device_mesh (2, 4): 2 replicas, each sharded over 4 ranks. Row-major: rank = r * 4 + s.
//
//                  shard dim (size 4) ->
//                  s=0   s=1   s=2   s=3
//     replica r=0 [  0     1     2     3 ]   <- shard group {0,1,2,3}: all-gather, reduce-scatter
//     replica r=1 [  4     5     6     7 ]   <- shard group {4,5,6,7}
//                    |     |     |     |
//                replicate groups {0,4} {1,5} {2,6} {3,7}: all-reduce of gradient shards
//
// Shard groups are contiguous ranks, i.e. inside a node when a node runs S or a multiple of S
// ranks; replicate groups stride across nodes. This is PyTorch's init_device_mesh(...,
// ("replicate", "shard")) and Lightning's device_mesh=(replication size, sharding size).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/collectives.h"

namespace fsdp {

class Runtime;

// The arithmetic of a mesh, without processes: validation, coordinates, groups.
class MeshLayout {
 public:
  // Resolves `shape` against a world of `world_size` ranks. One dim may be -1 and is inferred.
  // Default names: 1-D {"shard"}, 2-D {"replicate", "shard"}. Throws fsdp::Error naming the shape,
  // the rule and a fix: product != world, a dim < 1 other than one -1, a -1 that does not divide
  // the world, more than two dims, duplicate or empty names.
  static MeshLayout resolve(const std::vector<int64_t>& shape, int64_t world_size,
                            std::vector<std::string> names = {});
  // A 2-D mesh from explicit rank lists, for unusual topologies: grid[r][s] is the global rank at
  // replicate index r, shard index s. Must be a permutation of 0 .. world_size-1.
  static MeshLayout from_grid(const std::vector<std::vector<int64_t>>& grid, int64_t world_size,
                              std::vector<std::string> names = {});

  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t size(int64_t dim) const { return shape_.at(dim); }
  int64_t numel() const { return static_cast<int64_t>(ranks_.size()); }
  const std::vector<std::string>& names() const { return names_; }
  int64_t dim_index(const std::string& name) const;  // throws for an unknown name

  // Global rank at a grid coordinate, and the coordinate of a global rank.
  int64_t rank_at(const std::vector<int64_t>& coordinate) const;
  std::vector<int64_t> coordinate_of(int64_t rank) const;
  // Every group along `dim`: the ranks that differ only in that coordinate, in coordinate order;
  // groups ordered row-major by the other coordinates.
  std::vector<std::vector<int64_t>> groups(int64_t dim) const;
  // The group along `dim` that contains `rank`.
  std::vector<int64_t> group_of(int64_t dim, int64_t rank) const;

  // "(2, 4)"
  std::string shape_string() const;
  static std::string shape_string(const std::vector<int64_t>& shape);

 private:
  std::vector<int64_t> shape_;
  std::vector<std::string> names_;
  std::vector<int64_t> ranks_;  // row-major grid of global ranks
};

// A MeshLayout with its process groups created on a Runtime.
class DeviceMesh {
 public:
  // Creates every group of every dim on every rank, in the same order (dim 0's groups first);
  // each group gets its own store prefix. The layout must cover the runtime's world.
  DeviceMesh(std::shared_ptr<Runtime> runtime, MeshLayout layout);
  static std::shared_ptr<DeviceMesh> create(std::shared_ptr<Runtime> runtime,
                                            const std::vector<int64_t>& shape,
                                            std::vector<std::string> names = {});

  const MeshLayout& layout() const { return layout_; }
  const std::shared_ptr<Runtime>& runtime() const { return runtime_; }
  int64_t ndim() const { return layout_.ndim(); }
  // This rank's group along a dim, by index or name.
  std::shared_ptr<Group> group(int64_t dim) const;
  std::shared_ptr<Group> group(const std::string& name) const;
  // This rank's coordinate along a dim.
  int64_t coordinate(int64_t dim) const;
  int64_t coordinate(const std::string& name) const;

 private:
  std::shared_ptr<Runtime> runtime_;
  MeshLayout layout_;
  std::vector<int64_t> coordinate_;
  std::vector<std::shared_ptr<Group>> groups_;
};

}  // namespace fsdp
