// Worker-side error reporting for `dtrain run` (and torchrun).
//
// The launcher sets TORCHELASTIC_ERROR_FILE for each worker. A worker that
// dies of an uncaught exception or a fatal signal leaves its message there,
// and the launcher prints it as the root cause of the failure.
//
//   int main(int argc, char** argv) {
//     return dtrain::elastic::run_recording_errors([&] { return real_main(argc, argv); }, "my_program");
//   }
#pragma once

#include <functional>
#include <string>

namespace dtrain::elastic {

// Writes {"message": {"message": ..., "extraInfo": {...}}} (torch elastic's
// format) to TORCHELASTIC_ERROR_FILE if set; returns whether it wrote.
bool write_error_file(const std::string& message);

// The launcher's side: the message a worker left in the error file at
// `path` (either torch elastic shape), or "" when there is none or it is
// unreadable.
std::string read_error_message(const std::string& path);

// Installs a std::terminate handler and handlers for SIGSEGV, SIGABRT,
// SIGBUS, SIGFPE and SIGILL that record the cause before the process dies.
void install_error_handlers();

// Runs `main` with the handlers installed; an escaping exception is recorded,
// printed as "<program>: error: [rank r/w] <message>" (the rank tag when the
// message does not start with it already, as dtrain::Error's do), and turned
// into exit code 1. TrainingFinishedError (a fault-tolerant replica group
// that came back after the training finished) is printed and exits 0.
int run_recording_errors(const std::function<int()>& main, const std::string& program = "");

}  // namespace dtrain::elastic
