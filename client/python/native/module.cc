// kvq._native: kvq's kernels in Python (nanobind). The C++ in kv_layer.cc;
// this file converts arrays and errors at the edge.
//
// Arrays come in through nanobind's ndarray (the buffer protocol and
// DLPack: numpy arrays, torch CPU tensors) and are read in place, never
// copied: any strides are accepted as long as each row of head_dim is
// contiguous. absl::Status errors become ValueError (INVALID_ARGUMENT,
// OUT_OF_RANGE) or RuntimeError (the rest) with the status's message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/python/native/kv_layer.h"
#include "kernels/calibration_file.h"
#include "kernels/quant_spec.h"
#include "kernels/rope.h"

namespace nb = nanobind;

namespace kvq {
namespace {

using AnyArray = nb::ndarray<nb::ro, nb::device::cpu>;
using Floats3 = nb::ndarray<nb::numpy, float, nb::ndim<3>, nb::c_contig>;
using Floats2 = nb::ndarray<nb::numpy, float, nb::ndim<2>, nb::c_contig>;
using Floats3In = nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu>;

void Raise(const absl::Status& st) {
  if (st.ok()) return;
  const std::string message(st.message());
  if (st.code() == absl::StatusCode::kInvalidArgument ||
      st.code() == absl::StatusCode::kOutOfRange) {
    throw nb::value_error(message.c_str());
  }
  throw std::runtime_error(message);
}

template <typename T>
T Value(absl::StatusOr<T> v) {
  Raise(v.status());
  return *std::move(v);
}

DType ArrayDType(const AnyArray& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  if (t == nb::dtype<float>()) return DType::kFloat32;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16 &&
      t.lanes == 1) {
    return DType::kFloat16;
  }
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16 &&
      t.lanes == 1) {
    return DType::kBFloat16;
  }
  throw nb::value_error(
      absl::StrCat(name, " must be float32, float16 or bfloat16 (code ", t.code, ", ", t.bits,
                   " bits)")
          .c_str());
}

// A [heads, tokens, head_dim] array (or one layer `layer` of a 4-d one) as
// a view of its memory.
HeadsView View(const AnyArray& a, const char* name, int layer = -1) {
  const size_t lead = layer >= 0 ? 1 : 0;
  if (a.ndim() != 3 + lead) {
    throw nb::value_error(absl::StrCat(name, " must be [", lead ? "layers, " : "",
                                       "num_kv_heads, tokens, head_dim], got ", a.ndim(),
                                       " dimensions")
                              .c_str());
  }
  if (a.shape(lead + 2) > 1 && a.stride(lead + 2) != 1) {
    throw nb::value_error(
        absl::StrCat(name, ": the head_dim axis must be contiguous (stride 1), got stride ",
                     a.stride(lead + 2))
            .c_str());
  }
  for (size_t i = lead; i < lead + 3; ++i) {
    if (a.shape(i) > (size_t{1} << 30) || (a.stride(i) < 0)) {
      throw nb::value_error(absl::StrCat(name, ": dimension ", i, " is too large or reversed")
                                .c_str());
    }
  }
  HeadsView v;
  v.dtype = ArrayDType(a, name);
  const size_t offset = layer >= 0 ? static_cast<size_t>(layer) * a.stride(0) : 0;
  v.data = static_cast<const uint8_t*>(a.data()) + offset * DTypeBytes(v.dtype);
  v.heads = static_cast<int>(a.shape(lead));
  v.tokens = static_cast<int>(a.shape(lead + 1));
  v.head_dim = static_cast<int>(a.shape(lead + 2));
  v.head_stride = a.stride(lead);
  v.row_stride = a.stride(lead + 1);
  return v;
}

RopeConfig MakeRope(const std::string& scheme, std::optional<float> theta, int rotary_dim,
                    const std::string& pairing, const std::string& scaling, float factor) {
  RopeConfig rope;
  if (theta) rope.theta = *theta;
  rope.rotary_dim = rotary_dim;
  if (pairing == "half_split") {
    rope.pairing = RopeConfig::Pairing::kHalfSplit;
  } else if (pairing == "adjacent") {
    rope.pairing = RopeConfig::Pairing::kAdjacent;
  } else {
    throw nb::value_error(
        absl::StrCat("rope_pairing must be \"half_split\" or \"adjacent\", got \"",
                     pairing.substr(0, 32), "\"")
            .c_str());
  }
  if (scaling == "none") {
    rope.scaling = RopeConfig::Scaling::kNone;
  } else if (scaling == "linear") {
    rope.scaling = RopeConfig::Scaling::kLinear;
  } else if (scaling == "ntk") {
    rope.scaling = RopeConfig::Scaling::kNtk;
  } else {
    throw nb::value_error(
        absl::StrCat("rope_scaling must be \"none\", \"linear\" or \"ntk\", got \"",
                     scaling.substr(0, 32), "\"")
            .c_str());
  }
  rope.factor = factor;
  (void)scheme;
  return rope;
}

using CodebookArg = std::optional<std::vector<std::pair<std::vector<float>, std::vector<float>>>>;

// The stream config of a scheme string and keyword arguments.
StreamConfig MakeConfig(const std::string& scheme, int head_dim, int page_tokens,
                        const RopeConfig& rope, bool theta_given) {
  StreamConfig config;
  config.spec = Value(QuantSpec::Parse(scheme));
  config.head_dim = head_dim;
  config.page_tokens = page_tokens;
  config.rope = rope;
  if (config.spec.pre_rope && !theta_given) {
    throw nb::value_error(absl::StrCat("scheme ", config.spec.ToString(),
                                       " has pre_rope: kvq applies RoPE, so give rope_theta")
                              .c_str());
  }
  Raise(config.Validate());
  return config;
}

std::vector<Codebook> MakeCodebooks(const StreamConfig& config, const CodebookArg& arg) {
  std::vector<Codebook> out;
  if (!arg) return out;
  for (const auto& [key, value] : *arg) {
    Codebook c;
    c.bits = config.spec.bits;
    c.head_dim = config.head_dim;
    c.key_levels = key;
    c.value_levels = value;
    Raise(c.Validate(config));
    out.push_back(std::move(c));
  }
  return out;
}

const KernelBackend* Backend(const std::string& name) {
  return Value(BackendByName(name));
}

// Floats of a fresh numpy array of `shape`, owned by the array.
template <size_t N, typename Array>
Array NewArray(const size_t (&shape)[N], float** data) {
  size_t count = 1;
  for (size_t s : shape) count *= s;
  auto* buffer = new float[count > 0 ? count : 1];
  nb::capsule owner(buffer, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  *data = buffer;
  return Array(buffer, N, shape, owner);
}

// An out_k / out_v argument: a writable C-contiguous float32 [heads, n, dim]
// array, taken without conversion (a converted copy would be written instead).
MutableHeadsView OutView(nb::handle obj, const char* name, int heads, int n, int dim) {
  nb::ndarray<float, nb::ndim<3>, nb::c_contig, nb::device::cpu> a;
  if (!nb::try_cast(obj, a, /*convert=*/false)) {
    throw nb::value_error(absl::StrCat(name,
                                       " must be a writable C-contiguous float32 CPU array "
                                       "[num_kv_heads, tokens, head_dim]")
                              .c_str());
  }
  if (a.shape(0) != static_cast<size_t>(heads) || a.shape(1) != static_cast<size_t>(n) ||
      a.shape(2) != static_cast<size_t>(dim)) {
    throw nb::value_error(absl::StrCat(name, " is [", a.shape(0), ", ", a.shape(1), ", ",
                                       a.shape(2), "], the read needs [", heads, ", ", n, ", ",
                                       dim, "]")
                              .c_str());
  }
  return {a.data(), heads, n, dim, static_cast<int64_t>(n) * dim, dim};
}

nb::dict ByteDict(const ByteBreakdown& b) {
  nb::dict d;
  d["codes"] = b.codes;
  d["scales"] = b.scales;
  d["outliers"] = b.outliers;
  d["residual"] = b.residual;
  d["sink"] = b.sink;
  d["codebook"] = b.codebook;
  d["padding"] = b.padding;
  d["total"] = b.total();
  return d;
}

// A model's calibration (the crq schemes'): a .kvqcal file read through
// kernels/calibration_file, or statistics given as arrays (what kvq.calibrate
// computes from a transformers model), written through the same code.
class PyCalibration {
 public:
  explicit PyCalibration(CalibrationFile file) : file_(std::move(file)) {}

  static PyCalibration Load(const std::string& path) {
    return PyCalibration(Value(ReadCalibrationFile(path)));
  }

  // key_mean, key_scale, value_mean, value_scale: float32 [num_layers,
  // num_kv_heads, head_dim] each. The bytes a file of them would hold are
  // made and parsed back, so every check (name, finite values, positive
  // scales, the checksum) is the file format's own.
  static PyCalibration FromArrays(const std::string& name, const Floats3In& key_mean,
                                  const Floats3In& key_scale, const Floats3In& value_mean,
                                  const Floats3In& value_scale, const std::string& model) {
    const Floats3In* arrays[4] = {&key_mean, &key_scale, &value_mean, &value_scale};
    const char* names[4] = {"key_mean", "key_scale", "value_mean", "value_scale"};
    for (int i = 1; i < 4; ++i) {
      for (size_t d = 0; d < 3; ++d) {
        if (arrays[i]->shape(d) != key_mean.shape(d)) {
          throw nb::value_error(absl::StrCat(names[i], " is [", arrays[i]->shape(0), ", ",
                                             arrays[i]->shape(1), ", ", arrays[i]->shape(2),
                                             "], key_mean [", key_mean.shape(0), ", ",
                                             key_mean.shape(1), ", ", key_mean.shape(2), "]")
                                    .c_str());
        }
      }
    }
    ModelCalibration c;
    c.name = name;
    c.num_layers = static_cast<int>(key_mean.shape(0));
    c.num_kv_heads = static_cast<int>(key_mean.shape(1));
    c.head_dim = static_cast<int>(key_mean.shape(2));
    const size_t d = c.head_dim;
    for (size_t head = 0; head < key_mean.shape(0) * key_mean.shape(1); ++head) {
      HeadCalibration h;
      std::vector<float>* out[4] = {&h.key_mean, &h.key_scale, &h.value_mean, &h.value_scale};
      for (int i = 0; i < 4; ++i) {
        const float* at = arrays[i]->data() + head * d;
        out[i]->assign(at, at + d);
      }
      c.heads.push_back(std::move(h));
    }
    const std::string bytes = Value(SerializeCalibration(c, model));
    return PyCalibration(Value(ParseCalibration(bytes)));
  }

  void Write(const std::string& path) const {
    Raise(WriteCalibrationFile(path, file_.calibration, file_.model));
  }

  // The four statistics as float32 [num_layers, num_kv_heads, head_dim].
  nb::dict Arrays() const {
    const ModelCalibration& c = file_.calibration;
    const size_t shape[3] = {static_cast<size_t>(c.num_layers),
                             static_cast<size_t>(c.num_kv_heads),
                             static_cast<size_t>(c.head_dim)};
    nb::dict out;
    const char* names[4] = {"key_mean", "key_scale", "value_mean", "value_scale"};
    for (int i = 0; i < 4; ++i) {
      float* data = nullptr;
      Floats3 a = NewArray<3, Floats3>(shape, &data);
      for (const HeadCalibration& h : c.heads) {
        const std::vector<float>* v[4] = {&h.key_mean, &h.key_scale, &h.value_mean,
                                          &h.value_scale};
        data = std::copy(v[i]->begin(), v[i]->end(), data);
      }
      out[names[i]] = a;
    }
    return out;
  }

  const CalibrationFile& file() const { return file_; }

 private:
  CalibrationFile file_;
};

// The Python KvLayer: the C++ one behind a lock. The kernels run without
// the GIL, so Python threads may call into one layer at once: appends
// (writers) exclude everything else, reads and attention share it, as
// KvStream requires.
class PyKvLayer {
 public:
  PyKvLayer(const std::string& scheme, int num_kv_heads, int head_dim,
            std::optional<float> rope_theta, int rope_rotary_dim, const std::string& rope_pairing,
            const std::string& rope_scaling, float rope_factor, int page_tokens,
            const std::string& backend, const CodebookArg& codebooks,
            const PyCalibration* calibration, int calibration_layer) {
    const RopeConfig rope = MakeRope(scheme, rope_theta, rope_rotary_dim, rope_pairing,
                                     rope_scaling, rope_factor);
    const StreamConfig config =
        MakeConfig(scheme, head_dim, page_tokens, rope, rope_theta.has_value());
    layer_ = Value(KvLayer::Create(config, num_kv_heads, Backend(backend),
                                   MakeCodebooks(config, codebooks),
                                   calibration ? &calibration->file().calibration : nullptr,
                                   calibration_layer));
  }

  // f(layer) under the shared lock: the properties.
  template <typename F>
  auto With(F f) const {
    std::shared_lock lock(mu_);
    return f(*layer_);
  }

  void Append(const AnyArray& k, const AnyArray& v) {
    const HeadsView kv = View(k, "k"), vv = View(v, "v");
    absl::Status st;
    {
      nb::gil_scoped_release release;
      std::unique_lock lock(mu_);
      st = layer_->Append(kv, vv);
    }
    Raise(st);
  }

  nb::tuple Read(int begin, std::optional<int> end, nb::object out_k, nb::object out_v) {
    const int n_end = end.value_or(layer_->num_tokens());
    if (begin < 0 || n_end < begin || n_end > layer_->num_tokens()) {
      throw nb::value_error(absl::StrCat("read range [", begin, ", ", n_end,
                                         ") is not inside [0, ", layer_->num_tokens(), "]")
                                .c_str());
    }
    const int h = layer_->num_kv_heads(), d = layer_->head_dim(), n = n_end - begin;
    const size_t shape[3] = {static_cast<size_t>(h), static_cast<size_t>(n),
                             static_cast<size_t>(d)};
    nb::object ko = out_k, vo = out_v;
    float* kd = nullptr;
    float* vd = nullptr;
    if (ko.is_none()) ko = nb::cast(NewArray<3, Floats3>(shape, &kd));
    if (vo.is_none()) vo = nb::cast(NewArray<3, Floats3>(shape, &vd));
    const MutableHeadsView kv = OutView(ko, "out_k", h, n, d);
    const MutableHeadsView vv = OutView(vo, "out_v", h, n, d);
    absl::Status st;
    {
      nb::gil_scoped_release release;
      std::shared_lock lock(mu_);
      st = layer_->Read(begin, n_end, kv, vv);
    }
    Raise(st);
    return nb::make_tuple(ko, vo);
  }

  nb::object Attend(const AnyArray& q, std::optional<float> scale,
                    std::optional<std::vector<int32_t>> positions, bool return_lse) {
    if (q.ndim() != 3 || q.dtype() != nb::dtype<float>()) {
      throw nb::value_error("q must be float32 [num_q_heads, q_len, head_dim]");
    }
    const int hq = static_cast<int>(q.shape(0)), len = static_cast<int>(q.shape(1));
    const int d = static_cast<int>(q.shape(2));
    if (d != layer_->head_dim()) {
      throw nb::value_error(
          absl::StrCat("q has head_dim ", d, ", the layer ", layer_->head_dim()).c_str());
    }
    if (scale && !(*scale > 0.0f && std::isfinite(*scale))) {
      throw nb::value_error("scale must be finite and > 0");
    }
    std::vector<int32_t> pos;
    if (positions) {
      pos = *positions;
    } else {
      // Causal: the queries are the last q_len stored tokens.
      const int n = layer_->num_tokens();
      if (len > n) {
        throw nb::value_error(absl::StrCat("q has ", len, " queries but the layer stores ", n,
                                           " tokens; pass positions")
                                  .c_str());
      }
      for (int i = 0; i < len; ++i) pos.push_back(n - len + i);
    }
    // q as [q_head][query][dim] floats: a contiguous copy when it has other strides.
    std::vector<float> qc(static_cast<size_t>(hq) * len * d);
    const auto* base = static_cast<const float*>(q.data());
    for (int h = 0; h < hq; ++h) {
      for (int r = 0; r < len; ++r) {
        for (int e = 0; e < d; ++e) {
          qc[(static_cast<size_t>(h) * len + r) * d + e] =
              base[h * q.stride(0) + r * q.stride(1) + e * q.stride(2)];
        }
      }
    }
    const size_t out_shape[3] = {static_cast<size_t>(hq), static_cast<size_t>(len),
                                 static_cast<size_t>(d)};
    const size_t lse_shape[2] = {static_cast<size_t>(hq), static_cast<size_t>(len)};
    float* od = nullptr;
    float* ld = nullptr;
    Floats3 out = NewArray<3, Floats3>(out_shape, &od);
    Floats2 lse = NewArray<2, Floats2>(lse_shape, &ld);
    absl::Status st;
    {
      nb::gil_scoped_release release;
      std::shared_lock lock(mu_);
      st = layer_->Attend(qc.data(), hq, len, pos, scale.value_or(0.0f), od, ld);
    }
    Raise(st);
    if (return_lse) return nb::make_tuple(out, lse);
    return nb::cast(out);
  }

  nb::bytes Pages(int begin, std::optional<int> end) const {
    std::string data;
    absl::Status st;
    {
      nb::gil_scoped_release release;
      std::shared_lock lock(mu_);
      absl::StatusOr<std::string> pages =
          layer_->Pages(begin, end.value_or(layer_->stream(0).quantized_tokens()));
      if (pages.ok()) data = *std::move(pages);
      st = pages.status();
    }
    Raise(st);
    return nb::bytes(data.data(), data.size());
  }

  void AppendPages(nb::handle data, int tokens) {
    Py_buffer view;
    if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) {
      throw nb::python_error();
    }
    absl::Status st;
    {
      nb::gil_scoped_release release;
      std::unique_lock lock(mu_);
      st = layer_->AppendPages(static_cast<const uint8_t*>(view.buf),
                               static_cast<size_t>(view.len), tokens);
    }
    PyBuffer_Release(&view);
    Raise(st);
  }

 private:
  std::unique_ptr<KvLayer> layer_;
  mutable std::shared_mutex mu_;
};

// A read-only property (or method) of the layer, computed under its shared lock.
template <typename F>
auto Prop(F f) {
  return [f](const PyKvLayer& l) { return l.With(f); };
}

// Raw pages of a prompt's K and V ([heads, tokens, head_dim] for one
// layer or [layers, heads, tokens, head_dim]), in QuantizedPages order
// ([layer][kv_head][page]): what a client sends for a chunk of pages. The
// tokens are the quantized part's (after the sink), a multiple of the
// scheme's flush block.
nb::bytes QuantizePages(const std::string& scheme, const AnyArray& k, const AnyArray& v,
                        int page_tokens, const std::string& backend, const CodebookArg& codebooks) {
  if (k.ndim() != v.ndim() || (k.ndim() != 3 && k.ndim() != 4)) {
    throw nb::value_error(
        "k and v must both be [num_kv_heads, tokens, head_dim] or [layers, num_kv_heads, "
        "tokens, head_dim]");
  }
  const bool layered = k.ndim() == 4;
  const int layers = layered ? static_cast<int>(k.shape(0)) : 1;
  if (layered && v.shape(0) != k.shape(0)) {
    throw nb::value_error(
        absl::StrCat("k has ", k.shape(0), " layers but v has ", v.shape(0)).c_str());
  }
  const HeadsView first = View(k, "k", layered ? 0 : -1);
  const StreamConfig config = MakeConfig(scheme, first.head_dim, page_tokens, RopeConfig(),
                                         /*theta_given=*/true);
  const std::vector<Codebook> books = MakeCodebooks(config, codebooks);
  const size_t heads = static_cast<size_t>(first.heads);
  if (config.spec.nuq && books.size() != heads * layers) {
    throw nb::value_error(absl::StrCat("scheme ", config.spec.ToString(), " has nuq: it needs ",
                                       heads * layers, " codebooks (one per layer and kv head), got ",
                                       books.size())
                              .c_str());
  }
  if (config.spec.kind == SchemeKind::kFp8E4m3) {  // As KvStream::AppendPages says.
    throw std::runtime_error("fp8_e4m3 streams do not take raw pages: the scale is per stream");
  }
  const int flush = config.spec.flush_tokens();
  if (first.tokens % flush != 0) {
    throw nb::value_error(absl::StrCat("k has ", first.tokens, " tokens: raw pages hold whole "
                                       "blocks of ", flush, " tokens in scheme ",
                                       config.spec.ToString())
                              .c_str());
  }
  std::vector<HeadsView> ks, vs;
  for (int l = 0; l < layers; ++l) {
    ks.push_back(View(k, "k", layered ? l : -1));
    vs.push_back(View(v, "v", layered ? l : -1));
  }
  const KernelBackend* be = Backend(backend);
  std::string out;
  absl::Status st;
  {
    nb::gil_scoped_release release;
    st = [&]() -> absl::Status {
      for (int l = 0; l < layers; ++l) {
        std::vector<Codebook> layer_books;
        if (config.spec.nuq) {
          layer_books.assign(books.begin() + l * heads, books.begin() + (l + 1) * heads);
        }
        absl::StatusOr<std::unique_ptr<KvLayer>> layer =
            KvLayer::Create(config, static_cast<int>(heads), be, layer_books);
        if (!layer.ok()) return layer.status();
        // Pages start after the sink; its contents never reach them.
        if (config.spec.sink > 0) {
          const std::vector<uint16_t> zeros(
              static_cast<size_t>(config.spec.sink) * first.head_dim, 0);
          const HeadsView z{zeros.data(), DType::kFloat16, static_cast<int>(heads),
                            config.spec.sink, first.head_dim, 0, first.head_dim};
          if (absl::Status s = (*layer)->Append(z, z); !s.ok()) return s;
        }
        if (absl::Status s = (*layer)->Append(ks[l], vs[l]); !s.ok()) {
          return layered ? absl::Status(s.code(), absl::StrCat("layer ", l, ": ", s.message()))
                         : s;
        }
        absl::StatusOr<std::string> pages = (*layer)->Pages(0, first.tokens);
        if (!pages.ok()) return pages.status();
        out += *pages;
      }
      return absl::OkStatus();
    }();
  }
  Raise(st);
  return nb::bytes(out.data(), out.size());
}

// The page geometry of a scheme: what a client needs to split a prompt
// into raw-page chunks as the server will accept them.
nb::dict PageGeometry(const std::string& scheme, int head_dim, int page_tokens) {
  const StreamConfig config =
      MakeConfig(scheme, head_dim, page_tokens, RopeConfig(), /*theta_given=*/true);
  const PageLayout layout = Value(PageLayout::Make(config.spec, head_dim, page_tokens));
  nb::dict d;
  d["scheme"] = config.spec.ToString();
  d["page_tokens"] = layout.page_tokens;
  d["page_bytes"] = layout.page_bytes;
  d["flush_tokens"] = config.spec.flush_tokens();
  d["sink"] = config.spec.sink;
  // The server's CreateSequenceResponse.block_tokens: raw-page chunks
  // hold a multiple of it.
  d["block_tokens"] = config.spec.has_tail() ? config.spec.flush_tokens() : layout.page_tokens;
  d["kivi"] = config.spec.is_kivi();
  d["rotate"] = config.spec.rotate;
  d["raw_pages"] = config.spec.kind != SchemeKind::kFp8E4m3;
  d["nuq"] = config.spec.nuq;
  return d;
}

}  // namespace
}  // namespace kvq

NB_MODULE(_native, m) {
  using kvq::KvLayer;
  using kvq::Prop;
  using kvq::PyCalibration;
  using kvq::PyKvLayer;
  m.doc() = "kvq's quantized KV kernels (kvq::kernels) in Python";
  nb::class_<PyCalibration>(m, "Calibration",
                            "A model's calibration for the crq schemes: per (layer, KV head) "
                            "pre-RoPE key and value means and scales (a .kvqcal file).")
      .def_static("load", &PyCalibration::Load, nb::arg("path"),
                  "Reads and checks a .kvqcal file (as kvq-server loads it).")
      .def_static("from_arrays", &PyCalibration::FromArrays, nb::arg("name"),
                  nb::arg("key_mean"), nb::arg("key_scale"), nb::arg("value_mean"),
                  nb::arg("value_scale"), nb::kw_only(), nb::arg("model") = "",
                  "A calibration of float32 [num_layers, num_kv_heads, head_dim] statistics, "
                  "checked as a file of them would be.")
      .def("write", &PyCalibration::Write, nb::arg("path"),
           "Writes the .kvqcal file (to a temporary name, then renamed over path).")
      .def("arrays", &PyCalibration::Arrays,
           "{key_mean, key_scale, value_mean, value_scale}: float32 [num_layers, "
           "num_kv_heads, head_dim].")
      .def_prop_ro("name", [](const PyCalibration& c) { return c.file().calibration.name; })
      .def_prop_ro("model", [](const PyCalibration& c) { return c.file().model; })
      .def_prop_ro("checksum", [](const PyCalibration& c) { return c.file().checksum; })
      .def_prop_ro("num_layers",
                   [](const PyCalibration& c) { return c.file().calibration.num_layers; })
      .def_prop_ro("num_kv_heads",
                   [](const PyCalibration& c) { return c.file().calibration.num_kv_heads; })
      .def_prop_ro("head_dim",
                   [](const PyCalibration& c) { return c.file().calibration.head_dim; });
  nb::class_<PyKvLayer>(m, "KvLayer",
                        "One layer of one sequence: num_kv_heads quantized KV streams.")
      .def(nb::init<const std::string&, int, int, std::optional<float>, int, const std::string&,
                    const std::string&, float, int, const std::string&,
                    const kvq::CodebookArg&, const PyCalibration*, int>(),
           nb::arg("scheme"), nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::kw_only(),
           nb::arg("rope_theta") = nb::none(), nb::arg("rope_rotary_dim") = 0,
           nb::arg("rope_pairing") = "half_split", nb::arg("rope_scaling") = "none",
           nb::arg("rope_factor") = 1.0f, nb::arg("page_tokens") = 0,
           nb::arg("backend") = "cpu", nb::arg("codebooks") = nb::none(),
           nb::arg("calibration").none() = nb::none(), nb::arg("calibration_layer") = 0)
      .def_prop_ro("num_tokens",
                   Prop([](const KvLayer& x) { return x.num_tokens(); }))
      .def_prop_ro("num_kv_heads",
                   Prop([](const KvLayer& x) { return x.num_kv_heads(); }))
      .def_prop_ro("head_dim",
                   Prop([](const KvLayer& x) { return x.head_dim(); }))
      .def_prop_ro("scheme",
                   Prop([](const KvLayer& x) { return x.config().spec.ToString(); }))
      .def_prop_ro("sink_tokens",
                   Prop([](const KvLayer& x) { return x.stream(0).sink_tokens(); }))
      .def_prop_ro("quantized_tokens",
                   Prop([](const KvLayer& x) { return x.stream(0).quantized_tokens(); }))
      .def_prop_ro("tail_tokens",
                   Prop([](const KvLayer& x) { return x.stream(0).tail_tokens(); }))
      .def_prop_ro("page_tokens",
                   Prop([](const KvLayer& x) { return x.stream(0).layout().page_tokens; }))
      .def_prop_ro("page_bytes",
                   Prop([](const KvLayer& x) { return x.stream(0).layout().page_bytes; }))
      .def_prop_ro("flush_tokens",
                   Prop([](const KvLayer& x) { return x.config().spec.flush_tokens(); }))
      .def_prop_ro("accepts_pages",
                   Prop([](const KvLayer& x) { return x.stream(0).AcceptsPages(); }))
      .def("append", &PyKvLayer::Append, nb::arg("k"), nb::arg("v"),
           "Appends k, v [num_kv_heads, tokens, head_dim] (float32/float16/bfloat16, "
           "numpy or torch CPU), read in place. Nothing is stored on error.")
      .def("read", &PyKvLayer::Read, nb::arg("begin") = 0, nb::arg("end") = nb::none(),
           nb::kw_only(), nb::arg("out_k") = nb::none(), nb::arg("out_v") = nb::none(),
           "(K, V) dequantized float32 [num_kv_heads, end - begin, head_dim], keys post-RoPE; "
           "written into out_k / out_v (C-contiguous float32) when given.")
      .def("attend", &PyKvLayer::Attend, nb::arg("q"), nb::kw_only(),
           nb::arg("scale") = nb::none(), nb::arg("positions") = nb::none(),
           nb::arg("return_lse") = false,
           "Fused attention of q float32 [num_q_heads, q_len, head_dim] over the stored "
           "K/V: out of q's shape (and lse [num_q_heads, q_len] with return_lse). Causal, "
           "the queries at the last q_len positions unless positions are given.")
      .def("pages", &PyKvLayer::Pages, nb::arg("begin") = 0, nb::arg("end") = nb::none(),
           "Raw pages of quantized tokens [begin, end) (counted after the sink), "
           "[kv_head][page]: the bytes a kvq server stores for this layer.")
      .def("append_pages", &PyKvLayer::AppendPages, nb::arg("data"), nb::arg("tokens"),
           "Appends `tokens` tokens given as raw pages ([kv_head][page], as pages() "
           "returns them); all or nothing.")
      .def("bytes_by_component",
           Prop([](const KvLayer& x) { return kvq::ByteDict(x.Bytes()); }));
  m.def("quantize_pages", &kvq::QuantizePages, nb::arg("scheme"), nb::arg("k"), nb::arg("v"),
        nb::kw_only(), nb::arg("page_tokens") = 0, nb::arg("backend") = "cpu",
        nb::arg("codebooks") = nb::none());
  m.def("page_geometry", &kvq::PageGeometry, nb::arg("scheme"), nb::arg("head_dim"),
        nb::kw_only(), nb::arg("page_tokens") = 0);
  m.def("scheme_names", [] { return kvq::SchemeNames(); });
}
