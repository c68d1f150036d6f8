#include "service/server_config.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "gRPC listen address (host:port; port 0 picks one)");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9464",
          "Prometheus /metrics listen address; empty disables it");
ABSL_FLAG(std::string, backend, "auto", "Kernel backend: auto, cpu, ref or cuda");
ABSL_FLAG(int64_t, capacity_bytes, 0,
          "Page pool size in bytes; 0 uses --capacity_fraction of available memory");
ABSL_FLAG(double, capacity_fraction, 0.25,
          "Fraction of available memory for the page pool when --capacity_bytes is 0");
ABSL_FLAG(int64_t, device_capacity_bytes, 0,
          "With the cuda backend: device memory for the pages (one allocation at start); 0 "
          "uses --device_capacity_fraction of the free device memory");
ABSL_FLAG(double, device_capacity_fraction, 0.8,
          "Fraction of free device memory for the pages when --device_capacity_bytes is 0");
ABSL_FLAG(int64_t, device_page_bytes, 128 << 10,
          "Slot size of the device page pool: every page takes one, so at least the largest "
          "page a sequence's scheme and shape make (a multiple of 64)");
ABSL_FLAG(int64_t, slab_bytes, 1 << 20, "Page pool slab size (a multiple of 64)");
ABSL_FLAG(bool, pool_huge_pages, true,
          "Ask for transparent huge pages on the page pool (madvise): fewer TLB misses when "
          "attention streams long contexts");
ABSL_FLAG(int32_t, default_ttl_seconds, 600, "Idle lease of a sequence when the client sets none");
ABSL_FLAG(int32_t, max_ttl_seconds, 86400, "Largest idle lease a client may ask for");
ABSL_FLAG(bool, evict, false,
          "When the pool is full, evict released and idle sequences (LRU) instead of failing");
ABSL_FLAG(int32_t, max_sequences, 100000, "Most sequences held at once");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20, "Largest request message accepted");
ABSL_FLAG(int64_t, fetch_chunk_bytes, 1 << 20, "Default FetchDequant message size");
ABSL_FLAG(std::string, port_file, "", "Write the bound gRPC port to this file");
ABSL_FLAG(int32_t, shutdown_grace_seconds, 10, "On SIGTERM, time in-flight RPCs get to finish");
ABSL_FLAG(double, verify_fraction, 1.0,
          "Share of page reads that verify the pages' checksums (XXH3, taken when a page is "
          "sealed): 1 every read, 0 none, in between an evenly spread deterministic sample");
ABSL_FLAG(bool, retain_message_buffers, true,
          "Keep freed message buffers in the heap for reuse (glibc: no mmap below 32 MiB, "
          "trim above 64 MiB) instead of mapping and unmapping every large message");
// TLS (service/tls_config.h) and the exposure rule
// (service/exposure_check.h).
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the gRPC port; with --tls_key, the port speaks TLS only");
ABSL_FLAG(std::string, tls_key, "", "PEM private key (unencrypted) of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mutual TLS)");
ABSL_FLAG(int32_t, tls_refresh_seconds, 60,
          "How often the --tls_* files are re-read; new connections use what was read, open "
          "ones keep theirs");
ABSL_FLAG(std::string, metrics_tls_cert, "",
          "PEM certificate chain of the metrics port; with --metrics_tls_key, /metrics is "
          "served over HTTPS only (re-read every --tls_refresh_seconds)");
ABSL_FLAG(std::string, metrics_tls_key, "", "PEM private key (unencrypted) of --metrics_tls_cert");
ABSL_FLAG(bool, insecure, false,
          "Allow a non-loopback --address without TLS or tokens (plaintext; logs a warning)");
ABSL_FLAG(std::string, tokens_file, "",
          "Bearer tokens of the tenants, their quotas and rate limits (docs/DEPLOY.md); "
          "empty: no authentication, every call is the default tenant");
ABSL_FLAG(int32_t, tokens_reload_ms, 1000,
          "How often the tokens file is checked for changes (modification time and size)");
ABSL_FLAG(std::string, calibration_dir, "",
          "Directory of calibration files (NAME.kvqcal, from kvq-eval --write_calibration) that "
          "crq schemes name in CreateSequence; rescanned on SIGHUP and every "
          "--calibration_reload_seconds (a file that fails validation is skipped and logged, the "
          "version loaded before stays); empty: none");
ABSL_FLAG(int32_t, calibration_reload_seconds, 60,
          "How often --calibration_dir is rescanned; 0: only at start and on SIGHUP");

namespace kvq {

absl::StatusOr<size_t> AvailableMemoryBytes() {
  size_t available = 0;
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream fields(line.substr(13));
      size_t kib = 0;
      fields >> kib;
      available = kib * 1024;
    }
  }
  if (available == 0) return absl::UnavailableError("cannot read MemAvailable from /proc/meminfo");
  // In a container the cgroup limit (v2, then v1) is the real bound.
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream limit_file(path);
    size_t limit = 0;
    if (limit_file >> limit && limit > 0) {
      available = std::min(available, limit);
      break;
    }
  }
  return available;
}

absl::StatusOr<ServerConfig> ConfigFromFlags() {
  ServerConfig c;
  auto bad = [](absl::string_view flag, auto value, absl::string_view bound) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", bound));
  };
  c.address = absl::GetFlag(FLAGS_address);
  if (c.address.find(':') == std::string::npos) return bad("address", c.address, "must be host:port");
  c.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  c.backend = absl::GetFlag(FLAGS_backend);
  if (c.backend != "auto" && c.backend != "cpu" && c.backend != "ref" && c.backend != "cuda") {
    return bad("backend", c.backend, "must be auto, cpu, ref or cuda");
  }
  c.port_file = absl::GetFlag(FLAGS_port_file);

  const int64_t slab = absl::GetFlag(FLAGS_slab_bytes);
  if (slab < 64 || slab % 64 != 0 || slab > (int64_t{1} << 30)) {
    return bad("slab_bytes", slab, "must be a multiple of 64 in [64, 1 GiB]");
  }
  c.store.pool.slab_bytes = slab;
  c.store.pool.huge_pages = absl::GetFlag(FLAGS_pool_huge_pages);
  int64_t capacity = absl::GetFlag(FLAGS_capacity_bytes);
  if (capacity < 0) return bad("capacity_bytes", capacity, "must be >= 0");
  if (capacity == 0) {
    const double fraction = absl::GetFlag(FLAGS_capacity_fraction);
    if (!(fraction > 0.0 && fraction <= 0.95)) {
      return bad("capacity_fraction", fraction, "must be in (0, 0.95]");
    }
    absl::StatusOr<size_t> available = AvailableMemoryBytes();
    if (!available.ok()) return available.status();
    capacity = static_cast<int64_t>(fraction * static_cast<double>(*available));
  }
  if (capacity < slab) {
    return bad("capacity_bytes", capacity, absl::StrCat("must hold at least one slab of ", slab, " bytes"));
  }
  c.store.pool.capacity_bytes = capacity;

  // The device pool's capacity is checked against the device at start
  // (DevicePagePool::Create): only the flags' own bounds here.
  c.device_pool.capacity_bytes = absl::GetFlag(FLAGS_device_capacity_bytes);
  if (c.device_pool.capacity_bytes < 0) {
    return bad("device_capacity_bytes", c.device_pool.capacity_bytes, "must be >= 0");
  }
  c.device_pool.capacity_fraction = absl::GetFlag(FLAGS_device_capacity_fraction);
  if (!(c.device_pool.capacity_fraction > 0.0 && c.device_pool.capacity_fraction <= 0.95)) {
    return bad("device_capacity_fraction", c.device_pool.capacity_fraction,
               "must be in (0, 0.95]");
  }
  c.device_pool.page_bytes = absl::GetFlag(FLAGS_device_page_bytes);
  if (c.device_pool.page_bytes < 64 || c.device_pool.page_bytes % 64 != 0 ||
      c.device_pool.page_bytes > (int64_t{64} << 20)) {
    return bad("device_page_bytes", c.device_pool.page_bytes,
               "must be a multiple of 64 in [64, 64 MiB]");
  }
  if (c.device_pool.capacity_bytes > 0 && c.device_pool.capacity_bytes < c.device_pool.page_bytes) {
    return bad("device_capacity_bytes", c.device_pool.capacity_bytes,
               absl::StrCat("must hold at least one page of --device_page_bytes=",
                            c.device_pool.page_bytes));
  }

  const int32_t ttl = absl::GetFlag(FLAGS_default_ttl_seconds);
  const int32_t max_ttl = absl::GetFlag(FLAGS_max_ttl_seconds);
  if (max_ttl < 1) return bad("max_ttl_seconds", max_ttl, "must be >= 1");
  if (ttl < 1 || ttl > max_ttl) {
    return bad("default_ttl_seconds", ttl, absl::StrCat("must be in [1, --max_ttl_seconds=", max_ttl, "]"));
  }
  c.store.default_ttl = absl::Seconds(ttl);
  c.store.max_ttl = absl::Seconds(max_ttl);
  c.store.evict_when_full = absl::GetFlag(FLAGS_evict);
  c.store.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  if (c.store.max_sequences < 1) return bad("max_sequences", c.store.max_sequences, "must be >= 1");

  c.service.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (c.service.max_message_bytes < 1024 || c.service.max_message_bytes > (int64_t{1} << 30)) {
    return bad("max_message_bytes", c.service.max_message_bytes, "must be in [1 KiB, 1 GiB]");
  }
  c.service.fetch_chunk_bytes = absl::GetFlag(FLAGS_fetch_chunk_bytes);
  if (c.service.fetch_chunk_bytes < 1024 ||
      c.service.fetch_chunk_bytes > c.service.max_message_bytes) {
    return bad("fetch_chunk_bytes", c.service.fetch_chunk_bytes,
               "must be in [1 KiB, --max_message_bytes]");
  }
  c.service.verify_fraction = absl::GetFlag(FLAGS_verify_fraction);
  if (!(c.service.verify_fraction >= 0.0 && c.service.verify_fraction <= 1.0)) {
    return bad("verify_fraction", c.service.verify_fraction, "must be in [0, 1]");
  }
  const int32_t grace = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  if (grace < 0) return bad("shutdown_grace_seconds", grace, "must be >= 0");
  c.shutdown_grace = absl::Seconds(grace);
  c.retain_message_buffers = absl::GetFlag(FLAGS_retain_message_buffers);

  c.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  c.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  c.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  c.tls.refresh_interval = absl::Seconds(absl::GetFlag(FLAGS_tls_refresh_seconds));
  if (absl::Status s = ValidateTlsServerOptions(c.tls); !s.ok()) return s;
  c.metrics_tls.cert_file = absl::GetFlag(FLAGS_metrics_tls_cert);
  c.metrics_tls.key_file = absl::GetFlag(FLAGS_metrics_tls_key);
  c.metrics_tls.refresh_interval = c.tls.refresh_interval;
  if (absl::Status s = ValidateMetricsTlsOptions(c.metrics_tls, c.metrics_address); !s.ok()) {
    return s;
  }
  c.insecure = absl::GetFlag(FLAGS_insecure);
  c.tokens_file = absl::GetFlag(FLAGS_tokens_file);
  const int32_t reload_ms = absl::GetFlag(FLAGS_tokens_reload_ms);
  if (reload_ms < 10 || reload_ms > 3600000) {
    return bad("tokens_reload_ms", reload_ms, "must be in [10, 3600000]");
  }
  c.tokens_reload_interval = absl::Milliseconds(reload_ms);
  c.calibration_dir = absl::GetFlag(FLAGS_calibration_dir);
  const int32_t calibration_reload = absl::GetFlag(FLAGS_calibration_reload_seconds);
  if (calibration_reload < 0 || calibration_reload > 86400) {
    return bad("calibration_reload_seconds", calibration_reload, "must be in [0, 86400]");
  }
  c.calibration_reload_interval = absl::Seconds(calibration_reload);
  return c;
}

}  // namespace kvq
