# python_wheel.cmake — what `pip install .` puts into the wheel (the "python" install
# component, the only one scikit-build-core installs): the command, the C API library
# beside the package that loads it, and the zoo's files. Paths are inside the wheel.
if(NOT SKBUILD)  # scikit-build-core's build only: `cmake --install` keeps its usual tree
  return()
endif()
install(PROGRAMS $<TARGET_FILE:vramscope> DESTINATION vramscope/bin COMPONENT python)
# One file under the name the package looks for (a wheel cannot hold the soname links).
install(FILES $<TARGET_FILE:vramscope_c> DESTINATION vramscope RENAME libvramscope.so COMPONENT python)
# The planner API (vramscope.estimate, sweep, max_batch, plan).
install(FILES $<TARGET_FILE:vramscope_planner_c> DESTINATION vramscope RENAME libvramscope_planner.so COMPONENT python)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/models/zoo/ DESTINATION vramscope/zoo COMPONENT python
        FILES_MATCHING PATTERN "*.json")
