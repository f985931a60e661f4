// dcp/pickle.h (internal): Python's pickle format, as far as PyTorch's distributed checkpoint
// (DCP) needs it, in both directions, without ever running or constructing anything.
//
// Reading: a small stack machine for the opcodes of protocols 2 to 5 that builds a tree of plain
// values. A class or function reference (GLOBAL, STACK_GLOBAL) must be in the caller's allowed
// list, or reading stops with "refuses to load <module>.<name>"; NEWOBJ, REDUCE and BUILD only
// record (class, arguments, state) in an Object node for the caller to interpret. Every node
// lives in the Pickle's arena, so shared and even cyclic references (the memo) are safe.
//
// Writing: PickleWriter emits protocol-2 opcodes one call at a time, each string and class
// reference once (later uses read the memo), which every Python 3 reads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace fsdp::detail::pickle {

struct Value {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict, kGlobal,
                    kObject, kPersistent };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                  // kStr, kBytes; kGlobal: "module.name"
  std::vector<const Value*> items;  // kTuple, kList; kDict: key, value, key, value...
  // kObject: the class or callable (a kGlobal), its arguments (a kTuple), the BUILD state
  // (nullptr without BUILD), and whether REDUCE (a call) rather than NEWOBJ made it.
  const Value* cls = nullptr;
  const Value* args = nullptr;
  const Value* state = nullptr;
  bool reduced = false;
  const Value* pid = nullptr;     // kPersistent: the persistent id

  bool is(Kind k) const { return kind == k; }
  bool is_object_of(const std::string& global) const;
  // The entry under string key `key` of a kDict, or nullptr.
  const Value* get(const std::string& key) const;
  std::string describe() const;  // for error messages: a kind and a short excerpt
};

class Pickle {
 public:
  // Parses `data` (the whole pickle, STOP included). `allowed` lists "module.name" of every
  // class or function it may reference. Throws fsdp::Error naming `what` on anything else.
  Pickle(const std::string& data, const std::set<std::string>& allowed, const std::string& what);
  const Value& root() const { return *root_; }

 private:
  std::vector<std::unique_ptr<Value>> arena_;
  const Value* root_ = nullptr;
  friend class Unpickler;
};

// Checked accessors: fsdp::Error naming `what` when `v` is not of the kind.
int64_t as_int(const Value* v, const std::string& what);
double as_number(const Value* v, const std::string& what);  // kInt or kFloat
bool as_bool(const Value* v, const std::string& what);
const std::string& as_str(const Value* v, const std::string& what);
const std::vector<const Value*>& as_tuple(const Value* v, const std::string& what);
// A torch.Size, a tuple or a list of ints.
std::vector<int64_t> as_ints(const Value* v, const std::string& what);

class PickleWriter {
 public:
  PickleWriter();                 // PROTO 2
  std::string finish();           // STOP; the bytes
  void none();
  void boolean(bool v);
  void integer(int64_t v);
  void number(double v);
  void str(const std::string& v);
  void global(const std::string& module, const std::string& name);
  void mark();
  void tuple_from_mark();
  void tuple(int n);              // 0 to 3 items from the stack
  void empty_list();
  void appends();                 // the items since the mark onto the list below it
  void empty_dict();
  void setitems();                // key/value pairs since the mark into the dict below it
  void newobj();                  // cls, args tuple -> cls.__new__(cls, *args)
  void reduce();                  // callable, args tuple -> callable(*args)
  void build();                   // object, state -> object with state
  void binpersid();               // persistent id (the value on the stack)
  void ints(const std::vector<int64_t>& v);  // a tuple of ints
  void size(const std::vector<int64_t>& v);  // torch.Size(v)

 private:
  bool recall(const std::string& key);
  void remember(const std::string& key);
  std::string out_;
  std::map<std::string, uint32_t> memo_;
};

}  // namespace fsdp::detail::pickle
