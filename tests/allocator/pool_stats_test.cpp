// pool_stats_test.cpp — the allocator's per-pool statistics, white-box: 100,000 random
// increases, decreases (half of them through the signed add) and resets give, read
// back, exactly the three-entry figures
// PyTorch's update_stat_array gives (the "all" entry and the pool's updated together).
#include <gtest/gtest.h>

#include <random>

#include "pool_stats.hpp"

namespace mem::detail {
namespace {

/// PyTorch's way: every transition updates "all" and the pool's entry.
struct Reference {
  StatArray a{};
  static std::size_t type_of(std::size_t pool) {
    return static_cast<std::size_t>(pool == kSmallPoolIndex ? StatType::SmallPool : StatType::LargePool);
  }
  void increase(std::size_t pool, std::int64_t amount) {
    a[0].increase(amount);
    a[type_of(pool)].increase(amount);
  }
  void decrease(std::size_t pool, std::int64_t amount) {
    a[0].decrease(amount);
    a[type_of(pool)].decrease(amount);
  }
};

TEST(PoolStat, ReadsBackExactlyWhatTheThreeEntryUpdateGives) {
  std::mt19937_64 rng(7);
  PoolStat stat;
  Reference ref;
  std::int64_t current[2] = {0, 0};
  for (int step = 0; step < 100000; ++step) {
    const std::size_t pool = rng() % 2;
    const int op = static_cast<int>(rng() % 100);
    // Half the changes through add(), whose sign is the delta's (and a zero delta now and
    // then, which changes nothing).
    const bool signed_add = rng() % 2 == 0;
    if (op < 47) {
      const auto amount = static_cast<std::int64_t>(rng() % 4096) + 1;
      signed_add ? stat.add(pool, amount) : stat.increase(pool, amount);
      ref.increase(pool, amount);
      current[pool] += amount;
    } else if (op < 94) {
      if (current[pool] == 0) continue;
      const auto amount = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(current[pool])) + 1;
      signed_add ? stat.add(pool, -amount) : stat.decrease(pool, amount);
      ref.decrease(pool, amount);
      current[pool] -= amount;
    } else if (op < 96) {
      stat.add(pool, 0);
    } else if (op < 98) {
      stat.reset_peak();
      for (Stat& s : ref.a) s.reset_peak();
    } else {
      stat.reset_accumulated();
      for (Stat& s : ref.a) s.reset_accumulated();
    }
    const StatArray got = stat.read();
    ASSERT_EQ(got, ref.a) << "step " << step;
    ASSERT_EQ(stat.current(), ref.a[0].current);
  }
}

TEST(PoolStat, AllPeakIsThePeakOfTheSumNotTheSumOfPeaks) {
  PoolStat stat;
  stat.increase(kSmallPoolIndex, 100);  // small peaks at 100
  stat.decrease(kSmallPoolIndex, 100);
  stat.increase(kLargePoolIndex, 60);  // large peaks at 60 while small is back at 0
  const StatArray s = stat.read();
  EXPECT_EQ(s[static_cast<std::size_t>(StatType::SmallPool)].peak, 100);
  EXPECT_EQ(s[static_cast<std::size_t>(StatType::LargePool)].peak, 60);
  EXPECT_EQ(s[static_cast<std::size_t>(StatType::All)].peak, 100);
  EXPECT_EQ(s[static_cast<std::size_t>(StatType::All)].current, 60);
  EXPECT_EQ(s[static_cast<std::size_t>(StatType::All)].allocated, 160);
  EXPECT_EQ(s[static_cast<std::size_t>(StatType::All)].freed, 100);
}

}  // namespace
}  // namespace mem::detail
