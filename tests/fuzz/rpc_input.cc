#include "tests/fuzz/rpc_input.h"

#include <algorithm>
#include <cmath>

#include "absl/synchronization/mutex.h"
#include "kernels/status_macros.h"

namespace kvq::fuzz {

const char* MethodPath(Method m) {
  switch (m) {
    case Method::kGetServerInfo: return "/kvq.v1.KvCache/GetServerInfo";
    case Method::kCreateSequence: return "/kvq.v1.KvCache/CreateSequence";
    case Method::kAppend: return "/kvq.v1.KvCache/Append";
    case Method::kFetchDequant: return "/kvq.v1.KvCache/FetchDequant";
    case Method::kAttend: return "/kvq.v1.KvCache/Attend";
    case Method::kAppendAttend: return "/kvq.v1.KvCache/AppendAttend";
    case Method::kDecodeStream: return "/kvq.v1.KvCache/DecodeStream";
    case Method::kFork: return "/kvq.v1.KvCache/Fork";
    case Method::kRelease: return "/kvq.v1.KvCache/Release";
    case Method::kStats: return "/kvq.v1.KvCache/Stats";
  }
  return "";
}

bool ClientStreams(Method m) { return m == Method::kAppend || m == Method::kDecodeStream; }

std::vector<Call> DecodeCalls(const uint8_t* data, size_t size) {
  std::vector<Call> calls;
  size_t at = 0;
  while (at + 2 <= size && static_cast<int>(calls.size()) < kMaxCalls) {
    Call c;
    c.method = static_cast<Method>(data[at] % kNumMethods);
    const int count = std::min<int>(data[at + 1], kMaxMessages);
    at += 2;
    for (int i = 0; i < count && at < size; ++i) {
      size_t len = data[at];
      if (at + 1 < size) len |= static_cast<size_t>(data[at + 1]) << 8;
      at = std::min(at + 2, size);
      len = std::min(len, size - at);
      c.messages.emplace_back(reinterpret_cast<const char*>(data + at), len);
      at += len;
    }
    if (!ClientStreams(c.method) && c.messages.size() > 1) c.messages.resize(1);
    calls.push_back(std::move(c));
  }
  return calls;
}

std::string EncodeCalls(const std::vector<Call>& calls) {
  std::string out;
  for (const Call& c : calls) {
    out.push_back(static_cast<char>(c.method));
    out.push_back(static_cast<char>(c.messages.size()));
    for (const std::string& m : c.messages) {
      out.push_back(static_cast<char>(m.size() & 0xff));
      out.push_back(static_cast<char>((m.size() >> 8) & 0xff));
      out += m;
    }
  }
  return out;
}

absl::Status AddBaseSequences(SequenceStore* store) {
  for (const BaseSequence& b : kBaseSequences) {
    CreateSequenceArgs args;
    args.ns = kNamespace;
    args.id = b.id;
    args.shape.num_layers = b.layers;
    args.shape.num_kv_heads = b.kv_heads;
    args.shape.num_q_heads = b.q_heads;
    args.shape.head_dim = b.head_dim;
    args.scheme = b.scheme;
    KVQ_ASSIGN_OR_RETURN(SequenceStore::Handle seq, store->Create(args));
    // [layers, kv_heads, tokens, head_dim] fp32, keys and values apart.
    const size_t n = static_cast<size_t>(b.layers) * b.kv_heads * b.tokens * b.head_dim;
    std::vector<float> k(n), v(n);
    for (size_t i = 0; i < n; ++i) {
      k[i] = std::sin(0.113f * static_cast<float>(i));
      v[i] = std::cos(0.071f * static_cast<float>(i)) * 2.0f;
    }
    DenseKv kv{0, b.layers, b.tokens, DType::kFloat32, reinterpret_cast<const uint8_t*>(k.data()),
               reinterpret_cast<const uint8_t*>(v.data())};
    absl::MutexLock lock(&seq->mu());
    KVQ_RETURN_IF_ERROR(seq->AppendDense(kv));
  }
  return absl::OkStatus();
}

}  // namespace kvq::fuzz
