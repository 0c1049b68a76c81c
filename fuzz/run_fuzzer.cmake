# run_fuzzer.cmake — allocator_fuzz_short's body: fuzz a copy of the seed corpus
# for SECONDS and fail on any crash, leak, timeout or out-of-memory.
#   cmake -D FUZZER=... -D CORPUS=... -D WORK=... -D ARTIFACTS=... -D SECONDS=60 -P run_fuzzer.cmake
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK} ${ARTIFACTS})
file(GLOB seeds ${CORPUS}/*)
file(COPY ${seeds} DESTINATION ${WORK})
execute_process(
  COMMAND ${FUZZER} -max_total_time=${SECONDS} -rss_limit_mb=2048 -timeout=30
          -print_final_stats=1 -artifact_prefix=${ARTIFACTS}/ ${WORK}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "allocator_fuzzer failed (exit ${rc}); the input is in ${ARTIFACTS}/. "
                      "Reproduce: ${FUZZER} <that file>, or without clang: "
                      "VRAMSCOPE_REPLAY_INPUTS=<that file> vramscope_reliability_tests")
endif()
