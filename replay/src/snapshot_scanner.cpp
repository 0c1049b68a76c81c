// snapshot_scanner.cpp — one pass over a snapshot pickle: trace entries straight to
// RecordedEvents, segments' blocks to ScannedBlocks, everything else to PickleValues. Opcodes as in Python's
// Lib/pickle.py (protocols 2 to 5).
#include "snapshot_scanner.hpp"

#include <bit>
#include <cstdint>
#include <cstring>
#include <unordered_map>

namespace mem::detail {
namespace {

struct GiveUp {};  // not for the fast path: the caller runs the generic reader

/// A stack or memo entry: a scalar, a view of a string in the pickle's bytes, or the
/// id of a container. 16 bytes, never an allocation.
struct Value {
  enum Kind : std::uint8_t { Mark, None, Bool, Int, BigInt, Float, Str, List, Tuple, Dict, Event, Block };
  Kind kind = None;
  std::uint32_t len = 0;  // Str, BigInt: byte count
  union {
    std::int64_t i = 0;   // Int, Bool
    double f;             // Float
    const char* s;        // Str, BigInt
    std::uint32_t id;     // List, Tuple, Dict: container; Event: index in events_; Block: in blocks_
  };
  static Value of(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
};
static_assert(sizeof(Value) == 16);

/// What a list is to the snapshot: device_traces (the root of the traces), one GPU's
/// trace, a segment's blocks, or anything else.
enum class Role : std::uint8_t { Generic, Traces, DeviceTrace, Blocks };

/// Items no tuple, dict or generic list may hold: they are read into structs, not values.
bool scanned_item(const Value& v) { return v.kind == Value::Event || v.kind == Value::Block; }

class Scanner {
 public:
  Scanner(std::string_view data, const std::function<void(const char*)>& progress)
      : begin_(data.data()), p_(data.data()), end_(data.data() + data.size()), progress_(progress) {
    // Room for as many trace entries and memo entries as the bytes could hold (an entry
    // takes some 40 bytes or more): the vectors then never move, and what is not filled
    // is address space, not memory.
    events_.reserve(data.size() / 32);
    blocks_.reserve(data.size() / 32);
    memo_.reserve(data.size() / 8);
  }

  ScannedSnapshot run() {
    if (byte() != 0x80) throw GiveUp{};
    const unsigned proto = byte();
    if (proto < 2 || proto > 5) throw GiveUp{};
    std::ptrdiff_t next_report = kReportEvery;  // an offset: p_ + kReportEvery may lie past the end
    for (;;) {
      if (p_ - begin_ >= next_report && progress_) [[unlikely]] {
        progress_(p_);
        next_report = (p_ - begin_) + kReportEvery;
      }
      const unsigned op = byte();
      switch (op) {
        case 0x95: skip(8); break;  // FRAME: a length, for buffered readers
        case '.': return finish();  // STOP
        case '(': marks_.push_back(stack_.size()); push(Value::of(Value::Mark)); break;
        case 'N': push(Value::of(Value::None)); break;
        case 0x88: push(scalar(Value::Bool, 1)); break;  // NEWTRUE
        case 0x89: push(scalar(Value::Bool, 0)); break;  // NEWFALSE
        case 'K': push(scalar(Value::Int, byte())); break;  // BININT1
        case 'M': push(scalar(Value::Int, static_cast<std::int64_t>(le(2)))); break;  // BININT2
        case 'J': push(scalar(Value::Int, static_cast<std::int32_t>(le(4)))); break;  // BININT
        case 0x8a: long1(); break;
        case 'G': {  // BINFLOAT: big-endian IEEE 754
          std::uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = bits << 8 | byte();
          Value v = Value::of(Value::Float);
          v.f = std::bit_cast<double>(bits);
          push(v);
          break;
        }
        case 0x8c: str(byte()); break;      // SHORT_BINUNICODE
        case 'X': str(le(4)); break;        // BINUNICODE
        case 0x8d: str(le(8)); break;       // BINUNICODE8
        case ']': new_list(Value::List); break;   // EMPTY_LIST
        case ')': push(container(Value::Tuple)); break;  // EMPTY_TUPLE
        case '}': new_dict(); break;        // EMPTY_DICT
        case 't': tuple(pop_mark(), true); break;        // TUPLE
        case 0x85: tuple(stack_.size() - 1, false); break;  // TUPLE1
        case 0x86: tuple(stack_.size() - 2, false); break;  // TUPLE2
        case 0x87: tuple(stack_.size() - 3, false); break;  // TUPLE3
        case 'a': append(stack_.size() - 1, false); break;  // APPEND
        case 'e': append(pop_mark(), true); break;          // APPENDS
        case 's': setitems(stack_.size() - 2, false); break;  // SETITEM
        case 'u': setitems(pop_mark(), true); break;          // SETITEMS
        case 0x94: memo_put(memo_count_); break;       // MEMOIZE: len(memo), the keys stored
        case 'q': memo_put(byte()); break;             // BINPUT
        case 'r': memo_put(le(4)); break;              // LONG_BINPUT
        case 'h': memo_get(byte()); break;             // BINGET
        case 'j': memo_get(le(4)); break;              // LONG_BINGET
        default: throw GiveUp{};  // anything a snapshot does not need: the generic reader decides
      }
    }
  }

 private:
  // --- the byte stream ---------------------------------------------------------------
  unsigned byte() {
    if (p_ == end_) throw GiveUp{};
    return static_cast<unsigned char>(*p_++);
  }
  void skip(std::size_t n) {
    if (static_cast<std::size_t>(end_ - p_) < n) throw GiveUp{};
    p_ += n;
  }
  std::uint64_t le(int n) {
    if (end_ - p_ < n) throw GiveUp{};
    std::uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) v = v << 8 | static_cast<unsigned char>(p_[k]);
    p_ += n;
    return v;
  }

  // --- values ------------------------------------------------------------------------
  static Value scalar(Value::Kind kind, std::int64_t i) {
    Value v = Value::of(kind);
    v.i = i;
    return v;
  }
  void push(const Value& v) {
    if (stack_.size() >= kMaxStack) throw GiveUp{};
    stack_.push_back(v);
  }
  Value& top() {
    if (stack_.empty() || stack_.back().kind == Value::Mark) throw GiveUp{};
    return stack_.back();
  }
  /// The value below position `at`, skipping the one MARK a batch opens with.
  const Value* before(std::size_t at) const {
    if (at == 0) return nullptr;
    const Value* v = &stack_[at - 1];
    if (v->kind == Value::Mark) v = at >= 2 ? &stack_[at - 2] : nullptr;
    return v;
  }
  std::size_t pop_mark() {
    if (marks_.empty()) throw GiveUp{};
    const std::size_t at = marks_.back();
    marks_.pop_back();
    return at;  // the MARK's position; items follow it
  }
  void long1() {  // LONG1: little-endian two's complement of n bytes
    std::size_t n = byte();
    if (static_cast<std::size_t>(end_ - p_) < n) throw GiveUp{};
    if (n > 8) {
      // As the generic reader: sign padding beyond 8 bytes is dropped; what still does not
      // fit in 64 bits is a BigInt.
      std::size_t used = n;
      const bool negative = (static_cast<unsigned char>(p_[n - 1]) & 0x80) != 0;
      const unsigned char pad = negative ? 0xff : 0x00;
      while (used > 8 && static_cast<unsigned char>(p_[used - 1]) == pad) --used;
      if (used > 8 || ((static_cast<unsigned char>(p_[7]) & 0x80) != 0) != negative) {
        Value v = Value::of(Value::BigInt);
        v.s = p_;
        v.len = static_cast<std::uint32_t>(n);
        p_ += n;
        push(v);
        return;
      }
      std::uint64_t u = 0;
      for (std::size_t k = 8; k-- > 0;) u = u << 8 | static_cast<unsigned char>(p_[k]);
      p_ += n;
      push(scalar(Value::Int, static_cast<std::int64_t>(u)));
      return;
    }
    std::uint64_t u = 0;
    for (std::size_t k = n; k-- > 0;) u = u << 8 | static_cast<unsigned char>(p_[k]);
    if (n > 0 && n < 8 && (static_cast<unsigned char>(p_[n - 1]) & 0x80)) u |= ~std::uint64_t{0} << (8 * n);
    p_ += n;
    push(scalar(Value::Int, static_cast<std::int64_t>(u)));
  }
  void str(std::uint64_t n) {
    if (static_cast<std::uint64_t>(end_ - p_) < n || n > UINT32_MAX) throw GiveUp{};
    Value v = Value::of(Value::Str);
    v.s = p_;
    v.len = static_cast<std::uint32_t>(n);
    p_ += n;
    push(v);
  }
  static std::string_view view(const Value& v) { return {v.s, v.len}; }

  Value container(Value::Kind kind) {
    Value v = Value::of(kind);
    if (kind == Value::Dict) {
      v.id = static_cast<std::uint32_t>(dicts_.size());
      dicts_.emplace_back();
    } else {
      v.id = static_cast<std::uint32_t>(lists_.size());
      lists_.emplace_back();
      roles_.push_back(Role::Generic);
    }
    if (lists_.size() + dicts_.size() > kMaxContainers) throw GiveUp{};
    return v;
  }
  void new_list(Value::Kind kind) {
    // A list right after the key "device_traces" holds the traces; a list inside that one
    // (after it, or after the GPU before it) is one GPU's trace.
    const Value* prev = before(stack_.size());
    Role role = Role::Generic;
    if (prev != nullptr && prev->kind == Value::Str && view(*prev) == "device_traces") {
      if (++traces_lists_ > 1) throw GiveUp{};  // one device_traces, the root's
      role = Role::Traces;
    }
    if (prev != nullptr && prev->kind == Value::List &&
        (roles_[prev->id] == Role::Traces || roles_[prev->id] == Role::DeviceTrace)) {
      role = Role::DeviceTrace;
    }
    // A list under the key "blocks" (a segment's) holds block dicts.
    if (prev != nullptr && prev->kind == Value::Str && view(*prev) == "blocks") role = Role::Blocks;
    Value v = container(kind);
    roles_[v.id] = role;
    push(v);
  }
  void new_dict() {
    // A dict inside a GPU's trace (after the trace, or after the entry before it) is a
    // trace entry: it becomes an event, not a dict.
    const Value* prev = before(stack_.size());
    if (prev != nullptr && (prev->kind == Value::Event ||
                            (prev->kind == Value::List && roles_[prev->id] == Role::DeviceTrace))) {
      if (events_.size() >= UINT32_MAX) throw GiveUp{};
      Value v = Value::of(Value::Event);
      v.id = static_cast<std::uint32_t>(events_.size());
      events_.emplace_back();
      filled_.push_back(false);
      push(v);
      return;
    }
    // Likewise a dict inside a segment's blocks is a block.
    if (prev != nullptr && (prev->kind == Value::Block ||
                            (prev->kind == Value::List && roles_[prev->id] == Role::Blocks))) {
      if (blocks_.size() >= UINT32_MAX) throw GiveUp{};
      Value v = Value::of(Value::Block);
      v.id = static_cast<std::uint32_t>(blocks_.size());
      blocks_.emplace_back();
      push(v);
      return;
    }
    push(container(Value::Dict));
  }
  /// Items from `from` to the top; `marked`: `from` is the MARK that opened them.
  std::size_t first_item(std::size_t from, bool marked) const {
    if (from > stack_.size() || (marked && stack_[from].kind != Value::Mark)) throw GiveUp{};
    return marked ? from + 1 : from;
  }
  void tuple(std::size_t from, bool marked) {
    const std::size_t first = first_item(from, marked);
    Value t = container(Value::Tuple);
    for (std::size_t k = first; k < stack_.size(); ++k) {
      if (stack_[k].kind == Value::Mark || scanned_item(stack_[k])) throw GiveUp{};
      lists_[t.id].push_back(stack_[k]);
    }
    stack_.resize(from);
    push(t);
  }
  void append(std::size_t from, bool marked) {
    const std::size_t first = first_item(from, marked);
    if (from == 0) throw GiveUp{};
    const Value& target = stack_[from - 1];
    if (target.kind != Value::List) throw GiveUp{};
    const Role role = roles_[target.id];
    auto& items = lists_[target.id];
    for (std::size_t k = first; k < stack_.size(); ++k) {
      const Value& item = stack_[k];
      if (item.kind == Value::Mark) throw GiveUp{};
      if (role == Role::DeviceTrace) {
        // A GPU's trace holds its entries, each filled, in the order they were made.
        if (item.kind != Value::Event || !filled_[item.id]) throw GiveUp{};
        auto& range = device_range_[target.id];
        if (range.second == 0) range.first = item.id;
        if (item.id != range.first + range.second) throw GiveUp{};
        ++range.second;
      } else if (role == Role::Blocks) {
        // A segment's blocks, each filled, in the order they were made (as a GPU's trace).
        if (item.kind != Value::Block || !blocks_[item.id].filled) throw GiveUp{};
        auto& range = block_range_[target.id];
        if (range.second == 0) range.first = item.id;
        if (item.id != range.first + range.second) throw GiveUp{};
        ++range.second;
      } else {
        if (scanned_item(item)) throw GiveUp{};
        if (role == Role::Traces && (item.kind != Value::List || roles_[item.id] != Role::DeviceTrace)) throw GiveUp{};
        items.push_back(item);
      }
    }
    stack_.resize(from);
  }
  void setitems(std::size_t from, bool marked) {
    const std::size_t first = first_item(from, marked);
    if (from == 0 || (stack_.size() - first) % 2 != 0) throw GiveUp{};
    const Value& target = stack_[from - 1];
    if (target.kind == Value::Event) {
      if (filled_[target.id]) throw GiveUp{};  // filled twice: not a trace entry as PyTorch writes them
      fill_event(events_[target.id], first);
      filled_[target.id] = true;
    } else if (target.kind == Value::Block) {
      if (blocks_[target.id].filled) throw GiveUp{};
      fill_block(blocks_[target.id], first);
    } else if (target.kind == Value::Dict) {
      auto& items = dicts_[target.id];
      for (std::size_t k = first; k < stack_.size(); ++k) {
        const Value::Kind kind = stack_[k].kind;
        if (kind == Value::Mark || scanned_item(stack_[k])) throw GiveUp{};
        // A list or dict as a key is unhashable: the generic reader refuses it.
        if ((k - first) % 2 == 0 && (kind == Value::List || kind == Value::Dict)) throw GiveUp{};
        items.push_back(stack_[k]);
      }
    } else {
      throw GiveUp{};
    }
    stack_.resize(from);
  }
  /// A trace entry's fields, read as the generic reader reads them (trace_reader.cpp's
  /// read_event_fields); anything it would question sends the file there.
  void fill_event(RecordedEvent& e, std::size_t first) {
    bool has_action = false, has_addr = false, has_size = false;
    for (std::size_t k = first; k < stack_.size(); k += 2) {
      const Value& key = stack_[k];
      const Value& v = stack_[k + 1];
      if (key.kind != Value::Str) throw GiveUp{};
      const std::string_view name = view(key);
      const bool integer = v.kind == Value::Int || v.kind == Value::Bool;
      if (name == "action") {
        if (v.kind != Value::Str || !action(view(v), e.action)) throw GiveUp{};
        has_action = true;
      } else if (name == "addr") {
        if (!integer) throw GiveUp{};
        e.address = static_cast<std::uintptr_t>(v.i);
        has_addr = true;
      } else if (name == "size") {
        if (!integer || v.i < 0) throw GiveUp{};
        e.size = static_cast<std::size_t>(v.i);
        has_size = true;
      } else if (name == "stream") {
        if (!integer) throw GiveUp{};
        e.stream = static_cast<std::uint64_t>(v.i);
      } else if (name == "time_us") {
        if (v.kind == Value::Float) {
          e.time_us = v.f;
        } else if (v.kind == Value::Int) {  // as_float: a float or an int, not a bool
          e.time_us = static_cast<double>(v.i);
        } else if (v.kind == Value::None) {
          e.time_us = 0;  // a later key wins, as in the generic reader's lookup
        } else {
          throw GiveUp{};
        }
      } else if (name == "frames") {
        if (v.kind == Value::List || v.kind == Value::Tuple) {
          e.stack = frames_id(v.id);
        } else {
          throw GiveUp{};
        }
      }
      // Other keys (device_free, compile_context, user_metadata, ...) are not read.
    }
    if (!has_action || !has_size || (e.action != RecordedAction::Oom && !has_addr)) throw GiveUp{};
    if (e.action == RecordedAction::Oom) e.address = 0;  // an oom entry's address is not read
  }
  /// A block's fields, as trace_reader.cpp's read_segment reads them: size and state
  /// required, address and requested_size optional, the rest (frames) not read.
  void fill_block(ScannedBlock& b, std::size_t first) {
    bool has_size = false, has_state = false;
    for (std::size_t k = first; k < stack_.size(); k += 2) {
      const Value& key = stack_[k];
      const Value& v = stack_[k + 1];
      if (key.kind != Value::Str) throw GiveUp{};
      const std::string_view name = view(key);
      const bool size = (v.kind == Value::Int || v.kind == Value::Bool) && v.i >= 0;  // as_size()
      if (name == "size") {
        if (!size) throw GiveUp{};
        b.block.size = static_cast<std::size_t>(v.i);
        has_size = true;
      } else if (name == "address") {
        if (!size) throw GiveUp{};
        b.block.address = static_cast<std::uintptr_t>(v.i);
        b.has_address = true;
      } else if (name == "requested_size") {
        if (!size) throw GiveUp{};
        b.block.requested_size = static_cast<std::size_t>(v.i);
      } else if (name == "state") {
        if (v.kind != Value::Str) throw GiveUp{};
        const std::string_view state = view(v);
        if (state == "active_allocated") {
          b.block.state = BlockState::ActiveAllocated;
        } else if (state == "active_pending_free") {
          b.block.state = BlockState::ActivePendingFree;
        } else if (state == "inactive") {
          b.block.state = BlockState::Inactive;
        } else {
          throw GiveUp{};  // the generic reader names the state it does not know
        }
        has_state = true;
      }
    }
    if (!has_size || !has_state) throw GiveUp{};
    b.filled = true;
  }
  static bool action(std::string_view name, RecordedAction& out) {
    for (int a = 0; a <= static_cast<int>(RecordedAction::Snapshot); ++a) {
      if (recorded_action_name(static_cast<RecordedAction>(a)) == name) {
        out = static_cast<RecordedAction>(a);
        return true;
      }
    }
    return false;
  }
  /// 1 + the frames list's index (its items may still grow through the memo: whether it is
  /// empty is the stack table's question, asked once the scan is done).
  std::uint32_t frames_id(std::uint32_t list) {
    const auto [it, fresh] = frames_index_.emplace(list, static_cast<std::uint32_t>(frames_lists_.size() + 1));
    if (fresh) frames_lists_.push_back(list);
    return it->second;
  }
  // The memo: one word per entry (a snapshot memoizes every string and container, several
  // per trace entry). A string is where its bytes lie in the pickle; a container or trace
  // entry its kind and id; anything else an index into memo_values_.
  static constexpr std::uint64_t kUnset = ~std::uint64_t{0};
  static constexpr std::uint64_t kTagShift = 62;
  static constexpr std::uint64_t kString = 0, kContainer = 1, kOther = 2;
  static constexpr unsigned kLenBits = 22;  // longer strings go to memo_values_

  std::uint64_t memo_word(const Value& v) {
    if (v.kind == Value::Str) {
      const auto offset = static_cast<std::uint64_t>(v.s - begin_);
      if (v.len < (1u << kLenBits) && offset < (std::uint64_t{1} << (kTagShift - kLenBits))) {
        return kString << kTagShift | offset << kLenBits | v.len;
      }
    }
    if (v.kind == Value::List || v.kind == Value::Tuple || v.kind == Value::Dict || v.kind == Value::Event) {
      return kContainer << kTagShift | std::uint64_t{v.kind} << 32 | v.id;
    }
    memo_values_.push_back(v);
    return kOther << kTagShift | (memo_values_.size() - 1);
  }
  Value memo_value(std::uint64_t word) const {
    const std::uint64_t tag = word >> kTagShift;
    const std::uint64_t payload = word & ((std::uint64_t{1} << kTagShift) - 1);
    if (tag == kString) {
      Value v = Value::of(Value::Str);
      v.s = begin_ + (payload >> kLenBits);
      v.len = static_cast<std::uint32_t>(payload & ((1u << kLenBits) - 1));
      return v;
    }
    if (tag == kContainer) {
      Value v = Value::of(static_cast<Value::Kind>(payload >> 32));
      v.id = static_cast<std::uint32_t>(payload);
      return v;
    }
    return memo_values_[payload];
  }
  void memo_put(std::uint64_t index) {
    // Python's pickler numbers entries 0, 1, 2, ...: a key far beyond them (a hand-made or
    // damaged stream) is the generic reader's, which keeps such keys in a map.
    if (index >= memo_.size() + 1024) throw GiveUp{};
    if (index >= memo_.size()) memo_.resize(index + 1, kUnset);
    if (memo_[index] == kUnset) ++memo_count_;
    memo_[index] = memo_word(top());
  }
  void memo_get(std::uint64_t index) {
    if (index >= memo_.size() || memo_[index] == kUnset) throw GiveUp{};
    const Value v = memo_value(memo_[index]);
    // A trace entry, a block, a trace or a segment's blocks shared a second time is not
    // what PyTorch writes.
    if (scanned_item(v) || (v.kind == Value::List && roles_[v.id] != Role::Generic)) throw GiveUp{};
    push(v);
  }

  // --- the result ----------------------------------------------------------------------
  ScannedSnapshot finish() {
    if (stack_.size() != 1 || !marks_.empty() || stack_[0].kind != Value::Dict) throw GiveUp{};
    // The traces read must be the root's device_traces (its last such key, as lookups go).
    const auto& root = dicts_[stack_[0].id];
    const Value* traces = nullptr;
    for (std::size_t k = 0; k + 1 < root.size(); k += 2) {
      if (root[k].kind == Value::Str && view(root[k]) == "device_traces") traces = &root[k + 1];
    }
    const bool traces_read = traces != nullptr && traces->kind == Value::List && roles_[traces->id] == Role::Traces;
    if (traces_lists_ > 0 && !traces_read) throw GiveUp{};
    refuse_cycles();
    ScannedSnapshot out;
    out.root = convert(stack_[0], 0);
    // Every trace entry belongs to a GPU's trace under the root's device_traces.
    std::size_t placed = 0;
    for (const auto& range : device_ranges_) placed += range.second;
    if (placed != events_.size()) throw GiveUp{};
    for (std::uint32_t list : frames_lists_) out.frames.push_back(convert_list(list, Value::List, 1));
    out.events = std::move(events_);
    out.device_ranges = std::move(device_ranges_);
    out.blocks = std::move(blocks_of_);
    return out;
  }
  /// A container inside itself, reachable from the root or not, is refused by the generic
  /// reader (shared ownership could not free it): give way to it. Depth-first, iterative.
  void refuse_cycles() const {
    const std::size_t lists = lists_.size();
    std::vector<std::uint8_t> state(lists + dicts_.size(), 0);  // 0 new, 1 on the path, 2 done
    const auto node = [&](const Value& v) -> std::size_t {
      if (v.kind == Value::List || v.kind == Value::Tuple) return v.id;
      if (v.kind == Value::Dict) return lists + v.id;
      return SIZE_MAX;
    };
    const auto children = [&](std::size_t n) -> const std::vector<Value>& {
      return n < lists ? lists_[n] : dicts_[n - lists];
    };
    std::vector<std::pair<std::size_t, std::size_t>> path;  // node, next child
    for (std::size_t start = 0; start < state.size(); ++start) {
      if (state[start] != 0) continue;
      state[start] = 1;
      path.emplace_back(start, 0);
      while (!path.empty()) {
        auto& [n, i] = path.back();
        const std::vector<Value>& items = children(n);
        if (i == items.size()) {
          state[n] = 2;
          path.pop_back();
          continue;
        }
        const std::size_t c = node(items[i++]);
        if (c == SIZE_MAX || state[c] == 2) continue;
        if (state[c] == 1) throw GiveUp{};
        state[c] = 1;
        path.emplace_back(c, 0);
      }
    }
  }

  PickleValue convert(const Value& v, int depth) {
    if (depth > kMaxDepth) throw GiveUp{};  // deep nesting or a cycle: the generic reader's case
    switch (v.kind) {
      case Value::None: return PickleValue{};
      case Value::Bool: return PickleValue::boolean(v.i != 0);
      case Value::Int: return PickleValue::integer(v.i);
      case Value::BigInt: return PickleValue::big_integer(std::string(v.s, v.len));
      case Value::Float: return PickleValue::floating(v.f);
      case Value::Str: return PickleValue::string(std::string(v.s, v.len));
      case Value::List:
      case Value::Tuple: return convert_list(v.id, v.kind, depth);
      case Value::Dict: {
        // refuse_cycles() ran first: a container met again here is shared, never its own part.
        if (auto it = dict_done_.find(v.id); it != dict_done_.end()) return it->second;
        PickleValue d = PickleValue::dict();
        dict_done_.emplace(v.id, d);
        auto& items = d.mutable_dict();
        const auto& pairs = dicts_[v.id];
        items.reserve(pairs.size() / 2);
        for (std::size_t k = 0; k + 1 < pairs.size(); k += 2) {
          items.emplace_back(convert(pairs[k], depth + 1), convert(pairs[k + 1], depth + 1));
        }
        return d;
      }
      default: throw GiveUp{};
    }
  }
  PickleValue convert_list(std::uint32_t id, Value::Kind kind, int depth) {
    if (auto it = list_done_.find(id); it != list_done_.end()) return it->second;
    PickleValue l = PickleValue::sequence(kind == Value::Tuple ? PickleValue::Kind::Tuple : PickleValue::Kind::List);
    list_done_.emplace(id, l);
    auto& items = l.mutable_list();
    if (roles_[id] == Role::Traces) {
      // device_traces: an empty list per GPU; the GPU's events go to device_events.
      for (const Value& gpu : lists_[id]) {
        items.push_back(PickleValue::sequence(PickleValue::Kind::List));
        device_ranges_.push_back(device_range_[gpu.id]);
      }
      return l;
    }
    if (roles_[id] == Role::Blocks) {
      // A segment's blocks: an empty list, the blocks read are under its identity.
      auto& blocks = blocks_of_[l.identity()];
      const auto range = block_range_.find(id);
      if (range != block_range_.end()) {
        blocks.reserve(range->second.second);
        for (std::uint32_t b = range->second.first; b < range->second.first + range->second.second; ++b)
          blocks.push_back(blocks_[b]);
      }
      return l;
    }
    if (roles_[id] == Role::DeviceTrace) throw GiveUp{};  // a GPU's trace outside device_traces
    items.reserve(lists_[id].size());
    for (const Value& item : lists_[id]) items.push_back(convert(item, depth + 1));
    return l;
  }

  static constexpr std::size_t kMaxStack = std::size_t{1} << 24;
  static constexpr std::size_t kMaxContainers = std::size_t{1} << 31;
  static constexpr int kMaxDepth = 64;
  static constexpr std::ptrdiff_t kReportEvery = std::ptrdiff_t{8} << 20;

  const char* begin_;
  const char* p_;
  const char* end_;
  const std::function<void(const char*)>& progress_;
  std::vector<Value> stack_;
  std::vector<std::size_t> marks_;
  std::vector<std::uint64_t> memo_;
  std::uint64_t memo_count_ = 0;  // keys stored: len(memo), MEMOIZE's key
  std::vector<Value> memo_values_;
  std::vector<std::vector<Value>> lists_;  // List and Tuple items
  std::vector<Role> roles_;                // per list
  std::vector<std::vector<Value>> dicts_;  // key, value, key, value, ...
  std::vector<RecordedEvent> events_;      // every trace entry, in the order made
  std::vector<bool> filled_;               // per event: its fields were read
  std::vector<ScannedBlock> blocks_;       // every segment's blocks, in the order made
  std::unordered_map<std::uint32_t, std::pair<std::uint32_t, std::uint32_t>> block_range_;  // list -> blocks
  std::unordered_map<const void*, std::vector<ScannedBlock>> blocks_of_;  // converted list -> its blocks
  std::unordered_map<std::uint32_t, std::pair<std::uint32_t, std::uint32_t>> device_range_;  // trace -> events
  std::unordered_map<std::uint32_t, std::uint32_t> frames_index_;  // frames list -> 1 + index
  std::vector<std::uint32_t> frames_lists_;
  std::unordered_map<std::uint32_t, PickleValue> list_done_, dict_done_;  // converted, shared as in the memo
  std::vector<std::pair<std::size_t, std::size_t>> device_ranges_;  // per GPU: first event, count
  int traces_lists_ = 0;
};

}  // namespace

std::optional<ScannedSnapshot> scan_snapshot(std::string_view pickle,
                                             const std::function<void(const char*)>& progress) {
  try {
    return Scanner{pickle, progress}.run();
  } catch (const GiveUp&) {
    return std::nullopt;
  } catch (const std::bad_alloc&) {
    return std::nullopt;  // the generic reader reports what it can
  }
}

}  // namespace mem::detail
