# install.cmake — `cmake --install`: headers, libraries, the vramscope command, the
# CMake package (find_package(vramscope CONFIG)) and a pkg-config file.
include(CMakePackageConfigHelpers)

set(VRAMSCOPE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/vramscope)

install(TARGETS vramscope_allocator vramscope_instrumentation vramscope_replay vramscope_runtime vramscope_models
                vramscope_planner
                vramscope_c
  EXPORT vramscopeTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS vramscope RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(module allocator instrumentation replay runtime models planner bindings)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${module}/include/
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()

install(EXPORT vramscopeTargets NAMESPACE vramscope:: DESTINATION ${VRAMSCOPE_CMAKE_DIR})
# What the config must find again: with static libraries, the private dependencies
# travel with the targets (as $<LINK_ONLY:...>).
get_target_property(VRAMSCOPE_LIBRARY_TYPE vramscope_allocator TYPE)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/vramscopeConfig.cmake.in
  ${PROJECT_BINARY_DIR}/vramscopeConfig.cmake
  INSTALL_DESTINATION ${VRAMSCOPE_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/vramscopeConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/vramscopeConfig.cmake
              ${PROJECT_BINARY_DIR}/vramscopeConfigVersion.cmake
        DESTINATION ${VRAMSCOPE_CMAKE_DIR})

# pkg-config: `pkg-config --cflags --libs vramscope` (C++ libraries; add --static for
# static ones) and vramscope-c for the C API alone.
set(VRAMSCOPE_PC_PRIVATE "-lfmt -lopenblas -pthread")
if(VRAMSCOPE_HAVE_CUDA)
  string(APPEND VRAMSCOPE_PC_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -ldl -lrt")
endif()
# The prefix relative to the .pc file, so the tree can be installed anywhere
# (lib/pkgconfig, or lib/x86_64-linux-gnu/pkgconfig on Debian with prefix /usr).
file(RELATIVE_PATH VRAMSCOPE_PC_TO_PREFIX /${CMAKE_INSTALL_LIBDIR}/pkgconfig /)
string(REGEX REPLACE "/$" "" VRAMSCOPE_PC_TO_PREFIX "${VRAMSCOPE_PC_TO_PREFIX}")
configure_file(${CMAKE_CURRENT_LIST_DIR}/vramscope.pc.in ${PROJECT_BINARY_DIR}/vramscope.pc @ONLY)
configure_file(${CMAKE_CURRENT_LIST_DIR}/vramscope-c.pc.in ${PROJECT_BINARY_DIR}/vramscope-c.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/vramscope.pc ${PROJECT_BINARY_DIR}/vramscope-c.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
