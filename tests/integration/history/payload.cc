#include "tests/integration/history/payload.h"

#include <cstring>
#include <random>

#include "kernels/numeric.h"

namespace kvq::history {
namespace {

// Small multiples of 1/16 and 1/32: exact in fp16.
float KeyFill(int64_t op, int index, int head, int d) {
  return static_cast<float>((op * 31 + index * 17 + head * 7 + d * 13) % 64 - 32) / 16.0f;
}
float ValueFill(int64_t op, int index, int head, int d) {
  return static_cast<float>((op * 11 + index * 5 + head * 3 + d * 29) % 64 - 32) / 32.0f;
}

void PutRows(const std::vector<uint16_t>& row, std::string* data) {
  data->append(reinterpret_cast<const char*>(row.data()), row.size() * sizeof(uint16_t));
}

uint16_t Bits(const std::string& data, size_t element) {
  uint16_t b;
  std::memcpy(&b, data.data() + element * sizeof(uint16_t), sizeof(b));
  return b;
}

}  // namespace

v1::ModelLayout Layout() {
  v1::ModelLayout l;
  l.set_num_layers(kLayers);
  l.set_num_kv_heads(kKvHeads);
  l.set_num_q_heads(kQHeads);
  l.set_head_dim(kHeadDim);
  return l;
}

std::vector<uint16_t> KeyRow(int64_t op, int index, int head) {
  std::vector<uint16_t> row(kHeadDim);
  row[0] = FloatToHalf(static_cast<float>(op & 2047));
  row[1] = FloatToHalf(static_cast<float>((op >> 11) & 2047));
  row[2] = FloatToHalf(static_cast<float>(index));
  row[3] = FloatToHalf(static_cast<float>(head));
  for (int d = kTagDims; d < kHeadDim; ++d) row[d] = FloatToHalf(KeyFill(op, index, head, d));
  return row;
}

std::vector<uint16_t> ValueRow(int64_t op, int index, int head) {
  std::vector<uint16_t> row(kHeadDim);
  for (int d = 0; d < kHeadDim; ++d) row[d] = FloatToHalf(ValueFill(op, index, head, d));
  return row;
}

void FillChunk(int64_t op, int first, int tokens, v1::KvChunk* chunk) {
  for (v1::Tensor* t : {chunk->mutable_k(), chunk->mutable_v()}) {
    t->set_dtype(v1::DTYPE_FP16);
    t->clear_shape();
    for (int64_t d : {int64_t{kLayers}, int64_t{kKvHeads}, int64_t{tokens}, int64_t{kHeadDim}}) {
      t->add_shape(d);
    }
    t->clear_data();
  }
  chunk->set_layer_begin(0);
  for (int h = 0; h < kKvHeads; ++h) {
    for (int i = first; i < first + tokens; ++i) {
      PutRows(KeyRow(op, i, h), chunk->mutable_k()->mutable_data());
      PutRows(ValueRow(op, i, h), chunk->mutable_v()->mutable_data());
    }
  }
}

void FillStep(int64_t op, v1::Tensor* k, v1::Tensor* v) {
  for (v1::Tensor* t : {k, v}) {
    t->set_dtype(v1::DTYPE_FP16);
    t->clear_shape();
    for (int64_t d : {int64_t{kKvHeads}, int64_t{1}, int64_t{kHeadDim}}) t->add_shape(d);
    t->clear_data();
  }
  for (int h = 0; h < kKvHeads; ++h) {
    PutRows(KeyRow(op, 0, h), k->mutable_data());
    PutRows(ValueRow(op, 0, h), v->mutable_data());
  }
}

std::vector<std::optional<TokenRef>> Attribute(const v1::Tensor& k, const v1::Tensor& v) {
  std::vector<std::optional<TokenRef>> out;
  if (k.shape_size() != 3 || k.dtype() != v1::DTYPE_FP16 || v.dtype() != v1::DTYPE_FP16 ||
      k.shape(0) != kKvHeads || k.shape(2) != kHeadDim || v.data().size() != k.data().size() ||
      k.data().size() != static_cast<size_t>(k.shape(1)) * kKvHeads * kHeadDim * 2) {
    return out;
  }
  const int tokens = static_cast<int>(k.shape(1));
  for (int t = 0; t < tokens; ++t) {
    const size_t row0 = static_cast<size_t>(t) * kHeadDim;  // Head 0's row of token t.
    const float lo = HalfToFloat(Bits(k.data(), row0));
    const float hi = HalfToFloat(Bits(k.data(), row0 + 1));
    const float index = HalfToFloat(Bits(k.data(), row0 + 2));
    std::optional<TokenRef> ref;
    if (lo >= 0 && lo < 2048 && hi >= 0 && hi < 2048 && index >= 0 && index <= kMaxTokensPerOp) {
      ref = TokenRef{static_cast<int64_t>(lo) + (static_cast<int64_t>(hi) << 11),
                     static_cast<int>(index)};
      for (int h = 0; h < kKvHeads && ref; ++h) {
        const std::vector<uint16_t> kr = KeyRow(ref->op, ref->index, h);
        const std::vector<uint16_t> vr = ValueRow(ref->op, ref->index, h);
        const size_t base = (static_cast<size_t>(h) * tokens + t) * kHeadDim;
        for (int d = 0; d < kHeadDim; ++d) {
          if (Bits(k.data(), base + d) != kr[d] || Bits(v.data(), base + d) != vr[d]) {
            ref.reset();
            break;
          }
        }
      }
    }
    out.push_back(ref);
  }
  return out;
}

std::vector<float> Query(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.5f);
  std::vector<float> q(static_cast<size_t>(kQHeads) * kHeadDim, 0.0f);
  for (int h = 0; h < kQHeads; ++h) {
    for (int d = kTagDims; d < kHeadDim; ++d) q[h * kHeadDim + d] = n(rng);
  }
  return q;
}

}  // namespace kvq::history
