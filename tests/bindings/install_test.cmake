# install_test.cmake — `cmake --install` into a scratch prefix, then the README's
# "In your training binary" snippets, extracted verbatim, built as an outside project
# with find_package(vramscope CONFIG) and again with pkg-config, and run: their output
# must equal the output pasted in the README.
#   cmake -DSOURCE_DIR=... -DBUILD_DIR=... -DWORK_DIR=... -DLIBDIR=lib -DPYTHON=... -DCXX=...
#         -DCC=... -P install_test.cmake
cmake_minimum_required(VERSION 3.25)

function(run)
  # In the scratch folder: the README's programs write files where they run.
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY ${WORK_DIR}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(JOIN " " cmd ${ARGN})
    message(FATAL_ERROR "failed (${rc}): ${cmd}\n${out}\n${err}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix ${WORK_DIR}/prefix)
set(project ${WORK_DIR}/my_trainer)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
if(NOT LIBDIR)
  set(LIBDIR lib)
endif()
foreach(installed include/vramscope/c_api.h include/vramscope/allocator/caching_allocator.hpp
                  ${LIBDIR}/cmake/vramscope/vramscopeConfig.cmake ${LIBDIR}/pkgconfig/vramscope.pc
                  bin/vramscope)
  if(NOT EXISTS ${prefix}/${installed})
    message(FATAL_ERROR "not installed: ${installed}")
  endif()
endforeach()

# The snippets, verbatim from the README.
run(${PYTHON} ${SOURCE_DIR}/scripts/readme_snippets.py extract ${SOURCE_DIR}/README.md ${WORK_DIR})

# 1. CMake: find_package(vramscope CONFIG), with the example copied out of the tree as the
# README says (it needs vramscope::models: issue 36).
file(COPY ${SOURCE_DIR}/examples/hooks_and_exports.cpp DESTINATION ${project})
run(${CMAKE_COMMAND} -S ${project} -B ${project}/build -DCMAKE_PREFIX_PATH=${prefix}
    -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_C_COMPILER=${CC} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${project}/build -j2)

foreach(program my_trainer my_c_tool)
  run(${project}/build/${program})
  file(READ ${WORK_DIR}/expected/${program}.txt expected)
  if(NOT run_output STREQUAL expected)
    message(FATAL_ERROR "${program} printed:\n${run_output}\nthe README shows:\n${expected}")
  endif()
  message(STATUS "${program} (CMake package): output as in the README")
endforeach()
run(${project}/build/hooks_and_exports ${WORK_DIR}/example-out)
if(NOT EXISTS ${WORK_DIR}/example-out)
  message(FATAL_ERROR "hooks_and_exports, built out of the tree, wrote nothing")
endif()
message(STATUS "hooks_and_exports (CMake package, vramscope::models): built out of the tree and ran")

# 2. pkg-config: the same sources with the .pc files' flags.
find_program(PKG_CONFIG pkg-config)
if(PKG_CONFIG)
  set(ENV{PKG_CONFIG_PATH} "${prefix}/${LIBDIR}/pkgconfig")
  run(${PKG_CONFIG} --cflags --libs --static vramscope)
  string(STRIP "${run_output}" cxx_flags)
  separate_arguments(cxx_flags UNIX_COMMAND "${cxx_flags}")
  run(${CXX} ${project}/main.cpp -o ${WORK_DIR}/my_trainer_pc ${cxx_flags}
      -Wl,-rpath,${prefix}/${LIBDIR})  # for a BUILD_SHARED_LIBS tree
  run(${WORK_DIR}/my_trainer_pc)
  file(READ ${WORK_DIR}/expected/my_trainer.txt expected)
  if(NOT run_output STREQUAL expected)
    message(FATAL_ERROR "my_trainer (pkg-config) printed:\n${run_output}")
  endif()
  run(${PKG_CONFIG} --cflags --libs vramscope-c)
  string(STRIP "${run_output}" c_flags)
  separate_arguments(c_flags UNIX_COMMAND "${c_flags}")
  run(${CC} -std=c99 ${project}/main.c -o ${WORK_DIR}/my_c_tool_pc ${c_flags}
      -Wl,-rpath,${prefix}/${LIBDIR})
  run(${WORK_DIR}/my_c_tool_pc)
  file(READ ${WORK_DIR}/expected/my_c_tool.txt expected)
  if(NOT run_output STREQUAL expected)
    message(FATAL_ERROR "my_c_tool (pkg-config) printed:\n${run_output}")
  endif()
  message(STATUS "pkg-config builds: output as in the README")
else()
  message(STATUS "pkg-config not found: the .pc files were installed but not tried")
endif()
