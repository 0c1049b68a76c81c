// pickle_reader.cpp — the pickle virtual machine, restricted to plain data.
//
// A stack machine over the opcodes Python writes for built-in containers and
// scalars. Anything that would name or call Python code is refused, so a
// hostile file can cost at most time and memory proportional to its size;
// the tree is destroyed iteratively, so deep nesting cannot overflow the stack.
#include "vramscope/replay/pickle_reader.hpp"
#include "vramscope/instrumentation/files.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "vramscope/allocator/errors.hpp"

namespace mem {

// --- PickleValue --------------------------------------------------------------

namespace {
// Moves the children of a container this value solely owns into `out`.
void steal_children(PickleValue& v, std::vector<PickleValue>& out, bool sole_owner) {
  if (!sole_owner) return;
  if (v.is_sequence()) {
    PickleList& list = v.mutable_list();
    for (PickleValue& child : list) out.push_back(std::move(child));
    list.clear();
  } else if (v.is_dict()) {
    PickleDict& dict = v.mutable_dict();
    for (auto& [key, value] : dict) {
      out.push_back(std::move(key));
      out.push_back(std::move(value));
    }
    dict.clear();
  }
}
}  // namespace

PickleValue::~PickleValue() {
  if (!is_sequence() && kind_ != Kind::Dict) return;
  const long owners = is_sequence() ? std::get<std::shared_ptr<PickleList>>(value_).use_count()
                                    : std::get<std::shared_ptr<PickleDict>>(value_).use_count();
  if (owners != 1) return;
  std::vector<PickleValue> work;
  steal_children(*this, work, true);
  while (!work.empty()) {
    PickleValue v = std::move(work.back());
    work.pop_back();
    if (v.is_sequence()) {
      steal_children(v, work, std::get<std::shared_ptr<PickleList>>(v.value_).use_count() == 1);
    } else if (v.is_dict()) {
      steal_children(v, work, std::get<std::shared_ptr<PickleDict>>(v.value_).use_count() == 1);
    }
  }  // each v dies here with no children left: no recursion
}

PickleValue PickleValue::boolean(bool v) {
  PickleValue p;
  p.kind_ = Kind::Bool;
  p.value_ = v;
  return p;
}
PickleValue PickleValue::integer(std::int64_t v) {
  PickleValue p;
  p.kind_ = Kind::Int;
  p.value_ = v;
  return p;
}
PickleValue PickleValue::big_integer(std::string bytes) {
  PickleValue p;
  p.kind_ = Kind::BigInt;
  p.value_ = std::move(bytes);
  return p;
}
PickleValue PickleValue::floating(double v) {
  PickleValue p;
  p.kind_ = Kind::Float;
  p.value_ = v;
  return p;
}
PickleValue PickleValue::string(std::string v) {
  PickleValue p;
  p.kind_ = Kind::String;
  p.value_ = std::move(v);
  return p;
}
PickleValue PickleValue::bytes(std::string v) {
  PickleValue p;
  p.kind_ = Kind::Bytes;
  p.value_ = std::move(v);
  return p;
}
PickleValue PickleValue::sequence(Kind kind) {
  PickleValue p;
  p.kind_ = kind;
  p.value_ = std::make_shared<PickleList>();
  return p;
}
PickleValue PickleValue::dict() {
  PickleValue p;
  p.kind_ = Kind::Dict;
  p.value_ = std::make_shared<PickleDict>();
  return p;
}

std::string_view PickleValue::kind_name() const noexcept {
  switch (kind_) {
    case Kind::None: return "None";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::Bytes: return "bytes";
    case Kind::List: return "list";
    case Kind::Tuple: return "tuple";
    case Kind::Dict: return "dict";
    case Kind::Set: return "set";
    case Kind::BigInt: return "int beyond 64 bits";
  }
  return "?";
}

namespace {
[[noreturn]] void wrong_kind(std::string_view want, const PickleValue& got) {
  throw Error("pickle value: expected " + std::string(want) + ", got " +
              std::string(got.kind_name()));
}
}  // namespace

bool PickleValue::as_bool() const {
  if (kind_ == Kind::Bool) return std::get<bool>(value_);
  if (kind_ == Kind::Int) return std::get<std::int64_t>(value_) != 0;
  wrong_kind("bool", *this);
}
std::int64_t PickleValue::as_int() const {
  if (kind_ == Kind::Int) return std::get<std::int64_t>(value_);
  if (kind_ == Kind::Bool) return std::get<bool>(value_) ? 1 : 0;
  if (kind_ == Kind::BigInt) {
    throw Error("pickle value: an integer of " + std::to_string(std::get<std::string>(value_).size()) +
                " bytes does not fit in 64 bits");
  }
  wrong_kind("int", *this);
}
std::size_t PickleValue::as_size() const {
  const std::int64_t v = as_int();
  if (v < 0) throw Error("pickle value: expected a non-negative int, got " + std::to_string(v));
  return static_cast<std::size_t>(v);
}
double PickleValue::as_float() const {
  if (kind_ == Kind::Float) return std::get<double>(value_);
  if (kind_ == Kind::Int) return static_cast<double>(std::get<std::int64_t>(value_));
  wrong_kind("float", *this);
}
const std::string& PickleValue::as_string() const {
  if (kind_ == Kind::String || kind_ == Kind::Bytes) return std::get<std::string>(value_);
  wrong_kind("str", *this);
}
const PickleList& PickleValue::as_list() const {
  if (is_sequence()) return *std::get<std::shared_ptr<PickleList>>(value_);
  wrong_kind("list", *this);
}
const PickleDict& PickleValue::as_dict() const {
  if (kind_ == Kind::Dict) return *std::get<std::shared_ptr<PickleDict>>(value_);
  wrong_kind("dict", *this);
}
const void* PickleValue::identity() const noexcept {
  if (const auto* l = std::get_if<std::shared_ptr<PickleList>>(&value_)) return l->get();
  if (const auto* d = std::get_if<std::shared_ptr<PickleDict>>(&value_)) return d->get();
  return nullptr;
}

PickleList& PickleValue::mutable_list() {
  if (is_sequence()) return *std::get<std::shared_ptr<PickleList>>(value_);
  wrong_kind("list", *this);
}
PickleDict& PickleValue::mutable_dict() {
  if (kind_ == Kind::Dict) return *std::get<std::shared_ptr<PickleDict>>(value_);
  wrong_kind("dict", *this);
}

const PickleValue* PickleValue::find(std::string_view key) const noexcept {
  if (kind_ != Kind::Dict) return nullptr;
  const PickleDict& d = *std::get<std::shared_ptr<PickleDict>>(value_);
  for (auto it = d.rbegin(); it != d.rend(); ++it) {
    if (it->first.kind_ == Kind::String && std::get<std::string>(it->first.value_) == key)
      return &it->second;
  }
  return nullptr;
}

const PickleValue& PickleValue::at(std::string_view key) const {
  if (kind_ != Kind::Dict) wrong_kind("dict with key '" + std::string(key) + "'", *this);
  if (const PickleValue* v = find(key)) return *v;
  throw Error("pickle value: dict has no key '" + std::string(key) + "'");
}

// --- the machine ----------------------------------------------------------------

namespace {

class Machine {
 public:
  explicit Machine(std::string_view data) : data_(data) {}

  PickleValue run() {
    if (data_.empty()) fail(0, "empty input: not a pickle");
    for (;;) {
      const std::size_t at = pos_;
      const auto op = static_cast<unsigned char>(byte(at));
      ++pos_;
      if (step(op, at)) break;
    }
    if (stack_.size() != 1 || !marks_.empty())
      fail(pos_ - 1, "STOP with " + std::to_string(stack_.size()) + " values on the stack");
    return std::move(stack_.back());
  }

 private:
  using Entry = PickleValue;

  [[noreturn]] void fail(std::size_t offset, const std::string& what) const {
    throw Error("pickle: byte offset " + std::to_string(offset) + ": " + what);
  }
  [[noreturn]] void refuse(std::size_t offset, const std::string& opname,
                           const std::string& detail = {}) const {
    throw Error("pickle: byte offset " + std::to_string(offset) + ": opcode " + opname +
                " refused" + detail +
                ": this reader builds plain data only (dict, list, tuple, set, str, bytes, "
                "int, float, bool, None) and never imports or calls Python objects");
  }

  char byte(std::size_t at) const {
    if (at >= data_.size()) fail(at, "unexpected end of data (truncated pickle?)");
    return data_[at];
  }
  std::string_view take(std::size_t n) {
    if (n > data_.size() - pos_)
      fail(pos_, "unexpected end of data: need " + std::to_string(n) + " bytes, " +
                     std::to_string(data_.size() - pos_) + " left (truncated pickle?)");
    std::string_view s = data_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::uint64_t le(std::size_t n) {
    std::string_view s = take(n);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= std::uint64_t{static_cast<unsigned char>(s[i])} << (8 * i);
    return v;
  }
  std::string_view line() {
    const std::size_t end = data_.find('\n', pos_);
    if (end == std::string_view::npos) fail(pos_, "unexpected end of data in a text argument");
    std::string_view s = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }

  void push(PickleValue v) { stack_.push_back(std::move(v)); }
  Entry pop(std::size_t at) {
    if (stack_.size() <= floor()) fail(at, "stack underflow");
    Entry e = std::move(stack_.back());
    stack_.pop_back();
    return e;
  }
  Entry& top(std::size_t at) {
    if (stack_.size() <= floor()) fail(at, "stack underflow");
    return stack_.back();
  }
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // Pops the items above the last MARK and the mark itself.
  std::vector<Entry> pop_mark(std::size_t at) {
    if (marks_.empty()) fail(at, "no MARK on the stack");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Entry> items(std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(m)),
                             std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return items;
  }
  static Entry container(PickleValue v, std::vector<Entry>& items) {
    PickleList& list = v.mutable_list();
    list.reserve(items.size());
    for (Entry& item : items) list.push_back(std::move(item));
    return v;
  }

  // The memo: Python's pickler numbers entries 0, 1, 2, ... (MEMOIZE is len(memo)), so a
  // vector holds them; a key far beyond the entries so far (only a hand-made stream has
  // one) goes to a map, so the vector never outgrows what the stream stored.
  void memo_put(std::uint64_t index, std::size_t at) {
    if (index < dense_.size() + 1024) {
      if (index >= dense_.size()) {
        dense_.resize(index + 1);
        stored_.resize(index + 1, false);
      }
      if (!stored_[index]) ++memo_count_;
      stored_[index] = true;
      dense_[index] = top(at);
      return;
    }
    if (memo_.insert_or_assign(index, top(at)).second) ++memo_count_;
  }
  void memo_get(std::uint64_t index, std::size_t at) {
    if (index < dense_.size() && stored_[index]) {
      stack_.push_back(dense_[index]);
    } else {
      auto it = memo_.find(index);
      if (it == memo_.end()) fail(at, "memo key " + std::to_string(index) + " was never stored");
      stack_.push_back(it->second);
    }
    note_shared(stack_.back());
  }

  // Cycles. Only a container referenced a second time (memo get, DUP) can end up inside
  // itself, and only when something is added to it afterwards: those additions are checked,
  // so a pickle that refers to itself is refused instead of leaking (shared ownership
  // cannot free a cycle). PyTorch's snapshots have none.
  void note_shared(const Entry& e) {
    if (const void* id = e.identity()) shared_.insert(id);
  }
  void refuse_cycle(const Entry& target, const Entry& item, std::size_t at) {
    const void* goal = target.identity();
    if (goal == nullptr || !shared_.contains(goal) || item.identity() == nullptr) return;
    std::unordered_set<const void*> seen;
    std::vector<const PickleValue*> todo{&item};
    while (!todo.empty()) {
      const PickleValue* v = todo.back();
      todo.pop_back();
      const void* id = v->identity();
      if (id == nullptr || !seen.insert(id).second) continue;
      if (id == goal) fail(at, "the pickle puts a container inside itself (a cycle); a snapshot has none");
      if (v->is_dict()) {
        for (const auto& [k, val] : v->as_dict()) todo.push_back(&val);
      } else {
        for (const PickleValue& x : v->as_list()) todo.push_back(&x);
      }
    }
  }

  /// LONG1 / LONG4: little-endian two's complement. Up to 8 significant bytes is an int;
  /// more is a BigInt (a value no field replay needs can hold).
  static PickleValue signed_long(std::string_view bytes) {
    if (bytes.empty()) return PickleValue::integer(0);
    std::size_t n = bytes.size();
    const bool negative = (static_cast<unsigned char>(bytes[n - 1]) & 0x80) != 0;
    const unsigned char pad = negative ? 0xff : 0x00;
    while (n > 8 && static_cast<unsigned char>(bytes[n - 1]) == pad) --n;
    if (n > 8 || (n == 8 && ((static_cast<unsigned char>(bytes[7]) & 0x80) != 0) != negative)) {
      return PickleValue::big_integer(std::string(bytes));
    }
    std::uint64_t v = negative ? ~std::uint64_t{0} : 0;
    for (std::size_t i = 0; i < n; ++i) {
      v &= ~(std::uint64_t{0xff} << (8 * i));
      v |= std::uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
    }
    return PickleValue::integer(static_cast<std::int64_t>(v));
  }

  std::int64_t parse_text_int(std::string_view s, std::size_t at) const {
    if (!s.empty() && s.back() == 'L') s.remove_suffix(1);  // Python 2 longs
    std::int64_t v = 0;
    bool neg = false;
    std::size_t i = 0;
    if (i < s.size() && (s[i] == '-' || s[i] == '+')) neg = s[i++] == '-';
    if (i == s.size()) fail(at, "malformed integer '" + std::string(s) + "'");
    for (; i < s.size(); ++i) {
      if (s[i] < '0' || s[i] > '9') fail(at, "malformed integer '" + std::string(s) + "'");
      if (v > (INT64_MAX - (s[i] - '0')) / 10)
        fail(at, "integer '" + std::string(s) + "' does not fit in 64 bits");
      v = v * 10 + (s[i] - '0');
    }
    return neg ? -v : v;
  }

  std::string text_string(std::string_view s, std::size_t at) const {
    // Protocol 0 STRING: a quoted Python repr. Accept the plain quoted form.
    if (s.size() < 2 || s.front() != s.back() || (s.front() != '\'' && s.front() != '"'))
      fail(at, "malformed STRING argument");
    std::string out;
    for (std::size_t i = 1; i + 1 < s.size(); ++i) {
      if (s[i] == '\\' && i + 2 < s.size()) {
        const char c = s[++i];
        out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c);
      } else {
        out.push_back(s[i]);
      }
    }
    return out;
  }

  // Executes one opcode; returns true at STOP.
  bool step(unsigned char op, std::size_t at) {
    switch (op) {
      // --- framing and protocol -------------------------------------------
      case 0x80: {  // PROTO
        const auto proto = static_cast<unsigned char>(take(1)[0]);
        if (proto > 5) fail(at, "pickle protocol " + std::to_string(proto) + " is newer than 5");
        return false;
      }
      case 0x95:  // FRAME: a length prefix only; the data follows inline
        take(8);
        return false;
      case '.':  // STOP
        return true;

      // --- stack manipulation ---------------------------------------------
      case '(':  // MARK
        marks_.push_back(stack_.size());
        return false;
      case '0':  // POP
        if (!marks_.empty() && marks_.back() == stack_.size()) {
          marks_.pop_back();  // POP of a bare mark, as Python allows
        } else {
          pop(at);
        }
        return false;
      case '1':  // POP_MARK
        pop_mark(at);
        return false;
      case '2':  // DUP
        stack_.push_back(top(at));
        note_shared(stack_.back());
        return false;

      // --- memo --------------------------------------------------------------
      case 'p': memo_put(static_cast<std::uint64_t>(parse_text_int(line(), at)), at); return false;
      case 'q': memo_put(le(1), at); return false;                          // BINPUT
      case 'r': memo_put(le(4), at); return false;                          // LONG_BINPUT
      case 0x94: memo_put(memo_count_, at); return false;                   // MEMOIZE
      case 'g': memo_get(static_cast<std::uint64_t>(parse_text_int(line(), at)), at); return false;
      case 'h': memo_get(le(1), at); return false;                          // BINGET
      case 'j': memo_get(le(4), at); return false;                          // LONG_BINGET

      // --- scalars -------------------------------------------------------------
      case 'N': push(PickleValue{}); return false;
      case 0x88: push(PickleValue::boolean(true)); return false;   // NEWTRUE
      case 0x89: push(PickleValue::boolean(false)); return false;  // NEWFALSE
      case 'J': push(PickleValue::integer(static_cast<std::int32_t>(le(4)))); return false;
      case 'K': push(PickleValue::integer(static_cast<std::int64_t>(le(1)))); return false;
      case 'M': push(PickleValue::integer(static_cast<std::int64_t>(le(2)))); return false;
      case 0x8a: {  // LONG1
        const std::size_t n = le(1);
        push(signed_long(take(n)));
        return false;
      }
      case 0x8b: {  // LONG4: the bytes are in the file, so its size bounds them
        const std::uint64_t n = le(4);
        push(signed_long(take(n)));
        return false;
      }
      case 'I': {  // INT (text); I00/I01 are False/True
        const std::string_view s = line();
        if (s == "00" || s == "01") {
          push(PickleValue::boolean(s == "01"));
        } else {
          push(PickleValue::integer(parse_text_int(s, at)));
        }
        return false;
      }
      case 'L': push(PickleValue::integer(parse_text_int(line(), at))); return false;
      case 'G': {  // BINFLOAT: big-endian IEEE 754 double
        const std::string_view s = take(8);
        std::uint64_t bits = 0;
        for (char c : s) bits = (bits << 8) | static_cast<unsigned char>(c);
        push(PickleValue::floating(std::bit_cast<double>(bits)));
        return false;
      }
      case 'F': {  // FLOAT (text)
        const std::string s(line());
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) fail(at, "malformed FLOAT '" + s + "'");
        push(PickleValue::floating(v));
        return false;
      }

      // --- strings and bytes -------------------------------------------------
      case 0x8c: push(PickleValue::string(std::string(take(le(1))))); return false;  // SHORT_BINUNICODE
      case 'X': push(PickleValue::string(std::string(take(le(4))))); return false;   // BINUNICODE
      case 0x8d: push(PickleValue::string(std::string(take(le(8))))); return false;  // BINUNICODE8
      case 'U': push(PickleValue::string(std::string(take(le(1))))); return false;   // SHORT_BINSTRING
      case 'T': push(PickleValue::string(std::string(take(le(4))))); return false;   // BINSTRING
      case 'S': push(PickleValue::string(text_string(line(), at))); return false;    // STRING
      case 'V': push(PickleValue::string(std::string(line()))); return false;        // UNICODE (raw)
      case 'C': push(PickleValue::bytes(std::string(take(le(1))))); return false;    // SHORT_BINBYTES
      case 'B': push(PickleValue::bytes(std::string(take(le(4))))); return false;    // BINBYTES
      case 0x8e: push(PickleValue::bytes(std::string(take(le(8))))); return false;   // BINBYTES8
      case 0x96: push(PickleValue::bytes(std::string(take(le(8))))); return false;   // BYTEARRAY8

      // --- containers ----------------------------------------------------------
      case ']': push(PickleValue::sequence(PickleValue::Kind::List)); return false;  // EMPTY_LIST
      case ')': push(PickleValue::sequence(PickleValue::Kind::Tuple)); return false; // EMPTY_TUPLE
      case '}': push(PickleValue::dict()); return false;                              // EMPTY_DICT
      case 0x8f: push(PickleValue::sequence(PickleValue::Kind::Set)); return false;  // EMPTY_SET
      case 'l': {  // LIST
        auto items = pop_mark(at);
        stack_.push_back(container(PickleValue::sequence(PickleValue::Kind::List), items));
        return false;
      }
      case 't': {  // TUPLE
        auto items = pop_mark(at);
        stack_.push_back(container(PickleValue::sequence(PickleValue::Kind::Tuple), items));
        return false;
      }
      case 0x91: {  // FROZENSET
        auto items = pop_mark(at);
        stack_.push_back(container(PickleValue::sequence(PickleValue::Kind::Set), items));
        return false;
      }
      case 0x85: case 0x86: case 0x87: {  // TUPLE1, TUPLE2, TUPLE3
        const std::size_t n = op - 0x84u;
        if (stack_.size() < floor() + n) fail(at, "stack underflow");
        std::vector<Entry> items(std::make_move_iterator(stack_.end() - static_cast<std::ptrdiff_t>(n)),
                                 std::make_move_iterator(stack_.end()));
        stack_.resize(stack_.size() - n);
        stack_.push_back(container(PickleValue::sequence(PickleValue::Kind::Tuple), items));
        return false;
      }
      case 'a': {  // APPEND
        Entry item = pop(at);
        Entry& list = top(at);
        append(list, std::move(item), at);
        return false;
      }
      case 'e':    // APPENDS
      case 0x90: { // ADDITEMS
        auto items = pop_mark(at);
        Entry& list = top(at);
        for (Entry& item : items) append(list, std::move(item), at);
        return false;
      }
      case 'd': {  // DICT
        auto items = pop_mark(at);
        if (items.size() % 2 != 0) fail(at, "DICT with an odd number of items");
        Entry d = PickleValue::dict();
        fill_dict(d, items, at);
        stack_.push_back(std::move(d));
        return false;
      }
      case 's': {  // SETITEM
        Entry value = pop(at);
        Entry key = pop(at);
        Entry& d = top(at);
        std::vector<Entry> items;
        items.push_back(std::move(key));
        items.push_back(std::move(value));
        fill_dict(d, items, at);
        return false;
      }
      case 'u': {  // SETITEMS
        auto items = pop_mark(at);
        if (items.size() % 2 != 0) fail(at, "SETITEMS with an odd number of items");
        fill_dict(top(at), items, at);
        return false;
      }

      // --- everything that names or calls Python code -------------------------
      case 'c': {  // GLOBAL module\nname\n
        const std::string module(line());
        const std::string name(line());
        refuse(at, "GLOBAL", " (it names '" + module + "." + name + "')");
      }
      case 0x93: {  // STACK_GLOBAL
        std::string detail;
        if (stack_.size() >= 2 && stack_[stack_.size() - 2].is_string() &&
            stack_.back().is_string())
          detail = " (it names '" + stack_[stack_.size() - 2].as_string() + "." +
                   stack_.back().as_string() + "')";
        refuse(at, "STACK_GLOBAL", detail);
      }
      case 'R': refuse(at, "REDUCE");
      case 'b': refuse(at, "BUILD");
      case 'i': refuse(at, "INST");
      case 'o': refuse(at, "OBJ");
      case 0x81: refuse(at, "NEWOBJ");
      case 0x92: refuse(at, "NEWOBJ_EX");
      case 0x82: case 0x83: case 0x84: refuse(at, "EXT");
      case 'P': refuse(at, "PERSID");
      case 'Q': refuse(at, "BINPERSID");
      case 0x97: refuse(at, "NEXT_BUFFER");
      case 0x98: refuse(at, "READONLY_BUFFER");
      default: {
        std::ostringstream os;
        os << "unknown opcode 0x" << std::hex << static_cast<int>(op) << " (not a pickle, or corrupt)";
        fail(at, os.str());
      }
    }
  }

  void append(Entry& list, Entry item, std::size_t at) {
    if (!list.is_sequence() || list.kind() == PickleValue::Kind::Tuple)
      fail(at, "append to a " + std::string(list.kind_name()));
    refuse_cycle(list, item, at);
    list.mutable_list().push_back(std::move(item));
  }

  void fill_dict(Entry& d, std::vector<Entry>& items, std::size_t at) {
    if (!d.is_dict()) fail(at, "set an item on a " + std::string(d.kind_name()));
    PickleDict& dict = d.mutable_dict();
    for (std::size_t i = 0; i + 1 < items.size(); i += 2) {
      const auto k = items[i].kind();
      if (k == PickleValue::Kind::List || k == PickleValue::Kind::Dict || k == PickleValue::Kind::Set)
        fail(at, "unhashable dict key of type " + std::string(items[i].kind_name()));
      refuse_cycle(d, items[i + 1], at);
      dict.emplace_back(std::move(items[i]), std::move(items[i + 1]));
    }
  }

  std::string_view data_;
  std::size_t pos_ = 0;
  std::vector<Entry> stack_;
  std::vector<std::size_t> marks_;  // stack heights at each MARK
  std::vector<Entry> dense_;
  std::vector<bool> stored_;
  std::unordered_map<std::uint64_t, Entry> memo_;  // keys far beyond dense_
  std::uint64_t memo_count_ = 0;                   // distinct keys stored (len(memo))
  std::unordered_set<const void*> shared_;         // containers referenced a second time
};

}  // namespace

PickleValue read_pickle(std::string_view data) {
  Machine m{data};
  return m.run();
}

std::string read_pickle_bytes(const std::string& path) {
  check_input_file(path, "the pickle");
  std::error_code ec;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open '" + path + "' for reading");
  std::string data;
  // One allocation (growing by doubling would briefly hold twice the file).
  if (const auto size = std::filesystem::file_size(path, ec); !ec) data.reserve(size);
  // A read error is never taken for the end of the file (then "truncated pickle"): the
  // stream buffer throws it (libstdc++) or the stream says so.
  try {
    char chunk[1 << 16];
    while (in.read(chunk, sizeof chunk) || in.gcount() > 0) data.append(chunk, static_cast<std::size_t>(in.gcount()));
  } catch (const std::exception& e) {
    throw Error(path + ": read error (" + e.what() + ")");
  }
  if (in.bad()) throw Error(path + ": read error after " + std::to_string(data.size()) + " bytes");
  return data;
}

PickleValue read_pickle_file(const std::string& path) {
  const std::string data = read_pickle_bytes(path);
  try {
    return read_pickle(data);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

}  // namespace mem
