// corpus_replay_test.cpp — the fuzzer's seed corpus (fuzz/corpus) as a
// regression suite in every build: each file goes through the decoder and
// executor, then through the fuzzer's own LLVMFuzzerTestOneInput (compiled
// here with the ordinary compiler, no libFuzzer needed).
// VRAMSCOPE_REPLAY_INPUTS=<file or directory> replays other inputs, e.g. a
// crash file the fuzzer saved.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "operations.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace mem::reliability {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> inputs_in(const fs::path& where) {
  std::vector<fs::path> files;
  if (fs::is_regular_file(where)) return {where};
  if (!fs::is_directory(where)) return files;
  for (const auto& entry : fs::directory_iterator(where)) {
    if (entry.is_regular_file()) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

void replay(const std::vector<fs::path>& files) {
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    const std::vector<char> bytes{std::istreambuf_iterator<char>(in), {}};
    const auto* data = reinterpret_cast<const std::uint8_t*>(bytes.data());
    try {
      run_bytes(data, bytes.size());
    } catch (const std::exception& e) {
      ADD_FAILURE() << file << ": " << e.what();
      continue;
    }
    EXPECT_EQ(LLVMFuzzerTestOneInput(data, bytes.size()), 0) << file;
  }
}

TEST(CorpusReplay, EverySeedInputKeepsTheContract) {
  const std::vector<fs::path> files = inputs_in(VRAMSCOPE_FUZZ_CORPUS_DIR);
  ASSERT_GE(files.size(), 20u) << "seed corpus missing or small: " << VRAMSCOPE_FUZZ_CORPUS_DIR;
  replay(files);
}

TEST(CorpusReplay, InputsFromTheEnvironment) {
  const char* extra = std::getenv("VRAMSCOPE_REPLAY_INPUTS");
  if (extra == nullptr) GTEST_SKIP() << "set VRAMSCOPE_REPLAY_INPUTS to a file or directory";
  const std::vector<fs::path> files = inputs_in(extra);
  ASSERT_FALSE(files.empty()) << "no inputs at " << extra;
  replay(files);
}

}  // namespace
}  // namespace mem::reliability
