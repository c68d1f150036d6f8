// kvq-eval's two modes give identical numbers: the model attending through
// in-process kvq streams and through a real kvq-server (AppendAttend over
// gRPC) on the same short slice.
#include <memory>
#include <string>
#include <vector>

#include "bench/eval/attention_cache.h"
#include "bench/eval/eval_runner.h"
#include "bench/eval/gguf_file.h"
#include "bench/eval/remote_cache.h"
#include "client/kvq_client.h"
#include "gtest/gtest.h"
#include "tests/eval/real_model.h"
#include "tests/integration/server_process.h"

namespace kvq::eval {
namespace {

TEST(EvalEndToEndTest, ServerAndInProcessGiveIdenticalNumbers) {
  RealModel* real = SharedRealModel();
  ASSERT_NE(real, nullptr);
  LlamaModel* model = real->model.get();
  const BpeTokenizer* tokenizer = real->tokenizer.get();
  const std::vector<int32_t> window = tokenizer->Encode(
      "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money "
      "in my purse, and nothing particular to interest me on shore, I thought I would sail about "
      "a little and see the watery part of the world. It is a way I have of driving off the "
      "spleen and regulating the circulation.");
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start().ok());
  ClientOptions options;
  options.target = server.address();
  auto client = KvqClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();

  const CacheShape shape = model->config().cache_shape();
  WindowOptions wopt;
  wopt.chunk = 24;
  wopt.gen_tokens = 6;
  Reference local_ref, remote_ref;
  for (const char* scheme :
       {"fp16", "kivi4:g32:r32", "kivi2:g32:r32:pre_rope:sink=4", "kivi2:g32:r32:fit:p8"}) {
    SCOPED_TRACE(scheme);
    const QuantSpec spec = *QuantSpec::Parse(scheme);
    const bool first = std::string(scheme) == "fp16";
    auto local = KvqAttentionCache::Create(shape, spec, nullptr, &CpuBackend());
    ASSERT_TRUE(local.ok()) << local.status();
    auto remote = RemoteAttentionCache::Create(client->get(), shape, spec, nullptr);
    ASSERT_TRUE(remote.ok()) << remote.status();
    auto a = RunWindow(*model, window, local->get(), wopt, first ? nullptr : &local_ref,
                       first ? &local_ref : nullptr);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = RunWindow(*model, window, remote->get(), wopt, first ? nullptr : &remote_ref,
                       first ? &remote_ref : nullptr);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->nll_sum, b->nll_sum);
    EXPECT_EQ(a->kl_sum, b->kl_sum);
    EXPECT_EQ(a->agree, b->agree);
    EXPECT_EQ(a->scored, b->scored);
    EXPECT_EQ(a->bytes, b->bytes);
    EXPECT_EQ((*remote)->num_tokens(), static_cast<int>(window.size()));
  }
  EXPECT_EQ(local_ref.greedy, remote_ref.greedy);
}

}  // namespace
}  // namespace kvq::eval
