// Writes the seed corpus of every fuzz target into <dir>/<target>/:
//
//   build-fuzz/tests/fuzz/make_fuzz_corpus tests/fuzz/corpus
//
// The seeds are valid inputs (a few per target, a few KiB in all) built
// with the project's own code, so that the fuzzers start from the
// structures they mutate: real quantized pages, real requests against the
// base sequences of rpc_fuzz, well-formed .npy and GGUF files. The output
// is deterministic; the committed corpus is this program's output.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/host_tensor.h"
#include "client/npy.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kvq/v1/kvq.pb.h"
#include "service/sequence_store.h"
#include "tests/fuzz/raw_page_input.h"
#include "tests/fuzz/rpc_input.h"

namespace kvq::fuzz {
namespace {

std::string g_root;

void Die(const std::string& what) {
  std::fprintf(stderr, "make_fuzz_corpus: %s\n", what.c_str());
  std::exit(1);
}

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::filesystem::path dir = std::filesystem::path(g_root) / target;
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) Die("cannot write " + (dir / name).string());
}

std::vector<float> Wave(size_t n, float phase) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(0.29f * static_cast<float>(i) + phase);
  return v;
}

v1::Tensor WireTensor(const std::vector<int64_t>& shape, float phase, v1::DType dtype) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  const DType d = dtype == v1::DTYPE_FP32 ? DType::kFloat32
                  : dtype == v1::DTYPE_FP16 ? DType::kFloat16 : DType::kBFloat16;
  absl::StatusOr<HostTensor> t = HostTensor::FromFloats(Wave(n, phase), shape, d);
  if (!t.ok()) Die(t.status().ToString());
  v1::Tensor out;
  out.set_dtype(dtype);
  for (int64_t s : shape) out.add_shape(s);
  out.set_data(t->data);
  return out;
}

// ------------------------------------------------------------ quant_spec

void QuantSpecSeeds() {
  const char* schemes[] = {"fp16", "bf16", "int8", "fp8_e4m3", "kivi2", "kivi3:g64:r64",
                           "kivi4:v2:g32:r128:fit:p8", "kivi2:pre_rope:outliers=1:sink=4:nuq",
                           "kivi4:g16:r0:rotate:ktok", "kivi3:v4:g256:r4096:outliers=0.5"};
  int i = 0;
  for (const char* s : schemes) Write("quant_spec_fuzz", absl::StrCat("seed-", i++), s);
}

// ------------------------------------------------------------------ npy

void NpySeeds() {
  struct Case {
    std::vector<int64_t> shape;
    DType dtype;
  };
  const Case cases[] = {{{2, 3}, DType::kFloat32}, {{5}, DType::kFloat16}, {{}, DType::kFloat32},
                        {{2, 0, 4}, DType::kFloat16}, {{1, 2, 2, 2}, DType::kFloat32}};
  int i = 0;
  for (const Case& c : cases) {
    size_t n = 1;
    for (int64_t d : c.shape) n *= static_cast<size_t>(d);
    absl::StatusOr<HostTensor> t = HostTensor::FromFloats(Wave(n, 0.5f), c.shape, c.dtype);
    if (!t.ok()) Die(t.status().ToString());
    absl::StatusOr<std::string> bytes = SerializeNpy(*t);
    if (!bytes.ok()) Die(bytes.status().ToString());
    Write("npy_fuzz", absl::StrCat("seed-", i++), *bytes);
  }
}

// ----------------------------------------------------------------- gguf

class GgufWriter {
 public:
  template <typename T>
  void Put(T v) {
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void Str(const std::string& s) {
    Put<uint64_t>(s.size());
    out_ += s;
  }
  void Pad(size_t align) {
    while (out_.size() % align != 0) out_.push_back('\0');
  }
  std::string& bytes() { return out_; }

 private:
  std::string out_;
};

void GgufSeeds() {
  for (uint32_t version : {2u, 3u}) {
    GgufWriter w;
    w.Put<uint32_t>(0x46554747);  // "GGUF"
    w.Put<uint32_t>(version);
    w.Put<uint64_t>(2);  // Tensors.
    w.Put<uint64_t>(6);  // Metadata entries.
    w.Str("general.architecture");
    w.Put<uint32_t>(8);  // string
    w.Str("llama");
    w.Str("general.alignment");
    w.Put<uint32_t>(4);  // u32
    w.Put<uint32_t>(32);
    w.Str("llama.context_length");
    w.Put<uint32_t>(10);  // u64
    w.Put<uint64_t>(2048);
    w.Str("llama.rope.freq_base");
    w.Put<uint32_t>(6);  // f32
    w.Put<float>(10000.0f);
    w.Str("tokenizer.ggml.tokens");
    w.Put<uint32_t>(9);  // array
    w.Put<uint32_t>(8);  // of string
    w.Put<uint64_t>(3);
    for (const char* t : {"<s>", "a", "b"}) w.Str(t);
    w.Str("tokenizer.ggml.scores");
    w.Put<uint32_t>(9);  // array
    w.Put<uint32_t>(6);  // of f32
    w.Put<uint64_t>(3);
    for (float f : {0.0f, -1.0f, -2.0f}) w.Put<float>(f);
    // Tensors: f32 [8] at 0, q4_0 [32, 2] at 32.
    w.Str("a.weight");
    w.Put<uint32_t>(1);
    w.Put<uint64_t>(8);
    w.Put<uint32_t>(0);  // F32
    w.Put<uint64_t>(0);
    w.Str("b.weight");
    w.Put<uint32_t>(2);
    w.Put<uint64_t>(32);
    w.Put<uint64_t>(2);
    w.Put<uint32_t>(2);  // Q4_0: 18 bytes per 32 elements.
    w.Put<uint64_t>(32);
    w.Pad(32);
    for (int i = 0; i < 8; ++i) w.Put<float>(0.5f * i);
    for (int i = 0; i < 36; ++i) w.Put<uint8_t>(static_cast<uint8_t>(i * 7));
    Write("gguf_fuzz", absl::StrCat("seed-v", version), w.bytes());
  }
}

// ---------------------------------------------------- append_decoder

void AppendDecoderSeeds() {
  v1::AppendRequest raw;
  raw.mutable_sequence()->set_namespace_("tenant");
  raw.mutable_sequence()->set_sequence_id("seq-1");
  v1::QuantizedPages* p = raw.mutable_chunk()->mutable_pages();
  raw.mutable_chunk()->set_layer_begin(1);
  p->set_layers(1);
  p->set_tokens(32);
  p->set_page_bytes(192);
  p->set_page_tokens(32);
  p->set_page_data(std::string(192, '\x5a'));
  raw.add_token_ids(7);
  raw.add_token_ids(9);
  v1::AppendRequest dense;
  dense.mutable_sequence()->set_sequence_id("seq-2");
  *dense.mutable_chunk()->mutable_k() = WireTensor({1, 1, 2, 16}, 0.0f, v1::DTYPE_FP16);
  *dense.mutable_chunk()->mutable_v() = WireTensor({1, 1, 2, 16}, 1.0f, v1::DTYPE_FP16);
  int i = 0;
  for (const std::string& wire : {raw.SerializeAsString(), dense.SerializeAsString()}) {
    for (char slice : {'\0', '\7'}) {
      Write("append_decoder_fuzz", absl::StrCat("seed-", i++), std::string(1, slice) + wire);
    }
  }
}

// ------------------------------------------------------------ raw_page

void RawPageSeeds() {
  for (int si = 0; si < kNumPageSchemes; ++si) {
    if (std::string(kPageSchemes[si]) == "fp8_e4m3") continue;  // Takes no pages.
    const uint8_t shape_byte = static_cast<uint8_t>(1 + 3 * (si % 2));  // head_dim 32, both backends.
    const PageShape shape = DecodePageShape(shape_byte);
    StreamConfig config;
    absl::StatusOr<QuantSpec> spec = QuantSpec::Parse(kPageSchemes[si]);
    if (!spec.ok()) Die(spec.status().ToString());
    config.spec = *spec;
    config.head_dim = shape.head_dim;
    Codebook codebook;
    if (config.spec.nuq) codebook = Codebook::Uniform(config.spec.bits, shape.head_dim);
    absl::StatusOr<std::unique_ptr<KvStream>> s =
        KvStream::Create(config, shape.backend, nullptr, config.spec.nuq ? &codebook : nullptr);
    if (!s.ok()) Die(s.status().ToString());
    // Quantize sink + one flush of ordinary values, then take the pages.
    const int flush = config.spec.flush_tokens();
    const int n = config.spec.sink + flush;
    std::vector<float> k = Wave(static_cast<size_t>(n) * shape.head_dim, 0.2f);
    std::vector<float> v = Wave(static_cast<size_t>(n) * shape.head_dim, 1.3f);
    absl::Status st = (*s)->Append(Floats(k.data(), n, shape.head_dim),
                                   Floats(v.data(), n, shape.head_dim));
    if (!st.ok()) Die(st.ToString());
    std::string pages;
    st = (*s)->AppendPagesTo(0, flush, &pages);
    if (!st.ok()) Die(st.ToString());
    // [scheme][shape][tokens = one flush][cut in the first page].
    std::string input = {static_cast<char>(si), static_cast<char>(shape_byte), '\0', '\x50'};
    Write("raw_page_fuzz", absl::StrCat("seed-", si), input + pages);
  }
}

// ----------------------------------------------------------------- rpc

v1::SequenceRef Ref(const char* id) {
  v1::SequenceRef r;
  r.set_namespace_(kNamespace);
  r.set_sequence_id(id);
  return r;
}

Call One(Method m, const google::protobuf::Message& msg) {
  return Call{m, {msg.SerializeAsString()}};
}

void RpcSeeds() {
  // The base sequences, for their real pages.
  StoreOptions options;
  options.pool.capacity_bytes = size_t{8} << 20;
  options.pool.slab_bytes = size_t{64} << 10;
  options.pool.huge_pages = false;
  absl::StatusOr<std::unique_ptr<SequenceStore>> store = SequenceStore::Create(options, &CpuBackend());
  if (!store.ok()) Die(store.status().ToString());
  if (absl::Status st = AddBaseSequences(store->get()); !st.ok()) Die(st.ToString());
  const BaseSequence& kivi = kBaseSequences[0];
  const BaseSequence& fp16 = kBaseSequences[1];
  const BaseSequence& k4 = kBaseSequences[2];

  std::vector<std::vector<Call>> seeds;
  seeds.push_back({One(Method::kGetServerInfo, v1::GetServerInfoRequest())});
  {
    // Create a sequence, append a dense token to it, fetch it back.
    v1::CreateSequenceRequest c;
    c.set_namespace_(kNamespace);
    c.set_sequence_id("new");
    v1::ModelLayout* l = c.mutable_layout();
    l->set_num_layers(1);
    l->set_num_kv_heads(1);
    l->set_num_q_heads(2);
    l->set_head_dim(16);
    l->mutable_rope()->set_pairing(v1::RopeParams::PAIRING_ADJACENT);
    c.set_scheme("kivi4:g16:r16:sink=1");
    c.add_prompt_token_ids(1);
    v1::AppendRequest a;
    *a.mutable_sequence() = Ref("new");
    *a.mutable_chunk()->mutable_k() = WireTensor({1, 1, 3, 16}, 0.0f, v1::DTYPE_BF16);
    *a.mutable_chunk()->mutable_v() = WireTensor({1, 1, 3, 16}, 0.4f, v1::DTYPE_BF16);
    v1::FetchRequest f;
    *f.mutable_sequence() = Ref("new");
    f.set_dtype(v1::DTYPE_FP32);
    seeds.push_back({One(Method::kCreateSequence, c), One(Method::kAppend, a),
                     One(Method::kFetchDequant, f)});
  }
  {
    // A nuq sequence with its codebooks.
    v1::CreateSequenceRequest c;
    c.set_sequence_id("nuq");
    v1::ModelLayout* l = c.mutable_layout();
    l->set_num_layers(1);
    l->set_num_kv_heads(1);
    l->set_num_q_heads(1);
    l->set_head_dim(16);
    c.set_scheme("kivi2:g16:r0:nuq");
    v1::Codebook* cb = c.add_codebooks();
    v1::Tensor levels;
    levels.set_dtype(v1::DTYPE_FP32);
    levels.add_shape(16);
    levels.add_shape(4);
    std::vector<float> lv;
    for (int ch = 0; ch < 16; ++ch) {
      for (float x : {0.0f, 0.2f, 0.7f, 1.0f}) lv.push_back(x);
    }
    levels.set_data(std::string(reinterpret_cast<const char*>(lv.data()), lv.size() * 4));
    *cb->mutable_key_levels() = levels;
    *cb->mutable_value_levels() = levels;
    seeds.push_back({One(Method::kCreateSequence, c)});
  }
  {
    // Raw pages onto "kivi" (a page boundary, the tail empty): the
    // sequence's own first pages, one flush of tokens, in two messages.
    SequenceStore::Handle h = *(*store)->Get(kNamespace, kivi.id);
    absl::ReaderMutexLock lock(&h->mu());
    const KvStream& s0 = h->stream(0, 0);
    const int flush = s0.spec().flush_tokens();
    std::string pages;
    for (int l = 0; l < kivi.layers; ++l) {
      for (int head = 0; head < kivi.kv_heads; ++head) {
        if (!h->stream(l, head).AppendPagesTo(0, flush, &pages).ok()) Die("AppendPagesTo");
      }
    }
    v1::AppendRequest first;
    *first.mutable_sequence() = Ref(kivi.id);
    v1::AppendRequest raw;
    v1::QuantizedPages* p = raw.mutable_chunk()->mutable_pages();
    p->set_layers(kivi.layers);
    p->set_tokens(flush);
    p->set_page_bytes(static_cast<int64_t>(s0.layout().page_bytes));
    p->set_page_tokens(s0.layout().page_tokens);
    p->set_page_data(pages);
    seeds.push_back({Call{Method::kAppend, {first.SerializeAsString(), raw.SerializeAsString()}},
                     One(Method::kStats, [&] {
                       v1::StatsRequest r;
                       *r.mutable_sequence() = Ref(kivi.id);
                       return r;
                     }())});
  }
  {
    // Fetches: dense in small chunks, raw pages, pre_rope keys.
    v1::FetchRequest dense;
    *dense.mutable_sequence() = Ref(kivi.id);
    dense.set_layer_begin(1);
    dense.set_token_begin(3);
    dense.set_max_chunk_bytes(1000);
    v1::FetchRequest raw;
    *raw.mutable_sequence() = Ref(kivi.id);
    raw.set_raw(true);
    raw.set_token_begin(2);
    v1::FetchRequest roped;
    *roped.mutable_sequence() = Ref(k4.id);
    roped.set_apply_rope(true);
    roped.set_dtype(v1::DTYPE_BF16);
    seeds.push_back({One(Method::kFetchDequant, dense), One(Method::kFetchDequant, raw),
                     One(Method::kFetchDequant, roped)});
  }
  {
    // Attend: per item over two sequences of one group size, causal and
    // ranged; packed.
    v1::AttendRequest r;
    r.set_layer(1);
    v1::AttendItem* a = r.add_items();
    *a->mutable_sequence() = Ref(kivi.id);
    *a->mutable_q() = WireTensor({2, kivi.q_heads, kivi.head_dim}, 0.1f, v1::DTYPE_FP32);
    a->add_q_positions(10);
    a->add_q_positions(65);
    v1::AttendItem* b = r.add_items();
    *b->mutable_sequence() = Ref(k4.id);
    *b->mutable_q() = WireTensor({1, k4.q_heads, k4.head_dim}, 0.2f, v1::DTYPE_FP16);
    b->set_key_begin(3);
    b->set_key_end(40);
    v1::AttendRequest packed;
    packed.add_items()->mutable_sequence()->CopyFrom(Ref(kivi.id));
    packed.add_items()->mutable_sequence()->CopyFrom(Ref(kivi.id));
    *packed.mutable_q() = WireTensor({2, kivi.q_heads, kivi.head_dim}, 0.3f, v1::DTYPE_FP32);
    packed.set_softmax_scale(0.25f);
    seeds.push_back({One(Method::kAttend, r), One(Method::kAttend, packed)});
  }
  {
    // AppendAttend per item and packed, then a two-step DecodeStream.
    v1::AppendAttendRequest r;
    v1::AppendAttendItem* it = r.add_items();
    *it->mutable_sequence() = Ref(kivi.id);
    *it->mutable_k() = WireTensor({kivi.kv_heads, 2, kivi.head_dim}, 0.0f, v1::DTYPE_FP32);
    *it->mutable_v() = WireTensor({kivi.kv_heads, 2, kivi.head_dim}, 0.5f, v1::DTYPE_FP32);
    *it->mutable_q() = WireTensor({2, kivi.q_heads, kivi.head_dim}, 0.9f, v1::DTYPE_FP32);
    v1::AppendAttendRequest packed;
    packed.set_layer(1);
    packed.add_items()->mutable_sequence()->CopyFrom(Ref(k4.id));
    *packed.mutable_k() = WireTensor({1, k4.kv_heads, k4.head_dim}, 0.0f, v1::DTYPE_FP16);
    *packed.mutable_v() = WireTensor({1, k4.kv_heads, k4.head_dim}, 0.5f, v1::DTYPE_FP16);
    *packed.mutable_q() = WireTensor({1, k4.q_heads, k4.head_dim}, 0.9f, v1::DTYPE_FP16);
    seeds.push_back({One(Method::kAppendAttend, r), One(Method::kAppendAttend, packed)});
    Call decode{Method::kDecodeStream, {}};
    for (int layer = 0; layer < 1; ++layer) {
      for (int step = 0; step < 2; ++step) {
        v1::DecodeRequest d;
        v1::AppendAttendRequest* s = d.mutable_step();
        s->set_layer(layer);
        v1::AppendAttendItem* i = s->add_items();
        *i->mutable_sequence() = Ref(fp16.id);
        *i->mutable_k() = WireTensor({1, 1, fp16.head_dim}, 0.1f * step, v1::DTYPE_FP16);
        *i->mutable_v() = WireTensor({1, 1, fp16.head_dim}, 0.2f * step, v1::DTYPE_FP16);
        *i->mutable_q() = WireTensor({1, fp16.q_heads, fp16.head_dim}, 0.3f, v1::DTYPE_FP16);
        decode.messages.push_back(d.SerializeAsString());
      }
    }
    seeds.push_back({decode});
  }
  {
    // Fork on a flush boundary, stats of the fork, release both.
    v1::ForkRequest f;
    *f.mutable_source() = Ref(kivi.id);
    f.set_new_sequence_id("forked");
    f.set_num_tokens(34);
    f.set_ttl_seconds(60);
    v1::StatsRequest s;
    *s.mutable_sequence() = Ref("forked");
    v1::ReleaseRequest r1;
    *r1.mutable_sequence() = Ref("forked");
    v1::ReleaseRequest r2;
    *r2.mutable_sequence() = Ref(kivi.id);
    seeds.push_back({One(Method::kFork, f), One(Method::kStats, s), One(Method::kRelease, r1),
                     One(Method::kRelease, r2)});
  }
  seeds.push_back({One(Method::kStats, v1::StatsRequest())});
  for (size_t i = 0; i < seeds.size(); ++i) {
    Write("rpc_fuzz", absl::StrFormat("seed-%02d", i), EncodeCalls(seeds[i]));
  }
}

}  // namespace
}  // namespace kvq::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_corpus <corpus dir>\n");
    return 2;
  }
  kvq::fuzz::g_root = argv[1];
  kvq::fuzz::QuantSpecSeeds();
  kvq::fuzz::NpySeeds();
  kvq::fuzz::GgufSeeds();
  kvq::fuzz::AppendDecoderSeeds();
  kvq::fuzz::RawPageSeeds();
  kvq::fuzz::RpcSeeds();
  return 0;
}
