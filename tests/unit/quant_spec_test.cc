#include "kernels/quant_spec.h"

#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvq {
namespace {

QuantSpec MustParse(const std::string& text) {
  absl::StatusOr<QuantSpec> s = QuantSpec::Parse(text);
  EXPECT_TRUE(s.ok()) << "parsing \"" << text << "\": " << s.status();
  return s.ok() ? *s : QuantSpec{};
}

TEST(QuantSpecTest, ParsesAndPrintsCanonicalForm) {
  absl::StatusOr<QuantSpec> s = QuantSpec::Parse("kivi2:g32:r128:pre_rope:outliers=1:sink=4");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->bits, 2);
  EXPECT_TRUE(s->pre_rope);
  EXPECT_EQ(s->sink, 4);
  EXPECT_EQ(s->ToString(), "kivi2:g32:r128:pre_rope:outliers=1:sink=4");
  EXPECT_EQ(QuantSpec::Parse("kivi4")->ToString(), "kivi4:g32:r128");
}

TEST(QuantSpecTest, EveryBaseNameParsesAndRoundTrips) {
  const std::vector<std::string> expected = {
      "fp16", "bf16", "int8",   "fp8_e4m3", "kivi4", "kivi3",
      "kivi2", "crq4", "crq3.5", "crq3",    "crq2.5", "crq2"};
  EXPECT_EQ(SchemeNames(), expected) << "SchemeNames() changed order or content";
  for (const std::string& name : SchemeNames()) {
    const bool crq = name.substr(0, 3) == "crq";
    // crq needs pre_rope (its calibrated key means are pre-RoPE).
    const QuantSpec spec = MustParse(crq ? name + ":pre_rope" : name);
    const std::string printed = spec.ToString();
    if (crq) {
      EXPECT_EQ(printed, name + ":r128:pre_rope") << "crq prints r canonically";
    } else if (spec.is_kivi()) {
      EXPECT_EQ(printed, name + ":g32:r128") << "kivi prints g and r canonically";
    } else {
      EXPECT_EQ(printed, name) << "non-kivi base prints as its name";
    }
    EXPECT_EQ(MustParse(printed), spec) << "Parse(ToString()) of " << name;
    EXPECT_TRUE(spec.Validate().ok()) << name;
  }
}

TEST(QuantSpecTest, BaseFieldsAndDefaults) {
  struct Case {
    const char* text;
    SchemeKind kind;
    int bits;
  };
  for (const Case& c : {Case{"fp16", SchemeKind::kFp16, 16}, Case{"bf16", SchemeKind::kBf16, 16},
                        Case{"int8", SchemeKind::kInt8, 8},
                        Case{"fp8_e4m3", SchemeKind::kFp8E4m3, 8},
                        Case{"kivi4", SchemeKind::kKivi, 4}, Case{"kivi3", SchemeKind::kKivi, 3},
                        Case{"kivi2", SchemeKind::kKivi, 2}}) {
    const QuantSpec s = MustParse(c.text);
    EXPECT_EQ(s.kind, c.kind) << c.text;
    EXPECT_EQ(s.bits, c.bits) << c.text;
    EXPECT_EQ(s.group, 32) << c.text << ": default g";
    EXPECT_EQ(s.residual, 128) << c.text << ": default r";
    EXPECT_EQ(s.key_axis, KeyAxis::kPerChannel) << c.text;
    EXPECT_FALSE(s.pre_rope || s.nuq || s.rotate || s.has_outliers()) << c.text;
    EXPECT_EQ(s.sink, 0) << c.text;
    EXPECT_EQ(s.is_kivi(), c.kind == SchemeKind::kKivi) << c.text;
    EXPECT_EQ(s.flush_tokens(), s.is_kivi() ? 128 : 1) << c.text;
  }
}

TEST(QuantSpecTest, Fp8AliasParsesToFp8E4m3) {
  const QuantSpec s = MustParse("fp8");
  EXPECT_EQ(s.kind, SchemeKind::kFp8E4m3);
  EXPECT_EQ(s.bits, 8);
  EXPECT_EQ(s.ToString(), "fp8_e4m3") << "the alias prints as the canonical name";
  EXPECT_EQ(s, MustParse("fp8_e4m3"));
}

TEST(QuantSpecTest, EachOptionSetsItsField) {
  EXPECT_EQ(MustParse("kivi2:g64").group, 64);
  EXPECT_EQ(MustParse("kivi2:g8:r0").group, 8);
  EXPECT_EQ(MustParse("kivi2:g256:r256").group, 256);
  EXPECT_EQ(MustParse("kivi2:r256").residual, 256);
  EXPECT_EQ(MustParse("kivi2:r0").residual, 0);
  EXPECT_EQ(MustParse("kivi2:r4096").residual, 4096);
  EXPECT_TRUE(MustParse("kivi2:pre_rope").pre_rope);
  EXPECT_DOUBLE_EQ(MustParse("kivi2:outliers=1").outlier_percent, 1.0);
  EXPECT_DOUBLE_EQ(MustParse("kivi2:outliers=0.5").outlier_percent, 0.5);
  EXPECT_DOUBLE_EQ(MustParse("kivi2:outliers=10").outlier_percent, 10.0);
  EXPECT_EQ(MustParse("kivi2:sink=4").sink, 4);
  EXPECT_EQ(MustParse("kivi2:sink=0").sink, 0);
  EXPECT_EQ(MustParse("kivi2:sink=1024").sink, 1024);
  EXPECT_TRUE(MustParse("kivi2:nuq").nuq);
  EXPECT_TRUE(MustParse("kivi2:fit").fit);
  EXPECT_FALSE(MustParse("kivi2").fit) << "min/max ranges by default";
  EXPECT_TRUE(MustParse("kivi2:rotate").rotate);
  EXPECT_EQ(MustParse("kivi2:ktok").key_axis, KeyAxis::kPerToken);
  EXPECT_EQ(MustParse("kivi2").param_bits, 16) << "fp16 group parameters by default";
  EXPECT_EQ(MustParse("kivi2:p8").param_bits, 8);
  EXPECT_EQ(MustParse("kivi2:p16").param_bits, 16);
  EXPECT_EQ(MustParse("kivi4:v2").vbits, 2);
  EXPECT_EQ(MustParse("kivi4:v2").key_bits(), 4);
  EXPECT_EQ(MustParse("kivi4:v2").value_bits(), 2);
  EXPECT_EQ(MustParse("kivi2:v3").value_bits(), 3);
  EXPECT_EQ(MustParse("kivi3").value_bits(), 3) << "values follow the base without vN";
  EXPECT_EQ(MustParse("kivi3:v3").vbits, 0) << "vN equal to the base normalises away";
  // r0 keeps only an unfinished group: the flush size is G.
  EXPECT_EQ(MustParse("kivi2:g64:r0").flush_tokens(), 64);
  EXPECT_EQ(MustParse("kivi2:g64:r256").flush_tokens(), 256);
}

TEST(QuantSpecTest, OptionsPrintInCanonicalOrder) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"kivi2:ktok:rotate:nuq:sink=4:r64:g16", "kivi2:g16:r64:sink=4:nuq:rotate:ktok"},
      {"kivi3:sink=4:outliers=1:pre_rope", "kivi3:g32:r128:pre_rope:outliers=1:sink=4"},
      {"kivi4:outliers=0.5", "kivi4:g32:r128:outliers=0.5"},
      {"kivi2:r0", "kivi2:g32:r0"},
      {"kivi2:sink=0", "kivi2:g32:r128"},
      {"kivi4:g64", "kivi4:g64:r128"},
      {"kivi4:sink=4:p8:pre_rope:g128", "kivi4:g128:r128:p8:pre_rope:sink=4"},
      {"kivi2:p16", "kivi2:g32:r128"},
      {"kivi4:sink=4:v2:p8:g64:r64", "kivi4:v2:g64:r64:p8:sink=4"},
      {"kivi3:v3", "kivi3:g32:r128"},
      {"kivi2:sink=4:p8:fit:g64:r64", "kivi2:g64:r64:fit:p8:sink=4"},
      {"kivi4:ktok:fit:v2", "kivi4:v2:g32:r128:fit:ktok"},
      {"kivi2:g32:r128:pre_rope:outliers=1:sink=4:nuq:ktok",
       "kivi2:g32:r128:pre_rope:outliers=1:sink=4:nuq:ktok"},
  };
  for (const auto& [text, canonical] : cases) {
    const QuantSpec s = MustParse(text);
    EXPECT_EQ(s.ToString(), canonical) << "canonical form of " << text;
    EXPECT_EQ(MustParse(s.ToString()), s) << "round trip of " << text;
  }
}

void ExpectParseError(const std::string& text, const std::string& message) {
  absl::StatusOr<QuantSpec> s = QuantSpec::Parse(text);
  ASSERT_FALSE(s.ok()) << "\"" << text << "\" should not parse; got " << s->ToString();
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << text;
  EXPECT_EQ(s.status().message(), message) << text;
}

TEST(QuantSpecTest, OutlierPercentPrintsSoItReadsBackTheSame) {
  // Six significant digits (StrCat's) would print 0.522222 and read back
  // another spec; quant_spec_fuzz found it.
  for (const char* text : {"kivi3:v4:g256:r4096:outliers=.522222222222",
                           "kivi2:outliers=0.1", "kivi2:outliers=1", "kivi4:outliers=9.999999999"}) {
    absl::StatusOr<QuantSpec> spec = QuantSpec::Parse(text);
    ASSERT_TRUE(spec.ok()) << text << ": " << spec.status();
    absl::StatusOr<QuantSpec> again = QuantSpec::Parse(spec->ToString());
    ASSERT_TRUE(again.ok()) << spec->ToString() << ": " << again.status();
    EXPECT_EQ(*again, *spec) << spec->ToString();
  }
  EXPECT_EQ(QuantSpec::Parse("kivi2:outliers=1").value().ToString(), "kivi2:g32:r128:outliers=1");
  EXPECT_EQ(QuantSpec::Parse("kivi2:outliers=0.1").value().ToString(),
            "kivi2:g32:r128:outliers=0.1");
}

TEST(QuantSpecTest, RejectsUnknownBase) {
  ExpectParseError("int4", "scheme \"int4\": unknown base scheme \"int4\"; expected one of fp16, "
                           "bf16, int8, fp8_e4m3, kivi4, kivi3, kivi2, crq<K> (K in 2, 2.5, 3, 3.5, 4)");
  ExpectParseError("", "scheme \"\": unknown base scheme \"\"; expected one of fp16, bf16, int8, "
                       "fp8_e4m3, kivi4, kivi3, kivi2, crq<K> (K in 2, 2.5, 3, 3.5, 4)");
  ExpectParseError("KIVI2", "scheme \"KIVI2\": unknown base scheme \"KIVI2\"; expected one of "
                            "fp16, bf16, int8, fp8_e4m3, kivi4, kivi3, kivi2, crq<K> (K in 2, 2.5, 3, 3.5, 4)");
}

TEST(QuantSpecTest, RejectsUnknownOption) {
  const std::string expected_list =
      "; expected vN, gN, rN, fit, p8, pre_rope, outliers=P, sink=S, nuq, rotate or ktok";
  ExpectParseError("kivi2:fast", "scheme \"kivi2:fast\": unknown option \"fast\"" + expected_list);
  ExpectParseError("kivi2:nuq=1", "scheme \"kivi2:nuq=1\": unknown option \"nuq=1\"" + expected_list);
  ExpectParseError("kivi2:", "scheme \"kivi2:\": unknown option \"\"" + expected_list);
  ExpectParseError("kivi2:r-1", "scheme \"kivi2:r-1\": unknown option \"r-1\"" + expected_list);
}

TEST(QuantSpecTest, RejectsDuplicateOption) {
  ExpectParseError("kivi2:g32:g64", "scheme \"kivi2:g32:g64\": option \"g\" given twice");
  ExpectParseError("kivi2:r0:r128", "scheme \"kivi2:r0:r128\": option \"r\" given twice");
  ExpectParseError("kivi2:nuq:nuq", "scheme \"kivi2:nuq:nuq\": option \"nuq\" given twice");
  ExpectParseError("kivi2:sink=1:sink=2",
                   "scheme \"kivi2:sink=1:sink=2\": option \"sink\" given twice");
}

TEST(QuantSpecTest, RejectsOptionsOnNonKivi) {
  ExpectParseError("int8:g32", "scheme \"int8:g32\": option \"g32\" applies only to kivi schemes");
  ExpectParseError("fp16:sink=4",
                   "scheme \"fp16:sink=4\": option \"sink=4\" applies only to kivi schemes");
  ExpectParseError("fp8:rotate", "scheme \"fp8:rotate\": option \"rotate\" applies only to kivi schemes");
  QuantSpec s = MustParse("int8");
  s.sink = 4;
  const absl::Status st = s.Validate();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "options apply only to kivi schemes");
}

TEST(QuantSpecTest, RejectsBadNumbers) {
  ExpectParseError("kivi2:g", "scheme \"kivi2:g\": g needs an integer, e.g. g32");
  ExpectParseError("kivi2:g32x", "scheme \"kivi2:g32x\": g needs an integer, e.g. g32");
  ExpectParseError("kivi2:r12.5", "scheme \"kivi2:r12.5\": r needs an integer, e.g. r128");
  ExpectParseError("kivi2:sink=", "scheme \"kivi2:sink=\": sink needs a token count, e.g. sink=4");
  ExpectParseError("kivi2:p8x", "scheme \"kivi2:p8x\": p needs the parameter bits, p8 or p16");
  ExpectParseError("kivi2:p4", "scheme \"kivi2:p4\": group parameter bits p must be 8 or 16, got 4");
  ExpectParseError("kivi2:p8:p16", "scheme \"kivi2:p8:p16\": option \"p\" given twice");
  ExpectParseError("int8:p8", "scheme \"int8:p8\": option \"p8\" applies only to kivi schemes");
  ExpectParseError("kivi2:outliers=x",
                   "scheme \"kivi2:outliers=x\": outliers needs a percentage in (0, 10], e.g. outliers=1");
}

TEST(QuantSpecTest, RejectsResidualNotMultipleOfGroup) {
  ExpectParseError("kivi2:g32:r48",
                   "scheme \"kivi2:g32:r48\": residual r must be a multiple of g=32 in [0, 4096], got 48");
  ExpectParseError("kivi2:g64:r96",
                   "scheme \"kivi2:g64:r96\": residual r must be a multiple of g=64 in [0, 4096], got 96");
  ExpectParseError("kivi2:r8192",
                   "scheme \"kivi2:r8192\": residual r must be a multiple of g=32 in [0, 4096], got 8192");
}

TEST(QuantSpecTest, RejectsGroupNotPowerOfTwo) {
  ExpectParseError("kivi2:g24",
                   "scheme \"kivi2:g24\": group size g must be a power of two in [8, 256], got 24");
  ExpectParseError("kivi2:g4:r0",
                   "scheme \"kivi2:g4:r0\": group size g must be a power of two in [8, 256], got 4");
  ExpectParseError("kivi2:g512:r512",
                   "scheme \"kivi2:g512:r512\": group size g must be a power of two in [8, 256], got 512");
}

TEST(QuantSpecTest, RejectsOutlierPercentOutOfRange) {
  ExpectParseError("kivi2:outliers=0",
                   "scheme \"kivi2:outliers=0\": outliers needs a percentage in (0, 10], e.g. outliers=1");
  ExpectParseError("kivi2:outliers=-1",
                   "scheme \"kivi2:outliers=-1\": outliers needs a percentage in (0, 10], e.g. outliers=1");
  ExpectParseError("kivi2:outliers=11",
                   "scheme \"kivi2:outliers=11\": outliers must be in (0, 10] percent, got 11");
  ExpectParseError("kivi2:outliers=nan",
                   "scheme \"kivi2:outliers=nan\": outliers needs a percentage in (0, 10], e.g. outliers=1");
}

TEST(QuantSpecTest, RejectsSinkOutOfRange) {
  ExpectParseError("kivi2:sink=2000", "scheme \"kivi2:sink=2000\": sink must be in [0, 1024], got 2000");
  ExpectParseError("kivi2:sink=-1", "scheme \"kivi2:sink=-1\": sink must be in [0, 1024], got -1");
}

TEST(QuantSpecTest, RejectsRotateWithPreRope) {
  ExpectParseError("kivi2:pre_rope:rotate",
                   "scheme \"kivi2:pre_rope:rotate\": rotate and pre_rope cannot be combined: RoPE "
                   "acts on the unrotated channels, so a pre-RoPE key would have to be un-rotated "
                   "per token");
}

TEST(QuantSpecTest, RejectsFitWithNuq) {
  ExpectParseError("kivi3:fit:nuq",
                   "scheme \"kivi3:fit:nuq\": fit and nuq cannot be combined: fit searches uniform "
                   "steps, nuq's levels are learned");
  ExpectParseError("kivi3:fit:fit", "scheme \"kivi3:fit:fit\": option \"fit\" given twice");
  ExpectParseError("int8:fit", "scheme \"int8:fit\": option \"fit\" applies only to kivi schemes");
}

TEST(QuantSpecTest, RejectsBadValueBits) {
  ExpectParseError("kivi4:v8", "scheme \"kivi4:v8\": value bits v must be 2, 3 or 4, got 8");
  ExpectParseError("kivi4:v1", "scheme \"kivi4:v1\": value bits v must be 2, 3 or 4, got 1");
  ExpectParseError("kivi4:v2:v3", "scheme \"kivi4:v2:v3\": option \"v\" given twice");
  ExpectParseError("int8:v4", "scheme \"int8:v4\": option \"v4\" applies only to kivi schemes");
  ExpectParseError("kivi4:v2:nuq",
                   "scheme \"kivi4:v2:nuq\": nuq needs the same bits for keys and values (one "
                   "codebook size per stream)");
  EXPECT_TRUE(MustParse("kivi4:v4:nuq").nuq) << "equal bits are not a mix";
}

TEST(QuantSpecTest, CrqWidthsAndOptions) {
  struct Case {
    const char* text;
    int key_half_bits;
    int value_half_bits;  // As stored: 0 when equal to the keys.
    const char* canonical;
  };
  for (const Case& c : {
           Case{"crq2:pre_rope", 4, 0, "crq2:r128:pre_rope"},
           Case{"crq2.5:pre_rope", 5, 0, "crq2.5:r128:pre_rope"},
           Case{"crq3:pre_rope", 6, 0, "crq3:r128:pre_rope"},
           Case{"crq3.5:pre_rope", 7, 0, "crq3.5:r128:pre_rope"},
           Case{"crq4:pre_rope", 8, 0, "crq4:r128:pre_rope"},
           Case{"crq3:v2.5:pre_rope", 6, 5, "crq3:v2.5:r128:pre_rope"},
           Case{"crq3:v3:pre_rope", 6, 0, "crq3:r128:pre_rope"},
           Case{"crq2.5:sink=4:pre_rope:r0:v4", 5, 8, "crq2.5:v4:r0:pre_rope:sink=4"},
           Case{"crq4:r64:pre_rope:sink=0", 8, 0, "crq4:r64:pre_rope"},
           Case{"crq3:r4096:pre_rope:sink=1024", 6, 0, "crq3:r4096:pre_rope:sink=1024"},
       }) {
    const QuantSpec s = MustParse(c.text);
    EXPECT_EQ(s.kind, SchemeKind::kCrq) << c.text;
    EXPECT_TRUE(s.is_crq()) << c.text;
    EXPECT_FALSE(s.is_kivi()) << c.text;
    EXPECT_EQ(s.bits, 0) << c.text << ": crq's widths are in the half-bit fields";
    EXPECT_EQ(s.key_half_bits, c.key_half_bits) << c.text;
    EXPECT_EQ(s.value_half_bits, c.value_half_bits) << c.text;
    EXPECT_EQ(s.crq_half_bits(true), c.key_half_bits) << c.text;
    EXPECT_EQ(s.crq_half_bits(false), c.value_half_bits ? c.value_half_bits : c.key_half_bits)
        << c.text;
    EXPECT_EQ(s.ToString(), c.canonical) << c.text;
    EXPECT_EQ(MustParse(s.ToString()), s) << "round trip of " << c.text;
  }
  EXPECT_EQ(MustParse("crq3:pre_rope").residual, 128) << "default r";
  EXPECT_EQ(MustParse("crq3:r64:pre_rope").flush_tokens(), 64);
  EXPECT_TRUE(MustParse("crq3:r64:pre_rope").has_tail());
  EXPECT_EQ(MustParse("crq3:r0:pre_rope").flush_tokens(), 1) << "r0 quantizes on append";
  EXPECT_FALSE(MustParse("crq3:r0:pre_rope").has_tail());
  EXPECT_TRUE(MustParse("kivi2:r0").has_tail()) << "kivi keeps its unfinished group";
  EXPECT_FALSE(MustParse("int8").has_tail());
}

TEST(QuantSpecTest, CrqRefusesOtherOptionsNamingThem) {
  const std::string takes = " does not apply to crq; crq takes vV, rN, sink=S and pre_rope";
  for (const char* opt : {"g64", "fit", "p8", "p16", "outliers=1", "nuq", "rotate", "ktok", "x"}) {
    const std::string text = std::string("crq3:pre_rope:") + opt;
    ExpectParseError(text, "scheme \"" + text + "\": option \"" + opt + "\"" + takes);
  }
  ExpectParseError("crq3", "scheme \"crq3\": crq needs pre_rope: its calibrated key means are "
                           "pre-RoPE, so keys are appended before RoPE (write crq...:pre_rope)");
  ExpectParseError("crq3:r0", "scheme \"crq3:r0\": crq needs pre_rope: its calibrated key means "
                              "are pre-RoPE, so keys are appended before RoPE (write "
                              "crq...:pre_rope)");
  const std::string bases = "; expected one of fp16, bf16, int8, fp8_e4m3, kivi4, kivi3, kivi2, "
                            "crq<K> (K in 2, 2.5, 3, 3.5, 4)";
  for (const char* base : {"crq1", "crq5", "crq2.0", "crq2.25", "crq", "crq3.", "crq.5", "crq-3"}) {
    ExpectParseError(base, std::string("scheme \"") + base + "\": unknown base scheme \"" + base +
                               "\"" + bases);
  }
  const std::string vbad = "crq value bits v must be 2, 2.5, 3, 3.5 or 4, e.g. v2.5";
  for (const char* v : {"v1", "v5", "v2.0", "v3.25", "v4x"}) {
    const std::string text = std::string("crq3:pre_rope:") + v;
    ExpectParseError(text, "scheme \"" + text + "\": " + vbad);
  }
  ExpectParseError("crq3:pre_rope:r-1", "scheme \"crq3:pre_rope:r-1\": option \"r-1\"" + takes);
  ExpectParseError("crq3:pre_rope:r5000",
                   "scheme \"crq3:pre_rope:r5000\": residual r must be in [0, 4096], got 5000");
  ExpectParseError("crq3:pre_rope:r1.5",
                   "scheme \"crq3:pre_rope:r1.5\": r needs an integer, e.g. r128");
  ExpectParseError("crq3:pre_rope:sink=2000",
                   "scheme \"crq3:pre_rope:sink=2000\": sink must be in [0, 1024], got 2000");
  ExpectParseError("crq3:pre_rope:r0:r8",
                   "scheme \"crq3:pre_rope:r0:r8\": option \"r\" given twice");
  ExpectParseError("crq3:pre_rope:pre_rope",
                   "scheme \"crq3:pre_rope:pre_rope\": option \"pre_rope\" given twice");
  ExpectParseError("crq3:v2:v4:pre_rope",
                   "scheme \"crq3:v2:v4:pre_rope\": option \"v\" given twice");
}

TEST(QuantSpecTest, CrqValidateNamesWhatIsWrong) {
  const QuantSpec good = MustParse("crq2.5:pre_rope");
  auto expect = [](const QuantSpec& s, const std::string& message) {
    const absl::Status st = s.Validate();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_EQ(st.message(), message);
  };
  QuantSpec s = good;
  s.key_half_bits = 3;
  expect(s, "crq key bits must be 2, 2.5, 3, 3.5 or 4, got 3 half bits");
  s = good;
  s.value_half_bits = 9;
  expect(s, "crq value bits v must be 2, 2.5, 3, 3.5 or 4, got 9 half bits");
  s = good;
  s.value_half_bits = 5;
  expect(s, "crq value bits equal to the key bits (2.5) are written as value_half_bits = 0");
  s = good;
  s.bits = 3;
  expect(s, "crq keeps its widths in key_half_bits/value_half_bits; bits and vbits must be 0, "
            "got 3 and 0");
  s = good;
  s.group = 64;
  expect(s, "option g does not apply to crq; crq takes vV, rN, sink=S and pre_rope");
  s = good;
  s.rotate = true;
  expect(s, "option rotate does not apply to crq; crq takes vV, rN, sink=S and pre_rope");
  s = good;
  s.key_axis = KeyAxis::kPerToken;
  expect(s, "option ktok does not apply to crq; crq takes vV, rN, sink=S and pre_rope");
}

void ExpectValidateError(const QuantSpec& s, const std::string& message) {
  const absl::Status st = s.Validate();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(st.message(), message) << s.ToString();
}

TEST(QuantSpecTest, ValidateWantsEqualWidthsSpelledAsZero) {
  QuantSpec s = MustParse("kivi4:v2");
  s.vbits = 4;
  ExpectValidateError(s, "value bits v equal to the key bits (4) are written as vbits = 0");
  s.vbits = 0;
  EXPECT_TRUE(s.Validate().ok());
  EXPECT_EQ(s, MustParse("kivi4:v4")) << "Parse spells v4 on kivi4 as vbits = 0";
}

TEST(QuantSpecTest, ValidateRejectsBadKiviBits) {
  QuantSpec s = MustParse("kivi2");
  s.bits = 5;
  ExpectValidateError(s, "kivi bits must be 2, 3 or 4, got 5");
}

// Random scheme strings built from the grammar's own pieces, and valid ones
// with a character changed: Parse() accepts or returns INVALID_ARGUMENT, and
// whatever it accepts prints a canonical form that parses to the same spec.
// (Scheme strings arrive over the API from any client.)
TEST(QuantSpecTest, RandomStringsParseOrFailCleanly) {
  const std::vector<std::string> pieces = {
      "kivi2", "kivi3", "kivi4", "int8", "fp16", "bf16", "fp8_e4m3", "fp8", "g32", "g16", "g0",
      "g1024", "r128", "r0", "r32", "r-1", "pre_rope", "outliers=1", "outliers=0.5",
      "outliers=-1", "outliers=x", "sink=4", "sink=999999999999", "nuq", "rotate", "ktok",
      "p8", "fit", "v2", "v3", "v4", "v9", "", "=", ":", "crq2.5", "crq3", "crq4", "v2.5",
      "v3.5"};
  std::mt19937_64 rng(11);
  int accepted = 0;
  auto check = [&](const std::string& text) {
    absl::StatusOr<QuantSpec> spec = QuantSpec::Parse(text);
    if (!spec.ok()) {
      EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << "\"" << text << "\"";
      return;
    }
    ++accepted;
    const std::string canonical = spec->ToString();
    absl::StatusOr<QuantSpec> again = QuantSpec::Parse(canonical);
    ASSERT_TRUE(again.ok()) << "\"" << text << "\" printed \"" << canonical << "\": " << again.status();
    EXPECT_EQ(again->ToString(), canonical) << "\"" << text << "\"";
  };
  for (int trial = 0; trial < 4000; ++trial) {
    const size_t base = rng() % 10;
    std::string text = pieces[base < 8 ? base : pieces.size() - 5 + base - 8];
    for (int n = static_cast<int>(rng() % 5); n > 0; --n) text += ":" + pieces[rng() % pieces.size()];
    if (rng() % 4 == 0 && !text.empty()) text[rng() % text.size()] = static_cast<char>(rng() % 128);
    check(text);
  }
  EXPECT_GT(accepted, 100);
}

}  // namespace
}  // namespace kvq
