// Error files: how a dying worker tells the launcher why.
#include "dtrain/elastic/error_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <fstream>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <nlohmann/json.hpp>

#include "dtrain/log.h"
#include "dtrain/replica_errors.h"

namespace dtrain::elastic {
namespace {

std::string error_json(const std::string& message) {
  nlohmann::json j;
  j["message"]["message"] = message;
  j["message"]["extraInfo"]["timestamp"] = std::to_string(::time(nullptr));
  j["message"]["extraInfo"]["py_callstack"] = "";
  return j.dump();
}

// Async-signal-safe: only open/write/close and a static buffer.
char g_path[4096];
void on_fatal_signal(int sig) {
  if (g_path[0] != '\0') {
    const int fd = ::open(g_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      char buf[256];
      const char* name = sig == SIGSEGV   ? "SIGSEGV"
                         : sig == SIGABRT ? "SIGABRT"
                         : sig == SIGBUS  ? "SIGBUS"
                         : sig == SIGFPE  ? "SIGFPE"
                                          : "SIGILL";
      const int n =
          std::snprintf(buf, sizeof buf, "{\"message\":{\"message\":\"fatal signal %s\",\"extraInfo\":{}}}", name);
      if (n > 0) (void)!::write(fd, buf, static_cast<size_t>(n));
      ::close(fd);
    }
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void on_terminate() {
  std::string message = "std::terminate called";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      message = std::string("uncaught exception: ") + ex.what();
    } catch (...) {
      message = "uncaught non-standard exception";
    }
  }
  // The message goes to stderr (the default handler's would, ours replaces
  // it) and to the error file, which the SIGABRT handler must then leave as
  // it is: "fatal signal SIGABRT" would hide which exception it was.
  std::cerr << log::rank_tag() << (log::rank_tag().empty() ? "" : " ") << message << std::endl;
  if (write_error_file(message)) g_path[0] = '\0';
  std::abort();
}

}  // namespace

bool write_error_file(const std::string& message) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr || *path == '\0') return false;
  // Write a temporary file and rename, so the launcher never reads half a file.
  const std::string tmp = std::string(path) + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return false;
  const std::string body = error_json(message);
  const bool ok = std::fwrite(body.data(), 1, body.size(), f) == body.size();
  std::fclose(f);
  return ok && std::rename(tmp.c_str(), path) == 0;
}

void install_error_handlers() {
  if (const char* path = std::getenv("TORCHELASTIC_ERROR_FILE")) {
    std::strncpy(g_path, path, sizeof g_path - 1);
  }
  std::set_terminate(on_terminate);
  for (int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, on_fatal_signal);
}

int run_recording_errors(const std::function<int()>& main, const std::string& program) {
  install_error_handlers();
  try {
    return main();
  } catch (const TrainingFinishedError& e) {
    // A fault-tolerant replica group that came back after the training
    // finished (docs/fault_tolerance.md, Quorum): nothing is left for it to
    // do; it ends cleanly, having written nothing, and its launcher counts
    // it done instead of restarting it.
    std::cerr << (program.empty() ? "" : program + ": ") << e.what() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    write_error_file(e.what());
    const std::string what = e.what(), tag = log::rank_tag();
    const bool tagged = tag.empty() || what.rfind(tag, 0) == 0;
    std::cerr << (program.empty() ? "" : program + ": ") << "error: " << (tagged ? "" : tag + " ") << what << std::endl;
    return 1;
  }
}

std::string read_error_message(const std::string& path) {
  std::ifstream in(path);
  if (!in) return {};
  try {
    const auto j = nlohmann::json::parse(in);
    if (j.contains("message")) {
      const auto& m = j["message"];
      if (m.is_string()) return m.get<std::string>();
      if (m.contains("message")) return m["message"].get<std::string>();
    }
  } catch (...) {
  }
  return {};
}

}  // namespace dtrain::elastic
