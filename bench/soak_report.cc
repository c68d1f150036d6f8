// `kvq-bench soak`'s verdict and report: latency percentiles, the
// flat-after-warm-up check, the table and the JSON document.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/kernels_bench.h"
#include "bench/soak_bench.h"

namespace kvq {
namespace {

// Nearest-rank percentile of sorted values.
double Percentile(const std::vector<float>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * sorted.size()));
  return sorted[std::min(sorted.size(), std::max<size_t>(rank, 1)) - 1];
}

double MiB(double bytes) { return bytes / (1 << 20); }

}  // namespace

LatencySummary Summarize(std::string op, std::vector<float>* ms) {
  std::sort(ms->begin(), ms->end());
  LatencySummary s;
  s.op = std::move(op);
  s.count = static_cast<int64_t>(ms->size());
  s.p50_ms = Percentile(*ms, 50);
  s.p99_ms = Percentile(*ms, 99);
  s.max_ms = ms->empty() ? 0 : ms->back();
  return s;
}

std::vector<FlatCheck> EvaluateFlat(const std::vector<SoakSample>& samples, double duration_s,
                                    const SoakOptions& options) {
  struct Figure {
    const char* name;
    std::function<int64_t(const SoakSample&)> get;
    double fraction;
    double slack;
  };
  const std::vector<Figure> figures = {
      {"server_rss_bytes", [](const SoakSample& s) { return s.server_rss_bytes; },
       options.rss_tolerance_fraction, static_cast<double>(options.rss_tolerance_bytes)},
      {"used_bytes", [](const SoakSample& s) { return s.used_bytes; },
       options.pool_tolerance_fraction, static_cast<double>(options.pool_tolerance_bytes)},
      {"slabs_used", [](const SoakSample& s) { return s.slabs_used; },
       options.pool_tolerance_fraction, static_cast<double>(options.pool_tolerance_slabs)},
  };
  std::vector<FlatCheck> out;
  for (const Figure& f : figures) {
    int64_t middle = -1, last = -1;
    for (const SoakSample& s : samples) {
      const int64_t v = f.get(s);
      if (v < 0) continue;
      if (s.t_s >= 2 * duration_s / 3) {
        last = std::max(last, v);
      } else if (s.t_s >= duration_s / 3) {
        middle = std::max(middle, v);
      }
    }
    if (middle < 0 || last < 0) continue;
    FlatCheck c;
    c.figure = f.name;
    c.middle_max = static_cast<double>(middle);
    c.last_max = static_cast<double>(last);
    c.limit = c.middle_max + std::max(f.fraction * c.middle_max, f.slack);
    c.pass = c.last_max <= c.limit;
    out.push_back(c);
  }
  return out;
}

int64_t SoakResult::total_errors() const {
  int64_t n = 0;
  for (const auto& [code, count] : errors) n += count;
  return n;
}

bool SoakResult::ok() const {
  if (total_errors() != 0 || !returned_to_start || !stopped_early.empty()) return false;
  for (const FlatCheck& c : flat) {
    if (!c.pass) return false;
  }
  return true;
}

std::string FormatSoakTable(const SoakResult& r, const std::string& command) {
  std::string out = absl::StrCat("# ", command, "\n");
  absl::StrAppendFormat(&out,
                        "# kvq-server %s (backend %s) at %s%s, pool %.0f MiB; %d prefill + %d "
                        "decode clients for %.0f s\n# schemes: %s\n\n",
                        r.server_version, r.server_backend, r.target,
                        r.started_server ? " (started by the soak)" : "", MiB(r.capacity_bytes),
                        r.prefill_clients, r.decode_clients, r.duration_s,
                        absl::StrJoin(r.schemes, ", "));
  absl::StrAppendFormat(&out, "| %-26s | %9s | %9s | %9s | %9s |\n", "operation", "calls", "p50 ms",
                        "p99 ms", "max ms");
  absl::StrAppend(&out, "|", std::string(28, '-'), "|", std::string(11, '-'), "|",
                  std::string(11, '-'), "|", std::string(11, '-'), "|", std::string(11, '-'),
                  "|\n");
  for (const LatencySummary& s : r.ops) {
    absl::StrAppendFormat(&out, "| %-26s | %9d | %9.2f | %9.2f | %9.2f |\n", s.op, s.count,
                          s.p50_ms, s.p99_ms, s.max_ms);
  }
  absl::StrAppendFormat(&out,
                        "\nsequences created %d (prefix reused by %d: %d tokens), forks %d, "
                        "handed to decode %d, decode tokens appended %d\n",
                        r.sequences_created, r.prefix_hits, r.prefix_tokens_reused, r.forks,
                        r.handed_over, r.decode_tokens);
  absl::StrAppendFormat(&out, "unexpected errors: %d", r.total_errors());
  for (const auto& [code, count] : r.errors) absl::StrAppend(&out, "  ", code, "=", count);
  absl::StrAppend(&out, "\n");
  for (const std::string& e : r.error_examples) absl::StrAppend(&out, "  e.g. ", e, "\n");
  if (!r.stopped_early.empty()) absl::StrAppend(&out, "stopped early: ", r.stopped_early, "\n");

  auto figure = [](int64_t v, bool bytes) {
    if (v < 0) return std::string("n/a");
    return bytes ? absl::StrFormat("%.1f MiB", MiB(v)) : absl::StrCat(v);
  };
  absl::StrAppendFormat(&out,
                        "pool at start: %s used, %s slabs, %s sequences; after the clients "
                        "released theirs: %s used, %s slabs, %s sequences -> %s\n",
                        figure(r.start.used_bytes, true), figure(r.start.slabs_used, false),
                        figure(r.start.sequences, false), figure(r.end.used_bytes, true),
                        figure(r.end.slabs_used, false), figure(r.end.sequences, false),
                        r.returned_to_start ? "back to start" : "NOT back to start");
  absl::StrAppend(&out, "flat after warm-up (max of the last third vs the middle third):\n");
  for (const FlatCheck& c : r.flat) {
    const bool bytes = c.figure != "slabs_used";
    absl::StrAppendFormat(&out, "  %-17s middle %s, last %s, limit %s: %s\n", c.figure,
                          figure(static_cast<int64_t>(c.middle_max), bytes),
                          figure(static_cast<int64_t>(c.last_max), bytes),
                          figure(static_cast<int64_t>(c.limit), bytes), c.pass ? "PASS" : "FAIL");
  }
  if (r.flat.empty()) absl::StrAppend(&out, "  (too few samples)\n");
  // The RSS / pool curve, a line per tenth of the run.
  absl::StrAppend(&out,
                  "samples (every tenth of the run): t s, server RSS, client RSS, pool "
                  "used, slabs, sequences\n");
  const size_t step = std::max<size_t>(1, r.samples.size() / 10);
  for (size_t i = 0; i < r.samples.size(); i += step) {
    const SoakSample& s = r.samples[i];
    absl::StrAppendFormat(&out, "  %6.0f  %12s  %12s  %12s  %6s  %4s\n", s.t_s,
                          figure(s.server_rss_bytes, true), figure(s.client_rss_bytes, true),
                          figure(s.used_bytes, true), figure(s.slabs_used, false),
                          figure(s.sequences, false));
  }
  absl::StrAppend(&out, "\nsoak: ", r.ok() ? "PASS" : "FAIL", "\n");
  return out;
}

std::string FormatSoakJson(const SoakResult& r, const std::string& command) {
  std::string out = "{\n";
  absl::StrAppend(&out, "  \"command\": ", JsonString(command), ",\n");
  absl::StrAppend(&out, "  \"target\": ", JsonString(r.target),
                  ", \"started_server\": ", r.started_server ? "true" : "false",
                  ", \"server_version\": ", JsonString(r.server_version),
                  ", \"server_backend\": ", JsonString(r.server_backend), ",\n");
  absl::StrAppend(&out, "  \"duration_s\": ", JsonNumber(r.duration_s),
                  ", \"prefill_clients\": ", r.prefill_clients,
                  ", \"decode_clients\": ", r.decode_clients,
                  ", \"capacity_bytes\": ", r.capacity_bytes, ",\n");
  std::vector<std::string> schemes;
  for (const std::string& s : r.schemes) schemes.push_back(JsonString(s));
  absl::StrAppend(&out, "  \"schemes\": [", absl::StrJoin(schemes, ", "), "],\n");
  absl::StrAppend(&out, "  \"ops\": [\n");
  for (size_t i = 0; i < r.ops.size(); ++i) {
    const LatencySummary& s = r.ops[i];
    absl::StrAppend(&out, "    {\"op\": ", JsonString(s.op), ", \"count\": ", s.count,
                    ", \"p50_ms\": ", JsonNumber(s.p50_ms), ", \"p99_ms\": ", JsonNumber(s.p99_ms),
                    ", \"max_ms\": ", JsonNumber(s.max_ms), "}",
                    i + 1 < r.ops.size() ? ",\n" : "\n");
  }
  absl::StrAppend(&out, "  ],\n  \"errors\": {");
  std::vector<std::string> errors;
  for (const auto& [code, count] : r.errors)
    errors.push_back(absl::StrCat(JsonString(code), ": ", count));
  absl::StrAppend(&out, absl::StrJoin(errors, ", "), "},\n");
  std::vector<std::string> examples;
  for (const std::string& e : r.error_examples) examples.push_back(JsonString(e));
  absl::StrAppend(&out, "  \"error_examples\": [", absl::StrJoin(examples, ", "), "],\n");
  absl::StrAppend(&out, "  \"stopped_early\": ", JsonString(r.stopped_early), ",\n");
  absl::StrAppend(
      &out, "  \"sequences_created\": ", r.sequences_created, ", \"prefix_hits\": ", r.prefix_hits,
      ", \"prefix_tokens_reused\": ", r.prefix_tokens_reused, ", \"forks\": ", r.forks,
      ", \"handed_over\": ", r.handed_over, ", \"decode_tokens\": ", r.decode_tokens, ",\n");
  auto sample = [](const SoakSample& s) {
    return absl::StrCat(
        "{\"t_s\": ", JsonNumber(s.t_s), ", \"server_rss_bytes\": ", s.server_rss_bytes,
        ", \"client_rss_bytes\": ", s.client_rss_bytes, ", \"used_bytes\": ", s.used_bytes,
        ", \"slabs_used\": ", s.slabs_used, ", \"sequences\": ", s.sequences, "}");
  };
  absl::StrAppend(&out, "  \"start\": ", sample(r.start), ",\n  \"end\": ", sample(r.end),
                  ",\n  \"returned_to_start\": ", r.returned_to_start ? "true" : "false", ",\n");
  absl::StrAppend(&out, "  \"flat\": [");
  for (size_t i = 0; i < r.flat.size(); ++i) {
    const FlatCheck& c = r.flat[i];
    absl::StrAppend(&out, i ? ", " : "", "{\"figure\": ", JsonString(c.figure),
                    ", \"middle_max\": ", static_cast<int64_t>(c.middle_max),
                    ", \"last_max\": ", static_cast<int64_t>(c.last_max),
                    ", \"limit\": ", static_cast<int64_t>(c.limit),
                    ", \"pass\": ", c.pass ? "true" : "false", "}");
  }
  absl::StrAppend(&out, "],\n  \"samples\": [\n");
  for (size_t i = 0; i < r.samples.size(); ++i) {
    absl::StrAppend(&out, "    ", sample(r.samples[i]), i + 1 < r.samples.size() ? ",\n" : "\n");
  }
  absl::StrAppend(&out, "  ],\n  \"pass\": ", r.ok() ? "true" : "false", "\n}\n");
  return out;
}

}  // namespace kvq
