// dtrain's exception hierarchy and the two check macros.
//
// Library code reports problems by throwing; only a program's main() turns an
// exception into an exit code. Errors caused by the user (bad configuration,
// bad data, an unreachable peer) carry a hint saying what to do; broken
// internal invariants use DTRAIN_INTERNAL_ASSERT and say so. Every message is
// prefixed with the calling thread's rank tag ("[rank R/W] ") once a process
// group has been initialised on it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dtrain {

class Error : public std::runtime_error {
 public:
  // `what()` is "[rank R/W] <message> Hint: <hint>" (parts omitted when empty).
  Error(const std::string& message, const std::string& hint = "");
  const std::string& message() const noexcept { return message_; }
  const std::string& hint() const noexcept { return hint_; }

 private:
  std::string message_;
  std::string hint_;
};

// Invalid options, environment variables or arguments.
class ConfigError : public Error {
  using Error::Error;
};
// A blocking operation (connect, rendezvous, collective, worker) ran out of time.
class TimeoutError : public Error {
  using Error::Error;
};
// Ranks could not agree on the group (world size, membership, duplicate ranks).
class RendezvousError : public Error {
  using Error::Error;
};
// A collective or point-to-point operation failed.
class CommunicationError : public Error {
  using Error::Error;
};
// A dataset file is missing, corrupt, truncated or inconsistent.
class DataError : public Error {
  using Error::Error;
};
// A requested device does not exist or cannot be used.
class DeviceError : public Error {
  using Error::Error;
};
// A dtrain bug: an invariant that should hold did not.
class InternalError : public Error {
  using Error::Error;
};

namespace detail {
[[noreturn]] void throw_internal(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace dtrain

// Throws `ErrorType(message, hint)` unless `cond` holds. `message` and `hint`
// are stream expressions: DTRAIN_CHECK(n > 0, ConfigError, "n=" << n, "pass n >= 1").
// NOLINTBEGIN(bugprone-macro-parentheses): `message` and `hint` are stream
// expressions (`"n=" << n`), which parentheses would break.
#define DTRAIN_CHECK(cond, ErrorType, message, hint)                    \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::ostringstream dtrain_msg_, dtrain_hint_;                     \
      dtrain_msg_ << message;                                           \
      dtrain_hint_ << hint;                                             \
      throw ::dtrain::ErrorType(dtrain_msg_.str(), dtrain_hint_.str()); \
    }                                                                   \
  } while (false)

// For invariants of dtrain's own code; failing one is a bug to report.
#define DTRAIN_INTERNAL_ASSERT(cond, message)                                         \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::ostringstream dtrain_msg_;                                                 \
      dtrain_msg_ << message;                                                         \
      ::dtrain::detail::throw_internal(__FILE__, __LINE__, #cond, dtrain_msg_.str()); \
    }                                                                                 \
  } while (false)
// NOLINTEND(bugprone-macro-parentheses)
