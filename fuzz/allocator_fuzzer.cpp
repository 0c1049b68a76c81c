// allocator_fuzzer.cpp — libFuzzer entry: every input decodes to a run of
// allocator operations (tests/reliability/operations.hpp) checked against the
// reference model and validate() after each op; any broken contract aborts.
//
//   build/fuzz/fuzz/allocator_fuzzer -max_total_time=60 corpus_copy/ fuzz/corpus/
//   build/fuzz/fuzz/allocator_fuzzer crash-<sha1>       # reproduce one input
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "operations.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    mem::reliability::run_bytes(data, size);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allocator_fuzzer: %s\n", e.what());
    std::abort();
  }
  return 0;
}
