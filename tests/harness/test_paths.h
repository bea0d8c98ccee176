// Where the tests find this checkout's files and the build tree's programs.
#pragma once

#include <string>

namespace dtrain::testing {

// The checkout's root (CMake's PROJECT_SOURCE_DIR), absolute.
const std::string& source_dir();
// The build tree's root (PROJECT_BINARY_DIR), absolute: tools/dtrain,
// examples/gpt, tests/dtrain_*_worker are under it.
const std::string& binary_dir();

// Both are fixed at configure time in one generated translation unit
// (tests/harness/test_paths.cpp.in), not in -D definitions or in the test
// files: a test object that names no path of its checkout is the same compile
// in every checkout, so ccache shares it between them (Note [Test unity
// builds] in tests/CMakeLists.txt).

}  // namespace dtrain::testing
