// The mutation test of a checkpoint's manifest (issue 38): every way of editing one entry of a
// valid meta.json that keeps the JSON valid — remove it, duplicate it, change its shape, shift one
// of its chunks' begin, end or offset, point a chunk at another file, drop a rank from the RNG
// section — each of which a complete check must refuse (NOTE [complete manifest] in
// src/checkpoint/manifest.cpp). Header-only and pure, shared by test_train_manifest (the whole
// set through parse_meta, a sample through fsdp-train) and the fuzz target fuzz_checkpoint_meta
// (the whole set for every valid meta.json the fuzzer reaches).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace fsdp::testing {

struct ManifestMutation {
  std::string kind;  // "remove", "duplicate", "shape", "begin", "end", "offset", "file", "rng"
  std::string what;  // e.g. "remove tensors[1] (optim exp_avg tok_emb.weight)"
  nlohmann::ordered_json meta;
};

// Every mutation of `meta` (a valid meta.json): of each tensor entry, of each file entry, of each
// chunk, and of the RNG section. Entries not shaped as fsdp writes them are left alone.
inline std::vector<ManifestMutation> manifest_mutations(const nlohmann::ordered_json& meta) {
  using json = nlohmann::ordered_json;
  std::vector<ManifestMutation> out;
  auto add = [&](const std::string& kind, const std::string& what, json m) {
    out.push_back({kind, what, std::move(m)});
  };
  if (!meta.is_object()) return out;
  // Files some chunk or the RNG refers to: a listed file nothing refers to holds no state, and
  // neither does a tensor without chunks (no elements): removing them loses nothing (a load
  // still finds the tensor missing against its model).
  std::set<std::string> used;
  if (meta.contains("rng") && meta["rng"].is_object()) used.insert(meta["rng"].value("file", ""));
  if (meta.contains("tensors") && meta["tensors"].is_array()) {
    for (const auto& t : meta["tensors"]) {
      if (!t.is_object() || !t.contains("chunks") || !t["chunks"].is_array()) continue;
      for (const auto& c : t["chunks"]) {
        if (c.is_object() && c.contains("file") && c["file"].is_string()) used.insert(c["file"]);
      }
    }
  }
  std::vector<std::string> files;
  if (meta.contains("files") && meta["files"].is_array()) {
    const json& fs = meta["files"];
    for (size_t k = 0; k < fs.size(); ++k) {
      const std::string name = fs[k].value("name", std::string("?"));
      files.push_back(name);
      json m = meta;
      if (used.count(name)) {
        m["files"].erase(m["files"].begin() + static_cast<std::ptrdiff_t>(k));
        add("remove", "remove files[" + std::to_string(k) + "] (" + name + ")", std::move(m));
      }
      m = meta;
      m["files"].insert(m["files"].begin() + static_cast<std::ptrdiff_t>(k), fs[k]);
      add("duplicate", "duplicate files[" + std::to_string(k) + "] (" + name + ")", std::move(m));
    }
  }
  if (meta.contains("tensors") && meta["tensors"].is_array()) {
    const json& ts = meta["tensors"];
    for (size_t i = 0; i < ts.size(); ++i) {
      const json& t = ts[i];
      if (!t.is_object()) continue;
      const std::string at = "tensors[" + std::to_string(i) + "] (" + t.value("kind", "?") + " " +
                             (t.contains("field") ? t.value("field", "?") + " " : "") +
                             t.value("name", "?") + ")";
      auto edited = [&](const std::function<void(json&)>& fn) {
        json m = meta;
        fn(m["tensors"][i]);
        return m;
      };
      json m = meta;
      if (t.contains("chunks") && t["chunks"].is_array() && !t["chunks"].empty()) {
        m["tensors"].erase(m["tensors"].begin() + static_cast<std::ptrdiff_t>(i));
        add("remove", "remove " + at, std::move(m));
      }
      m = meta;
      m["tensors"].insert(m["tensors"].begin() + static_cast<std::ptrdiff_t>(i), t);
      add("duplicate", "duplicate " + at, std::move(m));
      if (t.contains("shape") && t["shape"].is_array()) {
        add("shape", "change the shape of " + at, edited([](json& e) {
              if (e["shape"].empty() || !e["shape"][0].is_number_integer()) {
                e["shape"] = json::array({2});
              } else {
                e["shape"][0] = e["shape"][0].get<int64_t>() + 1;
              }
            }));
      }
      if (!t.contains("chunks") || !t["chunks"].is_array()) continue;
      for (size_t c = 0; c < t["chunks"].size(); ++c) {
        const json& ch = t["chunks"][c];
        if (!ch.is_object()) continue;
        const std::string cat = at + " chunk " + std::to_string(c);
        for (const char* key : {"begin", "end", "offset"}) {
          if (!ch.contains(key) || !ch[key].is_number_integer()) continue;
          // One element (4 bytes for the offset) further: still inside the tensor and the file
          // where it can be, so only the check of the whole finds it.
          const int64_t by = std::string(key) == "offset" ? 4 : 1;
          add(key, std::string("shift ") + key + " of " + cat, edited([&](json& e) {
                e["chunks"][c][key] = ch[key].get<int64_t>() + by;
              }));
        }
        for (const auto& f : files) {
          if (!ch.contains("file") || ch["file"] == f) continue;
          add("file", "point " + cat + " at " + f, edited([&](json& e) { e["chunks"][c]["file"] = f; }));
        }
      }
    }
  }
  if (meta.contains("rng") && meta["rng"].is_object() && meta["rng"].contains("world_size") &&
      meta["rng"]["world_size"].is_number_integer()) {
    json m = meta;
    m["rng"]["world_size"] = meta["rng"]["world_size"].get<int64_t>() - 1;
    add("rng", "drop a rank from the RNG section", std::move(m));
  }
  return out;
}

}  // namespace fsdp::testing
