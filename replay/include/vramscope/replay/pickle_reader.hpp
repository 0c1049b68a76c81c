// pickle_reader.hpp — a safe reader for Python pickles of plain data.
//
//   mem::PickleValue root = mem::read_pickle_file("snapshot.pickle");
//   for (const mem::PickleValue& seg : root.at("segments").as_list())
//     std::size_t total = seg.at("total_size").as_size();
//
// Reads what Python's pickle module writes with protocols 2 to 5 (and the
// text opcodes of 0 and 1) for None, bools, ints, floats, str, bytes, lists,
// tuples, dicts and sets. It never imports or calls anything: GLOBAL,
// STACK_GLOBAL, REDUCE, BUILD, NEWOBJ, INST, OBJ, EXT and persistent ids are
// refused with mem::Error naming the opcode and its byte offset, as are
// truncated or malformed streams. That is all a PyTorch memory snapshot needs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace mem {

class PickleValue;
/// Elements of a list, tuple or set, in stream order.
using PickleList = std::vector<PickleValue>;
/// Entries of a dict in insertion order; a later duplicate key wins on lookup.
using PickleDict = std::vector<std::pair<PickleValue, PickleValue>>;

/// One node of the value tree. Containers are shared, as the pickle's memo
/// shares them, so copying a PickleValue is cheap.
class PickleValue {
 public:
  /// BigInt: an integer beyond 64 bits (LONG1 / LONG4), kept as its bytes. PyTorch writes
  /// such values in fields nothing here reads (a frame's `line` of 2^64 - 1); reading
  /// one as an int is the error, not loading the file.
  enum class Kind : std::uint8_t { None, Bool, Int, Float, String, Bytes, List, Tuple, Dict, Set, BigInt };

  PickleValue() = default;  ///< None
  PickleValue(const PickleValue&) = default;
  PickleValue(PickleValue&& other) noexcept
      : kind_(std::exchange(other.kind_, Kind::None)),
        value_(std::exchange(other.value_, std::monostate{})) {}
  PickleValue& operator=(const PickleValue&) = default;
  PickleValue& operator=(PickleValue&& other) noexcept {
    kind_ = std::exchange(other.kind_, Kind::None);
    value_ = std::exchange(other.value_, std::monostate{});
    return *this;
  }
  /// Iterative: a deeply nested tree from a hostile file cannot overflow the stack.
  ~PickleValue();
  static PickleValue boolean(bool v);
  static PickleValue integer(std::int64_t v);
  /// An integer that does not fit in 64 bits: its little-endian two's-complement bytes.
  static PickleValue big_integer(std::string bytes);
  static PickleValue floating(double v);
  static PickleValue string(std::string v);
  static PickleValue bytes(std::string v);
  /// An empty list, tuple or set (kind List, Tuple or Set).
  static PickleValue sequence(Kind kind);
  static PickleValue dict();

  Kind kind() const noexcept { return kind_; }
  /// "None", "bool", "int", "float", "str", "bytes", "list", "tuple", "dict", "set",
  /// "int beyond 64 bits".
  std::string_view kind_name() const noexcept;
  bool is_none() const noexcept { return kind_ == Kind::None; }
  bool is_int() const noexcept { return kind_ == Kind::Int; }
  bool is_string() const noexcept { return kind_ == Kind::String; }
  bool is_dict() const noexcept { return kind_ == Kind::Dict; }
  /// List, tuple or set.
  bool is_sequence() const noexcept {
    return kind_ == Kind::List || kind_ == Kind::Tuple || kind_ == Kind::Set;
  }

  // Accessors throw mem::Error naming the expected and actual kind.
  bool as_bool() const;
  std::int64_t as_int() const;          ///< int, or bool as 0/1
  std::size_t as_size() const;          ///< a non-negative int
  double as_float() const;              ///< float, or int converted
  const std::string& as_string() const; ///< str (or bytes)
  const PickleList& as_list() const;    ///< list, tuple or set
  const PickleDict& as_dict() const;

  /// The value under a string key of a dict, or nullptr (also when not a dict).
  const PickleValue* find(std::string_view key) const noexcept;
  /// The value under a string key; throws mem::Error if absent or not a dict.
  const PickleValue& at(std::string_view key) const;

  // Mutation, for the reader (containers are shared: all copies see it).
  PickleList& mutable_list();
  PickleDict& mutable_dict();
  /// The container this value shares (list, tuple, set or dict), or nullptr.
  const void* identity() const noexcept;

 private:
  Kind kind_ = Kind::None;
  std::variant<std::monostate, bool, std::int64_t, double, std::string,
               std::shared_ptr<PickleList>, std::shared_ptr<PickleDict>>
      value_;
};

/// Parses a whole pickle held in memory. Throws mem::Error with the byte offset
/// for anything malformed, truncated, or refused (globals, REDUCE, ...).
PickleValue read_pickle(std::string_view data);
/// Reads and parses a file; errors name the file.
PickleValue read_pickle_file(const std::string& path);
/// A file's bytes, for read_pickle; errors (a directory, a read error) name the file.
std::string read_pickle_bytes(const std::string& path);

}  // namespace mem
