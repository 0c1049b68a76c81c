// config_test.cpp — PYTORCH_CUDA_ALLOC_CONF parsing: accepted forms, round
// trips, and clear errors for everything malformed.
#include <gtest/gtest.h>

#include <string>

#include "vramscope/allocator/config.hpp"
#include "vramscope/allocator/errors.hpp"

namespace mem {
namespace {

TEST(Config, EmptyIsTheDefault) {
  EXPECT_EQ(AllocatorConfig::parse(""), AllocatorConfig{});
  EXPECT_EQ(AllocatorConfig::parse("  "), AllocatorConfig{});
  EXPECT_EQ(AllocatorConfig{}.to_string(), "");
}

TEST(Config, ParsesEveryKey) {
  const auto c = AllocatorConfig::parse(
      "max_split_size_mb:128, roundup_power2_divisions:4,garbage_collection_threshold:0.6,"
      "expandable_segments:False,backend:native");
  EXPECT_EQ(c.max_split_size, std::size_t{128} << 20);
  for (std::size_t d : c.roundup_power2_divisions) EXPECT_EQ(d, 4u);
  EXPECT_DOUBLE_EQ(c.garbage_collection_threshold, 0.6);
  EXPECT_FALSE(c.expandable_segments);
  const auto e = AllocatorConfig::parse("expandable_segments:True,max_split_size_mb:64");
  EXPECT_TRUE(e.expandable_segments);
  EXPECT_EQ(e.to_string(), "max_split_size_mb:64,expandable_segments:True");
  EXPECT_EQ(AllocatorConfig::parse(e.to_string()), e);
}

TEST(Config, DivisionListFillsIntervalsAsPyTorch) {
  const auto c = AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,>:8]");
  const auto& t = c.roundup_power2_divisions;
  // As PyTorch's parser: the first entry also covers all smaller intervals, and
  // ">" fills from the last named interval *inclusive*, so 512:2 is overwritten.
  for (std::size_t i = 0; i <= 8; ++i) EXPECT_EQ(t[i], 1u) << i;  // up to the 256 MiB interval
  for (std::size_t i = 9; i < t.size(); ++i) EXPECT_EQ(t[i], 8u) << i;
  EXPECT_EQ(c.divisions_for(300u << 20), 1u);
  EXPECT_EQ(c.divisions_for(600u << 20), 8u);
  const auto d = AllocatorConfig::parse("roundup_power2_divisions:[64:8,256:2]");
  EXPECT_EQ(d.divisions_for(10u << 20), 8u);
  EXPECT_EQ(d.divisions_for(100u << 20), 8u);  // [64 MiB, 128 MiB)
  EXPECT_EQ(d.divisions_for(200u << 20), 0u);  // between named intervals: unset
  EXPECT_EQ(d.divisions_for(300u << 20), 2u);
  EXPECT_EQ(c.divisions_for(std::size_t{3} << 30), 8u);
}

TEST(Config, ToStringRoundTrips) {
  for (const char* text : {"max_split_size_mb:128", "roundup_power2_divisions:4",
                           "roundup_power2_divisions:[256:1,512:2,>:8]", "max_non_split_rounding_mb:64",
                           "roundup_power2_divisions:[64:8,256:2]",
                           "max_split_size_mb:64,garbage_collection_threshold:0.8"}) {
    const auto c = AllocatorConfig::parse(text);
    EXPECT_EQ(AllocatorConfig::parse(c.to_string()), c) << text << " -> " << c.to_string();
  }
}

void expect_error(const std::string& conf, const std::string& fragment) {
  try {
    AllocatorConfig::parse(conf);
    ADD_FAILURE() << "accepted: " << conf;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "for \"" << conf << "\": " << e.what();
  }
}

TEST(Config, RejectsMalformedStringsWithClearMessages) {
  expect_error("max_split_size_mb", "no ':'");
  expect_error("max_split_size_mb:abc", "non-negative integer");
  expect_error("max_split_size_mb:-5", "non-negative integer");
  expect_error("max_split_size_mb:10", "must be >= 20");
  expect_error("max_non_split_rounding_mb:4", "must be >= 20");
  expect_error("unknown_key:1", "unknown key \"unknown_key\"");
  expect_error("roundup_power2_divisions:3", "power of 2");
  expect_error("roundup_power2_divisions:[300:2]", "powers of 2");
  expect_error("roundup_power2_divisions:[256:2", "end with ']'");
  expect_error("roundup_power2_divisions:[256]", "interval_mb:divisions");
  expect_error("garbage_collection_threshold:1.5", "between 0.0 and 1.0");
  expect_error("garbage_collection_threshold:0", "between 0.0 and 1.0");
  expect_error("garbage_collection_threshold:x", "expects a number");
  expect_error("expandable_segments:1", "expects True or False");
  expect_error("backend:cudaMallocAsync", "only native");
  expect_error("max_split_size_mb:128,,", "empty option");
  expect_error("max_split_size_mb:128,", "empty option");
}

TEST(Config, ErrorsNameTheValidKeys) {
  try {
    AllocatorConfig::parse("max_split:1");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_split_size_mb"), std::string::npos);
  }
}

}  // namespace
}  // namespace mem
