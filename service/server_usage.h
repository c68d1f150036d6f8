// ServerUsage: what `kvq-server --help` prints: every flag of the server
// (service/server_config.cc) with its default and help, grouped by what it
// governs (listening, backend and pool, security, limits). Abseil's own
// --help lists only flags defined in a file named like the program, which
// for kvq-server is none.
#ifndef KVQ_SERVICE_SERVER_USAGE_H_
#define KVQ_SERVICE_SERVER_USAGE_H_

#include <string>

namespace kvq {

// The usage text. A flag of server_config.cc missing from the groups'
// table is listed under "Other" rather than left out.
std::string ServerUsage();

// Whether `arg` asks for the usage text (--help, -help, -h).
bool IsHelpArg(const char* arg);

}  // namespace kvq

#endif  // KVQ_SERVICE_SERVER_USAGE_H_
