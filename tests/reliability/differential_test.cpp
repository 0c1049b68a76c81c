// differential_test.cpp — over a million random operations per run, split by
// run setup so CTest runs them in parallel, with validate() and the reference
// model checked after every one, and the device back at zero at the end.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "operations.hpp"

namespace mem::reliability {
namespace {

// 6 setups x 170,000 = 1,020,000 operations per ctest run.
// VRAMSCOPE_RELIABILITY_OPS overrides the per-setup count for longer soak runs.
std::uint64_t ops_per_setup() {
  if (const char* env = std::getenv("VRAMSCOPE_RELIABILITY_OPS")) return std::stoull(env);
  return 170000;
}

class Differential : public ::testing::TestWithParam<std::size_t> {};

TEST_P(Differential, MatchesReferenceModelAfterEveryOp) {
  const RunSetup& setup = run_setup(GetParam());
  const std::uint64_t seed = 0x5eed0000 + GetParam();
  Executor ex(setup, seed);
  OpGenerator gen(seed, setup);
  const std::uint64_t ops = ops_per_setup();
  for (std::uint64_t i = 0; i < ops; ++i) ex.apply(gen.next(ex.live_count()));
  ex.finish();

  const RunTotals& t = ex.totals();
  std::printf(
      "[%s] %llu ops: %llu allocations (%llu OOM, %llu injected failures), %llu frees "
      "(%llu deferred by stream events), %llu misuse errors, %llu empty_cache, "
      "%llu streams replaced, at most %llu live\n",
      setup.name.c_str(), static_cast<unsigned long long>(t.ops),
      static_cast<unsigned long long>(t.allocations), static_cast<unsigned long long>(t.ooms),
      static_cast<unsigned long long>(t.injected_failures),
      static_cast<unsigned long long>(t.frees), static_cast<unsigned long long>(t.deferred_frees),
      static_cast<unsigned long long>(t.misuse_errors),
      static_cast<unsigned long long>(t.empty_caches),
      static_cast<unsigned long long>(t.replaced_streams), static_cast<unsigned long long>(t.max_live));
  // The run reached every part of the vocabulary, not just the happy path.
  if (ops >= 10000) {
    EXPECT_GT(t.ooms, 0u);
    EXPECT_GT(t.injected_failures, 0u);
    EXPECT_GT(t.deferred_frees, 0u);
    EXPECT_GT(t.misuse_errors, 0u);
    EXPECT_GT(t.empty_caches, 0u);
    EXPECT_GT(t.replaced_streams, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Setups, Differential, ::testing::Range<std::size_t>(0, run_setup_count()),
                         [](const ::testing::TestParamInfo<std::size_t>& info) {
                           std::string name;
                           for (char c : run_setup(info.param).name) {
                             if (c != '-') name += c;
                           }
                           return name;
                         });

// The generator and the decoder are deterministic: the same seed or bytes, the same ops.
TEST(Operations, GeneratorIsDeterministic) {
  OpGenerator a(42, run_setup(0)), b(42, run_setup(0));
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(describe(a.next(5)), describe(b.next(5)));
}

TEST(Operations, EveryByteStringDecodesToValidOps) {
  // Short, empty and all-0xff inputs must decode and run cleanly too.
  const std::uint8_t ones[64] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  run_bytes(nullptr, 0);
  run_bytes(ones, 1);
  run_bytes(ones, 8);
  run_bytes(ones, sizeof ones);
  std::mt19937_64 rng(3);
  for (int n = 0; n < 50; ++n) {
    std::string bytes(1 + rng() % 300, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    run_bytes(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  }
}

}  // namespace
}  // namespace mem::reliability
