// The TLS flags of the command-line clients (kvq, kvq-demo): --tls_ca,
// --tls_cert, --tls_key, --tls_server_name. Linked only into those
// binaries, so the library itself defines no flags.
#ifndef KVQ_CLIENT_TLS_FLAGS_H_
#define KVQ_CLIENT_TLS_FLAGS_H_

#include "absl/status/status.h"
#include "client/kvq_client.h"

namespace kvq {

// With any of --tls_ca, --tls_cert or --tls_key set, TLS credentials from
// those files (tls_credentials.h) and the --tls_server_name override go
// into `options`; with none, `options` is left plaintext. --tls_server_name
// alone is an error (INVALID_ARGUMENT naming it), as are the files' errors.
absl::Status ApplyTlsFlags(ClientOptions* options);

}  // namespace kvq

#endif  // KVQ_CLIENT_TLS_FLAGS_H_
