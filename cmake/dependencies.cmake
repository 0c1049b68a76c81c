# dependencies.cmake — every system library the build needs, looked for once, up front:
# a fresh machine gets one message naming all that is missing and the command that
# installs it, not the first of several CMake errors.
set(vramscope_missing "")
macro(vramscope_need package debian)
  find_package(${package} ${ARGN} QUIET)
  if(NOT ${package}_FOUND)
    list(APPEND vramscope_missing ${debian})
  endif()
endmacro()

vramscope_need(fmt libfmt-dev)
vramscope_need(nlohmann_json nlohmann-json3-dev 3)
vramscope_need(CLI11 libcli11-dev)
set(BLA_VENDOR OpenBLAS)  # as runtime/ asks for it
vramscope_need(BLAS libopenblas-dev)
if(VRAMSCOPE_BUILD_TESTS)
  vramscope_need(GTest "libgtest-dev libgmock-dev")
endif()
if(VRAMSCOPE_BUILD_BENCH)
  vramscope_need(benchmark libbenchmark-dev)
endif()
if(vramscope_missing)
  string(REPLACE ";" " " vramscope_missing "${vramscope_missing}")
  message(FATAL_ERROR
    "vramscope: system libraries missing: ${vramscope_missing}\n"
    "Install them with scripts/install_deps.sh (Debian/Ubuntu), or: "
    "sudo apt-get install ${vramscope_missing}")
endif()
