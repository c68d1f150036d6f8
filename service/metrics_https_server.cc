#include "service/metrics_https_server.h"

#include <gnutls/abstract.h>
#include <gnutls/gnutls.h>
#include <microhttpd.h>
#include <netdb.h>
#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "service/tls_config.h"

namespace kvq {
namespace {

constexpr char kCertFlag[] = "metrics_tls_cert";
constexpr char kKeyFlag[] = "metrics_tls_key";
constexpr unsigned int kMaxChainLength = 16;

// A certificate chain and its private key in the form GnuTLS's certificate
// callback hands out.
struct KeyPair {
  std::vector<gnutls_pcert_st> chain;
  gnutls_privkey_t key = nullptr;

  KeyPair() = default;
  KeyPair(const KeyPair&) = delete;
  KeyPair& operator=(const KeyPair&) = delete;
  ~KeyPair() {
    for (gnutls_pcert_st& c : chain) gnutls_pcert_deinit(&c);
    if (key != nullptr) gnutls_privkey_deinit(key);
  }
};

gnutls_datum_t Datum(const std::string& bytes) {
  return {reinterpret_cast<unsigned char*>(const_cast<char*>(bytes.data())),
          static_cast<unsigned int>(bytes.size())};
}

// The SHA-256 key id of a public key (empty on error).
std::string KeyId(gnutls_pubkey_t key) {
  unsigned char id[64];
  size_t size = sizeof(id);
  if (gnutls_pubkey_get_key_id(key, GNUTLS_KEYID_USE_SHA256, id, &size) < 0) return "";
  return std::string(reinterpret_cast<char*>(id), size);
}

// Parses the PEM bytes the reload thread read and checks that the key
// belongs to the first certificate, on the same bytes it will serve (the
// files may change again between two reads).
absl::StatusOr<std::shared_ptr<KeyPair>> ParseKeyPair(const std::string& cert_pem,
                                                      const std::string& key_pem) {
  auto pair = std::make_shared<KeyPair>();
  gnutls_pcert_st certs[kMaxChainLength];
  unsigned int n = kMaxChainLength;
  const gnutls_datum_t cert_datum = Datum(cert_pem);
  int rc = gnutls_pcert_list_import_x509_raw(certs, &n, &cert_datum, GNUTLS_X509_FMT_PEM, 0);
  if (rc < 0 || n == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", kCertFlag, ": no usable PEM certificate chain (",
                     gnutls_strerror(rc), ")"));
  }
  pair->chain.assign(certs, certs + n);
  if ((rc = gnutls_privkey_init(&pair->key)) < 0) {
    pair->key = nullptr;
    return absl::InternalError(absl::StrCat("gnutls_privkey_init: ", gnutls_strerror(rc)));
  }
  const gnutls_datum_t key_datum = Datum(key_pem);
  rc = gnutls_privkey_import_x509_raw(pair->key, &key_datum, GNUTLS_X509_FMT_PEM, nullptr, 0);
  if (rc < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", kKeyFlag, ": no unencrypted PEM private key (", gnutls_strerror(rc), ")"));
  }
  gnutls_pubkey_t from_key = nullptr;
  std::string key_id;
  if (gnutls_pubkey_init(&from_key) >= 0) {
    if (gnutls_pubkey_import_privkey(from_key, pair->key, 0, 0) >= 0) key_id = KeyId(from_key);
    gnutls_pubkey_deinit(from_key);
  }
  if (key_id.empty() || key_id != KeyId(pair->chain[0].pubkey)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", kKeyFlag, " does not match the certificate of --", kCertFlag));
  }
  return pair;
}

bool ReadWholeFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return false;
  *out = ss.str();
  return true;
}

// "host:port", "[v6]:port" or ":port" (every address) as a socket address.
absl::StatusOr<sockaddr_storage> ResolveBind(const std::string& bind) {
  const size_t colon = bind.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("metrics: ", bind, " is not host:port"));
  }
  std::string host = bind.substr(0, colon);
  const std::string port = bind.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", bind, ": ", gai_strerror(rc)));
  }
  sockaddr_storage addr{};
  std::memcpy(&addr, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  return addr;
}

}  // namespace

absl::Status ValidateMetricsTlsOptions(const MetricsTlsOptions& o,
                                       const std::string& metrics_address) {
  if (o.cert_file.empty() && !o.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--metrics_tls_key is set without --metrics_tls_cert: TLS needs both");
  }
  if (!o.cert_file.empty() && o.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--metrics_tls_cert is set without --metrics_tls_key: TLS needs both");
  }
  if (!o.enabled()) return absl::OkStatus();
  if (metrics_address.empty()) {
    return absl::InvalidArgumentError(
        "--metrics_tls_cert is set but --metrics_address is empty: there is no metrics port");
  }
  if (o.refresh_interval < absl::Seconds(1) || o.refresh_interval > absl::Hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_refresh_seconds=",
                                                   absl::ToInt64Seconds(o.refresh_interval),
                                                   ": must be in [1, 86400]"));
  }
  return CheckKeyPairFiles(kCertFlag, o.cert_file, kKeyFlag, o.key_file);
}

class MetricsHttpsServer::Impl {
 public:
  Impl(MetricsTlsOptions options, std::function<std::string()> scrape)
      : options_(std::move(options)), scrape_(std::move(scrape)) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(stop_mu_);
      stopping_ = true;
    }
    stop_cv_.notify_all();
    if (reloader_.joinable()) reloader_.join();
    if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
    std::lock_guard<std::mutex> lock(ActiveMu());
    if (Active() == this) Active() = nullptr;
  }

  absl::Status Listen(const std::string& bind) {
    absl::StatusOr<sockaddr_storage> addr = ResolveBind(bind);
    if (!addr.ok()) return addr.status();
    if (absl::Status s = Reload(); !s.ok()) return s;
    {
      std::lock_guard<std::mutex> lock(ActiveMu());
      if (Active() != nullptr) {
        return absl::FailedPreconditionError("metrics: an HTTPS metrics server already runs");
      }
      Active() = this;
    }
    unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_TLS;
    if (addr->ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    daemon_ = MHD_start_daemon(
        flags, 0, nullptr, nullptr, &Impl::Handle, this, MHD_OPTION_SOCK_ADDR,
        reinterpret_cast<sockaddr*>(&*addr), MHD_OPTION_HTTPS_CERT_CALLBACK, &Impl::Certificate,
        MHD_OPTION_CONNECTION_LIMIT, kMetricsHttpsMaxConnections, MHD_OPTION_CONNECTION_TIMEOUT,
        kMetricsHttpsTimeoutSeconds, MHD_OPTION_END);
    if (daemon_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", bind,
                                                 " (HTTPS): ", std::strerror(errno)));
    }
    const MHD_DaemonInfo* info = MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_BIND_PORT);
    port_ = info == nullptr ? 0 : info->port;
    reloader_ = std::thread([this] { ReloadLoop(); });
    return absl::OkStatus();
  }

  int port() const { return port_; }

 private:
  // The server GnuTLS's callback serves (the callback has no user pointer).
  static std::mutex& ActiveMu() {
    static std::mutex mu;
    return mu;
  }
  static Impl*& Active() {
    static Impl* active = nullptr;
    return active;
  }

  // Reads both files; installs them when their bytes changed and they form
  // a valid pair. The pair in use stays otherwise.
  absl::Status Reload() {
    std::string cert, key;
    if (!ReadWholeFile(options_.cert_file, &cert)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", kCertFlag, "=", options_.cert_file, ": cannot read"));
    }
    if (!ReadWholeFile(options_.key_file, &key)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", kKeyFlag, "=", options_.key_file, ": cannot read"));
    }
    if (cert == cert_pem_ && key == key_pem_) return absl::OkStatus();
    absl::StatusOr<std::shared_ptr<KeyPair>> pair = ParseKeyPair(cert, key);
    if (!pair.ok()) return pair.status();
    cert_pem_ = std::move(cert);
    key_pem_ = std::move(key);
    std::lock_guard<std::mutex> lock(pair_mu_);
    // A handshake may still hold the old pair's pointers: keep it until the
    // server stops (one pair per change of the files, a few KiB each).
    if (current_ != nullptr) retired_.push_back(std::move(current_));
    current_ = *std::move(pair);
    return absl::OkStatus();
  }

  void ReloadLoop() {
    const auto interval = absl::ToChronoMilliseconds(options_.refresh_interval);
    std::string last_error;
    std::unique_lock<std::mutex> lock(stop_mu_);
    while (!stop_cv_.wait_for(lock, interval, [this] { return stopping_; })) {
      lock.unlock();
      const absl::Status s = Reload();
      const std::string error = s.ok() ? "" : std::string(s.message());
      if (!error.empty() && error != last_error) {
        std::fprintf(stderr,
                     "kvq-server: metrics TLS: %s; the previous certificate stays in use\n",
                     error.c_str());
      }
      last_error = error;
      lock.lock();
    }
  }

  static int Certificate(gnutls_session_t, const gnutls_datum_t*, int,
                         const gnutls_pk_algorithm_t*, int, gnutls_pcert_st** pcert,
                         unsigned int* pcert_length, gnutls_privkey_t* pkey) {
    std::lock_guard<std::mutex> active_lock(ActiveMu());
    Impl* self = Active();
    if (self == nullptr) return -1;
    std::lock_guard<std::mutex> lock(self->pair_mu_);
    if (self->current_ == nullptr) return -1;
    *pcert = self->current_->chain.data();
    *pcert_length = static_cast<unsigned int>(self->current_->chain.size());
    *pkey = self->current_->key;
    return 0;
  }

  static MHD_Result Handle(void* cls, MHD_Connection* connection, const char* url,
                           const char* method, const char*, const char*, size_t*, void**) {
    auto* self = static_cast<Impl*>(cls);
    unsigned int status = MHD_HTTP_OK;
    std::string body;
    if (std::strcmp(url, "/metrics") != 0) {
      status = MHD_HTTP_NOT_FOUND;
      body = "Not Found\n";
    } else if (std::strcmp(method, "GET") != 0 && std::strcmp(method, "HEAD") != 0) {
      status = MHD_HTTP_METHOD_NOT_ALLOWED;
      body = "Method Not Allowed\n";
    } else {
      body = self->scrape_();
    }
    MHD_Response* response =
        MHD_create_response_from_buffer(body.size(), body.data(), MHD_RESPMEM_MUST_COPY);
    if (response == nullptr) return MHD_NO;
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE,
                            status == MHD_HTTP_OK ? "text/plain; version=0.0.4" : "text/plain");
    if (status == MHD_HTTP_METHOD_NOT_ALLOWED) {
      MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    }
    const MHD_Result queued = MHD_queue_response(connection, status, response);
    MHD_destroy_response(response);
    return queued;
  }

  const MetricsTlsOptions options_;
  const std::function<std::string()> scrape_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  std::string cert_pem_, key_pem_;  // Bytes of the pair in use (reload thread only).
  std::mutex pair_mu_;
  std::shared_ptr<KeyPair> current_;
  std::vector<std::shared_ptr<KeyPair>> retired_;
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread reloader_;
};

absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> MetricsHttpsServer::Start(
    const std::string& bind, const MetricsTlsOptions& options,
    std::function<std::string()> scrape) {
  auto impl = std::make_unique<Impl>(options, std::move(scrape));
  if (absl::Status s = impl->Listen(bind); !s.ok()) return s;
  return std::unique_ptr<MetricsHttpsServer>(new MetricsHttpsServer(std::move(impl)));
}

MetricsHttpsServer::MetricsHttpsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsHttpsServer::~MetricsHttpsServer() = default;

int MetricsHttpsServer::port() const { return impl_->port(); }

}  // namespace kvq
