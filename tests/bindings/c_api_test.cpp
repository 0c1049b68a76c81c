// c_api_test.cpp — the C API on simulated devices: exact statistics from the policy,
// errors that change nothing, streams, snapshots, the summary, module scopes, and the
// PyTorch plugin's entry points. CTest runs each test in its own process, so each
// starts with no allocator.
#include "vramscope/c_api.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <atomic>

#include <nlohmann/json.hpp>

namespace {

constexpr std::size_t MiB = 1024 * 1024;

vramscope_stats stats_of(int device) {
  vramscope_stats s{};
  EXPECT_EQ(vramscope_get_stats(device, &s, sizeof s), VRAMSCOPE_OK) << vramscope_last_error();
  return s;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() /
             ("vramscope_c_api_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
              "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(CApi, VersionMatchesTheHeader) { EXPECT_EQ(vramscope_api_version(), VRAMSCOPE_C_API_VERSION); }

TEST(CApi, MallocAndFreeFollowThePolicyExactly) {
  ASSERT_EQ(vramscope_init("sim:a100-80g", ""), VRAMSCOPE_OK) << vramscope_last_error();
  void* p = vramscope_malloc(5 * MiB, 0, 0);
  ASSERT_NE(p, nullptr) << vramscope_last_error();
  vramscope_stats s = stats_of(0);
  // 5 MiB is a large request under 10 MiB: one 20 MiB segment, split.
  EXPECT_EQ(s.allocated_bytes[0].current, static_cast<std::int64_t>(5 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(20 * MiB));
  EXPECT_EQ(s.reserved_bytes[2].current, static_cast<std::int64_t>(20 * MiB));  // large pool
  EXPECT_EQ(s.segment[0].current, 1);
  EXPECT_EQ(s.num_device_alloc, 1);
  EXPECT_GT(s.device_total_bytes, 0);
  EXPECT_GT(s.context_bytes, 0);
  EXPECT_EQ(s.device_used_bytes.current, s.context_bytes + static_cast<std::int64_t>(20 * MiB));

  ASSERT_EQ(vramscope_free(p), VRAMSCOPE_OK);
  s = stats_of(0);
  EXPECT_EQ(s.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.allocated_bytes[0].peak, static_cast<std::int64_t>(5 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(20 * MiB));  // cached

  ASSERT_EQ(vramscope_empty_cache(0), VRAMSCOPE_OK);
  EXPECT_EQ(stats_of(0).reserved_bytes[0].current, 0);
  ASSERT_EQ(vramscope_reset_peak_stats(0), VRAMSCOPE_OK);
  EXPECT_EQ(stats_of(0).allocated_bytes[0].peak, 0);
  ASSERT_EQ(vramscope_reset_accumulated_stats(0), VRAMSCOPE_OK);
  EXPECT_EQ(stats_of(0).num_device_alloc, 0);
}

TEST(CApi, SmallRequestsShareTwoMiBSegments) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  void* a = vramscope_malloc(1000, 0, 0);  // rounds to 1024
  void* b = vramscope_malloc(512, 0, 0);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const vramscope_stats s = stats_of(0);
  EXPECT_EQ(s.allocated_bytes[1].current, 1536);  // small pool
  EXPECT_EQ(s.requested_bytes[0].current, 1512);
  EXPECT_EQ(s.reserved_bytes[1].current, static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(s.allocation[0].current, 2);
  EXPECT_EQ(vramscope_free(a), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_free(b), VRAMSCOPE_OK);
}

TEST(CApi, SettingsApplyToTheAllocator) {
  ASSERT_EQ(vramscope_init("sim:a100-80g", "max_split_size_mb:128"), VRAMSCOPE_OK);
  void* p = vramscope_malloc(MiB + 1, 0, 0);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(stats_of(0).max_split_size, static_cast<std::int64_t>(128 * MiB));
  vramscope_free(p);
}

TEST(CApi, MisuseIsAnErrorThatChangesNothing) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  void* p = vramscope_malloc(MiB, 0, 0);
  ASSERT_NE(p, nullptr);
  const vramscope_stats before = stats_of(0);

  EXPECT_EQ(vramscope_malloc(0, 0, 0), nullptr);
  EXPECT_EQ(vramscope_last_error_code(), VRAMSCOPE_ERROR_INVALID);
  EXPECT_NE(std::string(vramscope_last_error()).find("vramscope_malloc"), std::string::npos);

  EXPECT_EQ(vramscope_malloc(SIZE_MAX, 0, 0), nullptr);
  EXPECT_EQ(vramscope_last_error_code(), VRAMSCOPE_ERROR_INVALID);

  int local = 0;
  EXPECT_EQ(vramscope_free(&local), VRAMSCOPE_ERROR_INVALID);
  EXPECT_NE(std::string(vramscope_last_error()).find("nothing changed"), std::string::npos);
  EXPECT_EQ(vramscope_free(nullptr), VRAMSCOPE_OK);  // as free(NULL)

  EXPECT_EQ(vramscope_malloc(MiB, -1, 0), nullptr);
  EXPECT_NE(std::string(vramscope_last_error()).find("out of range"), std::string::npos);
  EXPECT_EQ(vramscope_malloc(MiB, 0, 12345), nullptr);  // a stream never created
  EXPECT_EQ(vramscope_last_error_code(), VRAMSCOPE_ERROR_INVALID);

  EXPECT_EQ(vramscope_get_stats(0, nullptr, sizeof(vramscope_stats)), VRAMSCOPE_ERROR_INVALID);
  vramscope_stats small{};
  EXPECT_EQ(vramscope_get_stats(0, &small, 8), VRAMSCOPE_ERROR_INVALID);
  EXPECT_EQ(vramscope_set_memory_fraction(0, 1.5), VRAMSCOPE_ERROR_INVALID);

  const vramscope_stats after = stats_of(0);
  EXPECT_EQ(std::memcmp(&before.allocated_bytes, &after.allocated_bytes, sizeof before.allocated_bytes), 0);
  EXPECT_EQ(after.reserved_bytes[0].current, before.reserved_bytes[0].current);

  ASSERT_EQ(vramscope_free(p), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_free(p), VRAMSCOPE_ERROR_INVALID);  // double free
  EXPECT_EQ(stats_of(0).allocation[0].current, 0);
}

TEST(CApi, BadSettingsAreRefusedAtInit) {
  EXPECT_EQ(vramscope_init("sim:no-such-gpu", ""), VRAMSCOPE_ERROR_INVALID);
  EXPECT_NE(std::string(vramscope_last_error()).find("no-such-gpu"), std::string::npos);
  EXPECT_EQ(vramscope_init("sim", "max_split_size_mb:banana"), VRAMSCOPE_ERROR_INVALID);
  EXPECT_EQ(vramscope_init("", ""), VRAMSCOPE_ERROR_INVALID);
  // Nothing was changed by the refused calls: a good init still works.
  EXPECT_EQ(vramscope_init("sim:t4", ""), VRAMSCOPE_OK);
}

TEST(CApi, SettingsCannotChangeOnceAllocatorsExist) {
  ASSERT_EQ(vramscope_init("sim:t4", ""), VRAMSCOPE_OK);
  void* p = vramscope_malloc(MiB, 0, 0);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(vramscope_init("sim:t4", ""), VRAMSCOPE_OK);  // the same settings again: fine
  EXPECT_EQ(vramscope_init(nullptr, nullptr), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_init("sim:a100-80g", ""), VRAMSCOPE_ERROR_INVALID);
  EXPECT_NE(std::string(vramscope_last_error()).find("before the first allocation"), std::string::npos);
  vramscope_free(p);
}

TEST(CApi, AutoAndItsResolutionAreTheSameSetting) {
  ::unsetenv("VRAMSCOPE_DEVICE");
  ::unsetenv("VRAMSCOPE_ALLOC_CONF");
  void* p = vramscope_malloc(MiB, 0, 0);  // created with the default, "auto"
  ASSERT_NE(p, nullptr) << vramscope_last_error();
  // Without a GPU "auto" is the simulated default: asking for it again is not a change.
  EXPECT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK) << vramscope_last_error();
  EXPECT_EQ(vramscope_init("auto", nullptr), VRAMSCOPE_OK) << vramscope_last_error();
  EXPECT_EQ(vramscope_init("sim:t4", ""), VRAMSCOPE_ERROR_INVALID);
  vramscope_free(p);
}

TEST(CApi, StatsStructsOfOtherVersionsAreServed) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  void* p = vramscope_malloc(5 * MiB, 0, 0);
  // A newer caller's larger struct: ours first, the fields we lack zeroed.
  struct Newer {
    vramscope_stats v1;
    int64_t later_field;
  } newer;
  std::memset(&newer, 0xff, sizeof newer);
  ASSERT_EQ(vramscope_get_stats(0, &newer.v1, sizeof newer), VRAMSCOPE_OK);
  EXPECT_EQ(newer.v1.allocated_bytes[0].current, static_cast<std::int64_t>(5 * MiB));
  EXPECT_EQ(newer.later_field, 0);
  vramscope_free(p);
}

TEST(CApi, ThreadsWritingOneSnapshotPathEachWriteItWhole) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  void* p = vramscope_malloc(5 * MiB, 0, 0);
  const auto dir = temp_dir();
  const std::string path = (dir / "same.json").string();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 25; ++i) {
        if (vramscope_snapshot_json(0, path.c_str()) != VRAMSCOPE_OK) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  // Whole, not interleaved: it parses.
  EXPECT_TRUE(nlohmann::json::accept(read_file(path)));
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 1u);  // no temporary file left behind
  vramscope_free(p);
  std::filesystem::remove_all(dir);
}

TEST(CApi, OutOfMemorySaysWhatWasAskedAndKeepsTheAllocatorUsable) {
  ASSERT_EQ(vramscope_init("sim:capacity=1GiB,context=100MiB", ""), VRAMSCOPE_OK);
  void* p = vramscope_malloc(600 * MiB, 0, 0);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(vramscope_malloc(600 * MiB, 0, 0), nullptr);
  EXPECT_EQ(vramscope_last_error_code(), VRAMSCOPE_ERROR_OUT_OF_MEMORY);
  const std::string message = vramscope_last_error();
  EXPECT_NE(message.find("600.00 MiB"), std::string::npos) << message;
  EXPECT_NE(message.find("allocated"), std::string::npos) << message;
  EXPECT_EQ(stats_of(0).num_ooms, 1);
  ASSERT_EQ(vramscope_free(p), VRAMSCOPE_OK);
  void* q = vramscope_malloc(600 * MiB, 0, 0);  // fits in the cached segment
  EXPECT_NE(q, nullptr);
  vramscope_free(q);
}

TEST(CApi, MemoryFractionCapsTheAllocator) {
  ASSERT_EQ(vramscope_init("sim:capacity=1GiB,context=0", ""), VRAMSCOPE_OK);
  ASSERT_EQ(vramscope_set_memory_fraction(0, 0.25), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_malloc(300 * MiB, 0, 0), nullptr);
  EXPECT_EQ(vramscope_last_error_code(), VRAMSCOPE_ERROR_OUT_OF_MEMORY);
  void* p = vramscope_malloc(200 * MiB, 0, 0);
  EXPECT_NE(p, nullptr);
  vramscope_free(p);
}

TEST(CApi, EachDeviceIndexHasItsOwnAllocator) {
  ASSERT_EQ(vramscope_init("sim:a100-80g", ""), VRAMSCOPE_OK);
  void* a = vramscope_malloc(5 * MiB, 0, 0);
  void* b = vramscope_malloc(30 * MiB, 1, 0);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(stats_of(0).reserved_bytes[0].current, static_cast<std::int64_t>(20 * MiB));
  EXPECT_EQ(stats_of(1).reserved_bytes[0].current, static_cast<std::int64_t>(30 * MiB));
  // vramscope_free finds the owner of either pointer.
  EXPECT_EQ(vramscope_free(b), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_free(a), VRAMSCOPE_OK);
  EXPECT_EQ(stats_of(0).allocated_bytes[0].current, 0);
  EXPECT_EQ(stats_of(1).allocated_bytes[0].current, 0);
  int local = 0;
  EXPECT_EQ(vramscope_free(&local), VRAMSCOPE_ERROR_INVALID);
}

TEST(CApi, BlocksAreReusedPerStreamAndRecordStreamDefersReuse) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  vramscope_stream s1 = 0;
  ASSERT_EQ(vramscope_stream_create(0, &s1), VRAMSCOPE_OK);
  void* p = vramscope_malloc(5 * MiB, 0, 0);
  ASSERT_EQ(vramscope_free(p), VRAMSCOPE_OK);
  void* q = vramscope_malloc(5 * MiB, 0, s1);  // another stream: a new segment
  EXPECT_NE(q, p);
  EXPECT_EQ(stats_of(0).segment[0].current, 2);
  void* r = vramscope_malloc(5 * MiB, 0, 0);  // the default stream's cached block
  EXPECT_EQ(r, p);
  EXPECT_EQ(vramscope_record_stream(r, s1), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_record_stream(r, 999), VRAMSCOPE_ERROR_INVALID);
  int local = 0;
  EXPECT_EQ(vramscope_record_stream(&local, s1), VRAMSCOPE_ERROR_INVALID);
  EXPECT_EQ(vramscope_free(r), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_free(q), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_stream_destroy(0, s1), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_stream_destroy(0, s1), VRAMSCOPE_ERROR_INVALID);
  EXPECT_EQ(vramscope_stream_destroy(0, 0), VRAMSCOPE_ERROR_INVALID);
  EXPECT_EQ(vramscope_stream_create(0, nullptr), VRAMSCOPE_ERROR_INVALID);
}

TEST(CApi, ScopesStampBlocksWithModuleAndPhase) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  const auto dir = temp_dir();
  ASSERT_EQ(vramscope_record_history(0, 1000), VRAMSCOPE_OK);
  ASSERT_EQ(vramscope_scope_push("encoder", "forward"), VRAMSCOPE_OK);
  ASSERT_EQ(vramscope_scope_push("encoder.layer0", "forward"), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_scope_depth(), 2u);
  void* p = vramscope_malloc(3 * MiB, 0, 0);
  ASSERT_EQ(vramscope_scope_pop(), VRAMSCOPE_OK);
  ASSERT_EQ(vramscope_scope_pop(), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_scope_pop(), VRAMSCOPE_ERROR_INVALID);
  EXPECT_EQ(vramscope_scope_push("x", "sideways"), VRAMSCOPE_ERROR_INVALID);
  EXPECT_EQ(vramscope_scope_depth(), 0u);
  ASSERT_EQ(vramscope_scope_push("head", "backward"), VRAMSCOPE_OK);
  void* q = vramscope_malloc(1 * MiB, 0, 0);
  ASSERT_EQ(vramscope_scope_pop(), VRAMSCOPE_OK);

  ASSERT_EQ(vramscope_snapshot_json(0, (dir / "s.json").c_str()), VRAMSCOPE_OK) << vramscope_last_error();
  const auto json = nlohmann::json::parse(read_file(dir / "s.json"));
  int found = 0;
  for (const auto& seg : json.at("segments")) {
    for (const auto& b : seg.at("blocks")) {
      if (b.value("state", "") != "active_allocated") continue;
      const std::string module = b.value("module", "");
      const std::string phase = b.value("phase", "");
      if (module == "encoder.layer0" && phase == "forward") ++found;
      if (module == "head" && phase == "backward") ++found;
    }
  }
  EXPECT_EQ(found, 2) << json.dump(1).substr(0, 3000);

  ASSERT_EQ(vramscope_snapshot_pickle(0, (dir / "s.pickle").c_str()), VRAMSCOPE_OK);
  const std::string pickle = read_file(dir / "s.pickle");
  ASSERT_GT(pickle.size(), 2u);
  EXPECT_EQ(static_cast<unsigned char>(pickle[0]), 0x80);  // protocol 2
  EXPECT_NE(pickle.find("encoder.layer0"), std::string::npos);  // the trace's frames
  EXPECT_EQ(vramscope_snapshot_pickle(0, (dir / "missing" / "s.pickle").c_str()), VRAMSCOPE_ERROR_IO);
  EXPECT_EQ(vramscope_snapshot_json(0, ""), VRAMSCOPE_ERROR_INVALID);
  EXPECT_FALSE(std::filesystem::exists(dir / "missing"));
  vramscope_free(p);
  vramscope_free(q);
  std::filesystem::remove_all(dir);
}

TEST(CApi, SummaryIsSizedLikeSnprintf) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  void* p = vramscope_malloc(5 * MiB, 0, 0);
  const size_t length = vramscope_memory_summary(0, nullptr, 0);
  ASSERT_GT(length, 100u);
  std::string text(length + 1, '\0');
  EXPECT_EQ(vramscope_memory_summary(0, text.data(), text.size()), length);
  text.resize(length);
  EXPECT_NE(text.find("PyTorch CUDA memory summary"), std::string::npos) << text;
  EXPECT_NE(text.find("Allocated memory"), std::string::npos);
  char tiny[8];
  EXPECT_EQ(vramscope_memory_summary(0, tiny, sizeof tiny), length);
  EXPECT_EQ(std::string(tiny), text.substr(0, 7));
  EXPECT_EQ(vramscope_memory_summary(0, nullptr, 10), 0u);
  EXPECT_EQ(vramscope_last_error_code(), VRAMSCOPE_ERROR_INVALID);
  vramscope_free(p);
}

TEST(CApi, EnvironmentChoosesTheDeviceWithoutInit) {
  ::setenv("VRAMSCOPE_DEVICE", "sim:capacity=2GiB,context=0", 1);
  ::setenv("VRAMSCOPE_ALLOC_CONF", "max_split_size_mb:64", 1);
  void* p = vramscope_malloc(MiB, 0, 0);
  ASSERT_NE(p, nullptr) << vramscope_last_error();
  const vramscope_stats s = stats_of(0);
  EXPECT_EQ(s.device_total_bytes, static_cast<std::int64_t>(2048 * MiB));
  EXPECT_EQ(s.max_split_size, static_cast<std::int64_t>(64 * MiB));
  vramscope_free(p);
}

// --- the PyTorch plugin's entry points -----------------------------------------------

TEST(TorchPlugin, NativeStreamsMapToTheirOwnPools) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  void* stream_a = reinterpret_cast<void*>(0x1000);  // cudaStream_t handles as PyTorch passes them
  void* stream_b = reinterpret_cast<void*>(0x2000);
  void* p = vramscope_torch_malloc(5 * MiB, 0, stream_a);
  ASSERT_NE(p, nullptr);
  vramscope_torch_free(p, 5 * MiB, 0, stream_a);
  void* q = vramscope_torch_malloc(5 * MiB, 0, stream_b);  // not stream a's cached block
  EXPECT_NE(q, p);
  void* r = vramscope_torch_malloc(5 * MiB, 0, stream_a);  // stream a again: its block
  EXPECT_EQ(r, p);
  void* d = vramscope_torch_malloc(5 * MiB, 0, nullptr);  // the default stream
  EXPECT_NE(d, p);
  EXPECT_EQ(stats_of(0).segment[0].current, 3);
  vramscope_torch_free(q, 5 * MiB, 0, stream_b);
  vramscope_torch_free(r, 5 * MiB, 0, stream_a);
  vramscope_torch_free(d, 5 * MiB, 0, nullptr);
  EXPECT_EQ(stats_of(0).allocated_bytes[0].current, 0);
}

TEST(TorchPlugin, ZeroBytesIsNullAndFreeingNullIsANoOp) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  EXPECT_EQ(vramscope_torch_malloc(0, 0, nullptr), nullptr);
  vramscope_torch_free(nullptr, 0, 0, nullptr);
  EXPECT_EQ(stats_of(0).allocation[0].allocated, 0);
}

TEST(TorchPlugin, OutOfMemoryThrowsABadAllocIntoPyTorch) {
  ASSERT_EQ(vramscope_init("sim:capacity=1GiB,context=0", ""), VRAMSCOPE_OK);
  try {
    vramscope_torch_malloc(static_cast<ptrdiff_t>(2048 * MiB), 0, nullptr);
    FAIL() << "expected std::bad_alloc";
  } catch (const std::bad_alloc& e) {
    EXPECT_NE(std::string(e.what()).find("2.00 GiB"), std::string::npos) << e.what();
  }
}

TEST(TorchPlugin, RecordStreamDefersReuseOnTheNativeStream) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  void* side = reinterpret_cast<void*>(0x3000);
  void* p = vramscope_torch_malloc(5 * MiB, 0, nullptr);
  vramscope_torch_record_stream(p, side);
  EXPECT_EQ(vramscope_last_error_code(), VRAMSCOPE_OK) << vramscope_last_error();
  vramscope_torch_free(p, 5 * MiB, 0, nullptr);
  // The block's reuse waits for the side stream's event (a simulated one completes at once
  // when queried), so the allocator still counts it active until then.
  EXPECT_GE(stats_of(0).active_bytes[0].peak, static_cast<std::int64_t>(5 * MiB));
  int local = 0;
  vramscope_torch_record_stream(&local, side);  // must not throw: recorded instead
  EXPECT_EQ(vramscope_last_error_code(), VRAMSCOPE_ERROR_INVALID);
}

TEST(TorchPlugin, AForeignPointerInFreeIsRecordedNotThrown) {
  ASSERT_EQ(vramscope_init("sim", ""), VRAMSCOPE_OK);
  int local = 0;
  vramscope_torch_free(&local, 4, 0, nullptr);  // a deleter must not throw
  EXPECT_EQ(vramscope_last_error_code(), VRAMSCOPE_ERROR_INVALID);
  EXPECT_NE(std::string(vramscope_last_error()).find("vramscope_torch_free"), std::string::npos);
}

}  // namespace
