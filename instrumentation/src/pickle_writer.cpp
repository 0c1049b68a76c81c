// pickle_writer.cpp — the opcodes of PickleWriter (see pickletools for their meaning).
#include "pickle_writer.hpp"

#include <bit>
#include <cstring>
#include <limits>

#include "vramscope/allocator/errors.hpp"

namespace mem::detail {
namespace {

constexpr char kProto = '\x80';
constexpr char kEmptyDict = '}';
constexpr char kEmptyList = ']';
constexpr char kMark = '(';
constexpr char kSetItems = 'u';
constexpr char kAppends = 'e';
constexpr char kBinInt1 = 'K';
constexpr char kBinInt = 'J';
constexpr char kLong1 = '\x8a';
constexpr char kBinUnicode = 'X';
constexpr char kBinFloat = 'G';
constexpr char kNewTrue = '\x88';
constexpr char kNewFalse = '\x89';
constexpr char kNone = 'N';
constexpr char kTuple2 = '\x86';
constexpr char kStop = '.';

}  // namespace

PickleWriter::PickleWriter() {
  op(kProto);
  out_.push_back('\x02');  // protocol 2: every opcode above exists there
}

void PickleWriter::u32(std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// SETITEMS/APPENDS add everything after the last MARK to the container just below it.
void PickleWriter::begin_dict() { op(kEmptyDict); op(kMark); ++depth_; }
void PickleWriter::end_dict() { op(kSetItems); --depth_; }
void PickleWriter::begin_list() { op(kEmptyList); op(kMark); ++depth_; }
void PickleWriter::end_list() { op(kAppends); --depth_; }
void PickleWriter::tuple2() { op(kTuple2); }

void PickleWriter::integer(std::int64_t value) {
  if (value >= 0 && value < 256) {
    op(kBinInt1);
    out_.push_back(static_cast<char>(value));
  } else if (value >= std::numeric_limits<std::int32_t>::min() &&
             value <= std::numeric_limits<std::int32_t>::max()) {
    op(kBinInt);
    u32(static_cast<std::uint32_t>(static_cast<std::int32_t>(value)));
  } else {
    // LONG1: little-endian two's complement, as few bytes as keep the sign
    // (the memory_viz reader takes at most 8).
    const auto bits = static_cast<std::uint64_t>(value);
    int n = 8;
    while (n > 1) {
      const auto top = static_cast<std::uint8_t>(bits >> (8 * (n - 1)));
      const auto next_sign = static_cast<std::uint8_t>(bits >> (8 * (n - 2))) & 0x80;
      if ((top == 0x00 && next_sign == 0) || (top == 0xff && next_sign != 0)) {
        --n;
      } else {
        break;
      }
    }
    op(kLong1);
    out_.push_back(static_cast<char>(n));
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  }
}

void PickleWriter::unsigned_integer(std::uint64_t value) {
  constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  integer(static_cast<std::int64_t>(value > kMax ? kMax : value));
}

void PickleWriter::string(std::string_view value) {
  if (value.size() > std::numeric_limits<std::uint32_t>::max()) {
    throw Error("pickle export: a string of " + std::to_string(value.size()) +
                " bytes does not fit BINUNICODE");
  }
  op(kBinUnicode);
  u32(static_cast<std::uint32_t>(value.size()));
  out_.append(value);
}

void PickleWriter::floating(double value) {
  op(kBinFloat);
  const auto bits = std::bit_cast<std::uint64_t>(value);
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
}

void PickleWriter::boolean(bool value) { op(value ? kNewTrue : kNewFalse); }
void PickleWriter::none() { op(kNone); }

std::string PickleWriter::finish() {
  op(kStop);
  return std::move(out_);
}

}  // namespace mem::detail
