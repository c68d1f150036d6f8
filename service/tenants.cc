#include "service/tenants.h"

#include <sys/stat.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "service/sequence_store.h"

namespace kvq {

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // No early exit: every byte of b is compared (against 0 past a's end).
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    diff = diff | (x ^ static_cast<unsigned char>(b[i]));
  }
  return diff == 0;
}

// -------------------------------------------------------------- TokenBucket

TokenBucket::TokenBucket(double rate, double burst, absl::Time now)
    : rate_(rate), burst_(burst), tokens_(burst), last_(now) {}

bool TokenBucket::TryTake(absl::Time now) {
  if (now > last_) {
    tokens_ = std::min(burst_, tokens_ + rate_ * absl::ToDoubleSeconds(now - last_));
    last_ = now;
  }
  if (tokens_ < 1.0) return false;
  tokens_ -= 1.0;
  return true;
}

// ------------------------------------------------------------------- Tenant

Tenant::Tenant(const TenantSpec& spec, absl::Time now) : name_(spec.name) { Update(spec, now); }

void Tenant::Update(const TenantSpec& spec, absl::Time now) {
  absl::MutexLock lock(&mu_);
  const bool same_rate = spec_.rate_rps == spec.rate_rps && spec_.burst == spec.burst;
  spec_ = spec;
  if (spec.rate_rps <= 0) {
    bucket_.reset();
  } else if (!same_rate || bucket_ == nullptr) {
    bucket_ = std::make_unique<TokenBucket>(spec.rate_rps, spec.burst, now);
  }
}

TenantSpec Tenant::spec() const {
  absl::MutexLock lock(&mu_);
  return spec_;
}

absl::Status Tenant::Admit(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (bucket_ == nullptr || bucket_->TryTake(now)) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrFormat("tenant \"%s\" is over its rate limit: rate_rps = %g, burst = %g", name_,
                      spec_.rate_rps, spec_.burst));
}

// ------------------------------------------------------------------ Tenants

Tenants::FileStamp Tenants::Stamp(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return FileStamp{};
  return FileStamp{int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec,
                   static_cast<int64_t>(st.st_size)};
}

absl::StatusOr<std::unique_ptr<Tenants>> Tenants::Load(const std::string& path) {
  const FileStamp stamp = Stamp(path);
  absl::StatusOr<std::vector<TenantSpec>> specs = ReadTokensFile(path);
  if (!specs.ok()) return specs.status();
  std::unique_ptr<Tenants> t = FromSpecs(*specs);
  t->path_ = path;
  absl::MutexLock lock(&t->mu_);
  t->stamp_ = stamp;
  return t;
}

std::unique_ptr<Tenants> Tenants::FromSpecs(const std::vector<TenantSpec>& specs) {
  std::unique_ptr<Tenants> t(new Tenants());
  t->Replace(specs);
  return t;
}

void Tenants::Replace(const std::vector<TenantSpec>& specs) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  if (store_ != nullptr) {
    for (const TenantSpec& spec : specs) store_->SetTenantQuota(spec.name, spec.quota_bytes);
  }
  tokens_.clear();
  for (const TenantSpec& spec : specs) {
    std::shared_ptr<Tenant>& t = by_name_[spec.name];
    if (t == nullptr) {
      t = std::make_shared<Tenant>(spec, now);
    } else {
      t->Update(spec, now);
    }
    tokens_.emplace_back(spec.token, t);
  }
}

void Tenants::AttachStore(SequenceStore* store) {
  absl::MutexLock lock(&mu_);
  store_ = store;
  for (const auto& [token, t] : tokens_) store_->SetTenantQuota(t->name(), t->spec().quota_bytes);
}

absl::StatusOr<bool> Tenants::ReloadIfChanged() {
  if (path_.empty()) return false;
  const FileStamp stamp = Stamp(path_);
  {
    absl::MutexLock lock(&mu_);
    if (stamp == stamp_) return false;
    // Remember it either way: a bad file is reported once, not every poll.
    stamp_ = stamp;
  }
  absl::StatusOr<std::vector<TenantSpec>> specs = ReadTokensFile(path_);
  if (!specs.ok()) return specs.status();
  Replace(*specs);
  return true;
}

std::vector<TenantSpec> Tenants::Specs() const {
  std::vector<TenantSpec> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [token, t] : tokens_) out.push_back(t->spec());
  }
  std::sort(out.begin(), out.end(),
            [](const TenantSpec& a, const TenantSpec& b) { return a.name < b.name; });
  return out;
}

absl::StatusOr<std::shared_ptr<Tenant>> Tenants::Authenticate(
    bool present, absl::string_view authorization) const {
  if (!present) {
    return absl::UnauthenticatedError(
        "this server needs \"authorization: Bearer <token>\" metadata on every call");
  }
  constexpr absl::string_view kScheme = "Bearer ";
  if (authorization.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError("the authorization metadata must be \"Bearer <token>\"");
  }
  const absl::string_view token = authorization.substr(kScheme.size());
  std::shared_ptr<Tenant> found;
  absl::MutexLock lock(&mu_);
  for (const auto& [t, tenant] : tokens_) {
    if (ConstantTimeEquals(token, t) && found == nullptr) found = tenant;
  }
  if (found == nullptr) return absl::UnauthenticatedError("the bearer token is not valid");
  return found;
}

}  // namespace kvq
