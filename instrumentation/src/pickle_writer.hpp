// pickle_writer.hpp — a Python pickle (protocol 2) emitter using only the
// opcodes the JavaScript unpickler of pytorch.org/memory_viz accepts:
// PROTO, EMPTY_DICT, EMPTY_LIST, MARK, SETITEMS, APPENDS, BININT1, BININT,
// LONG1, BINUNICODE, BINFLOAT, NEWTRUE, NEWFALSE, NONE, TUPLE2, STOP.
// No memo: every value is written out, which both readers accept.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace mem::detail {

class PickleWriter {
 public:
  PickleWriter();

  // Containers: begin_*() then the items (key, value, key, value... for a dict), then end_*().
  void begin_dict();
  void end_dict();
  void begin_list();
  void end_list();
  /// A 2-tuple of the two values written just before (TUPLE2).
  void tuple2();

  void integer(std::int64_t value);
  void unsigned_integer(std::uint64_t value);  ///< values above INT64_MAX are clamped
  void string(std::string_view value);
  void floating(double value);
  void boolean(bool value);
  void none();

  /// Key-value shorthands inside a dict.
  void item(std::string_view key, std::int64_t value) { string(key); integer(value); }
  void item_u(std::string_view key, std::uint64_t value) { string(key); unsigned_integer(value); }
  void item(std::string_view key, std::string_view value) { string(key); string(value); }
  void item(std::string_view key, const char* value) { string(key); string(value); }
  void item(std::string_view key, bool value) { string(key); boolean(value); }
  void item(std::string_view key, double value) { string(key); floating(value); }

  /// Appends STOP and returns the bytes; the writer is spent afterwards.
  std::string finish();

 private:
  void op(char code) { out_.push_back(code); }
  void u32(std::uint32_t v);

  std::string out_;
  int depth_ = 0;
};

}  // namespace mem::detail
