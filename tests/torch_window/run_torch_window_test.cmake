# Configures dtrain against stand-in LibTorch packages outside the supported
# window (cmake/DtrainTorch.cmake) and checks that configuring fails with the
# message naming the version found and the window. The stand-ins are a
# TorchConfigVersion.cmake and an empty TorchConfig.cmake: the check must
# fire before anything of LibTorch is used.
file(REMOVE_RECURSE ${WORK_DIR})
foreach(version 1.13.1 2.10.0 2.16.0)
  set(prefix ${WORK_DIR}/libtorch-${version})
  file(WRITE ${prefix}/share/cmake/Torch/TorchConfigVersion.cmake "set(PACKAGE_VERSION \"${version}\")
if(PACKAGE_VERSION VERSION_LESS PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
endif()
")
  file(WRITE ${prefix}/share/cmake/Torch/TorchConfig.cmake "set(TORCH_LIBRARIES \"\")\n")
  # Only the stand-in may be found: no environment or system prefixes (so the
  # build tool and compiler are passed in).
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${DTRAIN_SOURCE_DIR} -B ${WORK_DIR}/build-${version} -G ${CMAKE_GENERATOR}
      -DCMAKE_MAKE_PROGRAM=${CMAKE_MAKE_PROGRAM} -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}
      -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_FIND_USE_SYSTEM_ENVIRONMENT_PATH=OFF
      -DCMAKE_FIND_USE_CMAKE_SYSTEM_PATH=OFF -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
      -DDTRAIN_BUILD_TESTS=OFF -DDTRAIN_BUILD_EXAMPLES=OFF -DDTRAIN_BUILD_BENCH=OFF
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "configuring against LibTorch ${version} succeeded; it is outside the window")
  endif()
  if(NOT err MATCHES "dtrain supports LibTorch 2\\.11 through 2\\.15" OR NOT err MATCHES "LibTorch ${version}"
     OR NOT err MATCHES "HINT:")
    message(FATAL_ERROR "configuring against LibTorch ${version} failed without the window message:\n${err}")
  endif()
  message(STATUS "LibTorch ${version} refused as expected")
endforeach()
