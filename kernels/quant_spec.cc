#include "kernels/quant_spec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/quoted.h"

namespace kvq {
namespace {

absl::Status Bad(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("scheme ", Quoted(text), ": ", why));
}

bool ParseInt(absl::string_view s, int* out) {
  return !s.empty() && absl::SimpleAtoi(s, out);
}

// crq's widths as written: "2", "2.5", ..., "4" -> 4, 5, ..., 8 half bits.
// Only these spellings, so that every width has one canonical form.
bool ParseHalfBits(absl::string_view s, int* half_bits) {
  static constexpr absl::string_view kNames[] = {"2", "2.5", "3", "3.5", "4"};
  for (int i = 0; i < 5; ++i) {
    if (s == kNames[i]) {
      *half_bits = 4 + i;
      return true;
    }
  }
  return false;
}

std::string HalfBitsName(int half_bits) {
  return half_bits % 2 == 0 ? absl::StrCat(half_bits / 2) : absl::StrCat(half_bits / 2, ".5");
}

constexpr absl::string_view kBaseList =
    "fp16, bf16, int8, fp8_e4m3, kivi4, kivi3, kivi2, crq<K> (K in 2, 2.5, 3, 3.5, 4)";

// crq's options: vV, rN, sink=S and pre_rope; anything else is named back.
absl::Status ParseCrqOption(absl::string_view text, absl::string_view opt, QuantSpec* spec) {
  if (opt.size() > 1 && opt[0] == 'v' && std::isdigit(static_cast<unsigned char>(opt[1]))) {
    if (!ParseHalfBits(opt.substr(1), &spec->value_half_bits)) {
      return Bad(text, "crq value bits v must be 2, 2.5, 3, 3.5 or 4, e.g. v2.5");
    }
    if (spec->value_half_bits == spec->key_half_bits) spec->value_half_bits = 0;
  } else if (opt.size() > 1 && opt[0] == 'r' && std::isdigit(static_cast<unsigned char>(opt[1]))) {
    if (!ParseInt(opt.substr(1), &spec->residual)) return Bad(text, "r needs an integer, e.g. r128");
  } else if (opt.substr(0, opt.find('=')) == "sink") {
    if (opt.size() <= 5 || !ParseInt(opt.substr(5), &spec->sink)) {
      return Bad(text, "sink needs a token count, e.g. sink=4");
    }
  } else if (opt == "pre_rope") {
    spec->pre_rope = true;
  } else {
    return Bad(text, absl::StrCat("option ", Quoted(opt),
                                  " does not apply to crq; crq takes vV, rN, sink=S and pre_rope"));
  }
  return absl::OkStatus();
}

}  // namespace

const std::vector<std::string>& SchemeNames() {
  static const auto* names = new std::vector<std::string>{
      "fp16", "bf16", "int8", "fp8_e4m3", "kivi4", "kivi3", "kivi2",
      "crq4", "crq3.5", "crq3", "crq2.5", "crq2"};
  return *names;
}

int QuantSpec::flush_tokens() const {
  if (is_kivi()) return std::max(residual, group);
  return is_crq() ? std::max(residual, 1) : 1;
}

absl::StatusOr<QuantSpec> QuantSpec::Parse(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  QuantSpec spec;
  const absl::string_view base = parts[0];
  if (base == "fp16") {
    spec.kind = SchemeKind::kFp16;
  } else if (base == "bf16") {
    spec.kind = SchemeKind::kBf16;
  } else if (base == "int8") {
    spec.kind = SchemeKind::kInt8;
    spec.bits = 8;
  } else if (base == "fp8_e4m3" || base == "fp8") {
    spec.kind = SchemeKind::kFp8E4m3;
    spec.bits = 8;
  } else if (base == "kivi4" || base == "kivi3" || base == "kivi2") {
    spec.kind = SchemeKind::kKivi;
    spec.bits = base[4] - '0';
  } else if (base.substr(0, 3) == "crq" && ParseHalfBits(base.substr(3), &spec.key_half_bits)) {
    spec.kind = SchemeKind::kCrq;
    spec.bits = 0;
  } else {
    return Bad(text, absl::StrCat("unknown base scheme ", Quoted(base), "; expected one of ",
                                  kBaseList));
  }
  std::set<std::string> seen;
  for (size_t i = 1; i < parts.size(); ++i) {
    absl::string_view opt = parts[i];
    if (spec.is_crq()) {
      std::string key(opt.substr(0, opt.find('=')));
      if (opt.size() > 1 && (opt[0] == 'r' || opt[0] == 'v') &&
          std::isdigit(static_cast<unsigned char>(opt[1]))) {
        key = std::string(opt.substr(0, 1));
      }
      if (!seen.insert(key).second) {
        return Bad(text, absl::StrCat("option ", Quoted(key), " given twice"));
      }
      if (absl::Status s = ParseCrqOption(text, opt, &spec); !s.ok()) return s;
      continue;
    }
    if (!spec.is_kivi()) {
      return Bad(text, absl::StrCat("option ", Quoted(opt), " applies only to kivi schemes"));
    }
    std::string key(opt.substr(0, opt.find('=')));
    if (opt.size() > 1 && (opt[0] == 'g' || opt[0] == 'r' || opt[0] == 'p' || opt[0] == 'v') &&
        std::isdigit(static_cast<unsigned char>(opt[1]))) {
      key = std::string(opt.substr(0, 1));
    }
    if (!seen.insert(key).second) {
      return Bad(text, absl::StrCat("option ", Quoted(key), " given twice"));
    }
    if (key == "g") {
      if (!ParseInt(opt.substr(1), &spec.group)) return Bad(text, "g needs an integer, e.g. g32");
    } else if (key == "r") {
      if (!ParseInt(opt.substr(1), &spec.residual)) return Bad(text, "r needs an integer, e.g. r128");
    } else if (key == "v") {
      if (!ParseInt(opt.substr(1), &spec.vbits)) {
        return Bad(text, "v needs the value bits, e.g. v2");
      }
      if (spec.vbits == spec.bits) spec.vbits = 0;  // Canonical: same as the base.
    } else if (key == "p") {
      if (!ParseInt(opt.substr(1), &spec.param_bits)) {
        return Bad(text, "p needs the parameter bits, p8 or p16");
      }
    } else if (opt == "fit") {
      spec.fit = true;
    } else if (opt == "pre_rope") {
      spec.pre_rope = true;
    } else if (opt == "nuq") {
      spec.nuq = true;
    } else if (opt == "rotate") {
      spec.rotate = true;
    } else if (opt == "ktok") {
      spec.key_axis = KeyAxis::kPerToken;
    } else if (key == "outliers") {
      if (opt.size() <= 9 || !absl::SimpleAtod(opt.substr(9), &spec.outlier_percent) ||
          !std::isfinite(spec.outlier_percent) || spec.outlier_percent <= 0.0) {
        return Bad(text, "outliers needs a percentage in (0, 10], e.g. outliers=1");
      }
    } else if (key == "sink") {
      if (opt.size() <= 5 || !ParseInt(opt.substr(5), &spec.sink)) {
        return Bad(text, "sink needs a token count, e.g. sink=4");
      }
    } else {
      return Bad(text, absl::StrCat("unknown option ", Quoted(opt),
                                    "; expected vN, gN, rN, fit, p8, pre_rope, outliers=P, "
                                    "sink=S, nuq, rotate or ktok"));
    }
  }
  absl::Status status = spec.Validate();
  if (!status.ok()) return Bad(text, status.message());
  return spec;
}

absl::Status QuantSpec::ValidateCrq() const {
  if (bits != 0 || vbits != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "crq keeps its widths in key_half_bits/value_half_bits; bits and vbits must be 0, got ",
        bits, " and ", vbits));
  }
  if (key_half_bits < 4 || key_half_bits > 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "crq key bits must be 2, 2.5, 3, 3.5 or 4, got ", key_half_bits, " half bits"));
  }
  if (value_half_bits != 0 && (value_half_bits < 4 || value_half_bits > 8)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "crq value bits v must be 2, 2.5, 3, 3.5 or 4, got ", value_half_bits, " half bits"));
  }
  if (value_half_bits == key_half_bits) {
    return absl::InvalidArgumentError(absl::StrCat(
        "crq value bits equal to the key bits (", HalfBitsName(key_half_bits),
        ") are written as value_half_bits = 0"));
  }
  // Options of the other schemes, each named (a QuantSpec built in code can
  // set them; the parser refuses them as text).
  const char* other = group != 32                         ? "g"
                      : param_bits != 16                  ? "p8"
                      : fit                               ? "fit"
                      : outlier_percent != 0.0            ? "outliers"
                      : nuq                               ? "nuq"
                      : rotate                            ? "rotate"
                      : key_axis != KeyAxis::kPerChannel  ? "ktok"
                                                          : nullptr;
  if (other != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option ", other, " does not apply to crq; crq takes vV, rN, sink=S and pre_rope"));
  }
  if (residual < 0 || residual > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("residual r must be in [0, 4096], got ", residual));
  }
  if (sink < 0 || sink > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("sink must be in [0, 1024], got ", sink));
  }
  if (!pre_rope) {
    return absl::InvalidArgumentError(
        "crq needs pre_rope: its calibrated key means are pre-RoPE, so keys are appended "
        "before RoPE (write crq...:pre_rope)");
  }
  return absl::OkStatus();
}

absl::Status QuantSpec::Validate() const {
  if (is_crq()) return ValidateCrq();
  if (!is_kivi()) {
    QuantSpec plain;
    plain.kind = kind;
    plain.bits = bits;
    if (!(*this == plain)) {
      return absl::InvalidArgumentError("options apply only to kivi schemes");
    }
    return absl::OkStatus();
  }
  if (bits != 2 && bits != 3 && bits != 4) {
    return absl::InvalidArgumentError(absl::StrCat("kivi bits must be 2, 3 or 4, got ", bits));
  }
  if (vbits != 0 && vbits != 2 && vbits != 3 && vbits != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("value bits v must be 2, 3 or 4, got ", vbits));
  }
  if (vbits == bits) {
    // One spelling per scheme, so that == and ToString() agree.
    return absl::InvalidArgumentError(
        absl::StrCat("value bits v equal to the key bits (", bits, ") are written as vbits = 0"));
  }
  if (vbits != 0 && nuq) {
    return absl::InvalidArgumentError(
        "nuq needs the same bits for keys and values (one codebook size per stream)");
  }
  if (fit && nuq) {
    return absl::InvalidArgumentError(
        "fit and nuq cannot be combined: fit searches uniform steps, nuq's levels are learned");
  }
  if (group < 8 || group > 256 || (group & (group - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("group size g must be a power of two in [8, 256], got ", group));
  }
  if (residual < 0 || residual > 4096 || residual % group != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "residual r must be a multiple of g=", group, " in [0, 4096], got ", residual));
  }
  if (param_bits != 8 && param_bits != 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("group parameter bits p must be 8 or 16, got ", param_bits));
  }
  if (!(outlier_percent >= 0.0 && outlier_percent <= 10.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("outliers must be in (0, 10] percent, got ", outlier_percent));
  }
  if (sink < 0 || sink > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("sink must be in [0, 1024], got ", sink));
  }
  if (rotate && pre_rope) {
    return absl::InvalidArgumentError(
        "rotate and pre_rope cannot be combined: RoPE acts on the unrotated "
        "channels, so a pre-RoPE key would have to be un-rotated per token");
  }
  return absl::OkStatus();
}

std::string QuantSpec::ToString() const {
  switch (kind) {
    case SchemeKind::kFp16: return "fp16";
    case SchemeKind::kBf16: return "bf16";
    case SchemeKind::kInt8: return "int8";
    case SchemeKind::kFp8E4m3: return "fp8_e4m3";
    case SchemeKind::kKivi: break;
    case SchemeKind::kCrq: {
      std::string out = absl::StrCat("crq", HalfBitsName(key_half_bits));
      if (value_half_bits != 0) absl::StrAppend(&out, ":v", HalfBitsName(value_half_bits));
      absl::StrAppend(&out, ":r", residual);
      if (pre_rope) absl::StrAppend(&out, ":pre_rope");
      if (sink > 0) absl::StrAppend(&out, ":sink=", sink);
      return out;
    }
  }
  std::string out = absl::StrCat("kivi", bits);
  if (value_bits() != bits) absl::StrAppend(&out, ":v", value_bits());
  absl::StrAppend(&out, ":g", group, ":r", residual);
  if (fit) absl::StrAppend(&out, ":fit");
  if (param_bits == 8) absl::StrAppend(&out, ":p8");
  if (pre_rope) absl::StrAppend(&out, ":pre_rope");
  if (has_outliers()) {
    // The shortest decimal that reads back as the same double: StrCat's six
    // significant digits would turn outliers=.522222222222 into another
    // spec (found by quant_spec_fuzz).
    char percent[32];
    const std::to_chars_result r =
        std::to_chars(percent, percent + sizeof(percent), outlier_percent);
    absl::StrAppend(&out, ":outliers=", absl::string_view(percent, r.ptr - percent));
  }
  if (sink > 0) absl::StrAppend(&out, ":sink=", sink);
  if (nuq) absl::StrAppend(&out, ":nuq");
  if (rotate) absl::StrAppend(&out, ":rotate");
  if (key_axis == KeyAxis::kPerToken) absl::StrAppend(&out, ":ktok");
  return out;
}

}  // namespace kvq
