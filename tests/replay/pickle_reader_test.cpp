// pickle_reader_test.cpp — the safe pickle reader: protocols 2 to 5 as CPython
// writes them, shared containers, and refusals with byte offsets.
#include "vramscope/replay/pickle_reader.hpp"

#include <gtest/gtest.h>

#include <string>

#include "replay_test_pickles.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem {
namespace {

std::string error_of(std::string_view data) {
  try {
    read_pickle(data);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

void expect_common(const PickleValue& v, int proto) {
  SCOPED_TRACE("protocol " + std::to_string(proto));
  ASSERT_TRUE(v.is_dict());
  EXPECT_TRUE(v.at("none").is_none());
  EXPECT_TRUE(v.at("t").as_bool());
  EXPECT_FALSE(v.at("f").as_bool());
  EXPECT_EQ(v.at("neg").as_int(), -7);
  EXPECT_EQ(v.at("i1").as_int(), 200);
  EXPECT_EQ(v.at("i2").as_int(), 60000);
  EXPECT_EQ(v.at("i4").as_int(), -100000);
  EXPECT_EQ(v.at("big").as_int(), (std::int64_t{1} << 40) + 3);
  EXPECT_EQ(v.at("huge").as_int(), std::int64_t{1} << 62);
  EXPECT_EQ(v.at("minus_big").as_int(), -(std::int64_t{1} << 40));
  EXPECT_DOUBLE_EQ(v.at("pi").as_float(), 3.25);
  EXPECT_EQ(v.at("text").as_string(), "h\xc3\xa9llo");
  EXPECT_EQ(v.at("tuple").kind(), PickleValue::Kind::Tuple);
  ASSERT_EQ(v.at("tuple").as_list().size(), 2u);
  EXPECT_EQ(v.at("tuple").as_list()[1].as_string(), "a");
  EXPECT_TRUE(v.at("empty").as_list().empty());
  const PickleList& nested = v.at("nested").as_list();
  ASSERT_EQ(nested.size(), 2u);
  EXPECT_EQ(nested[0].as_list()[0].as_int(), 1);
  EXPECT_EQ(nested[1].at("k").as_string(), "v");
  // "a" and "b" are one list in Python: the memo shares it.
  EXPECT_EQ(&v.at("a").as_list(), &v.at("b").as_list());
  EXPECT_EQ(v.at("b").as_list()[1].as_int(), 2);
}

TEST(PickleReader, ReadsProtocolTwo) { expect_common(read_pickle(test::kProto2), 2); }

TEST(PickleReader, ReadsProtocolThreeWithBytes) {
  const PickleValue v = read_pickle(test::kProto3);
  expect_common(v, 3);
  EXPECT_EQ(v.at("bytes").kind(), PickleValue::Kind::Bytes);
  EXPECT_EQ(v.at("bytes").as_string(), std::string("\x00\x01\xff", 3));
}

TEST(PickleReader, ReadsProtocolsFourAndFiveWithSets) {
  for (auto data : {test::kProto4, test::kProto5}) {
    const PickleValue v = read_pickle(data);
    expect_common(v, 4);
    EXPECT_EQ(v.at("set").kind(), PickleValue::Kind::Set);
    EXPECT_EQ(v.at("set").as_list()[0].as_int(), 3);
    EXPECT_EQ(v.at("fs").as_list()[0].as_int(), 4);
  }
}

TEST(PickleReader, RefusesStackGlobalWithOffsetAndName) {
  const std::string msg = error_of(test::kGlobal);
  EXPECT_NE(msg.find("byte offset 39"), std::string::npos) << msg;
  EXPECT_NE(msg.find("STACK_GLOBAL"), std::string::npos) << msg;
  EXPECT_NE(msg.find("collections.OrderedDict"), std::string::npos) << msg;
}

TEST(PickleReader, RefusesGlobalOpcode) {
  // Protocol 2 writes bytes as _codecs.encode(...) through GLOBAL and REDUCE.
  const std::string msg = error_of(test::kProto2Bytes);
  EXPECT_NE(msg.find("GLOBAL"), std::string::npos) << msg;
  EXPECT_NE(msg.find("_codecs.encode"), std::string::npos) << msg;
}

TEST(PickleReader, RefusesReduce) {
  // EMPTY_TUPLE EMPTY_TUPLE REDUCE: refused before anything is called.
  const std::string msg = error_of(std::string_view("\x80\x04))R.", 6));
  EXPECT_NE(msg.find("byte offset 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("REDUCE"), std::string::npos) << msg;
}

TEST(PickleReader, TruncatedInputNamesTheOffset) {
  const std::string_view half = test::kProto4.substr(0, test::kProto4.size() / 2);
  const std::string msg = error_of(half);
  EXPECT_NE(msg.find("byte offset"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST(PickleReader, RejectsGarbage) {
  EXPECT_NE(error_of("").find("empty"), std::string::npos);
  const std::string msg = error_of(std::string_view("\x80\x04\xff", 3));
  EXPECT_NE(msg.find("byte offset 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown opcode 0xff"), std::string::npos) << msg;
  EXPECT_NE(error_of(std::string_view("\x80\x04" "a.", 4)).find("underflow"), std::string::npos);
  EXPECT_NE(error_of(std::string_view("\x80\x09.", 3)).find("protocol 9"), std::string::npos);
  EXPECT_NE(error_of(std::string_view("\x80\x04hx.", 5)).find("memo key"), std::string::npos);
  // Two values left at STOP.
  EXPECT_NE(error_of(std::string_view("\x80\x04NN.", 5)).find("STOP"), std::string::npos);
}

TEST(PickleReader, DeepNestingIsDestroyedWithoutRecursion) {
  constexpr std::size_t kDepth = 200000;
  std::string data = "\x80\x04";
  data.append(kDepth, ']');
  data.append(kDepth - 1, 'a');
  data.push_back('.');
  const PickleValue v = read_pickle(data);
  EXPECT_EQ(v.as_list().size(), 1u);
}

TEST(PickleReader, RefusesAPickleThatRefersToItself) {
  // Python's pickle of `a = []; a.append(a)`, of `d = {}; d["x"] = d`, and of a cycle through
  // two lists (a = []; a.append([a])): refused, not leaked (LeakSanitizer watches the debug run).
  using namespace std::string_view_literals;
  for (std::string_view cyclic : {"\x80\x02]q\x00h\x00" "a."sv,
                                  "\x80\x04\x95\n\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01x\x94h\x00s."sv,
                                  "\x80\x02]q\x00]q\x01h\x00" "aa."sv}) {
    const std::string message = error_of(std::string(cyclic));
    EXPECT_NE(message.find("a cycle"), std::string::npos) << message;
  }
  // Sharing without a cycle is read: x = [1]; [x, x] (the second x is a memo reference).
  const PickleValue shared = read_pickle("\x80\x02]q\x00(]q\x01K\x01" "ah\x01" "e."sv);
  ASSERT_EQ(shared.as_list().size(), 2u);
  EXPECT_EQ(shared.as_list()[0].identity(), shared.as_list()[1].identity());
}

TEST(PickleValue, AccessorsNameTheKinds) {
  const PickleValue v = PickleValue::integer(-1);
  try {
    (void)v.as_string();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected str, got int"), std::string::npos);
  }
  EXPECT_THROW((void)v.as_size(), Error);
  EXPECT_THROW((void)PickleValue::dict().at("missing"), Error);
  EXPECT_EQ(PickleValue::dict().find("missing"), nullptr);
}

}  // namespace
}  // namespace mem
