// The translation unit that compiles the tests' shared precompiled header
// (Note [Test precompiled header] in tests/CMakeLists.txt); nothing else.
