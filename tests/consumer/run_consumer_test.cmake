# Installs dtrain from the build tree into a scratch prefix, then configures,
# builds and runs tests/consumer against it. Fails on any step.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${DTRAIN_BINARY_DIR} --prefix ${prefix})
run(${CMAKE_COMMAND} -S ${DTRAIN_SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -G ${CMAKE_GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix} -DTorch_DIR=${TORCH_DIR} -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
if(NOT last_output MATCHES "consumer ok")
  message(FATAL_ERROR "consumer printed: ${last_output}")
endif()
message(STATUS "${last_output}")
