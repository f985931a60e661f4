// The pickle subset of DCP (see pickle.h).
#include "dcp/pickle.h"

#include <cstring>
#include <unordered_map>

#include "fsdp/error.h"

namespace fsdp::detail::pickle {

namespace {

using Kind = Value::Kind;

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "a bool";
    case Kind::kInt: return "an int";
    case Kind::kFloat: return "a float";
    case Kind::kStr: return "a string";
    case Kind::kBytes: return "bytes";
    case Kind::kTuple: return "a tuple";
    case Kind::kList: return "a list";
    case Kind::kDict: return "a dict";
    case Kind::kGlobal: return "a class reference";
    case Kind::kObject: return "an object";
    case Kind::kPersistent: return "a persistent id";
  }
  return "?";
}

}  // namespace

bool Value::is_object_of(const std::string& global) const {
  return kind == Kind::kObject && cls && cls->s == global;
}

const Value* Value::get(const std::string& key) const {
  if (kind != Kind::kDict) return nullptr;
  for (size_t k = 0; k + 1 < items.size(); k += 2) {
    if (items[k]->kind == Kind::kStr && items[k]->s == key) return items[k + 1];
  }
  return nullptr;
}

std::string Value::describe() const {
  switch (kind) {
    case Kind::kInt: return cat("the int ", i);
    case Kind::kFloat: return cat("the float ", f);
    case Kind::kStr: return cat("the string '", s.substr(0, 40), s.size() > 40 ? "...'" : "'");
    case Kind::kGlobal: return cat("a reference to ", s);
    case Kind::kObject: return cat("an object of ", cls ? cls->s : "?");
    default: return kind_name(kind);
  }
}

class Unpickler {
 public:
  Unpickler(Pickle& p, const std::string& data, const std::set<std::string>& allowed,
            const std::string& what)
      : p_(p), d_(data), allowed_(allowed), what_(what) {}

  const Value* run() {
    for (;;) {
      const uint8_t op = u8();
      switch (op) {
        case 0x80: {  // PROTO
          const int v = u8();
          fail_if(v < 2 || v > 5, cat("uses pickle protocol ", v, " (2 to 5 are read)"));
          break;
        }
        case 0x95: take(8); break;  // FRAME: a length hint
        case '.': {                 // STOP
          fail_if(stack_.size() != 1 || !marks_.empty(), "ends with an unbalanced stack");
          return stack_.back();
        }
        case '(': marks_.push_back(stack_.size()); break;
        case '0': pop(); break;
        case '1': pop_mark(); break;
        case '2': push(top()); break;
        case 'N': push(make(Kind::kNone)); break;
        case 0x88: case 0x89: {
          Value* v = make(Kind::kBool);
          v->b = op == 0x88;
          push(v);
          break;
        }
        case 'J': push_int(static_cast<int32_t>(le(4))); break;
        case 'K': push_int(static_cast<int64_t>(le(1))); break;
        case 'M': push_int(static_cast<int64_t>(le(2))); break;
        case 0x8a: case 0x8b: {  // LONG1, LONG4: little-endian two's complement
          const uint64_t n = le(op == 0x8a ? 1 : 4);
          fail_if(n > 8, cat("holds an integer of ", n, " bytes (at most 8 are read)"));
          const uint64_t raw = n == 0 ? 0 : le(static_cast<int>(n));
          int64_t v = static_cast<int64_t>(raw);
          if (n > 0 && n < 8 && (raw >> (8 * n - 1)) & 1) v -= static_cast<int64_t>(1ull << (8 * n));
          push_int(v);
          break;
        }
        case 'G': {  // BINFLOAT: big-endian
          const char* b = take(8);
          uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = bits << 8 | static_cast<uint8_t>(b[k]);
          Value* v = make(Kind::kFloat);
          std::memcpy(&v->f, &bits, 8);
          push(v);
          break;
        }
        case 0x8c: push_str(Kind::kStr, le(1)); break;   // SHORT_BINUNICODE
        case 'X': push_str(Kind::kStr, le(4)); break;    // BINUNICODE
        case 0x8d: push_str(Kind::kStr, le(8)); break;   // BINUNICODE8
        case 'U': push_str(Kind::kStr, le(1)); break;    // SHORT_BINSTRING
        case 'T': push_str(Kind::kStr, le(4)); break;    // BINSTRING
        case 'C': push_str(Kind::kBytes, le(1)); break;  // SHORT_BINBYTES
        case 'B': push_str(Kind::kBytes, le(4)); break;  // BINBYTES
        case 0x8e: case 0x96: push_str(Kind::kBytes, le(8)); break;  // BINBYTES8, BYTEARRAY8
        case ')': push(make(Kind::kTuple)); break;
        case 't': push(seq(Kind::kTuple, pop_mark())); break;
        case 0x85: case 0x86: case 0x87: {
          const size_t n = op - 0x84;
          fail_if(stack_.size() < n, "pops an empty stack");
          std::vector<const Value*> items(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          check_mark();
          push(seq(Kind::kTuple, std::move(items)));
          break;
        }
        case ']': push(make(Kind::kList)); break;
        case 'l': push(seq(Kind::kList, pop_mark())); break;
        case 'a': {
          const Value* item = pop();
          container(Kind::kList)->items.push_back(item);
          break;
        }
        case 'e': {
          auto items = pop_mark();
          Value* list = container(Kind::kList);
          list->items.insert(list->items.end(), items.begin(), items.end());
          break;
        }
        case '}': push(make(Kind::kDict)); break;
        case 'd': {
          auto items = pop_mark();
          fail_if(items.size() % 2, "builds a dict from an odd number of items");
          push(seq(Kind::kDict, std::move(items)));
          break;
        }
        case 's': {
          const Value* v = pop();
          const Value* k = pop();
          Value* dict = container(Kind::kDict);
          dict->items.push_back(k);
          dict->items.push_back(v);
          break;
        }
        case 'u': {
          auto items = pop_mark();
          fail_if(items.size() % 2, "sets a dict's items from an odd number of values");
          Value* dict = container(Kind::kDict);
          dict->items.insert(dict->items.end(), items.begin(), items.end());
          break;
        }
        case 'c': {  // GLOBAL: "module\nname\n"
          const std::string module = line(), name = line();
          push(global(module, name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          const Value* name = pop();
          const Value* module = pop();
          fail_if(!module->is(Kind::kStr) || !name->is(Kind::kStr),
                  "names a class with something other than strings");
          push(global(module->s, name->s));
          break;
        }
        case 'R': case 0x81: {  // REDUCE, NEWOBJ
          const Value* args = pop();
          const Value* cls = pop();
          fail_if(!cls->is(Kind::kGlobal), cat("calls ", cls->describe()));
          fail_if(!args->is(Kind::kTuple), cat("calls ", cls->s, " with ", args->describe()));
          Value* v = make(Kind::kObject);
          v->cls = cls;
          v->args = args;
          v->reduced = op == 'R';
          push(v);
          break;
        }
        case 'b': {
          const Value* state = pop();
          Value* obj = mutable_top();
          fail_if(!obj->is(Kind::kObject) || obj->state,
                  cat("sets the state of ", obj->describe()));
          obj->state = state;
          break;
        }
        case 'Q': {  // BINPERSID
          Value* v = make(Kind::kPersistent);
          v->pid = pop();
          push(v);
          break;
        }
        case 'q': memo_[le(1)] = top(); break;
        case 'r': memo_[le(4)] = top(); break;
        case 0x94: memo_[memo_.size()] = top(); break;  // MEMOIZE
        case 'h': push(memo(le(1))); break;
        case 'j': push(memo(le(4))); break;
        default:
          fail(cat("has opcode 0x", hex(op), " at byte ", at_ - 1,
                   " (not one that DCP's pickles use)"));
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { throw Error(cat(what_, " ", why)); }
  void fail_if(bool bad, const std::string& why) const {
    if (bad) fail(why);
  }
  static std::string hex(uint8_t b) {
    const char* d = "0123456789abcdef";
    return {d[b >> 4], d[b & 15]};
  }
  const char* take(uint64_t n) {
    fail_if(n > d_.size() - at_, "is cut short (it ends inside an opcode)");
    const char* p = d_.data() + at_;
    at_ += n;
    return p;
  }
  uint8_t u8() { return static_cast<uint8_t>(*take(1)); }
  uint64_t le(int n) {
    const char* b = take(static_cast<uint64_t>(n));
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) v = v << 8 | static_cast<uint8_t>(b[k]);
    return v;
  }
  std::string line() {
    const size_t end = d_.find('\n', at_);
    fail_if(end == std::string::npos, "is cut short (a GLOBAL without its newline)");
    std::string s = d_.substr(at_, end - at_);
    at_ = end + 1;
    return s;
  }
  Value* make(Kind k) {
    p_.arena_.push_back(std::make_unique<Value>());
    p_.arena_.back()->kind = k;
    return p_.arena_.back().get();
  }
  Value* seq(Kind k, std::vector<const Value*> items) {
    Value* v = make(k);
    v->items = std::move(items);
    return v;
  }
  void push(const Value* v) { stack_.push_back(const_cast<Value*>(v)); }
  void push_int(int64_t i) {
    Value* v = make(Kind::kInt);
    v->i = i;
    push(v);
  }
  void push_str(Kind k, uint64_t n) {
    const char* b = take(n);
    Value* v = make(k);
    v->s.assign(b, n);
    push(v);
  }
  void check_mark() const {
    fail_if(!marks_.empty() && stack_.size() < marks_.back(), "pops past a MARK");
  }
  Value* pop() {
    fail_if(stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back()),
            "pops an empty stack");
    Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  const Value* top() const {
    fail_if(stack_.empty(), "reads an empty stack");
    return stack_.back();
  }
  Value* mutable_top() {
    fail_if(stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back()),
            "reads an empty stack");
    return stack_.back();
  }
  std::vector<const Value*> pop_mark() {
    fail_if(marks_.empty(), "has no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<const Value*> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  Value* container(Kind k) {
    Value* c = mutable_top();
    fail_if(!c->is(k), cat("adds items to ", c->describe(), " where ", kind_name(k),
                           " was expected"));
    return c;
  }
  const Value* memo(uint64_t k) const {
    auto it = memo_.find(k);
    fail_if(it == memo_.end(), cat("reads memo entry ", k, ", which was never stored"));
    return it->second;
  }
  const Value* global(const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    fail_if(!allowed_.count(full), cat("refuses to load ", full, ": not one of the classes a "
                                       "PyTorch distributed checkpoint uses (the reader never "
                                       "constructs arbitrary objects)"));
    Value* v = make(Kind::kGlobal);
    v->s = full;
    return v;
  }

  Pickle& p_;
  const std::string& d_;
  const std::set<std::string>& allowed_;
  const std::string& what_;
  size_t at_ = 0;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, const Value*> memo_;
};

Pickle::Pickle(const std::string& data, const std::set<std::string>& allowed,
               const std::string& what) {
  Unpickler u(*this, data, allowed, what);
  root_ = u.run();
}

namespace {
template <typename T>
[[noreturn]] T wrong(const Value* v, const char* want, const std::string& what) {
  throw Error(cat(what, " is ", v ? v->describe() : "missing", " where ", want, " was expected"));
}
}  // namespace

int64_t as_int(const Value* v, const std::string& what) {
  if (v && v->is(Kind::kInt)) return v->i;
  return wrong<int64_t>(v, "an int", what);
}

double as_number(const Value* v, const std::string& what) {
  if (v && v->is(Kind::kInt)) return static_cast<double>(v->i);
  if (v && v->is(Kind::kFloat)) return v->f;
  return wrong<double>(v, "a number", what);
}

bool as_bool(const Value* v, const std::string& what) {
  if (v && v->is(Kind::kBool)) return v->b;
  return wrong<bool>(v, "a bool", what);
}

const std::string& as_str(const Value* v, const std::string& what) {
  if (v && v->is(Kind::kStr)) return v->s;
  return wrong<const std::string&>(v, "a string", what);
}

const std::vector<const Value*>& as_tuple(const Value* v, const std::string& what) {
  if (v && v->is(Kind::kTuple)) return v->items;
  return wrong<const std::vector<const Value*>&>(v, "a tuple", what);
}

std::vector<int64_t> as_ints(const Value* v, const std::string& what) {
  // torch.Size(tuple) pickles as REDUCE(torch.Size, (tuple,)).
  if (v && v->is_object_of("torch.Size") && v->args->items.size() == 1) v = v->args->items[0];
  if (!v || !(v->is(Kind::kTuple) || v->is(Kind::kList))) {
    return wrong<std::vector<int64_t>>(v, "a torch.Size", what);
  }
  std::vector<int64_t> out;
  for (const Value* x : v->items) out.push_back(as_int(x, what));
  return out;
}

// ---- writing

PickleWriter::PickleWriter() { out_ = "\x80\x02"; }

std::string PickleWriter::finish() {
  out_ += '.';
  return std::move(out_);
}

void PickleWriter::none() { out_ += 'N'; }
void PickleWriter::boolean(bool v) { out_ += static_cast<char>(v ? 0x88 : 0x89); }

void PickleWriter::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    out_ += 'K';
    out_ += static_cast<char>(v);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_ += 'J';
    for (int k = 0; k < 4; ++k) out_ += static_cast<char>((static_cast<uint32_t>(v) >> (8 * k)) & 255);
  } else {
    out_ += static_cast<char>(0x8a);  // LONG1, 8 bytes
    out_ += static_cast<char>(8);
    for (int k = 0; k < 8; ++k) out_ += static_cast<char>((static_cast<uint64_t>(v) >> (8 * k)) & 255);
  }
}

void PickleWriter::number(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  out_ += 'G';
  for (int k = 7; k >= 0; --k) out_ += static_cast<char>((bits >> (8 * k)) & 255);
}

// Strings and class references repeat in a .metadata (every chunk's field names, file, class):
// the first is stored in the memo (BINPUT), later ones read it back (BINGET).
bool PickleWriter::recall(const std::string& key) {
  auto it = memo_.find(key);
  if (it == memo_.end()) return false;
  const uint32_t i = it->second;
  out_ += i < 256 ? 'h' : 'j';
  for (int k = 0; k < (i < 256 ? 1 : 4); ++k) out_ += static_cast<char>((i >> (8 * k)) & 255);
  return true;
}

void PickleWriter::remember(const std::string& key) {
  const auto i = static_cast<uint32_t>(memo_.size());
  memo_[key] = i;
  out_ += i < 256 ? 'q' : 'r';
  for (int k = 0; k < (i < 256 ? 1 : 4); ++k) out_ += static_cast<char>((i >> (8 * k)) & 255);
}

void PickleWriter::str(const std::string& v) {
  if (recall("s" + v)) return;
  out_ += 'X';
  const auto n = static_cast<uint32_t>(v.size());
  for (int k = 0; k < 4; ++k) out_ += static_cast<char>((n >> (8 * k)) & 255);
  out_ += v;
  remember("s" + v);
}

void PickleWriter::global(const std::string& module, const std::string& name) {
  const std::string key = "g" + module + "\n" + name;
  if (recall(key)) return;
  out_ += 'c';
  out_ += module + "\n" + name + "\n";
  remember(key);
}

void PickleWriter::mark() { out_ += '('; }
void PickleWriter::tuple_from_mark() { out_ += 't'; }
void PickleWriter::tuple(int n) { out_ += static_cast<char>(n == 0 ? ')' : 0x84 + n); }
void PickleWriter::empty_list() { out_ += ']'; }
void PickleWriter::appends() { out_ += 'e'; }
void PickleWriter::empty_dict() { out_ += '}'; }
void PickleWriter::setitems() { out_ += 'u'; }
void PickleWriter::newobj() { out_ += static_cast<char>(0x81); }
void PickleWriter::reduce() { out_ += 'R'; }
void PickleWriter::build() { out_ += 'b'; }
void PickleWriter::binpersid() { out_ += 'Q'; }

void PickleWriter::ints(const std::vector<int64_t>& v) {
  mark();
  for (int64_t x : v) integer(x);
  tuple_from_mark();
}

void PickleWriter::size(const std::vector<int64_t>& v) {
  global("torch", "Size");
  ints(v);
  tuple(1);
  reduce();
}

}  // namespace fsdp::detail::pickle
